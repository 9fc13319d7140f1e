"""Checkpoints: save / load resume bit-exactly (alpha > 0, mixed placement, both schedules),
skip consumed data, refuse mismatching models and configs, and survive a crash mid-save."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.utils.data import DataLoader, TensorDataset

import snake.checkpoint as ckpt
import snake.checkpoint_files as ckpt_files
import snake.manifest as manifest_mod
from snake import ConfigError, Placement, SnakeConfig, SnakeError, SnakeTrainer
from tests.helpers import KindsLM, batches, kinds_parts, reference, tiny_gpt

TIMEOUT = 120
MIXED = Placement(param=0.5, ckpt=0.5, opt=0.5)


def config(tmp_path: Path, name: str, **kw) -> SnakeConfig:
    base = dict(
        micro_batches=2, placement=MIXED, alpha=0.3, device="cpu", schedule="vertical",
        offload_dir=tmp_path / f"off-{name}",
    )
    base.update(kw)
    return SnakeConfig(**base)


def model(seed: int = 0, **kw):
    return tiny_gpt(n_layer=3, bias=False, dropout=0.1, seed=seed, **kw)


async def straight(tmp_path, data, steps, **kw):
    async with SnakeTrainer(model(), data=data, config=config(tmp_path, "straight", **kw)) as t:
        await t.run(steps)
        return await t.state_dict()


async def first_half(tmp_path, data, steps, where, **kw):
    async with SnakeTrainer(model(), data=data, config=config(tmp_path, "first", **kw)) as t:
        await t.run(steps)
        await t.save(where)
        return await t.state_dict()


async def second_half(tmp_path, data, steps, where, **kw):
    # a different random init: everything must come from the checkpoint
    async with SnakeTrainer(model(seed=123), data=data, config=config(tmp_path, "second", **kw)) as t:
        await t.load(where)
        loaded = await t.state_dict()
        await t.run(steps)
        return loaded, await t.state_dict(), t.source.consumed


async def resumed_as_straight(tmp_path, data, where, **kw) -> int:
    """2 steps, a save to `where`, a load into a trainer of another init and 2 more steps:
    the loaded state is the saved one and the end state that of 4 steps straight, bitwise.
    Returns the batches the resumed trainer consumed."""
    want = await straight(tmp_path, data, 4, **kw)
    mid = await first_half(tmp_path, data, 2, where, **kw)
    loaded, got, consumed = await second_half(tmp_path, data, 2, where, **kw)
    assert_equal_state(loaded, mid)
    assert_equal_state(got, want)
    return consumed


def assert_equal_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_resume_is_bitwise_identical(tmp_path, schedule):
    async def body():
        where = tmp_path / "ckpt"
        assert await resumed_as_straight(tmp_path, batches(4, 4), where, schedule=schedule) == 4
        # only safetensors and json, and the manifest says what it should
        names = {p.name for p in where.iterdir()}
        assert names and all(n.endswith((".safetensors", ".json")) for n in names)
        manifest = json.loads((where / "manifest.json").read_text())
        assert manifest["step"] == 2 and manifest["consumed_batches"] == 2
        assert manifest["config"]["alpha"] == 0.3 and manifest["config"]["schedule"] == schedule
        assert set(manifest["files"]) == names - {"manifest.json"}
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.")]  # no leftovers

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
async def test_resume_with_a_dataloader_skips_consumed_batches(tmp_path):
    async def body():
        xs = torch.stack([x for x, _ in batches(8, 1)]).squeeze(1)
        ys = torch.stack([y for _, y in batches(8, 1)]).squeeze(1)

        def loader():
            return DataLoader(TensorDataset(xs, ys), batch_size=2, shuffle=False)

        want = await straight(tmp_path, loader(), 4)
        where = tmp_path / "ckpt"
        await first_half(tmp_path, loader(), 2, where)
        _, got, consumed = await second_half(tmp_path, loader(), 2, where)
        assert_equal_state(got, want)
        assert consumed == 4

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
async def test_resume_with_a_list_skips_consumed_batches_and_restores_rng(tmp_path):
    async def body():
        data = batches(4, 4)
        where = tmp_path / "ckpt"
        async with SnakeTrainer(model(), data=data, config=config(tmp_path, "first")) as t:
            await t.run(2)
            torch.manual_seed(77)
            rng = torch.get_rng_state()
            await t.save(where)
        async with SnakeTrainer(model(seed=5), data=data, config=config(tmp_path, "list")) as t:
            await t.load(where)
            assert torch.equal(torch.get_rng_state(), rng)  # model(seed=5) reseeded it
            assert t.source.consumed == 2
            assert [item for item, _ in t.source._peeked] == [data[2]]  # the next batch handed out is batch 2
        # without skipping, the same list would resume from batch 0: other weights
        want = await straight(tmp_path, data, 4)
        async with SnakeTrainer(model(seed=5), data=data, config=config(tmp_path, "noskip")) as t:
            await t.load(where, skip_data=False)
            await t.run(2)
            other = await t.state_dict()
        assert not all(torch.equal(other[k], want[k]) for k in want)

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
async def test_save_before_run_then_load(tmp_path):
    async def body():
        data = batches(3, 4)
        where = tmp_path / "ckpt"
        async with SnakeTrainer(model(), data=data, config=config(tmp_path, "a")) as t:
            await t.save(where)
        want = await straight(tmp_path, data, 3)
        _, got, _ = await second_half(tmp_path, data, 3, where)
        assert_equal_state(got, want)

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "other, field",
    [
        (dict(n_embd=32), "model."),
        (dict(n_layer=2), "model.n_layer"),
        (dict(dtype="bfloat16"), "dtype"),
        (dict(alpha=0.0), "alpha"),
        (dict(schedule="horizontal"), "schedule"),
        (dict(micro_batches=1), "micro_batches"),
    ],
)
async def test_mismatch_is_a_clear_error(tmp_path, other, field):
    async def body():
        data = batches(4, 4)
        where = tmp_path / "ckpt"
        await first_half(tmp_path, data, 1, where)
        shape = {k: v for k, v in other.items() if k in ("n_embd", "n_layer")}
        cfg = {k: v for k, v in other.items() if k not in shape}
        m = tiny_gpt(**{"n_layer": 3, "bias": False, **shape})
        async with SnakeTrainer(m, data=data, config=config(tmp_path, "b", **cfg)) as t:
            with pytest.raises(ConfigError) as err:
                await t.load(where)
            assert err.value.field.startswith(field)
            assert "checkpoint" in str(err.value)
            if "n_embd" in shape:
                assert "shape" in str(err.value)
            # a refused checkpoint leaves the trainer as it was: it can still train
            assert t.engine is None and t.source.consumed == 0
            await t.run(1)

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
async def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    async def body():
        data = batches(4, 4)
        where = tmp_path / "ckpt"
        async with SnakeTrainer(model(), data=data, config=config(tmp_path, "c")) as t:
            await t.run(2)
            await t.save(where)
            at_two = await t.state_dict()
            before = digest(where)
            await t.run(1)

            real = ckpt_files._rename

            def crash(src, dst):
                if ".tmp-" in Path(src).name:  # the final rename of the new checkpoint
                    raise OSError("simulated crash")
                real(src, dst)

            monkeypatch.setattr(ckpt_files, "_rename", crash)
            with pytest.raises(OSError, match="simulated crash"):
                await t.save(where)
            assert digest(where) == before
            assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt")) == []
            monkeypatch.setattr(ckpt_files, "_rename", real)
            # the trainer is fine after a failed save; a later save replaces the checkpoint
            await t.save(tmp_path / "ckpt3")
            await t.save(tmp_path / "ckpt3")
            at_three = await t.state_dict()
        await _each_loads(tmp_path, data, {where: (at_two, 2), tmp_path / "ckpt3": (at_three, 3)})

    await asyncio.wait_for(body(), TIMEOUT)


async def _each_loads(tmp_path, data, checkpoints: dict) -> None:
    """Each checkpoint (directory -> (state, step)) loads into a new trainer of other
    initial weights with the state and step it was saved with."""
    for i, (where, (state, step)) in enumerate(checkpoints.items()):
        async with SnakeTrainer(model(seed=9), data=data, config=config(tmp_path, f"load{i}")) as t:
            await t.load(where)
            assert_equal_state(await t.state_dict(), state)
            assert t.engine is not None and t.engine.next_t == step


@pytest.mark.asyncio
async def test_a_cancelled_save_stops_at_its_next_file_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """Cancelling the task awaiting save() stops the save before its next file (each file
    here takes 0.3 s to write): the layers after it are not written, its temporary directory
    goes, the checkpoint there stays as it was, and the trainer goes on and saves again."""
    import threading

    async def body():
        data = batches(4, 4)
        where = tmp_path / "ckpt"
        async with SnakeTrainer(model(), data=data, config=config(tmp_path, "c")) as t:
            await t.run(2)
            await t.save(where)
            before = digest(where)
            at_two = await t.state_dict()
            await t.run(1)
            real, written = ckpt._write_tensors, []
            loop, first = asyncio.get_running_loop(), asyncio.Event()

            def slow(path, tensors, meta):
                written.append(path.name)
                loop.call_soon_threadsafe(first.set)
                threading.Event().wait(0.3)
                return real(path, tensors, meta)

            monkeypatch.setattr(ckpt, "_write_tensors", slow)
            task = asyncio.create_task(t.save(where))
            await first.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert written == [ckpt.layer_file(0)]  # three layers, the resident file and the RNG's
            assert digest(where) == before
            assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt")) == []
            monkeypatch.setattr(ckpt, "_write_tensors", real)
            await t.save(tmp_path / "ckpt3")
            at_three = await t.state_dict()
        await _each_loads(tmp_path, data, {where: (at_two, 2), tmp_path / "ckpt3": (at_three, 3)})

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
async def test_a_cancelled_load_stops_at_its_next_layer_and_closes_the_trainer(tmp_path, monkeypatch):
    """Cancelling the task awaiting load() stops it before its next layer (each layer file
    here takes 0.3 s to open): the trainer is closed (its state is part-loaded), with no
    thread left, and a new trainer loads the checkpoint."""
    import threading

    from tests.test_fault_injection import _snake_threads

    async def body():
        data = batches(4, 4)
        where = tmp_path / "ckpt"
        async with SnakeTrainer(model(), data=data, config=config(tmp_path, "a")) as t:
            await t.run(2)
            await t.save(where)
            want = await t.state_dict()
        real, opened = ckpt_files._TensorFile.__enter__, []
        loop, first = asyncio.get_running_loop(), asyncio.Event()

        def slow(self):
            opened.append(self.path.name)
            loop.call_soon_threadsafe(first.set)
            threading.Event().wait(0.3)
            return real(self)

        t = SnakeTrainer(model(seed=9), data=data, config=config(tmp_path, "b"))
        with monkeypatch.context() as m:
            m.setattr(ckpt_files._TensorFile, "__enter__", slow)
            task = asyncio.create_task(t.load(where))
            await first.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert opened == [ckpt.layer_file(0)]  # not the other two layers, the resident file, the RNG's
        with pytest.raises(SnakeError, match="stopped after"):
            await t.run(1)
        await t.close()
        assert not _snake_threads()
        async with SnakeTrainer(model(seed=9), data=data, config=config(tmp_path, "c")) as t:
            await t.load(where)
            assert_equal_state(await t.state_dict(), want)

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
async def test_crash_between_renames_is_recovered(tmp_path):
    """A kill after the old checkpoint went aside but before the new one came in: load
    says where the old one is, and the next save puts it back before replacing it."""

    async def body():
        data = batches(2, 4)
        where = tmp_path / "ckpt"
        async with SnakeTrainer(model(), data=data, config=config(tmp_path, "f")) as t:
            await t.run(1)
            await t.save(where)
            aside = tmp_path / ".ckpt.old-123"
            where.rename(aside)
            (tmp_path / ".ckpt.tmp-456").mkdir()  # half-written new one
            async with SnakeTrainer(model(), data=data, config=config(tmp_path, "g")) as other:
                with pytest.raises(SnakeError, match=r"\.ckpt\.old-123"):
                    await other.load(where)
            await t.save(where)
            assert not aside.exists() and not (tmp_path / ".ckpt.tmp-456").exists()
            assert (where / "manifest.json").is_file()

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
async def test_load_after_run_or_twice_is_refused(tmp_path):
    async def body():
        data = batches(4, 4)
        where = tmp_path / "ckpt"
        await first_half(tmp_path, data, 1, where)
        async with SnakeTrainer(model(), data=data, config=config(tmp_path, "h")) as t:
            await t.run(1)
            with pytest.raises(SnakeError, match="before its first run"):
                await t.load(where)
        async with SnakeTrainer(model(), data=data, config=config(tmp_path, "i")) as t:
            await t.load(where)
            with pytest.raises(SnakeError, match="before its first run"):
                await t.load(where)
            await t.run(1)  # still usable

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
async def test_damaged_or_foreign_directories(tmp_path):
    async def body():
        data = batches(4, 4)
        where = tmp_path / "ckpt"
        await first_half(tmp_path, data, 1, where)
        layer = where / ckpt.layer_file(0)
        raw = bytearray(layer.read_bytes())
        raw[-1] ^= 0xFF
        layer.write_bytes(bytes(raw))
        async with SnakeTrainer(model(), data=data, config=config(tmp_path, "j")) as t:
            with pytest.raises(SnakeError, match="sha256"):
                await t.load(where)
            with pytest.raises(SnakeError, match="no checkpoint directory"):
                await t.load(tmp_path / "nowhere")
            # save refuses to replace a directory that is not a checkpoint
            foreign = tmp_path / "mine"
            foreign.mkdir()
            (foreign / "notes.txt").write_text("keep me")
            with pytest.raises(SnakeError, match="not a snake checkpoint"):
                await t.save(foreign)
            assert (foreign / "notes.txt").read_text() == "keep me"

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
async def test_export_checks_the_checkpoint_as_load_does(tmp_path):
    """`snake export` read the files without their sha256: a flipped byte was exported as
    a wrong weight, exit 0 (found by round 20's audit)."""
    from snake.export import read_masters

    where = tmp_path / "ckpt"
    await asyncio.wait_for(first_half(tmp_path, batches(2, 4), 1, where), TIMEOUT)
    _, good = read_masters(where)
    assert good
    layer = where / ckpt.layer_file(0)
    raw = bytearray(layer.read_bytes())
    raw[-1] ^= 0xFF
    layer.write_bytes(bytes(raw))
    with pytest.raises(SnakeError, match="export: .* sha256"):
        read_masters(where)
    layer.unlink()
    with pytest.raises(SnakeError, match="export: .* is missing"):
        read_masters(where)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "field,value,says",
    [
        ("step", -3, "step=-3, which must be an integer >= 0"),
        ("step", "abc", "step='abc', which must be an integer >= 0"),
        ("consumed_batches", -2, "consumed_batches=-2"),
        ("config", None, "config='NoneType', which must be a mapping"),
        ("model", {"block_params": []}, "model.n_layer=None"),
        ("loss_scale", [2.0], "loss_scale='list', which must be a mapping"),
        ("loss_scale", {"scale": -1.0, "growth_tracker": 0}, "loss_scale.scale=-1.0, which must be a finite number >= 0"),
        ("loss_scale", {"scale": 8.0, "growth_tracker": True}, "loss_scale.growth_tracker=True, which must be an integer >= 0"),
    ],
)
async def test_damaged_manifest_values_are_refused(tmp_path, field, value, says):
    """A manifest with step=-3 loaded and trained to non-finite weights; consumed_batches=-2
    replayed data; other damage gave raw KeyErrors (round 20's audit)."""
    where = tmp_path / "ckpt"
    await asyncio.wait_for(first_half(tmp_path, batches(2, 4), 1, where), TIMEOUT)
    path = where / ckpt.MANIFEST
    manifest = json.loads(path.read_text())
    manifest[field] = value
    path.write_text(json.dumps(manifest))
    async with SnakeTrainer(model(), data=batches(2, 4), config=config(tmp_path, "j")) as t:
        with pytest.raises(SnakeError, match="load: .*" + says.replace("(", r"\(").replace("[", r"\[")):
            await t.load(where)
        assert t.engine is None


@pytest.mark.asyncio
async def test_resume_with_a_budget_plans_the_placement_under_it(tmp_path):
    """placement=None with cpu_memory_bytes took the checkpoint's placement (all in CPU
    memory here), over the budget, without a word (round 20's audit). With a budget the
    planner places under it; micro_batches and alpha still come from the checkpoint."""
    data = batches(4, 4)
    where = tmp_path / "ckpt"
    m6 = lambda: tiny_gpt(n_layer=6, bias=False, dropout=0.1)  # noqa: E731
    async with SnakeTrainer(m6(), data=data, config=config(tmp_path, "a", placement=Placement.all_cpu())) as t:
        await asyncio.wait_for(t.run(1), TIMEOUT)
        await t.save(where)
    # all in CPU memory needs ~5.2 MiB by the planner's model, everything on SSD ~3.5 MiB
    # (the placed data and the CPU device's working set as modelled until round 21), plus
    # what it counts since: the runtime's overhead, gradients and the head's logits
    from planner.profile import shape_of
    from snake.memory import HEAD_FP32_BYTES_PER_LOGIT, RUNTIME_OVERHEAD_BYTES

    sh = shape_of(m6().config, 2, 16, "float32")
    since = (RUNTIME_OVERHEAD_BYTES + 3 * (sh.layer_params + sh.resident_params) * 4
             + sh.tokens_per_micro * sh.vocab_size * (4 + HEAD_FP32_BYTES_PER_LOGIT))
    budget = int(4.8 * 2**20) + since
    cfg = config(tmp_path, "b", placement=None, micro_batches=None, alpha=None, cpu_memory_bytes=budget)
    async with SnakeTrainer(m6(), data=data, config=cfg) as t:
        await asyncio.wait_for(t.load(where), TIMEOUT)
        assert (t.config.micro_batches, t.config.alpha) == (2, 0.3)
        assert t.config.placement is not None and t.config.placement != Placement.all_cpu()
        await asyncio.wait_for(t.run(1), TIMEOUT)


@pytest.mark.asyncio
async def test_save_leaves_other_checkpoints_leftovers_alone(tmp_path):
    """A save cleans up its own crash leftovers by name; a glob of the name ('ck*') matched
    another checkpoint's set-aside copy and would have moved or deleted it (round 20's
    audit, from the code)."""
    other = tmp_path / ".ckX.old-0123456789ab"  # another checkpoint's, kept by a crashed save
    other.mkdir()
    (other / "manifest.json").write_text("{}")
    await asyncio.wait_for(first_half(tmp_path, batches(2, 4), 1, tmp_path / "ck*"), TIMEOUT)
    assert (other / "manifest.json").read_text() == "{}"
    assert (tmp_path / "ck*" / ckpt.MANIFEST).is_file()


@pytest.mark.asyncio
async def test_save_keeps_the_target_directorys_mode(tmp_path):
    """A save replaces its target directory with the checkpoint's: a directory the user made
    0700 (an empty one, or a checkpoint saved there before) stays 0700, where the checkpoint
    came out 0755; a new target gets the default (0755 less the umask)."""
    private = tmp_path / "private"
    private.mkdir()
    private.chmod(0o700)
    async with SnakeTrainer(model(), data=batches(2, 4), config=config(tmp_path, "mode")) as t:
        await asyncio.wait_for(t.run(1), TIMEOUT)
        for _ in range(2):  # into the empty directory, then over the checkpoint there
            await asyncio.wait_for(t.save(private), TIMEOUT)
            assert private.stat().st_mode & 0o777 == 0o700
            assert (private / ckpt.MANIFEST).is_file()
        await asyncio.wait_for(t.save(tmp_path / "new"), TIMEOUT)
        umask = os.umask(0)
        os.umask(umask)
        assert (tmp_path / "new").stat().st_mode & 0o777 == 0o755 & ~umask


@pytest.mark.asyncio
async def test_save_under_a_file_is_refused_before_anything_changes(tmp_path):
    """A checkpoint path under a regular file was a bare FileExistsError from mkdir, after
    the delayed optimizer steps had been flushed; now a SnakeError naming the file, before
    the flush, and the trainer runs on."""
    (tmp_path / "afile").write_text("x")
    async with SnakeTrainer(model(), data=batches(3, 4), config=config(tmp_path, "file")) as t:
        await asyncio.wait_for(t.run(1), TIMEOUT)
        flushes = []
        flush = t._flush
        t._flush = lambda what: flushes.append(what) or flush(what)  # type: ignore[method-assign]
        with pytest.raises(SnakeError, match="afile is not a directory"):
            await t.save(tmp_path / "afile" / "ck")
        assert flushes == []
        await asyncio.wait_for(t.run(1), TIMEOUT)


@pytest.mark.asyncio
@pytest.mark.parametrize("opt, alpha", [(0.0, 0.3), (0.37, 0.0), (1.0, 0.3)], ids=["all-ssd", "straddling", "all-cpu"])
async def test_resume_is_bitwise_identical_at_every_optimizer_share(tmp_path, opt, alpha):
    """Save writes a parameter that lies in a CPU head from the head itself and copies what
    has a part on SSD (through the optimizer's staging buffers); load spreads each parameter
    over heads and tails unit by unit. Every way a parameter can sit (in a head, in a tail,
    across the head/tail boundary, across the delayed part's boundary) resumes exactly."""
    kw = dict(placement=Placement(param=0.5, ckpt=1.0, opt=opt), alpha=alpha)

    async def body():
        await resumed_as_straight(tmp_path, batches(4, 4), tmp_path / "ckpt", **kw)

    await asyncio.wait_for(body(), TIMEOUT)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


@pytest.mark.asyncio
@pytest.mark.parametrize("opt", [0.0, 0.37, 1.0])
async def test_save_and_load_hold_no_copy_of_a_layer(tmp_path, opt, monkeypatch):
    """Peak RSS growth (Linux: VmHWM, reset through /proc/self/clear_refs) of a save and of
    a load's restore, on layers of 3.1 M parameters (36 MiB of fp32 state each). Save held
    three copies of a layer's state at once (the stacked read, per-parameter clones for
    safetensors, the file's bytes: +110 MiB and more here) and load as many; now a save
    grows the process by next to nothing (views of the CPU heads, copies in the idle
    staging buffers), and a load by the layer file's mapped pages and the engine's own
    staging buffers, touched for the first time."""
    net = tiny_gpt(n_layer=2, n_embd=512, seed=0)
    layer_state = 12 * sum(p.numel() for p in net.blocks[0].parameters())
    cfg = dict(placement=Placement(param=1.0, ckpt=1.0, opt=opt), alpha=0.0, micro_batches=1)
    where = tmp_path / "ckpt"
    async with SnakeTrainer(net, data=batches(2, 2), config=config(tmp_path, "a", **cfg)) as t:
        await asyncio.wait_for(t.run(1), TIMEOUT)
        await asyncio.wait_for(t.save(where), TIMEOUT)  # touches staging buffers one step may not have
        base = _status("VmRSS")
        _reset_peak()
        await asyncio.wait_for(t.save(where), TIMEOUT)
        grew = _status("VmHWM") - base
    assert grew < layer_state / 8, f"save grew the process {grew / 2**20:.1f} MiB"

    restored = {}
    apply = ckpt.apply_checkpoint

    def measured(e, *a):
        base = _status("VmRSS")
        _reset_peak()
        out = apply(e, *a)
        restored["grew"] = _status("VmHWM") - base
        restored["staging"] = sum(s.max_tail_bytes for s in (e.stores["opt"], e.stores["param"]))
        return out

    monkeypatch.setattr(ckpt, "apply_checkpoint", measured)
    async with SnakeTrainer(tiny_gpt(n_layer=2, n_embd=512, seed=1), data=batches(2, 2),
                            config=config(tmp_path, "b", **cfg)) as t:
        await asyncio.wait_for(t.load(where), TIMEOUT)
    bound = layer_state + restored["staging"] + 8 * 2**20  # one mapped file, the staging buffers
    assert restored["grew"] < bound, f"load grew the process {restored['grew'] / 2**20:.1f} MiB"


STATE_DICT_PEAK = """
import asyncio, ctypes, json, sys
ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: what is freed leaves the process (RSS = live)
import torch
from snake import Placement, SnakeConfig, SnakeTrainer
from tests.helpers import batches, tiny_gpt
from tests.test_checkpoint import _reset_peak, _status

async def main(off, opt, resident, threads):
    torch.set_num_threads(int(threads))  # the test's: another count sums the matmuls in another order
    cfg = SnakeConfig(micro_batches=1, placement=Placement(param=1.0, ckpt=1.0, opt=float(opt)), alpha=0.0,
                      device="cpu", offload_dir=off, resident_optimizer=resident)
    async with SnakeTrainer(tiny_gpt(n_layer=6, n_embd=512, seed=0), data=batches(2, 2), config=cfg) as t:
        await t.run(1)
        base = _status("VmRSS")
        _reset_peak()
        got = await t.state_dict()
        grew = _status("VmHWM") - base
    torch.save(got, off + "/state.pt")
    print(json.dumps({"grew": grew, "result": sum(v.numel() * v.element_size() for v in got.values())}))

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.parametrize("opt,resident", [(1.0, "cpu"), (0.5, "ssd")])
def test_state_dict_holds_one_layer_beside_its_result(tmp_path, opt, resident):
    """Peak RSS growth of a state_dict() over what it returns (in a child process whose
    freed memory goes back to the system), on 6 layers of 3.1 M parameters (12.6 MiB of
    fp32 masters each): it read every layer's masters, then copied each tensor out of them
    (twice the model's state at its peak); now each tensor is copied from one layer's
    masters at a time, and the embeddings' and head's once. The values are the weights
    PyTorch trains."""
    import subprocess
    import sys

    net = tiny_gpt(n_layer=6, n_embd=512, seed=0)
    layer_bytes = 4 * sum(p.numel() for p in net.blocks[0].parameters())
    off = tmp_path / "off"
    off.mkdir()
    done = subprocess.run([sys.executable, "-c", STATE_DICT_PEAK, str(off), str(opt), resident, str(torch.get_num_threads())],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["grew"] < out["result"] + 2 * layer_bytes, (
        f"state_dict grew the process {out['grew'] / 2**20:.1f} MiB for a result of {out['result'] / 2**20:.1f} MiB")
    got = torch.load(off / "state.pt")
    want, _ = reference(net, batches(2, 2)[:1], 1)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)


SAVE_PAST_A_FILE_LIMIT = """
import asyncio, json, resource, signal, sys
from snake import Placement, SnakeConfig, SnakeTrainer
from tests.helpers import KindsLM, batches, kinds_parts, reference, tiny_gpt
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing

async def main(off, ck):
    # no delayed steps: the save's flush writes nothing (the limit would fail the SSD tier's writes too)
    cfg = SnakeConfig(micro_batches=2, placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.0,
                      device="cpu", offload_dir=off)
    async with SnakeTrainer(tiny_gpt(n_layer=3), data=batches(4, 4), config=cfg) as t:
        await t.run(1)
        await t.save(ck)
        await t.run(1)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # no file may grow past 4 KiB
        try:
            await t.save(ck)
            out = {"raised": None}
        except Exception as e:
            out = {"raised": type(e).__name__, "oserror": isinstance(e, OSError), "errno": getattr(e, "errno", None),
                   "message": str(e)}
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        await t.run(1)  # the trainer goes on
        out["step"] = t.engine.next_t
    print(json.dumps(out))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_a_save_that_cannot_write_fails_by_name_and_keeps_the_last_checkpoint(tmp_path):
    """A checkpoint file that cannot be written (here a file-size limit: EFBIG; a full disk is
    ENOSPC) surfaced as safetensors' SafetensorError with the OS error in its text. It is a
    StorageError (an OSError with the errno) naming the file and the fix; the checkpoint
    already in the target is untouched, nothing of the failed one stays, and the trainer
    trains on."""
    import errno
    import subprocess
    import sys

    ck = tmp_path / "ck"
    done = subprocess.run([sys.executable, "-c", SAVE_PAST_A_FILE_LIMIT, str(tmp_path / "off"), str(ck)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    before = json.loads((ck / ckpt.MANIFEST).read_text())
    out = json.loads(done.stdout)
    assert out["raised"] == "StorageError" and out["oserror"] and out["errno"] == errno.EFBIG, out
    assert "layer-00000.safetensors" in out["message"] and "unchanged" in out["message"], out
    assert out["step"] == 3
    assert before["step"] == 1  # the first save's checkpoint, as it was
    for name, info in before["files"].items():
        assert hashlib.sha256((ck / name).read_bytes()).hexdigest() == info["sha256"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ck.tmp-")]


@pytest.mark.asyncio
@pytest.mark.parametrize("opt", [0.0, 0.37])
async def test_layers_of_several_kinds_resume_exactly_and_are_checked_per_layer(tmp_path, opt):
    """Dense and mixture-of-experts layers: each layer's file holds its own kind's
    parameters, the manifest each layer's kind, and a resumed run is bitwise the
    uninterrupted one. A model whose layer is of another kind than the checkpoint's is
    refused naming that layer's parameter."""
    kw = dict(placement=Placement(param=0.5, ckpt=1.0, opt=opt), alpha=0.3)

    def cfg(name: str) -> SnakeConfig:
        return config(tmp_path, name, **kw)

    async def body():
        data = batches(4, 4)
        async with SnakeTrainer(kinds_parts(KindsLM()), data=data, config=cfg("straight")) as t:
            await t.run(4)
            want = await t.state_dict()
        where = tmp_path / "ckpt"
        async with SnakeTrainer(kinds_parts(KindsLM()), data=data, config=cfg("first")) as t:
            await t.run(2)
            await t.save(where)
            mid = await t.state_dict()
        other = KindsLM()
        with torch.no_grad():
            for p in other.parameters():
                p.mul_(-1.0)  # everything must come from the checkpoint
        async with SnakeTrainer(kinds_parts(other), data=data, config=cfg("second")) as t:
            await t.load(where)
            assert_equal_state(await t.state_dict(), mid)
            await t.run(2)
            assert_equal_state(await t.state_dict(), want)
        manifest = json.loads((where / "manifest.json").read_text())
        assert manifest["model"]["layer_kinds"] == [0, 1, 2, 1, 0]
        # layer 2 a mixture of experts where the checkpoint has a dense layer
        swapped = KindsLM()
        swapped.layers[2] = type(swapped.layers[1])(16)
        async with SnakeTrainer(kinds_parts(swapped), data=data, config=cfg("third")) as t:
            with pytest.raises(ConfigError) as err:
                await t.load(where)
            assert err.value.field.startswith("model.layers.2.")

    await asyncio.wait_for(body(), TIMEOUT)


def frozen_model(seed: int):
    """The test GPT with its positions and one projection frozen, their values the same
    whatever `seed` (the rest's)."""
    m = model(seed=seed)
    torch.manual_seed(77)
    with torch.no_grad():
        m.wpe.weight.normal_()
        m.blocks[1].attn.c_proj.weight.normal_()
    m.wpe.weight.requires_grad_(False)
    m.blocks[1].attn.c_proj.weight.requires_grad_(False)
    return m


@pytest.mark.asyncio
async def test_frozen_parameters_resume_exactly_and_must_match(tmp_path):
    """Frozen parameters are stepped never: the manifest keeps their digests, a resume with
    the same frozen values is bitwise the uninterrupted run, and a model whose frozen values
    differ (or that freezes others) is refused naming one."""

    async def body():
        data = batches(4, 4)
        async with SnakeTrainer(frozen_model(0), data=data, config=config(tmp_path, "straight")) as t:
            await t.run(4)
            want = await t.state_dict()
        where = tmp_path / "ckpt"
        async with SnakeTrainer(frozen_model(0), data=data, config=config(tmp_path, "first")) as t:
            await t.run(2)
            await t.save(where)
        async with SnakeTrainer(frozen_model(123), data=data, config=config(tmp_path, "second")) as t:
            await t.load(where)
            await t.run(2)
            assert_equal_state(await t.state_dict(), want)
        manifest = json.loads((where / "manifest.json").read_text())
        assert sorted(manifest["model"]["frozen_params"]) == ["blocks.1.attn.c_proj.weight", "wpe.weight"]
        other = frozen_model(0)
        with torch.no_grad():
            other.wpe.weight.add_(1.0)
        async with SnakeTrainer(other, data=data, config=config(tmp_path, "third")) as t:
            with pytest.raises(ConfigError, match="frozen and differs") as err:
                await t.load(where)
            assert err.value.field == "model.wpe.weight"
        unfrozen = frozen_model(0)
        unfrozen.wpe.weight.requires_grad_(True)
        async with SnakeTrainer(unfrozen, data=data, config=config(tmp_path, "fourth")) as t:
            with pytest.raises(ConfigError, match="trained but frozen in the checkpoint"):
                await t.load(where)

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
async def test_a_checkpoint_without_its_frozen_parameters_resumes_and_export_refuses_it(tmp_path, monkeypatch):
    """`save(frozen=False)` stores no frozen parameter (the default for a PEFT model, whose
    checkpoint then holds what trains: tests/test_peft.py): it resumes bit for bit, checks
    the model's frozen values against the digests, and `snake export`, which needs them,
    refuses it with the way. The digests are taken once per trainer (every save read the
    whole frozen base for them); a bad `frozen` is refused before anything is written."""
    from snake.cli import main

    digested = []
    digest = manifest_mod._digest
    monkeypatch.setattr(manifest_mod, "_digest", lambda t: digested.append(t.shape) or digest(t))

    async def body():
        data = batches(4, 4)
        async with SnakeTrainer(frozen_model(0), data=data, config=config(tmp_path, "straight")) as t:
            await t.run(4)
            want = await t.state_dict()
        async with SnakeTrainer(frozen_model(0), data=data, config=config(tmp_path, "first")) as t:
            with pytest.raises(ConfigError, match=r"save\(frozen=...\)='no' must be True, False or None"):
                await t.save(tmp_path / "bad", frozen="no")
            await t.run(2)
            await t.save(tmp_path / "with", frozen=True)
            assert len(digested) == 2  # the two frozen parameters
            await t.save(tmp_path / "ckpt", frozen=False)
            assert len(digested) == 2  # not again
        assert not (tmp_path / "bad").exists()
        stored = {}
        for name in ("with", "ckpt"):
            stored[name] = []
            for file in sorted((tmp_path / name).glob("*.safetensors")):  # a layer's in its file
                with safe_open(str(file), framework="pt") as f:
                    stored[name] += [(file.name, k) for k in f.keys() if k.startswith("frozen/")]
            manifest = json.loads((tmp_path / name / "manifest.json").read_text())
            assert manifest["frozen_stored"] == (name == "with")
            assert sorted(manifest["model"]["frozen_params"]) == ["blocks.1.attn.c_proj.weight", "wpe.weight"]
        assert stored == {"with": [("layer-00001.safetensors", "frozen/blocks.1.attn.c_proj.weight"),
                                   ("resident.safetensors", "frozen/wpe.weight")], "ckpt": []}
        async with SnakeTrainer(frozen_model(123), data=data, config=config(tmp_path, "second")) as t:
            await t.load(tmp_path / "ckpt")
            await t.run(2)
            assert_equal_state(await t.state_dict(), want)
        other = frozen_model(0)
        with torch.no_grad():
            other.wpe.weight.add_(1.0)
        async with SnakeTrainer(other, data=data, config=config(tmp_path, "third")) as t:
            with pytest.raises(ConfigError, match="frozen and differs"):
                await t.load(tmp_path / "ckpt")

    await asyncio.wait_for(body(), TIMEOUT)
    assert main(["export", str(tmp_path / "with"), "--hf", str(tmp_path / "hf-with")]) == 0
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) != 0
    assert not (tmp_path / "hf").exists()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "damage,says",
    [
        (lambda m: m.update(layer_kinds=[0, 1]), r"model\.layer_kinds=\[0, 1\], which must list 5 kinds in \[0, 3\)"),
        (lambda m: m.update(layer_kinds=[0, 1, 7, 1, 0]), r"model\.layer_kinds=\[0, 1, 7, 1, 0\]"),
        (lambda m: m.update(kind_params=5), r"model\.kind_params=5, which must be a non-empty list"),
        (lambda m: m.pop("kind_params"), r"model\.kind_params=None"),
        (lambda m: m.update(frozen_params=["x"]), r"model\.frozen_params=\['x'\], which must map names"),
        (lambda m: m.update(block_params=[["w", "big"]]), r"model\.block_params=.*list of \[name, shape\] pairs"),
    ],
    ids=["kinds-short", "kind-out-of-range", "kind-params-not-a-list", "kind-params-missing", "frozen-not-a-map",
         "shape-not-a-list"],
)
async def test_damaged_layer_kinds_in_a_manifest_are_refused(tmp_path, damage, says):
    """An audit's find: a damaged kinds record gave raw IndexError / TypeError / KeyError."""
    where = tmp_path / "ckpt"

    async def body():
        async with SnakeTrainer(kinds_parts(KindsLM()), data=batches(2, 4), config=config(tmp_path, "a")) as t:
            await t.run(1)
            await t.save(where)
        path = where / ckpt.MANIFEST
        manifest = json.loads(path.read_text())
        damage(manifest["model"])
        path.write_text(json.dumps(manifest))
        async with SnakeTrainer(kinds_parts(KindsLM()), data=batches(2, 4), config=config(tmp_path, "b")) as t:
            with pytest.raises(SnakeError, match="load: .*" + says + ".*the manifest is damaged"):
                await t.load(where)
            assert t.engine is None

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "missed,says",
    [
        ([1], r"missed_steps='list', which must be a mapping"),
        ({"blocks.0.nope": 1}, r"missed_steps\['blocks\.0\.nope'\]=1, which must name a trained parameter"),
        ({"wpe.weight": 0}, r"missed_steps\['wpe\.weight'\]=0, which must be an integer in \[1, step=1\]"),
        ({"blocks.1.attn.c_proj.weight": 2}, r"=2, which must be an integer in \[1, step=1\]"),
        ({"wpe.weight": True}, r"=True, which must be an integer"),
    ],
    ids=["not-a-map", "unknown-name", "none-missed", "more-than-steps", "bool"],
)
async def test_damaged_missed_steps_in_a_manifest_are_refused(tmp_path, missed, says):
    """`missed_steps` (the steps a parameter without a gradient was left) is checked like
    the rest of the manifest, before the trainer changes."""
    where = tmp_path / "ckpt"

    async def body():
        async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(2, 4), config=config(tmp_path, "a")) as t:
            await t.run(1)
            await t.save(where)
        path = where / ckpt.MANIFEST
        manifest = json.loads(path.read_text())
        assert manifest["missed_steps"] == {}
        manifest["missed_steps"] = missed
        path.write_text(json.dumps(manifest))
        async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(2, 4), config=config(tmp_path, "b")) as t:
            with pytest.raises(SnakeError, match="load: .*" + says + ".*the manifest is damaged"):
                await t.load(where)
            assert t.engine is None

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
async def test_a_version_1_checkpoint_loads_and_an_unknown_version_is_refused(tmp_path):
    """Version 2 added `missed_steps`; a version 1 checkpoint (none: every parameter had every
    step) loads as before, and a version this snake does not know is refused by name."""
    where = tmp_path / "ckpt"

    async def body():
        async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(4, 4), config=config(tmp_path, "a")) as t:
            await t.run(2)
            await t.save(where)
            await t.run(2)
            want = await t.state_dict()
        path = where / ckpt.MANIFEST
        manifest = json.loads(path.read_text())
        assert manifest["version"] == 2
        del manifest["missed_steps"]
        path.write_text(json.dumps({**manifest, "version": 1}))
        async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(4, 4), config=config(tmp_path, "b")) as t:
            await t.load(where)
            await t.run(2)
            got = await t.state_dict()
        for k in want:
            assert torch.equal(got[k], want[k]), k
        path.write_text(json.dumps({**manifest, "version": 3}))
        async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(4, 4), config=config(tmp_path, "c")) as t:
            with pytest.raises(SnakeError, match="has checkpoint format version 3; this snake reads versions 1, 2; it was saved by a newer snake"):
                await t.load(where)

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
@pytest.mark.parametrize("frozen", [True, False])
async def test_a_checkpoint_saved_before_the_first_run_of_a_model_with_a_frozen_layer_resumes(tmp_path, frozen):
    """save() before any run() reads the state from the model; a layer that trains nothing
    (frozen, or a bf16 model's fp32 adapters, held with the embedding) has no state of its
    own, and the save failed in torch.cat (an audit, round 38). The checkpoint (with its
    frozen weights stored or not) resumes to the weights of a run never saved."""
    from tests.helpers import assert_close_state

    def model():
        m = tiny_gpt(n_layer=3, bias=False)
        m.blocks[0].requires_grad_(False)
        return m

    data = batches(3, 4)

    def cfg(d):
        return SnakeConfig(device="cpu", offload_dir=d, micro_batches=2, alpha=0.0, placement=Placement.all_cpu())

    async with SnakeTrainer(model(), data=data, config=cfg(tmp_path / "a")) as t:
        await t.save(tmp_path / "ckpt", frozen=frozen)
    async with SnakeTrainer(model(), data=data, config=cfg(tmp_path / "b")) as t:
        await t.load(tmp_path / "ckpt")
        await t.run(3)
        got = await t.state_dict()
    async with SnakeTrainer(model(), data=data, config=cfg(tmp_path / "c")) as t:
        await t.run(3)
        want = await t.state_dict()
    assert_close_state(got, want, rtol=0, atol=0)
