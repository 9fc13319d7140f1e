"""Planning for any described model (Hugging Face, ModelParts), not only the built-in GPT:
the probes time the model's own blocks, embedding and head through the runtime's kernels,
its shape is read off the model, and a trainer with placement=None plans under its budget
and trains to the same weights as plain PyTorch."""

from __future__ import annotations

import asyncio

import pytest
import torch

from planner.profile import architecture, measure_profile
from planner.solve import off_budget
from snake import ModelParts, SnakeConfig, SnakeTrainer
from snake.adapters import describe
from snake.memory import host_memory
from tests.helpers import assert_close_state, batches, tiny_gpt
from tests.test_hf import VOCAB, make, reference


def test_profile_of_a_hugging_face_model_reads_its_shape_and_times_its_blocks(tmp_path):
    model = make("llama")
    model.eval()
    parts = describe(model)
    calls = []
    block_fn = parts.block_fn

    def counting(block, h, layer):
        calls.append(h.shape)
        return block_fn(block, h, layer=layer)

    counted = ModelParts(model=model, blocks=parts.blocks, blocks_prefix=parts.blocks_prefix,
                         pre=parts.pre, post=parts.post, block_fn=counting)
    p = measure_profile(counted, micro_batch_size=2, seq_len=16, offload_dir=tmp_path, io_bytes=16 << 20,
                        seconds_per_probe=0.05)
    s = p.shape
    assert s.n_layers == 3 and s.vocab_size == VOCAB
    assert s.layer_params == sum(x.numel() for x in model.model.layers[0].parameters())
    assert s.ckpt_elems == 2 * 16 * 64 and s.tokens_per_micro == 32
    # embedding, head (untied) and final norm
    assert s.resident_params == 2 * VOCAB * 64 + 64
    # the model's own blocks were timed (through its block_fn), at the micro-batch's shape
    assert calls and all(tuple(c) == (2, 16, 64) for c in calls)
    assert p.fwd_seconds > 0 and p.bwd_seconds > 0 and p.pre_post_seconds > 0
    assert not model.training  # the probes' kernels gave the model its mode back


def test_the_profile_cache_tells_architectures_apart(tmp_path):
    """Two models of one shape but another attention implementation (or classes) do not
    share cached timings. A model without a Hugging Face config, which nothing tells apart
    from another of its classes (an audit's second model ran 9x slower on the first's
    cached timings), is measured every time: no cache file."""
    a, b = describe(make("llama", attn="sdpa")), describe(make("llama", attn="eager"))
    assert architecture(a) != architecture(b)
    assert architecture(a) == architecture(describe(make("llama", attn="sdpa", seed=1)))
    kw = dict(micro_batch_size=1, seq_len=8, io_bytes=16 << 20, seconds_per_probe=0.02)
    hf, plain = tmp_path / "hf", tmp_path / "plain"
    measure_profile(a, offload_dir=hf, **kw)
    assert len(list(hf.glob("snake-profile-*.json"))) == 1
    parts = describe(tiny_gpt(n_layer=2))  # described as parts: its GPTConfig is no HF config
    assert architecture(parts) is None
    measure_profile(parts, offload_dir=plain, **kw)
    assert not list(plain.glob("snake-profile-*.json"))


_PEFT_KEYS = """
import warnings
warnings.simplefilter("ignore")
import peft
from planner.profile import architecture
from snake.adapters import describe
from tests.test_hf import make
for targets in (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], ["q_proj"], ["o_proj"]):
    print(architecture(describe(peft.get_peft_model(make("llama"), peft.LoraConfig(r=4, target_modules=targets)))))
"""


def test_the_profile_cache_tells_loras_apart():
    """Two LoRAs of one shape on other modules (q_proj and o_proj, both 64 -> 64) do not
    share cached timings, nor a LoRA the model without it; the key of one is the same in
    every process (PEFT's targets are a set, whose order changes with the hash seed: seeds
    1 and 2 order these seven differently)."""
    import os
    import subprocess
    import sys

    def keys(seed: str) -> list[str]:
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", _PEFT_KEYS], capture_output=True, text=True, env=env,
                              timeout=120, check=True)
        return done.stdout.split()

    one = keys("1")
    assert one == keys("2")
    every, q, o = one
    assert len({every, q, o, architecture(describe(make("llama")))}) == 4


@pytest.mark.asyncio
async def test_trainer_plans_a_hugging_face_model_under_its_budget(tmp_path):
    model = make("llama", num_hidden_layers=12)  # more layers than staging buffers
    data = batches(3, 4, seq=16, vocab=VOCAB)
    # a budget with room for parameters, checkpoints and half the optimizer states at M = 2
    from planner.profile import shape_of_parts

    shape = shape_of_parts(describe(model), 2, 16, "float32")
    mem = host_memory(shape, n_micro=2, alpha=0.0, schedule="vertical", workers=2)
    p = measure_profile(describe(model), micro_batch_size=2, seq_len=16, offload_dir=tmp_path / "off",
                        io_bytes=16 << 20, seconds_per_probe=0.05)
    budget = int(mem.at(1.0, 1.0, 0.5) + off_budget(p, 2))
    cfg = SnakeConfig(micro_batches=2, placement=None, alpha=None, device="cpu", offload_dir=tmp_path / "off",
                      cpu_memory_bytes=budget)
    want = reference(model, data, 2)
    rng = torch.get_rng_state()
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(3), timeout=120)
        assert torch.equal(torch.get_rng_state(), rng)  # the probes' random inputs left no trace
        got = await trainer.state_dict()
        placed = trainer.config.placement
    assert placed is not None and placed.opt < 1.0  # the budget binds: some optimizer state on SSD
    assert_close_state(got, want)
    assert not torch.equal(got["model.layers.0.mlp.up_proj.weight"], model.state_dict()["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.asyncio
async def test_trainer_plans_a_model_of_two_kinds_under_its_budget(tmp_path):
    """DeepSeek V3's dense first layer and its expert layers: the shape counts the layers'
    mean (what they store and move in all) and the largest (what the staging buffers are
    sized for), the probe times both kinds, and the planned run under a budget that binds
    trains to plain PyTorch's weights."""
    from planner.profile import shape_of_parts
    from tests.test_hf import assert_matches

    model = make("deepseekv3", num_hidden_layers=8)
    parts = describe(model)
    sizes = [sum(x.numel() for x in layer.parameters()) for layer in model.model.layers]
    assert sizes[0] < sizes[1] == max(sizes)
    shape = shape_of_parts(parts, 2, 16, "float32")
    assert shape.layer_params == -(-sum(sizes) // 8) and shape.largest == sizes[1]
    mem = host_memory(shape, n_micro=2, alpha=0.0, schedule="vertical", workers=2)
    p = measure_profile(parts, micro_batch_size=2, seq_len=16, offload_dir=tmp_path / "off", io_bytes=16 << 20,
                        seconds_per_probe=0.05)
    assert p.shape == shape
    budget = int(mem.at(1.0, 1.0, 0.5) + off_budget(p, 2))
    cfg = SnakeConfig(micro_batches=2, placement=None, alpha=None, device="cpu", offload_dir=tmp_path / "off",
                      cpu_memory_bytes=budget)
    data = batches(3, 4, seq=16, vocab=VOCAB)
    want = reference(model, data, 2)
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(3), timeout=120)
        got = await trainer.state_dict()
        placed = trainer.config.placement
        # each layer's units are its own size: the dense layer's optimizer state is smaller
        opt = trainer.engine.stores["opt"]
        assert sum(opt.unit((0, q)).n for q in (0, 1) if (0, q) in opt.units) == sizes[0]
    assert placed is not None and placed.opt < 1.0
    assert_matches(got, want)
