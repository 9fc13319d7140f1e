"""`snake.hf.stream_hf`: a Hugging Face model whose layers' weights stay in their safetensors
files until snake copies them into its tiers. Trains to the same weights as the model
loaded whole (and so as plain PyTorch), without the model ever holding its layers' weights."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from planner.profile import shape_of_parts
from snake import ConfigError, ModelError, Placement, SnakeTrainer, StorageError
from snake.adapters import describe
from snake.hf import export_hf, load_hf, stream_hf
from tests.helpers import batches
from tests.test_hf import VOCAB, assert_matches, make, reference, snake_config


def saved(kind: str, tmp_path, shard: str | None = None, **kw):
    """The test model of `kind`, saved (in shards of `shard` where given) to tmp_path/kind."""
    model = make(kind, **kw)
    out = tmp_path / kind
    model.save_pretrained(str(out), **({"max_shard_size": shard} if shard else {}))
    return model, out


def layer_params(model):
    prefix = describe(model).blocks_prefix + "."
    return {n: p for n, p in model.named_parameters() if n.startswith(prefix)}


async def train(model, data, tmp_path, steps=3):
    async with SnakeTrainer(model, data=data, config=snake_config(tmp_path)) as trainer:
        await asyncio.wait_for(trainer.run(steps), timeout=120)
        return await trainer.state_dict()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind,kw,shard", [
    ("llama", {}, "20KB"), ("llama", {"tie_word_embeddings": True}, None), ("gpt2", {}, None), ("qwen3", {}, "30KB"),
    ("mixtral", {}, "30KB"), ("deepseekv3", {}, None), ("neox", {}, None), ("gemma4moe", {}, "30KB"),
], ids=["llama-sharded", "llama-tied", "gpt2", "qwen3-sharded", "mixtral-sharded", "deepseekv3", "neox",
        "gemma4moe-sharded"])
async def test_streamed_layers_train_as_plain_pytorch_and_stay_on_disk(tmp_path, kind, kw, shard):
    model, path = saved(kind, tmp_path, shard, **kw)
    streamed = stream_hf(path)
    lazy = layer_params(streamed)
    assert lazy and all(p.is_meta for p in lazy.values())
    outside = [p for n, p in streamed.named_parameters() if n not in lazy]
    assert outside and not any(p.is_meta for p in outside)
    data = batches(3, 4, seq=16, vocab=VOCAB)
    want = reference(load_hf(path), data, 2)
    got = await train(streamed, data, tmp_path)
    assert_matches(got, want)
    # the trained weights came from the files, and the model never held them
    assert all(p.is_meta for p in lazy.values())
    assert got.keys() == model.state_dict().keys()


@pytest.mark.asyncio
async def test_state_dict_before_a_run_reads_the_layers_from_their_files(tmp_path):
    model, path = saved("llama", tmp_path, "20KB")
    async with SnakeTrainer(stream_hf(path), data=batches(1, 4, vocab=VOCAB), config=snake_config(tmp_path)) as trainer:
        got = await trainer.state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got[k], v.float(), rtol=0, atol=0, msg=k)


@pytest.mark.asyncio
async def test_bf16_checkpoint_streams_in_its_own_dtype(tmp_path):
    model = make("llama").to(torch.bfloat16)
    model.save_pretrained(str(tmp_path / "m"))
    streamed = stream_hf(tmp_path / "m")
    assert {p.dtype for p in streamed.parameters()} == {torch.bfloat16}
    assert stream_hf(tmp_path / "m", dtype=torch.float32).model.embed_tokens.weight.dtype == torch.float32
    # "auto" without a dtype in config.json: the stored weights', as from_pretrained
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    assert {p.dtype for p in stream_hf(tmp_path / "m").parameters()} == {torch.bfloat16}
    data = batches(2, 4, seq=16, vocab=VOCAB)
    cfg = snake_config(tmp_path / "a", dtype="bfloat16")
    async with SnakeTrainer(streamed, data=data, config=cfg) as t:
        await asyncio.wait_for(t.run(2), timeout=120)
        got = await t.state_dict()
    async with SnakeTrainer(load_hf(tmp_path / "m"), data=data, config=snake_config(tmp_path / "b", dtype="bfloat16")) as t:
        await asyncio.wait_for(t.run(2), timeout=120)
        want = await t.state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)


def mapped_files() -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's file mappings (Linux)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append((lo, hi, fields[5]))
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("load_dtype", ["float32", "bfloat16"])
async def test_frozen_layer_weights_stream_from_a_mapped_file_of_snakes(tmp_path, load_dtype):
    """A LoRA-style fine-tune of a streamed model: the frozen layer weights, still in the
    files, go to a file of snake's own in the compute dtype (fp32) that the process maps (the
    kernel's page cache holds them, not the process). Loaded in the compute dtype, the
    model's parameters point at the mapping; loaded in another (bf16), they stay in their
    files (until round 37 they were read into memory, as a model loaded whole holds them,
    beside snake's copy). Both train as plain PyTorch on the same weights, `state_dict`
    reads what stayed in the files, and a checkpoint saved before the first run holds them."""
    _, path = saved("llama", tmp_path)
    streamed, again_streamed = (stream_hf(path, dtype=getattr(torch, load_dtype)) for _ in range(2))
    whole = load_hf(path, dtype=getattr(torch, load_dtype)).float()
    for m in (streamed, again_streamed, whole):
        for name, p in m.named_parameters():
            if "mlp" in name or "embed" in name:
                p.requires_grad_(False)
    data = batches(3, 4, seq=16, vocab=VOCAB)
    want = reference(whole, data, 2)
    # the memory model leaves out what the mapping holds
    shape = shape_of_parts(describe(streamed), 2, 16, "float32")
    assert shape.layer_frozen_in_files and shape.layer_frozen_params > 0
    async with SnakeTrainer(streamed, data=data, config=snake_config(tmp_path)) as trainer:
        await trainer.save(tmp_path / "before")
        await asyncio.wait_for(trainer.run(3), timeout=120)
        got = await trainer.state_dict()
        kernels = trainer.engine.kernels
        assert kernels.frozen_mapped
        maps = [(lo, hi) for lo, hi, name in mapped_files() if "frozen-" in name and "(deleted)" in name]
        for host in kernels.frozen_host:
            assert host is not None and host.dtype == torch.float32
            assert any(lo <= host.data_ptr() < hi for lo, hi in maps)
        # the CPU device reads them where they are mapped: a layer's load copies its trained
        # parameters alone (half of them on the SSD here: no view of the store)
        await trainer.evaluate(data[:1])  # and so does an evaluation's
        for name in ("param L", "eval param L"):
            loads = [s for s in trainer.trace.spans if s.name.startswith(name) and s.link == "cpu->gpu"]
            assert loads and {s.nbytes for s in loads} == {trainer.engine.layer_P[0] * 4}, name
    assert_matches(got, want)
    frozen = [p for n, p in layer_params(streamed).items() if "mlp" in n]
    assert frozen and all(p.is_meta == (load_dtype == "bfloat16") for p in frozen)
    assert not list((tmp_path / "off").glob("frozen-*"))  # unlinked once mapped
    async with SnakeTrainer(again_streamed, data=data, config=snake_config(tmp_path / "again")) as trainer:
        await trainer.load(tmp_path / "before")  # the frozen digests match the model's
        await asyncio.wait_for(trainer.run(3), timeout=120)
        again = await trainer.state_dict()
    for k, v in got.items():
        torch.testing.assert_close(again[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.asyncio
async def test_planned_run_probes_the_streamed_layers(tmp_path):
    """With micro_batches, placement and alpha left to the planner, its probes time copies
    of the layers with their weights read from the files."""
    _, path = saved("llama", tmp_path)
    config = dataclasses.replace(snake_config(tmp_path), placement=None, alpha=None)
    async with SnakeTrainer(stream_hf(path), data=batches(2, 4, vocab=VOCAB), config=config) as trainer:
        report = await asyncio.wait_for(trainer.run(2), timeout=300)
    assert all(torch.isfinite(torch.tensor(s.loss)) for s in report.steps)


@pytest.mark.asyncio
async def test_a_layer_weight_missing_from_the_checkpoint_is_refused_naming_it(tmp_path):
    _, path = saved("llama", tmp_path)
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    key = "model.layers.1.mlp.up_proj.weight"
    tensors["model.layers.1.mlp.up_proj.w"] = tensors.pop(key)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*load_hf"):
        stream_hf(path)
    # a model whose weights transformers converts: a layer of each kind is converted at once,
    # and every layer must store what the first of its kind stores
    _, path = saved("mixtral", tmp_path)
    file = path / "model.safetensors"
    whole = load_file(str(file))
    for layer in (0, 1):
        key = f"model.layers.{layer}.self_attn.q_proj.weight"
        save_file({k: v for k, v in whole.items() if k != key}, str(file), metadata={"format": "pt"})
        with pytest.raises(ModelError, match=rf"model\.layers\.{layer}\.self_attn\.q_proj\.weight.*load_hf"):
            stream_hf(path)


def test_missing_weights_outside_the_layers_and_bad_directories_are_refused(tmp_path):
    _, path = saved("llama", tmp_path)
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["model.norm.weight"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"model\.norm\.weight"):
        stream_hf(path)
    with pytest.raises(ModelError, match="config.json"):
        stream_hf(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(json.loads((path / "config.json").read_text())))
    with pytest.raises(ModelError, match="safetensors"):
        stream_hf(tmp_path / "empty")


def test_a_meta_layer_without_weights_is_refused(tmp_path):
    _, path = saved("llama", tmp_path)
    parts = describe(stream_hf(path))
    with pytest.raises(ModelError, match="meta device.*stream_hf"):
        SnakeTrainer(dataclasses.replace(parts, weights=None), data=batches(1, 4, vocab=VOCAB), config=snake_config(tmp_path))
    assert not (tmp_path / "off").exists()


@pytest.mark.asyncio
async def test_save_load_and_export_from_streamed_models(tmp_path):
    """A streamed run saved after one step and resumed by a new streamed trainer gives the
    weights of a whole model's two steps; export writes them where load_hf reads them."""
    model, path = saved("llama", tmp_path, "20KB", tie_word_embeddings=True)
    data = batches(2, 4, seq=16, vocab=VOCAB)
    async with SnakeTrainer(load_hf(path), data=data, config=snake_config(tmp_path / "whole")) as t:
        await asyncio.wait_for(t.run(2), timeout=120)
        want = await t.state_dict()
    async with SnakeTrainer(stream_hf(path), data=data, config=snake_config(tmp_path / "a")) as t:
        await asyncio.wait_for(t.run(1), timeout=120)
        await t.save(tmp_path / "ckpt")
    streamed = stream_hf(path)
    async with SnakeTrainer(streamed, data=data, config=snake_config(tmp_path / "b")) as t:
        await t.load(tmp_path / "ckpt")
        await asyncio.wait_for(t.run(1), timeout=120)
        got = await t.state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
    export_hf(got, streamed, tmp_path / "export")
    again = load_hf(tmp_path / "export", dtype=torch.float32)
    assert again.lm_head.weight is again.model.embed_tokens.weight
    for k, v in again.state_dict().items():
        torch.testing.assert_close(v, got[k], rtol=0, atol=0, msg=k)


def test_parameters_go_to_meta_only_in_the_building_thread_and_only_while_it_builds():
    from concurrent.futures import ThreadPoolExecutor

    from torch import nn

    from snake.hf.load import _parameters_on_meta

    with ThreadPoolExecutor(1) as other:
        with _parameters_on_meta():
            here = nn.Linear(4, 4)
            there = other.submit(nn.Linear, 4, 4).result()
        assert here.weight.is_meta and here.bias.is_meta
        assert not there.weight.is_meta
    with pytest.raises(RuntimeError, match="boom"), _parameters_on_meta():
        raise RuntimeError("boom")
    assert not nn.Linear(4, 4).weight.is_meta


@pytest.mark.asyncio
async def test_the_model_is_described_when_the_trainer_is_made(tmp_path):
    """What the user changes on the model after stream_hf (its attention implementation
    here, whose masks snake supplies) is what snake trains."""
    _, path = saved("llama", tmp_path)
    streamed = stream_hf(path)
    streamed.set_attn_implementation("eager")
    whole = load_hf(path, attn_implementation="eager")
    data = batches(2, 4, seq=16, vocab=VOCAB)
    want = reference(whole, data, 2)
    assert_matches(await train(streamed, data, tmp_path, steps=2), want)


@pytest.mark.asyncio
async def test_a_checkpoint_without_the_base_model_prefix_streams(tmp_path):
    """The Hub's GPT-2 stores `h.0.…` and `wte.weight`, without `transformer.`, which
    from_pretrained accepts: its layers stay in the file too."""
    model, path = saved("gpt2", tmp_path)
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, str(file), metadata={"format": "pt"})
    streamed = stream_hf(path)
    assert all(p.is_meta for p in layer_params(streamed).values())
    data = batches(2, 4, seq=16, vocab=VOCAB)
    assert_matches(await train(streamed, data, tmp_path, steps=2), reference(model, data, 2))


def test_damaged_shards_and_a_config_that_does_not_match_are_refused_at_once(tmp_path):
    _, path = saved("llama", tmp_path, "20KB")
    shards = sorted(path.glob("*.safetensors"))
    last = shards[-1].read_bytes()
    shards[-1].write_bytes(last[: len(last) // 2])
    with pytest.raises(ModelError, match=rf"cannot read .*{shards[-1].name}"):
        stream_hf(path)
    shards[-1].unlink()
    with pytest.raises(ModelError, match=rf"cannot read .*{shards[-1].name}"):
        stream_hf(path)
    (path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ModelError, match="not a safetensors index"):
        stream_hf(path)
    _, path = saved("llama", tmp_path / "other")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    with pytest.raises(ModelError, match=r"mlp\..*shape.*config.json does not match"):
        stream_hf(path)
    with pytest.raises(ModelError, match="dtype"):
        stream_hf(path, dtype="float8_e4m3fn")


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
async def test_a_cast_after_loading_casts_what_was_loaded(tmp_path, kind):
    """`stream_hf(dir, dtype=bf16).float()` holds bf16-rounded weights, as
    `load_hf(dir, dtype=bf16).float()` does (read by name and converted alike)."""
    _, path = saved(kind, tmp_path)
    got, want = stream_hf(path, dtype=torch.bfloat16).float(), load_hf(path, dtype=torch.bfloat16).float()
    states = []
    for i, model in enumerate((got, want)):
        async with SnakeTrainer(model, data=batches(1, 4, vocab=VOCAB), config=snake_config(tmp_path / str(i))) as t:
            states.append(await t.state_dict())
    assert states[0].keys() == states[1].keys()
    for k, v in states[1].items():
        torch.testing.assert_close(states[0][k], v, rtol=0, atol=0, msg=k)


def test_a_later_layer_of_another_shape_or_a_missing_layer_is_refused_at_load(tmp_path):
    _, path = saved("mixtral", tmp_path)
    file = path / "model.safetensors"
    whole = load_file(str(file))
    key = "model.layers.1.self_attn.q_proj.weight"
    save_file({**whole, key: whole[key][:-1].clone()}, str(file), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=rf"{key}.*shape"):
        stream_hf(path)
    save_file({k: v for k, v in whole.items() if not k.startswith("model.layers.1.")}, str(file),
              metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"no layer 1 .*num_hidden_layers"):
        stream_hf(path)


@pytest.mark.asyncio
async def test_layers_made_real_behind_snakes_back_or_files_gone_are_refused(tmp_path):
    _, path = saved("llama", tmp_path)
    emptied = stream_hf(path).to_empty(device="cpu")
    with pytest.raises(ModelError, match="no longer on the meta device"):
        SnakeTrainer(emptied, data=batches(1, 4, vocab=VOCAB), config=snake_config(tmp_path / "a"))
    streamed = stream_hf(path)
    (path / "model.safetensors").unlink()
    async with SnakeTrainer(streamed, data=batches(1, 4, vocab=VOCAB), config=snake_config(tmp_path / "b")) as t:
        with pytest.raises(ModelError, match="cannot read .*must stay as it was loaded"):
            await asyncio.wait_for(t.run(1), timeout=120)


def lora(model):
    for name, p in model.named_parameters():
        if "mlp" in name or "embed" in name:
            p.requires_grad_(False)
    return model


@pytest.mark.asyncio
async def test_a_second_trainer_keeps_the_first_ones_mapping_and_a_failed_mapping_changes_nothing(
    tmp_path, monkeypatch
):
    _, path = saved("llama", tmp_path)
    streamed = lora(stream_hf(path))
    data = batches(2, 4, seq=16, vocab=VOCAB)
    hosts = []
    for i in range(2):
        async with SnakeTrainer(streamed, data=data, config=snake_config(tmp_path / str(i))) as trainer:
            await asyncio.wait_for(trainer.run(1), timeout=120)
            kernels = trainer.engine.kernels
            assert kernels.frozen_mapped
            hosts.append([h.data_ptr() for h in kernels.frozen_host])
    assert hosts[0] == hosts[1]  # the same mapping: nothing read into memory the second time

    # a mapping that fails part-way (here the second layer's) leaves the model as it was
    fresh = lora(stream_hf(path))
    calls = []
    from_file = torch.from_file

    def failing(*args, **kw):
        calls.append(args)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return from_file(*args, **kw)

    monkeypatch.setattr(torch, "from_file", failing)
    async with SnakeTrainer(fresh, data=data, config=snake_config(tmp_path / "fail")) as trainer:
        with pytest.raises(StorageError, match="frozen-00001.bin, layer 1's frozen weights.*No space left.*offload_dir"):
            await asyncio.wait_for(trainer.run(1), timeout=120)
    frozen = [p for n, p in layer_params(fresh).items() if "mlp" in n]
    assert frozen and all(p.is_meta for p in frozen)
    assert not list((tmp_path / "fail" / "off").glob("frozen-*"))


@pytest.mark.asyncio
async def test_not_enough_disk_for_the_mapped_frozen_weights_names_them(tmp_path, monkeypatch):
    from collections import namedtuple

    import snake.engine

    _, path = saved("llama", tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(snake.engine.shutil, "disk_usage", lambda p: usage(2**30, 2**30 - 2**10, 2**10))
    config = dataclasses.replace(snake_config(tmp_path), placement=Placement.all_cpu())
    async with SnakeTrainer(lora(stream_hf(path)), data=batches(1, 4, vocab=VOCAB), config=config) as trainer:
        with pytest.raises(ConfigError, match=r"0\.0 MiB free but the SSD tier needs 0\.0 MiB and the frozen layer "
                                              r"weights' mapped files [0-9.]+ MiB"):
            await asyncio.wait_for(trainer.run(1), timeout=120)


@pytest.mark.asyncio
async def test_mapped_frozen_weights_the_memory_cannot_hold_are_warned_of(tmp_path, monkeypatch):
    """A streamed model's frozen weights, mapped from a file of snake's, that the memory left
    available cannot hold: every pass reads them from the disk again, which the planner
    does not count; warned of once the tiers are allocated, with what to leave free. With
    the memory to hold them, nothing is said (the suite turns warnings into errors)."""
    import snake.engine
    from snake.offload_dir import FrozenFromDiskWarning

    _, path = saved("llama", tmp_path)
    data = batches(1, 4, vocab=VOCAB)
    async with SnakeTrainer(lora(stream_hf(path)), data=data, config=snake_config(tmp_path / "a")) as trainer:
        await asyncio.wait_for(trainer.run(1), timeout=120)  # plenty of memory: no warning
    monkeypatch.setattr(snake.engine, "_available_memory", lambda: 2**10)
    async with SnakeTrainer(lora(stream_hf(path)), data=data, config=snake_config(tmp_path / "b")) as trainer:
        with pytest.warns(FrozenFromDiskWarning, match=r"frozen layer weights snake maps from offload_dir take "
                                                       r"0\.3 MiB, more than the 0\.0 MiB of memory available.*"
                                                       r"reads them from the disk again.*lower cpu_memory_bytes"):
            await asyncio.wait_for(trainer.run(1), timeout=120)
