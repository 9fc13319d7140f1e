"""PEFT models (LoRA): snake trains the base model with the adapters PEFT injected into its
layers (the frozen base weights stream with their layer, the adapters are trained), given
the PEFT model itself or its base model. The weights are plain PyTorch's; the adapters
save with PEFT's own save_pretrained and load back with the trained logits."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open

from snake import ModelError, SnakeTrainer
from snake.cli import main
from snake.hf import init_adapters, load_hf, stream_hf
from tests.helpers import batches, mixed_reference
from tests.test_hf import (
    VOCAB,
    assert_matches,
    assert_mixed_precision,
    make,
    reference,
    snake_config,
)
from tests.test_stream_hf import saved

# (PEFT reads transformers' deprecated gradient-checkpointing flag)
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")


def lora(kind: str = "llama", dtype: torch.dtype = torch.float32, use_dora: bool = False,
         peft: dict | None = None, **kw) -> PeftModel:
    """The test model of `kind` (`kw` to `make`) in `dtype` with LoRA adapters (PEFT's
    defaults: float32; `use_dora`: DoRA's; `peft`: more of LoraConfig), B away from its zero
    start (so that A gets gradients from the first step)."""
    model = get_peft_model(make(kind, **kw).to(dtype), LoraConfig(**LORA, use_dora=use_dora, **(peft or {})))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


async def train(model, data, tmp_path, dtype="float32", steps=3):
    async with SnakeTrainer(model, data=data, config=snake_config(tmp_path, dtype=dtype)) as trainer:
        await asyncio.wait_for(trainer.run(steps), timeout=120)
        await trainer.save(tmp_path / "ckpt")
        return await trainer.state_dict()


@pytest.mark.asyncio
@pytest.mark.parametrize("given", ["peft", "base"])
async def test_lora_trains_as_plain_pytorch(tmp_path, given):
    model = lora()
    base = model.get_base_model()
    trained = {n for n, p in base.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    data = batches(3, 4, seq=16, vocab=VOCAB)
    want = reference(base, data, 2)
    got = await train(model if given == "peft" else base, data, tmp_path)
    assert got.keys() == base.state_dict().keys()
    assert_matches(got, want)
    # the frozen base weights are as they were; the adapters moved
    for n, p in base.named_parameters():
        assert torch.equal(got[n], p.detach()) != (n in trained), n


@pytest.mark.asyncio
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")  # PEFT's, on merging
async def test_a_head_trained_beside_the_adapters_as_plain_pytorch(tmp_path, tie):
    """PEFT's `modules_to_save=["lm_head"]`: a trained copy of the head beside the adapters
    (its original frozen, and with it the embedding where they are tied), of a model whose
    head is tied to the embedding or not."""
    model = get_peft_model(make("llama", tie_word_embeddings=tie), LoraConfig(**LORA, modules_to_save=["lm_head"]))
    base = model.get_base_model()
    assert {n for n, p in base.named_parameters() if p.requires_grad and "lora_" not in n} == {
        "lm_head.modules_to_save.default.weight"}  # the embedding frozen, tied or not
    data = batches(3, 4, seq=16, vocab=VOCAB)
    want = reference(base, data, 2)
    assert_matches(await train(model, data, tmp_path), want)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["dora", "ia3"])
async def test_other_adapters_train_as_plain_pytorch(tmp_path, kind):
    """DoRA (LoRA with a learned magnitude, from the frozen base weight's norm, which it
    reads from the streamed layer) and IA3 (learned scales of activations)."""
    from peft import IA3Config

    if kind == "dora":
        model = lora(use_dora=True)
    else:
        model = get_peft_model(make("llama"), IA3Config(task_type="CAUSAL_LM", target_modules=["k_proj", "v_proj",
                               "down_proj"], feedforward_modules=["down_proj"]))
    base = model.get_base_model()
    marker = {"dora": "lora_magnitude_vector", "ia3": "ia3_l"}[kind]
    assert any(marker in n for n, p in base.named_parameters() if p.requires_grad)
    data = batches(3, 4, seq=16, vocab=VOCAB)
    want = reference(base, data, 2)
    assert_matches(await train(model, data, tmp_path), want)


@pytest.mark.asyncio
async def test_trained_adapters_save_and_load_with_peft(tmp_path):
    model = lora()
    data = batches(3, 4, seq=16, vocab=VOCAB)
    got = await train(model, data, tmp_path)
    model.get_base_model().load_state_dict(got)
    model.save_pretrained(str(tmp_path / "adapter"))
    again = PeftModel.from_pretrained(make("llama"), str(tmp_path / "adapter"))
    x = data[0][0]
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(x).logits, model.eval()(x).logits, rtol=0, atol=1e-6)
    # `snake export` rebuilds a model from its config, which has no adapters: refused, with the way
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) != 0
    assert not (tmp_path / "hf").exists()


@pytest.mark.asyncio
async def test_bf16_lora_follows_plain_mixed_precision(tmp_path):
    """A bfloat16 model with its adapters in bfloat16 too (autocast_adapter_dtype=False):
    they stream with their layer in the compute dtype, fp32 masters, as in plain PyTorch
    mixed precision."""
    model = get_peft_model(make("llama").to(torch.bfloat16), LoraConfig(**LORA), autocast_adapter_dtype=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    data = batches(3, 4, seq=16, vocab=VOCAB)
    want = mixed_reference(model.get_base_model(), data, 2, fused=True)
    assert_mixed_precision(await train(model, data, tmp_path, dtype="bfloat16"), want)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha", [("vertical", 0.3), ("horizontal", 0.0), ("vertical", 1.0)])
async def test_fp32_adapters_of_a_bf16_model_compute_in_fp32(tmp_path, schedule, alpha):
    """PEFT's default keeps a bfloat16 model's adapters in float32 (`autocast_adapter_dtype`):
    they are all a layer trains, held on the device in float32 with pre/post's while the
    frozen bfloat16 base weights stream; they compute in float32 as in plain PyTorch (until
    round 35 they streamed in bfloat16, up to 3e-4 apart after three steps, with a warning)."""
    model = lora(dtype=torch.bfloat16)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    data = batches(3, 4, seq=16, vocab=VOCAB)
    want = mixed_reference(model.get_base_model(), data, 2, fused=True)
    cfg = snake_config(tmp_path, schedule=schedule, dtype="bfloat16")
    cfg = dataclasses.replace(cfg, alpha=alpha)
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(3), timeout=120)
        got = await trainer.state_dict()
        # nothing of the layers' trained state streams: every adapter is held
        assert trainer.engine.layer_P == [0] * 3
    assert_mixed_precision(got, want)
    trained = {n for n, p in model.get_base_model().named_parameters() if p.requires_grad}
    assert all(got[n].dtype == torch.float32 for n in trained)


@pytest.mark.asyncio
async def test_fp32_adapters_of_a_bf16_model_clip_as_pytorch(tmp_path):
    """Clipping by the global norm where everything trained is held (no layer streams a
    trained element): the norms are the held adapters' and the head's, the coefficient
    torch's clip_grad_norm_'s on the fp32 gradients."""
    from snake import AdamW

    model = lora(dtype=torch.bfloat16)
    data = batches(3, 4, seq=16, vocab=VOCAB)
    want = mixed_reference(model.get_base_model(), data, 2, fused=True, max_norm=0.05)
    cfg = dataclasses.replace(snake_config(tmp_path, dtype="bfloat16"), alpha=1.0,
                              optimizer=AdamW(max_grad_norm=0.05))
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        report = await asyncio.wait_for(trainer.run(3), timeout=120)
        got = await trainer.state_dict()
    assert all(s.grad_norm > 0.05 for s in report.steps)  # every step clipped
    assert_mixed_precision(got, want)


@pytest.mark.asyncio
async def test_held_adapters_resume_where_they_stopped(tmp_path):
    """A checkpoint of a bf16 model's fp32 adapters (held with pre/post's, their AdamW state
    in the resident state) resumes bit for bit."""
    from snake import Placement
    from tests.helpers import straight_and_resumed

    model = lora(dtype=torch.bfloat16)
    straight, resumed, _, manifest = await straight_and_resumed(
        tmp_path, model, batches(4, 4, seq=16, vocab=VOCAB), 2, 2, micro_batches=2, dtype="bfloat16", alpha=0.3,
        placement=Placement(param=0.5, ckpt=0.5, opt=0.5))
    assert straight.keys() == resumed.keys()
    for k, v in straight.items():
        assert torch.equal(resumed[k], v), k
    assert any("lora_A" in name for name, _ in manifest["model"]["resident_params"])


def as_before_round_36(ckpt, model) -> None:
    """Rewrite the checkpoint at `ckpt` of `model` (PEFT's fp32 adapters of a bf16 model,
    held with pre/post's) as snake wrote it before round 36, when they streamed with their
    layer: their state in the layer files, by the same names, listed in the manifest's
    block parameters (in the block's order) rather than its resident ones."""
    from safetensors.torch import load_file

    import snake.checkpoint_files as ckpt_files
    import snake.manifest as ckpt_mod

    manifest = json.loads((ckpt / "manifest.json").read_text())
    record = manifest["model"]
    prefix = record["blocks_prefix"] + "."
    held = {n for n, _ in record["resident_params"] if n.startswith(prefix)}
    assert held and record["block_params"] == []  # everything a layer trains is held now
    base = model.get_base_model()
    first = [n for n, p in base.get_submodule(prefix + "0").named_parameters() if p.requires_grad]
    record["block_params"] = [[n, list(dict(base.named_parameters())[f"{prefix}0.{n}"].shape)] for n in first]
    record["resident_params"] = [[n, s] for n, s in record["resident_params"] if n not in held]
    resident = load_file(str(ckpt / "resident.safetensors"))
    meta = {"format": ckpt_mod.FORMAT}
    for i in range(record["n_layer"]):
        name = ckpt_mod.layer_file(i)
        layer = load_file(str(ckpt / name))
        layer.update({k: resident.pop(k) for k in list(resident) if k.partition("/")[2].startswith(f"{prefix}{i}.")})
        (ckpt / name).unlink()
        manifest["files"][name] = ckpt_files._write_tensors(ckpt / name, layer, meta)
    (ckpt / "resident.safetensors").unlink()
    manifest["files"]["resident.safetensors"] = ckpt_files._write_tensors(ckpt / "resident.safetensors", resident, meta)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.asyncio
async def test_a_checkpoint_from_before_the_adapters_were_held_resumes(tmp_path):
    """Until round 36 PEFT's fp32 adapters of a bf16 model streamed with their layer, and its
    checkpoints hold their state in the layer files: such a checkpoint resumes (their state
    read from there), bit for bit as the run that was not interrupted, where it was refused
    as of another model."""
    model = lora(dtype=torch.bfloat16)
    data = batches(4, 4, seq=16, vocab=VOCAB)

    def cfg(name):
        return snake_config(tmp_path / name, dtype="bfloat16")

    async with SnakeTrainer(model, data=data, config=cfg("straight")) as t:
        await t.run(4)
        straight = await t.state_dict(trained_only=True)
    async with SnakeTrainer(model, data=data, config=cfg("first")) as t:
        await t.run(2)
        await t.save(tmp_path / "ckpt")
    as_before_round_36(tmp_path / "ckpt", model)
    async with SnakeTrainer(model, data=data, config=cfg("second")) as t:
        await t.load(tmp_path / "ckpt")
        await t.run(2)
        resumed = await t.state_dict(trained_only=True)
    for k, v in straight.items():
        assert torch.equal(resumed[k], v), k


def test_prompt_learning_is_refused_by_name(tmp_path):
    """Prompt tuning's virtual tokens are added to the inputs by the PeftModel, outside the
    base model snake trains: refused with the way (an adapter of the layers), where it
    would have trained nothing."""
    from peft import PromptTuningConfig

    model = get_peft_model(make("llama"), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ModelError, match=r"PEFT adapter 'default' is PromptTuningConfig, prompt learning.*"
                                         r"use LoRA \(peft.LoraConfig\)"):
        SnakeTrainer(model, data=batches(1, 4, vocab=VOCAB), config=snake_config(tmp_path))
    assert not (tmp_path / "off").exists()


# -- adapters of a model from stream_hf (its layer weights in their files) -------------------


def streamed_lora(path, seed: int = 3, **kw) -> tuple[PeftModel, PeftModel]:
    """(a LoRA model of the checkpoint at `path` loaded in memory, the same of it streamed),
    their adapters drawn from one seed: the streamed one's initialised by snake; `kw` to
    LoraConfig over LORA's (B drawn, "gaussian", so that A gets gradients from the first step)."""
    config = {**LORA, "init_lora_weights": "gaussian", **kw}
    torch.manual_seed(seed)
    loaded = get_peft_model(load_hf(path), LoraConfig(**config))
    streamed = get_peft_model(stream_hf(path), LoraConfig(**config))
    trained = [(n, p) for n, p in streamed.named_parameters() if p.requires_grad]
    assert trained and all(p.is_meta for _, p in trained)  # where PEFT leaves them
    adapters = [p for n, p in trained if "modules_to_save" not in n]  # not trained copies of stored modules
    torch.manual_seed(seed)
    assert init_adapters(streamed) == len(adapters)
    assert init_adapters(streamed) == 0  # once
    return loaded, streamed


@pytest.mark.asyncio
@pytest.mark.parametrize("kind,kw", [("llama", {}), ("llama", {"use_dora": True}),
                                     ("llama", {"layers_to_transform": [1], "layers_pattern": "layers"}),
                                     ("llama", {"modules_to_save": ["post_attention_layernorm"]}),
                                     ("mixtral", {"target_modules": ["q_proj", "v_proj"]})],
                         ids=["lora", "dora", "middle-layer-only", "a-layers-norm-trained", "mixtral-converted"])
async def test_lora_on_a_streamed_model_trains_as_plain_pytorch(tmp_path, kind, kw):
    """A model whose layer weights stay in their files (stream_hf) takes PEFT's adapters:
    snake initialises them as PEFT does a model in memory (the same values from the same
    seed; DoRA's magnitude from the stored weights), the frozen base weights stream from
    their files, the adapters train as plain PyTorch's. PEFT finds the layers it adapts by
    their path (`layers_to_transform`); a trained copy of a layer's module
    (`modules_to_save`) starts from its stored weights; Mixtral's experts are stored one by
    one, which transformers converts with PEFT's wrappers out of its way."""
    _, path = saved(kind, tmp_path)
    loaded, streamed = streamed_lora(path, **kw)
    base = streamed.get_base_model()
    for n, p in loaded.get_base_model().named_parameters():
        if p.requires_grad and "modules_to_save" not in n:  # (those stay in the files until trained)
            assert torch.equal(dict(base.named_parameters())[n], p), n
    assert all(p.is_meta for n, p in base.named_parameters() if "base_layer" in n)
    data = batches(3, 4, seq=16, vocab=VOCAB)
    want = reference(loaded.get_base_model(), data, 2)
    got = await train(streamed, data, tmp_path)
    assert_matches(got, want)
    assert all(p.is_meta or getattr(p, "snake_mapped", False) for n, p in base.named_parameters() if "base_layer" in n)


def other_adapter(name: str):
    """A PEFT config of another kind than LoRA's, for a streamed model."""
    import peft

    if name == "oft":  # adapter buffers (its rotation's index rows and columns) beside parameters
        return peft.OFTConfig(r=0, oft_block_size=16, target_modules=["q_proj"], task_type="CAUSAL_LM")
    if name == "adalora":  # a frozen rank count per module beside the trained adapters
        return peft.AdaLoraConfig(init_r=4, target_r=2, lora_alpha=8, target_modules=["q_proj"], total_step=10,
                                  task_type="CAUSAL_LM")
    if name == "trainable-tokens":  # the embedding's trained rows, outside the layers, beside LoRA
        return LoraConfig(**{**LORA, "init_lora_weights": "gaussian", "trainable_token_indices": [3, 5]})
    raise ValueError(name)


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["oft", "adalora", "trainable-tokens", "second-adapter-added-first"])
async def test_other_adapters_of_a_streamed_model_train_as_plain_pytorch(tmp_path, name):
    """What an audit found: OFT's adapter buffers are made too (they were left on the meta
    device); AdaLoRA's frozen rank count stays frozen (PEFT's move to the meta device
    re-made it trained, and snake stepped it); LoRA with the embedding's trainable tokens
    (outside the layers) initialises (the copied layer has no embedding); an adapter added
    before snake initialised the first, which PEFT initialises itself, is taken as it is
    (it was refused as made real behind snake's back). The adapters are given to the model
    in memory, whose plain PyTorch training the streamed one matches."""
    _, path = saved("llama", tmp_path)
    second = name == "second-adapter-added-first"
    config = (lambda: LoraConfig(**{**LORA, "init_lora_weights": "gaussian"})) if second else (lambda: other_adapter(name))
    loaded, streamed = (get_peft_model(load(path), config()) for load in (load_hf, stream_hf))
    if second:
        for m in (loaded, streamed):
            m.add_adapter("second", LoraConfig(**{**LORA, "init_lora_weights": "gaussian", "r": 2}))
            m.set_adapter("second")
    init_adapters(streamed)
    base, mine = loaded.get_base_model(), streamed.get_base_model()
    with torch.no_grad():  # the reference starts where snake does
        for (n, p), (_, q) in zip(base.named_parameters(), mine.named_parameters(), strict=True):
            if p.requires_grad or "lora_" in n or "oft_" in n:
                p.copy_(q)
    for (n, b), (_, c) in zip(base.named_buffers(), mine.named_buffers(), strict=True):
        assert not c.is_meta and torch.equal(b, c), n
    data = batches(3, 4, seq=16, vocab=VOCAB)
    want = reference(base, data, 2)
    got = await train(streamed, data, tmp_path)
    assert_matches(got, want)
    frozen = [n for n, p in mine.named_parameters() if not p.requires_grad and ("ranknum" in n or ".default." in n)]
    assert all(torch.equal(got[n], want[n]) for n in frozen)  # AdaLoRA's rank count; LoRA's inactive adapter


def test_what_snake_cannot_initialise_or_run_is_refused_by_name(tmp_path):
    """PEFT's LoRA of a parameter (`target_parameters`, a mixture of experts' fused experts),
    which failed in the first step streamed or not, and adapters outside the layers that
    `low_cpu_mem_usage` left on the meta device (snake initialises the layers' only):
    refused by name with the way, before anything is set up."""
    _, path = saved("deepseekv3", tmp_path)
    for load in (load_hf, stream_hf):
        model = get_peft_model(load(path), LoraConfig(r=4, target_modules=[], target_parameters=["mlp.experts.down_proj"]))
        with pytest.raises(ModelError, match=r"LoRA of a parameter \(target_parameters: model\.layers\.1 has a "
                                             r"ParamWrapper\).*target_modules"):
            SnakeTrainer(model, data=batches(1, 4, vocab=VOCAB), config=snake_config(tmp_path))
    _, path = saved("llama", tmp_path)
    model = get_peft_model(stream_hf(path), LoraConfig(**{**LORA, "target_modules": ["q_proj", "lm_head"]}),
                           low_cpu_mem_usage=True)
    with pytest.raises(ModelError, match=r"PEFT left lm_head\.lora_A\.default\.weight, outside the layers, on the "
                                         r"meta device.*without low_cpu_mem_usage"):
        SnakeTrainer(model, data=batches(1, 4, vocab=VOCAB), config=snake_config(tmp_path))
    assert not (tmp_path / "off").exists()


@pytest.mark.asyncio
async def test_fp32_adapters_of_a_streamed_bf16_model_train_as_those_of_one_in_memory(tmp_path):
    """A bf16 checkpoint streamed, PEFT's fp32 adapters held on the device in float32, the
    frozen bf16 weights mapped from a file of snake's: the same weights, bit for bit, as
    the same model loaded in memory, and a trainer made before the adapters are initialised
    initialises them itself, seeded as PEFT would be."""
    make("llama").to(torch.bfloat16).save_pretrained(str(tmp_path / "m"))
    config = {**LORA, "init_lora_weights": "gaussian"}
    torch.manual_seed(5)
    loaded = get_peft_model(load_hf(tmp_path / "m", dtype=torch.bfloat16), LoraConfig(**config))
    streamed = get_peft_model(stream_hf(tmp_path / "m"), LoraConfig(**config))
    assert {p.dtype for p in streamed.parameters() if p.requires_grad} == {torch.float32}
    data = batches(3, 4, seq=16, vocab=VOCAB)
    got = {}
    for name, model in [("loaded", loaded), ("streamed", streamed)]:
        torch.manual_seed(5)  # the streamed model's adapters draw when its trainer is made
        cfg = snake_config(tmp_path / name, dtype="bfloat16")
        async with SnakeTrainer(model, data=data, config=cfg) as trainer:
            await asyncio.wait_for(trainer.run(3), timeout=120)
            got[name] = await trainer.state_dict(trained_only=True)
            assert trainer.engine.layer_P == [0] * 3  # every adapter held
            assert trainer.engine.kernels.frozen_mapped == (name == "streamed")
    assert got["loaded"].keys() == got["streamed"].keys() == {
        n for n, p in loaded.get_base_model().named_parameters() if p.requires_grad}
    for n, v in got["loaded"].items():
        assert torch.equal(got["streamed"][n], v), n


@pytest.mark.asyncio
async def test_adapters_of_a_streamed_model_save_with_peft_and_resume(tmp_path):
    """The trained adapters alone (`state_dict(trained_only=True)`: the frozen weights are
    not read) go into the PEFT model, which saves them with PEFT's save_pretrained; loaded
    onto the checkpoint in memory they give the logits of plain PyTorch's training. A
    snake checkpoint of the streamed model resumes bit for bit."""
    _, path = saved("llama", tmp_path)
    loaded, streamed = streamed_lora(path)
    data = batches(4, 4, seq=16, vocab=VOCAB)
    want = reference(loaded.get_base_model(), data[:3], 2)
    cfg = snake_config(tmp_path / "a")
    async with SnakeTrainer(streamed, data=data, config=cfg) as trainer:
        before = await trainer.state_dict(trained_only=True)
        assert before.keys() == {n for n, p in streamed.get_base_model().named_parameters() if p.requires_grad}
        await asyncio.wait_for(trainer.run(2), timeout=120)
        await trainer.save(tmp_path / "ckpt")
        await asyncio.wait_for(trainer.run(1), timeout=120)
        straight = await trainer.state_dict(trained_only=True)
    assert_matches(straight, {n: want[n] for n in straight})
    assert not all(torch.equal(before[n], straight[n]) for n in before)
    # a PEFT model's checkpoint holds what trains, not the frozen base (its digests only)
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["frozen_stored"] is False and manifest["model"]["frozen_params"]
    for file in (tmp_path / "ckpt").glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            assert not [k for k in f.keys() if k.startswith("frozen/")], file

    again = get_peft_model(stream_hf(path), LoraConfig(**{**LORA, "init_lora_weights": "gaussian"}))
    async with SnakeTrainer(again, data=data, config=snake_config(tmp_path / "b")) as trainer:
        await trainer.load(tmp_path / "ckpt")
        await asyncio.wait_for(trainer.run(1), timeout=120)
        resumed = await trainer.state_dict(trained_only=True)
    for n, v in straight.items():
        assert torch.equal(resumed[n], v), n

    streamed.get_base_model().load_state_dict(straight, strict=False)
    streamed.save_pretrained(str(tmp_path / "adapter"))
    model = PeftModel.from_pretrained(load_hf(path), str(tmp_path / "adapter"))
    x = data[0][0]
    with torch.no_grad():
        loaded.get_base_model().load_state_dict(want)
        torch.testing.assert_close(model.eval()(x).logits, loaded.eval()(x).logits, rtol=0, atol=1e-5)


def test_an_initialisation_that_changes_the_base_weights_is_refused_on_a_streamed_model(tmp_path):
    """PiSSA and OLoRA move the base weights' principal part into the adapters, where
    stream_hf's files keep them as stored (PEFT itself fails on them at get_peft_model
    unless low_cpu_mem_usage, which leaves the initialisation to snake): refused by name
    before anything is set up or changed."""
    _, path = saved("llama", tmp_path)
    model = get_peft_model(stream_hf(path), LoraConfig(**{**LORA, "init_lora_weights": "pissa"}),
                           low_cpu_mem_usage=True)
    with pytest.raises(ModelError, match=r"initialisation \(pissa\) changes the base weight model\.layers\.0\."
                                         r"self_attn\.q_proj\.weight.*init_lora_weights=True"):
        SnakeTrainer(model, data=batches(1, 4, vocab=VOCAB), config=snake_config(tmp_path))
    assert all(p.is_meta for n, p in model.named_parameters() if p.requires_grad)  # nothing changed
    assert not (tmp_path / "off").exists()
    with pytest.raises(ModelError, match="init_adapters: LlamaForCausalLM is not a model from snake.hf.stream_hf"):
        init_adapters(make("llama"))


# -- `snake export --peft` and `--hf` of a PEFT model's checkpoint --------------------------


def exported_adapters(directory) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "adapter_model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.asyncio
async def test_a_checkpoint_exports_its_adapters_as_peft_saves_them(tmp_path, capsys):
    """`snake export CKPT --peft DIR` writes a PEFT model's checkpoint as PEFT's own
    save_pretrained does, from the configs the checkpoint records, with no process of the
    training and nothing of the base read: the same tensors, bit for bit, and config; PEFT
    loads it onto the base model with the trained logits; `--hf` of it (saved without its
    frozen base) names --peft."""
    model = lora(peft={"modules_to_save": ["lm_head"]}, tie_word_embeddings=False)
    data = batches(3, 4, seq=16, vocab=VOCAB)
    got = await train(model, data, tmp_path)
    model.get_base_model().load_state_dict(got)
    out = tmp_path / "adapter"
    assert main(["export", str(tmp_path / "ckpt"), "--peft", str(out)]) == 0
    model.save_pretrained(str(tmp_path / "by-peft"))
    ours, theirs = exported_adapters(out), exported_adapters(tmp_path / "by-peft")
    assert ours.keys() == theirs.keys() and any(".lm_head." in k for k in ours)
    for k, v in theirs.items():
        assert torch.equal(ours[k], v), k
    def config(directory) -> dict:  # PEFT writes its sets as lists in the set's order (the hash seed's)
        d = json.loads((directory / "adapter_config.json").read_text())
        return {k: sorted(v) if k in ("target_modules", "modules_to_save") and v else v for k, v in d.items()}

    assert config(out) == config(tmp_path / "by-peft")
    again = PeftModel.from_pretrained(make("llama"), str(out))
    x = data[0][0]
    with torch.no_grad():  # (the files are equal bit for bit, above)
        torch.testing.assert_close(again.eval()(x).logits, model.eval()(x).logits, rtol=0, atol=1e-6)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 2
    assert "--peft DIR" in capsys.readouterr().err and not (tmp_path / "hf").exists()


@pytest.mark.asyncio
async def test_a_checkpoint_with_its_base_exports_the_merged_model(tmp_path):
    """A PEFT model's checkpoint saved with its frozen base (save(frozen=True)) exports with
    --hf as the whole model, the active adapter merged into the base (PEFT's
    merge_and_unload): transformers loads it with the trained model's logits; an adapter
    that was not active is not merged."""
    model = lora(use_dora=True)
    model.add_adapter("other", LoraConfig(**LORA))  # not active: not trained, not merged
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B.other" in name:
                p.fill_(0.5)
    data = batches(3, 4, seq=16, vocab=VOCAB)
    async with SnakeTrainer(model, data=data, config=snake_config(tmp_path)) as trainer:
        await asyncio.wait_for(trainer.run(2), timeout=120)
        await trainer.save(tmp_path / "ckpt", frozen=True)
        model.get_base_model().load_state_dict(await trainer.state_dict())
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    x = data[0][0]
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(x).logits, model.eval()(x).logits, rtol=0, atol=1e-5)
    # both adapters are in the checkpoint: --peft writes the other beside the active one
    assert main(["export", str(tmp_path / "ckpt"), "--peft", str(tmp_path / "adapters")]) == 0
    assert (tmp_path / "adapters" / "adapter_config.json").is_file()
    assert (tmp_path / "adapters" / "other" / "adapter_config.json").is_file()
    other = exported_adapters(tmp_path / "adapters" / "other")
    assert other and all(torch.equal(v, torch.full_like(v, 0.5)) for k, v in other.items() if "lora_B" in k)


@pytest.mark.asyncio
async def test_adapters_of_a_streamed_bf16_model_export_from_its_checkpoint(tmp_path):
    """A LoRA of a bf16 model streamed from its files (fp32 adapters) exports with --peft:
    the file holds the trained adapters by PEFT's names, the base the user's PEFT config
    names (here not the local directory it was loaded from), and loads onto the base in
    memory."""
    _, path = saved("llama", tmp_path)
    torch.manual_seed(3)
    streamed = get_peft_model(stream_hf(path, dtype=torch.bfloat16), LoraConfig(**LORA, init_lora_weights="gaussian"))
    streamed.peft_config["default"].base_model_name_or_path = "org/tiny-llama"
    data = batches(3, 4, seq=16, vocab=VOCAB)
    async with SnakeTrainer(streamed, data=data, config=snake_config(tmp_path / "a", dtype="bfloat16")) as trainer:
        await asyncio.wait_for(trainer.run(2), timeout=120)
        await trainer.save(tmp_path / "ckpt")
        trained = await trainer.state_dict(trained_only=True)
    out = tmp_path / "adapter"
    assert main(["export", str(tmp_path / "ckpt"), "--peft", str(out)]) == 0
    ours = exported_adapters(out)
    assert len(ours) == len(trained)
    for name, v in trained.items():
        assert torch.equal(ours["base_model.model." + name.replace(".default.", ".")], v), name
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "org/tiny-llama"
    assert config["r"] == LORA["r"] and sorted(config["target_modules"]) == sorted(LORA["target_modules"])
    PeftModel.from_pretrained(load_hf(path, dtype=torch.bfloat16), str(out))  # loads


@pytest.mark.asyncio
async def test_what_export_cannot_make_adapters_of_is_refused_by_name(tmp_path, capsys):
    """--peft of a checkpoint without PEFT's adapters, of one saved before the PEFT config was
    recorded, into a directory of other files: each refused by name, nothing written."""
    model = lora()
    data = batches(3, 4, seq=16, vocab=VOCAB)
    await train(model, data, tmp_path)
    ckpt = tmp_path / "ckpt"
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert main(["export", str(ckpt), "--peft", str(busy)]) == 2
    assert "--peft" in capsys.readouterr().err and sorted(p.name for p in busy.iterdir()) == ["notes.txt"]

    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["peft"]["active"] == ["default"]
    del manifest["peft"]  # as a checkpoint of a snake before it was recorded
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert main(["export", str(ckpt), "--peft", str(tmp_path / "a")]) == 2
    assert "does not record its PEFT config" in capsys.readouterr().err and not (tmp_path / "a").exists()

    plain = make("llama")
    async with SnakeTrainer(plain, data=data, config=snake_config(tmp_path / "p")) as trainer:
        await asyncio.wait_for(trainer.run(1), timeout=120)
        await trainer.save(tmp_path / "plain")
    assert main(["export", str(tmp_path / "plain"), "--peft", str(tmp_path / "b")]) == 2
    assert "export it with --hf" in capsys.readouterr().err and not (tmp_path / "b").exists()
