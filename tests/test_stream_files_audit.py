"""Audit of a streamed model's files on disk (`snake.hf.stream_hf`) against snake's use of
them: the source directory changed while a streamed model is open or training (a file
replaced by a new inode, truncated in place, moved), an export into that directory, file
descriptors and mappings after close, directories laid out as the Hugging Face cache lays
them out (symlinks to blobs, read-only), directories holding more than one set of weights,
and the files' dtype against `dtype=`. Expectations come from the model loaded whole
(`load_hf` of an untouched copy) and plain PyTorch. What may kill the process (a mapped page
past a truncated file's end: SIGBUS) runs in a child process, never in pytest's."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors import safe_open
from safetensors.torch import load_file

from snake import ModelError, Placement, SnakeConfig, SnakeTrainer
from snake.hf import export_hf, load_hf, stream_hf
from tests.helpers import batches
from tests.test_hf import assert_matches, reference

ROOT = Path(__file__).resolve().parents[1]
V = 96
DATA = batches(2, 4, seq=8, vocab=V)
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=V, max_position_embeddings=32, bos_token_id=0, eos_token_id=1, pad_token_id=None)


def make(seed: int = 0) -> tf.LlamaForCausalLM:
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL))


def saved(directory: Path, seed: int = 0, **kw) -> Path:
    make(seed).save_pretrained(str(directory), **kw)
    return directory


def config(directory: Path, dtype: str = "float32") -> SnakeConfig:
    return SnakeConfig(micro_batches=2, offload_dir=Path(directory) / "off", device="cpu", dtype=dtype, alpha=0.3,
                       placement=Placement(param=0.5, ckpt=0.5, opt=0.5))


def lora(model):
    """A LoRA-style fine-tune: the MLPs and the embedding frozen, attention trained."""
    for name, p in model.named_parameters():
        if "mlp" in name or "embed" in name:
            p.requires_grad_(False)
    return model


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def whole_loss(state: dict, source: Path, batch) -> float:
    """The mean cross-entropy of `state` (loaded into the model of `source`, whole) on `batch`."""
    m = load_hf(source, dtype=torch.float32)
    m.load_state_dict(state)
    m.eval()
    x, y = batch
    with torch.no_grad():
        logits = m(x).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1)))


# -- files replaced (a new inode) or moved ----------------------------------------------------


@pytest.mark.asyncio
async def test_a_file_replaced_before_the_first_run_is_not_trained_on_silently(tmp_path):
    """stream_hf checked the files and read the embedding from them; another model's file
    put in their place (os.replace: same names and shapes) before the trainer reads the
    layers must be refused naming it, or not be read: never a model of the old embedding and
    the new layers."""
    src = saved(tmp_path / "src")
    orig = shutil.copytree(src, tmp_path / "orig")
    saved(tmp_path / "other", seed=1)
    model = stream_hf(src)
    os.replace(tmp_path / "other" / "model.safetensors", src / "model.safetensors")
    want = reference(load_hf(orig, dtype=torch.float32), DATA[:1], 2)
    async with SnakeTrainer(model, data=DATA, config=config(tmp_path)) as trainer:
        try:
            await trainer.run(1)
        except ModelError as e:
            assert "model.safetensors" in str(e), e
            return
        got = await trainer.state_dict()
    wrong = sorted(k for k in want if not torch.allclose(got[k], want[k], atol=1e-4))
    assert not wrong, (
        f"trained silently on the replaced file's layers with the loaded embedding: {wrong[:4]} differ from "
        "the model stream_hf loaded (files.py _read opens the path again at each read; no check that the "
        "file is the one loaded: inode/size/mtime or header)"
    )


@pytest.mark.asyncio
async def test_a_file_replaced_after_training_started_does_not_change_the_frozen_weights_given(tmp_path):
    """A LoRA-style fine-tune of a model streamed in another dtype than the compute dtype
    (fp32 files, bf16 compute): its frozen layer weights stay in the files. Once trained,
    the source file replaced by another model's (a new inode) must not change the frozen
    weights `state_dict()` and `save()` give: either those trained with (the original's) or
    an error naming the file."""
    src = saved(tmp_path / "src")
    original = make(0).state_dict()
    saved(tmp_path / "other", seed=1)
    frozen = [k for k in original if ".mlp." in k]
    async with SnakeTrainer(lora(stream_hf(src)), data=DATA, config=config(tmp_path, "bfloat16")) as trainer:
        await trainer.run(1)
        os.replace(tmp_path / "other" / "model.safetensors", src / "model.safetensors")
        for what in ("state_dict", "save"):
            try:
                if what == "state_dict":
                    got = await trainer.state_dict()
                else:
                    await trainer.save(tmp_path / "ckpt", frozen=True)
                    got = {}
                    for f in (tmp_path / "ckpt").glob("*.safetensors"):
                        with safe_open(str(f), "pt") as g:
                            got.update({k[len("frozen/"):]: g.get_tensor(k) for k in g.keys() if k.startswith("frozen/")})
            except ModelError as e:
                assert "model.safetensors" in str(e), e
                continue
            changed = [k for k in frozen if not torch.equal(got[k].float(), original[k].float())]
            assert not changed, (
                f"{what}() after the source file was replaced gives the new file's frozen layer weights "
                f"({changed[:3]}), not those the trainer trained with, without a word (state_dict.py "
                "_meta_values / checkpoint.py layer_frozen read the path again via stream.py _LayerReader)"
            )


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["full", "lora-bf16"])
async def test_a_source_directory_moved_after_training_started(tmp_path, kind):
    """The directory renamed after the first run: run, evaluate, state_dict and save either
    give what the model loaded whole gives or fail naming the file, leave no checkpoint
    half-written, and the trainer goes on training."""
    src = saved(tmp_path / "src")
    orig = shutil.copytree(src, tmp_path / "orig")
    dtype = "bfloat16" if kind == "lora-bf16" else "float32"
    model = stream_hf(src)
    if kind != "full":
        lora(model)
    async with SnakeTrainer(model, data=DATA, config=config(tmp_path, dtype)) as trainer:
        await trainer.run(1)
        os.rename(src, tmp_path / "moved")
        loss = (await trainer.evaluate(DATA[:1])).loss
        try:
            got = await trainer.state_dict()
        except ModelError as e:
            assert "model.safetensors" in str(e), e
            got = None
        try:
            await trainer.save(tmp_path / "ckpt")
        except ModelError as e:
            assert "model.safetensors" in str(e), e
            assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")], "a half-written checkpoint"
        await trainer.run(1)
    if kind == "full":
        want1 = reference(load_hf(orig, dtype=torch.float32), DATA[:1], 2)
        assert loss == pytest.approx(whole_loss(want1, orig, DATA[0]), abs=1e-5)
        assert got is not None
        assert_matches(got, want1)
        assert (tmp_path / "ckpt" / "manifest.json").is_file()
    elif got is not None:  # the frozen layer weights, as loaded (fp32)
        original = load_hf(orig, dtype=torch.float32).state_dict()
        for k in (k for k in original if ".mlp." in k):
            torch.testing.assert_close(got[k], original[k], rtol=0, atol=0, msg=k)


# -- an export into the directory a streamed model reads --------------------------------------


@pytest.mark.asyncio
async def test_an_export_into_the_source_directory_of_open_streamed_models(tmp_path):
    """`export_hf(state, model, SRC)` with a trainer of the model open and a second model
    streamed from SRC still open (not yet trained). stream_hf's docstring says not to export
    into it: refused naming the directory before a file is written; or, where written, the
    export loads as the trained weights, the trainer trains on correctly, and the second
    model is either the one it loaded or refused naming the file: never a mix of the
    loaded embedding and the exported layers."""
    src = saved(tmp_path / "src")
    orig = shutil.copytree(src, tmp_path / "orig")
    before = digest(src)
    model, second = stream_hf(src), stream_hf(src)
    async with SnakeTrainer(model, data=DATA, config=config(tmp_path / "a")) as trainer:
        await trainer.run(1)
        state = await trainer.state_dict()
        try:
            export_hf(state, model, src)
        except ModelError as e:
            assert str(src) in str(e), e
            assert digest(src) == before, "refused, but after writing into the directory"
            return
        again = load_hf(src, dtype=torch.float32).state_dict()
        for k, v in state.items():
            torch.testing.assert_close(again[k], v, rtol=0, atol=0, msg=k)
        await trainer.run(1)
        assert_matches(await trainer.state_dict(), reference(load_hf(orig, dtype=torch.float32), DATA, 2))
    want = load_hf(orig, dtype=torch.float32).state_dict()
    async with SnakeTrainer(second, data=DATA, config=config(tmp_path / "b")) as trainer:
        try:
            got = await trainer.state_dict()  # before a run: the layers read from the files
        except ModelError as e:
            assert "model.safetensors" in str(e), e
            return
    mixed = sorted(k for k in want if not torch.equal(got[k], want[k]))
    assert not mixed, (
        f"export_hf into the directory of a still-open streamed model was not refused, and that model now "
        f"reads the exported layers beside the embedding it loaded: {mixed[:4]} are not the loaded model's "
        "(export.py export_hf has no check of the model's own/another open model's source directory; "
        "files.py _read reads the new file by path)"
    )


# -- what the directory holds -------------------------------------------------------------


def _stale_index(d: Path) -> None:  # save_pretrained over a sharded save: its index stays
    saved(d, seed=1, max_shard_size="20KB")
    saved(d)


def _stale_shards(d: Path) -> None:  # a new model.safetensors copied beside old shards
    saved(d, seed=1, max_shard_size="20KB")
    saved(d.with_name("new"))
    shutil.copy(d.with_name("new") / "model.safetensors", d / "model.safetensors")


def _extra_file(d: Path) -> None:  # another *.safetensors beside model.safetensors
    saved(d)
    saved(d.with_name("old"), seed=1)
    shutil.copy(d.with_name("old") / "model.safetensors", d / "model_v0.safetensors")


def _bin_too(d: Path) -> None:  # pytorch_model.bin (other weights) beside model.safetensors
    saved(d)
    torch.save(make(1).state_dict(), d / "pytorch_model.bin")


@pytest.mark.asyncio
@pytest.mark.parametrize("layout", [_stale_index, _stale_shards, _extra_file, _bin_too],
                         ids=["stale-index", "stale-shards", "extra-safetensors", "bin-too"])
async def test_a_directory_with_more_than_one_set_of_weights_streams_what_load_hf_loads(tmp_path, layout):
    """stream_hf loads a directory "as load_hf does": where it holds more than one set of
    weights, the same one (from_pretrained takes model.safetensors before an index, and no
    other *.safetensors), or a refusal naming what is wrong; never other weights."""
    d = tmp_path / "d"
    layout(d)
    want = load_hf(d, dtype=torch.float32).state_dict()
    try:
        model = stream_hf(d)
    except ModelError as e:
        pytest.fail(f"stream_hf refuses a directory load_hf loads ({sorted(p.name for p in d.iterdir())}): {e} "
                    "(files.py _safetensors_keys reads model.safetensors.index.json first; from_pretrained "
                    "reads model.safetensors first)")
    async with SnakeTrainer(model, data=DATA, config=config(tmp_path)) as trainer:
        got = await trainer.state_dict()  # before a run: the layers read from the files
    other = sorted(k for k in want if not torch.equal(got[k], want[k]))
    assert not other, (
        f"stream_hf streams other weights than load_hf loads from {sorted(p.name for p in d.iterdir())}: "
        f"{other[:4]} differ (files.py _safetensors_keys: the index before model.safetensors, or every "
        "*.safetensors of the directory merged, the last sorted winning)"
    )


def _hf_cache(tmp_path: Path) -> Path:
    """A model saved in shards, laid out as the Hugging Face cache lays it out: the
    snapshot's files are relative symlinks to content-named blobs; everything read-only."""
    plain = saved(tmp_path / "plain", max_shard_size="20KB")
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in plain.iterdir():
        blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
        blob.chmod(0o444)
    for d in (blobs, snap):
        d.chmod(0o555)
    return snap


@pytest.mark.asyncio
async def test_a_symlinked_read_only_sharded_cache_snapshot_streams_and_trains_as_load_hf(tmp_path):
    """The Hugging Face cache's layout (symlinks to blobs), read-only, in shards: streamed
    and trained (LoRA-style, frozen weights read from the files; then saved and exported
    elsewhere), the weights are plain PyTorch's on the model loaded whole, and the files
    are only read: unchanged, and every mapping of them private (as root a chmod does not
    bind, so that is what shows no write can reach them)."""
    snap = _hf_cache(tmp_path)
    blobs = snap.parent.parent / "blobs"
    try:
        before = digest(blobs)
        stamps = {p.name: p.stat().st_mtime_ns for p in blobs.iterdir()}
        model = lora(stream_hf(snap))
        want = reference(lora(load_hf(snap, dtype=torch.float32)), DATA, 2)
        async with SnakeTrainer(model, data=DATA, config=config(tmp_path / "t")) as trainer:
            await trainer.run(2)
            # (none at all since round 44: the embedding, head and norms are read into memory
            # of their own, and this model's frozen weights are copied into snake's tiers)
            maps = _mappings(blobs)
            shared = [m for m in maps if m[1][3] != "p"]
            assert not shared, f"a shared mapping of the model's files, which writes would reach: {shared}"
            got = await trainer.state_dict()
            await trainer.save(tmp_path / "ckpt")
        export_hf(got, model, tmp_path / "export")
        assert_matches(got, want)
        assert digest(blobs) == before
        assert {p.name: p.stat().st_mtime_ns for p in blobs.iterdir()} == stamps
        if os.geteuid() != 0:
            assert not os.access(blobs, os.W_OK)
    finally:
        for d in (blobs, snap):
            d.chmod(0o755)
        for f in blobs.iterdir():
            f.chmod(0o644)


def _mappings(directory: Path) -> list[list[str]]:
    """This process's mappings (fields of /proc/self/maps) of files under `directory`."""
    return [line.split() for line in Path("/proc/self/maps").read_text().splitlines() if str(directory) in line]


def _ours(directory: Path) -> tuple[list[str], list[str]]:
    """This process's open file descriptors and mappings of files under `directory`."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    maps = [line.split(maxsplit=5)[-1] for line in Path("/proc/self/maps").read_text().splitlines()]
    return [p for p in fds if p.startswith(str(directory))], [p for p in maps if p.startswith(str(directory))]


@pytest.mark.asyncio
async def test_no_descriptor_or_mapping_of_the_files_outlives_the_model(tmp_path):
    """A sharded model streamed in another dtype than the compute dtype (its frozen weights
    read from the files again by state_dict and save): no file descriptor of its files
    open while it trains; after close() and the model dropped, no mapping either, and the
    directory deletes."""
    src = saved(tmp_path / "src", max_shard_size="20KB")
    model = lora(stream_hf(src))
    trainer = SnakeTrainer(model, data=DATA, config=config(tmp_path, "bfloat16"))
    try:
        await trainer.run(1)
        await trainer.evaluate(DATA[:1])
        await trainer.state_dict()
        await trainer.save(tmp_path / "ckpt")
        fds, _ = _ours(src)
        assert not fds, f"descriptors of the model's files left open while training: {fds}"
    finally:
        await trainer.close()
    alive = weakref.ref(model)
    del model, trainer
    gc.collect()
    assert alive() is None, "the streamed model outlives its trainer and its last reference"
    fds, maps = _ours(src)
    assert not fds and not maps, f"after close and the model dropped: descriptors {fds}, mappings {maps}"
    shutil.rmtree(src)
    assert not src.exists()


# -- the files' dtype against dtype= ----------------------------------------------------------


@pytest.mark.asyncio
async def test_bf16_files_streamed_as_float32_train_as_the_model_loaded_whole(tmp_path):
    """bf16 files, `stream_hf(dtype=torch.float32)`, LoRA-style (the frozen layer weights go
    from the bf16 files to snake's fp32 file): the weights of plain PyTorch on
    `load_hf(dtype=torch.float32)` of the same files."""
    m = make(0).to(torch.bfloat16)
    m.save_pretrained(str(tmp_path / "src"))
    src = tmp_path / "src"
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    model = lora(stream_hf(src, dtype=torch.float32))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    want = reference(lora(load_hf(src, dtype=torch.float32)), DATA, 2)
    async with SnakeTrainer(model, data=DATA, config=config(tmp_path)) as trainer:
        await trainer.run(2)
        got = await trainer.state_dict()
    assert_matches(got, want)


@pytest.mark.asyncio
async def test_float32_files_streamed_as_bf16_train_as_the_model_loaded_whole(tmp_path):
    """fp32 files, `stream_hf(dtype=torch.bfloat16)`, bf16 compute, a full fine-tune and a
    LoRA-style one: bit for bit what snake trains of `load_hf(dtype=torch.bfloat16)` (the
    fp32 masters start from the bf16 rounding either way)."""
    src = saved(tmp_path / "src")
    for frozen in (False, True):
        streamed, whole = stream_hf(src, dtype=torch.bfloat16), load_hf(src, dtype=torch.bfloat16)
        if frozen:
            lora(streamed), lora(whole)
        got = await _trained(streamed, tmp_path / f"stream-{frozen}")
        want = await _trained(whole, tmp_path / f"whole-{frozen}")
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=lambda m, k=k, f=frozen: f"frozen={f} {k}: {m}")


async def _trained(model, directory: Path) -> dict[str, torch.Tensor]:
    async with SnakeTrainer(model, data=DATA, config=config(directory, "bfloat16")) as trainer:
        await trainer.run(2)
        return await trainer.state_dict()


# -- what may kill the process: in children, started once for the module -------------------

CHILD = r"""
import asyncio, json, os, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from snake import Placement, SnakeConfig, SnakeTrainer
from snake.hf import stream_hf
from tests.helpers import batches

scenario, out = sys.argv[1], Path(sys.argv[2])
DATA = batches(2, 4, seq=8, vocab=96)

def say(phase, step, **kw):
    print(json.dumps({"phase": phase, "step": step, **kw}), flush=True)

def cfg(d):
    return SnakeConfig(micro_batches=2, offload_dir=d / "off", device="cpu", dtype="float32", alpha=0.3,
                       placement=Placement(param=0.5, ckpt=0.5, opt=0.5))

def lora(model):
    for name, p in model.named_parameters():
        if "mlp" in name or "embed" in name:
            p.requires_grad_(False)
    return model

async def attempt(phase, step, make):
    say(phase, step + ":start")
    try:
        value = await make()
    except Exception as e:
        say(phase, step, error=f"{type(e).__name__}: {e}")
        return None
    say(phase, step, ok=True, **({"loss": value.loss} if step == "evaluate" else {}))
    return value

async def after(phase, src, frozen):
    model = stream_hf(src)
    if frozen:
        lora(model)
    async with SnakeTrainer(model, data=DATA, config=cfg(out / phase)) as t:
        await t.run(1)
        os.truncate(src / "model.safetensors", 0)  # in place: the same inode, now empty
        say(phase, "truncated")
        await attempt(phase, "run", lambda: t.run(1))
        await attempt(phase, "evaluate", lambda: t.evaluate(DATA[:1]))
        sd = await attempt(phase, "state_dict", t.state_dict)
        if sd is not None:
            save_file({k: v.detach().contiguous().clone() for k, v in sd.items()}, str(out / f"{phase}.safetensors"))
        await attempt(phase, "save", lambda: t.save(out / f"{phase}-ckpt"))
    say(phase, "closed")

async def before(phase, src):
    model = stream_hf(src)
    os.truncate(src / "model.safetensors", 0)
    say(phase, "truncated")
    async with SnakeTrainer(model, data=DATA, config=cfg(out / phase)) as t:
        await attempt(phase, "run", lambda: t.run(1))
    say(phase, "closed")

async def main():
    if scenario == "after":
        await after("full", out / "src-full", False)
        await after("lora", out / "src-lora", True)
    else:
        await before("before", out / "src-before")

asyncio.run(main())
"""


class Child:
    def __init__(self, scenario: str, out: Path) -> None:
        self.out = out
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        self.log = open(out / f"{scenario}.log", "w")  # noqa: SIM115  (closed in `result`)
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, scenario, str(out)], cwd=str(ROOT), env=env,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        self._lines: list[dict] | None = None

    def result(self) -> tuple[int, list[dict]]:
        if self._lines is None:
            stdout, _ = self.proc.communicate(timeout=120)
            self.log.close()
            self._lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
        return self.proc.returncode, self._lines

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()
        if not self.log.closed:
            self.log.close()


@pytest.fixture(scope="module", autouse=True)
def children(tmp_path_factory):
    """Children started before the module's other tests (they run meanwhile): each streams
    its own copy of one saved model, `orig` left untouched for the expectations."""
    out = tmp_path_factory.mktemp("children")
    orig = saved(out / "orig")
    for name in ("src-full", "src-lora", "src-before"):
        shutil.copytree(orig, out / name)
    kids = {"after": Child("after", out), "before": Child("before", out)}
    yield out, kids
    for kid in kids.values():
        kid.stop()


def _phase(kid: Child, phase: str) -> tuple[int, dict[str, dict]]:
    rc, lines = kid.result()
    return rc, {x["step"]: x for x in lines if x["phase"] == phase}


def _died(rc: int, steps: dict[str, dict], kid: Child) -> str:
    started = [s[: -len(":start")] for s in steps if s.endswith(":start") and s[: -len(":start")] not in steps]
    how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
    return (f"the process was {how} during {started[-1] if started else '?'} (steps done: "
            f"{[s for s in steps if not s.endswith(':start')]}); log tail: {kid.log.name}")


@pytest.mark.parametrize("phase", ["full", "lora"])
def test_a_source_file_truncated_in_place_after_training_started(children, phase):
    """After the first run, snake holds everything it trains with (tiers, its own file of
    the frozen layer weights, its copy of the frozen embedding): the source's model.safetensors
    truncated in place (as `cp new model.safetensors` does first) must not change the next
    run, evaluate, state_dict or save, nor kill the process; at most each fails naming the
    file. A full fine-tune and a LoRA-style one (frozen embedding and MLPs)."""
    out, kids = children
    rc, steps = _phase(kids["after"], phase)
    assert "truncated" in steps, f"{phase}: never got to the truncation: {_died(rc, steps, kids['after'])}"
    assert "closed" in steps, (
        f"{phase}: after the source file was truncated in place, {_died(rc, steps, kids['after'])}: the "
        "streamed model's embedding/head/norms are views of safetensors' mapping of the file "
        "(files.py _read -> stream.py eager load_state_dict(assign=True)), which state_dict()/save() "
        "read (outer_as_computed / resident_tensors) though the trainer holds its own copy"
    )
    whole = load_hf(out / "orig", dtype=torch.float32)
    if phase == "lora":
        lora(whole)
    want = reference(whole, DATA, 2)
    for step in ("run", "evaluate", "state_dict", "save"):
        got = steps[step]
        assert got.get("ok") or "model.safetensors" in got.get("error", ""), f"{phase} {step}: {got}"
    if steps["state_dict"].get("ok") and steps["run"].get("ok"):
        assert_matches(load_file(str(out / f"{phase}.safetensors")), want)
    if steps["evaluate"].get("ok") and steps["run"].get("ok"):
        assert steps["evaluate"]["loss"] == pytest.approx(whole_loss(want, out / "orig", DATA[0]), abs=1e-5)


def test_a_source_file_truncated_in_place_before_the_first_run_is_an_error_not_a_crash(children):
    """The directory must stay as loaded until training has started; a file truncated in
    place before then is an error naming it (as a file deleted is: test_stream_hf), not a
    SIGBUS of the process when the trainer reads the embedding mapped from it."""
    out, kids = children
    rc, steps = _phase(kids["before"], "before")
    assert "closed" in steps, (
        f"model.safetensors truncated in place between stream_hf and the first run: {_died(rc, steps, kids['before'])}"
        " instead of a ModelError naming the file (stream_hf's 'read at once' embedding/head/norms stay views of"
        " the file's mapping: files.py _read, stream.py _LayerSource.__init__ eager load)"
    )
    assert "model.safetensors" in steps["run"].get("error", ""), steps["run"]
