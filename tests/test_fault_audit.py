"""A fault audit: I/O errors and full disks in the storage mover (forward, the backward's
checkpoint reads, the delayed step, the resident step on SSD), in save() (each file, the
rename, the scratch copy) and in load(); a crashing optimizer worker while another steps;
run() cancelled at many points, close() from another thread, two trainers on one
offload_dir and a full disk as the engine is built. After each: the documented exception,
within a few seconds, chained from the cause; no snake thread, no file descriptor into the
offload_dir and no offload file left once closed; a checkpoint that was there intact and
loadable; and where the trainer stays usable, the weights of a run never interrupted."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import threading
import time
import uuid
from collections import namedtuple
from pathlib import Path

import pytest
import torch

import snake.actors.optimizer as opt_actor
import snake.checkpoint as checkpoint
import snake.checkpoint_files as checkpoint_files
from snake import ActorFailed, Placement, SnakeConfig, SnakeError, SnakeTrainer
from snake.engine import Engine
from snake.errors import ConfigError, StorageError
from snake.faults import ActorFaults, StorageFaults, inject_storage
from snake.io.posix import PosixFile
from tests.helpers import batches, tiny_gpt

TIMEOUT = 60
MIXED = Placement(param=0.3, ckpt=0.3, opt=0.3, grad=0.0)  # every kind partly on SSD
DATA = batches(12, 4)


def cfg(off, **kw) -> SnakeConfig:
    base = dict(micro_batches=2, offload_dir=off, placement=MIXED, alpha=0.3, device="cpu", stall_timeout_s=10.0)
    base.update(kw)
    return SnakeConfig(**base)


def model():
    return tiny_gpt(n_layer=3, bias=False)


# -- what a fault may leave behind --------------------------------------------------------
def snake_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("snake-")]


def fds_under(path) -> list[str]:
    root = os.path.realpath(path)
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(root):
            out.append(target)
    return out


async def assert_clean(off) -> None:
    """No snake thread (after a short grace for threads that are ending), no descriptor into
    `off`, and `off` as empty as before the trainer (store files and lock removed)."""
    deadline = time.monotonic() + 3
    while snake_threads() and time.monotonic() < deadline:  # noqa: ASYNC110 - nothing signals a thread's end
        await asyncio.sleep(0.02)
    assert not snake_threads(), snake_threads()
    assert not fds_under(off), fds_under(off)
    assert entries(off) == [], entries(off)


def entries(path) -> list[str]:
    return sorted(p.name for p in Path(path).iterdir()) if Path(path).exists() else []


def assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


_REFS: dict[tuple, dict] = {}


async def reference(tmp_path, steps: int, **kw) -> dict:
    """The weights after `steps` steps of a run never interrupted (cached per config)."""
    key = (steps, tuple(sorted(kw.items())))
    if key not in _REFS:
        async with SnakeTrainer(model(), data=DATA, config=cfg(tmp_path / f"ref-{uuid.uuid4().hex[:6]}", **kw)) as t:
            await t.run(steps)
            _REFS[key] = await t.state_dict()
    return _REFS[key]


def tree(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


async def resumes_to_reference(tmp_path, ckpt: Path, steps: int, want_steps: int, **kw) -> None:
    """`ckpt` loads into a new trainer and, `steps` steps on, gives the reference weights."""
    off = tmp_path / f"resume-{uuid.uuid4().hex[:6]}"
    async with SnakeTrainer(model(), data=DATA, config=cfg(off, **kw)) as t:
        await t.load(ckpt)
        await asyncio.wait_for(t.run(steps), TIMEOUT)
        got = await t.state_dict()
    assert_equal(got, await reference(tmp_path, want_steps, **kw))
    await assert_clean(off)


def no_room_under(m, directory: Path, size_at_least: int = 0) -> None:
    """A disk that is full under `directory`: posix_fallocate of a file there for
    `size_at_least` bytes or more fails with ENOSPC, as on a real full disk (the tests run as
    any user: no file system of a given size is mounted)."""
    real = os.posix_fallocate

    def fallocate(fd: int, offset: int, length: int) -> None:
        where = os.readlink(f"/proc/self/fd/{fd}")
        if where.startswith(str(directory)) and length >= size_at_least:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    m.setattr(os, "posix_fallocate", fallocate)


def free_is(m, free: int) -> None:
    """shutil.disk_usage says every disk has `free` bytes free."""
    m.setattr(shutil, "disk_usage", lambda p: Usage(1 << 40, (1 << 40) - free, free))


Usage = namedtuple("Usage", "total used free")


def plenty_free(monkeypatch) -> None:
    """shutil.disk_usage says every disk has room: the checks before the writes pass, and
    the disk fills as they write (another process took the space in between)."""
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(1 << 40, 0, 1 << 40))


# -- storage faults in a run --------------------------------------------------------------
async def run_fails(tmp_path, setup, actor: str, *, steps_before: int = 1, **kw) -> ActorFailed:
    """Train a step, save, break something, and check that the next run fails cleanly;
    then that the checkpoint is intact, loads and trains on to the reference weights."""
    off = tmp_path / "off"
    ckpt = tmp_path / "ckpt"
    async with SnakeTrainer(model(), data=DATA, config=cfg(off, **kw)) as t:
        await t.run(steps_before)
        await t.save(ckpt)
        before = tree(ckpt)
        setup(t)
        t0 = time.monotonic()
        with pytest.raises(ActorFailed) as e:
            await asyncio.wait_for(t.run(6), TIMEOUT)
        took = time.monotonic() - t0
        with pytest.raises(SnakeError, match="closed"):
            await t.run(1)
    assert took < 5, took
    assert e.value.actor == actor, e.value
    assert e.value.__cause__ is not None
    await assert_clean(off)
    assert tree(ckpt) == before
    await resumes_to_reference(tmp_path, ckpt, 2, steps_before + 2, **kw)
    return e.value


STORAGE_CASES = [
    # the forward's and backward's parameter reads, at several points of the iteration
    ("param", StorageFaults(seed=1, read_error=1.0), "ssd_read", errno.EIO, {}),
    ("param", StorageFaults(seed=1, read_error=1.0, after=4), "ssd_read", errno.EIO, {}),
    ("param", StorageFaults(seed=1, read_error=1.0, after=9), "ssd_read", errno.EIO, {}),
    # the backward's checkpoint reads
    ("ckpt", StorageFaults(seed=2, read_error=1.0), "ssd_read", errno.EIO, {}),
    ("ckpt", StorageFaults(seed=2, read_error=1.0, after=3), "ssd_read", errno.EIO, {}),
    # the forward's checkpoint writes on a full disk
    ("ckpt", StorageFaults(seed=3, no_space=1.0), "ssd_write", errno.ENOSPC, {}),
    ("ckpt", StorageFaults(seed=3, no_space=1.0, after=5), "ssd_write", errno.ENOSPC, {}),
    # the delayed step (alpha > 0): its state and its gradient's SSD part
    ("opt", StorageFaults(seed=4, read_error=1.0, after=2), "ssd_read", errno.EIO, {}),
    ("opt", StorageFaults(seed=4, no_space=1.0, after=2), "ssd_write", errno.ENOSPC, {}),
    ("grad", StorageFaults(seed=5, read_error=1.0, after=1), "ssd_read", errno.EIO, {}),
    ("grad", StorageFaults(seed=5, no_space=1.0, after=1), "ssd_write", errno.ENOSPC, {}),
    # the delayed step at alpha = 1 (every element waits)
    ("opt", StorageFaults(seed=6, read_error=1.0, after=1), "ssd_read", errno.EIO, {"alpha": 1.0}),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind,faults,actor,code,kw", STORAGE_CASES,
                         ids=[f"{c[0]}-{'read' if c[1].read_error else 'nospace'}-after{c[1].after}-{i}"
                              for i, c in enumerate(STORAGE_CASES)])
async def test_storage_fault_in_a_run(tmp_path, kind, faults, actor, code, kw):
    err = await run_fails(tmp_path, lambda t: inject_storage(t.engine.stores[kind].file, faults), actor, **kw)
    cause = err.__cause__
    assert isinstance(cause, StorageError), repr(cause)
    assert cause.errno == code
    assert f"{kind}.bin" in str(cause)
    assert isinstance(cause.__cause__, OSError) and cause.__cause__.errno == code  # chained from the OS error
    assert err.iteration is not None


@pytest.mark.asyncio
@pytest.mark.parametrize("faults,code", [
    (StorageFaults(seed=1, read_error=1.0), errno.EIO),
    (StorageFaults(seed=1, read_error=1.0, after=1), errno.EIO),
    (StorageFaults(seed=2, write_error=1.0), errno.EIO),
    (StorageFaults(seed=3, no_space=1.0, after=1), errno.ENOSPC),
])
async def test_storage_fault_in_the_resident_step_on_ssd(tmp_path, faults, code):
    """resident_optimizer='ssd': the embeddings' and head's step at each iteration's end
    reads and writes its chunks on the SSD threads; a fault there fails the run (the
    compute actor runs that step) and leaves no transfer, thread or file behind."""
    err = await run_fails(tmp_path, lambda t: inject_storage(t.engine.stores["resident"].file, faults), "compute",
                          resident_optimizer="ssd")
    assert isinstance(err.__cause__, StorageError) and err.__cause__.errno == code
    assert "resident.bin" in str(err.__cause__)


# -- save() ---------------------------------------------------------------------------------
async def save_fails_then_trains_on(tmp_path, break_save, expect=StorageError, **kw) -> BaseException:
    """run 1, save, run 1, a save that fails (`break_save` installs the fault and takes it
    out again as a context), run 1: the old checkpoint unchanged and nothing beside it, the
    trainer usable, and the weights those of 3 steps never interrupted."""
    off, ckpt = tmp_path / "off", tmp_path / "ckpt"
    async with SnakeTrainer(model(), data=DATA, config=cfg(off, **kw)) as t:
        await t.run(1)
        await t.save(ckpt)
        before = tree(ckpt)
        await t.run(1)
        t0 = time.monotonic()
        with break_save(), pytest.raises(expect) as e:
            await asyncio.wait_for(t.save(ckpt), TIMEOUT)
        assert time.monotonic() - t0 < 5
        assert tree(ckpt) == before
        assert sorted(p.name for p in ckpt.parent.iterdir() if p.name.startswith(".ckpt")) == []
        assert not fds_under(ckpt)
        await asyncio.wait_for(t.run(1), TIMEOUT)
        got = await t.state_dict()
    assert_equal(got, await reference(tmp_path, 3, **kw))
    await assert_clean(off)
    return e.value


class _FailAt:
    """Make `module.name` (a writer of one file per call) fail at its n-th call, after
    writing part of that file, as a disk that fills part-way does."""

    def __init__(self, monkeypatch, module, name: str, n: int) -> None:
        self.mp, self.module, self.name, self.n = monkeypatch, module, name, n
        self.calls = 0

    def __enter__(self):
        real = getattr(self.module, self.name)

        def failing(path, *a, **kw):
            i, self.calls = self.calls, self.calls + 1
            if i == self.n:
                Path(path).write_bytes(b"\0" * 100)
                raise checkpoint_files._write_failed(Path(path), OSError(errno.ENOSPC, "No space left on device"))
            return real(path, *a, **kw)

        self.mp.setattr(self.module, self.name, failing)
        return self

    def __exit__(self, *exc):
        self.mp.undo()
        return False


@pytest.mark.asyncio
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4])  # layers 0-2, resident.safetensors, rng.safetensors
async def test_a_save_failing_at_each_file_keeps_the_old_checkpoint(tmp_path, monkeypatch, n):
    err = await save_fails_then_trains_on(tmp_path, lambda: _FailAt(monkeypatch, checkpoint, "_write_tensors", n))
    assert err.errno == errno.ENOSPC


@pytest.mark.asyncio
async def test_a_save_failing_at_its_manifest_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    await save_fails_then_trains_on(tmp_path, lambda: _FailAt(monkeypatch, checkpoint, "_write_file", 0))


@pytest.mark.asyncio
async def test_a_save_whose_rename_fails_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    """The publishing renames: the old checkpoint aside, then the new one into place; the
    second fails (EIO), and the old one goes back."""
    import contextlib

    @contextlib.contextmanager
    def broken():
        real, calls = checkpoint_files._rename, []

        def rename(a, b):
            calls.append(a)
            if len(calls) == 2:
                raise OSError(errno.EIO, "injected rename failure")
            return real(a, b)

        with monkeypatch.context() as m:
            m.setattr(checkpoint_files, "_rename", rename)
            yield

    await save_fails_then_trains_on(tmp_path, broken, expect=OSError)


@pytest.mark.asyncio
async def test_a_save_whose_resident_scratch_copy_finds_the_offload_disk_full(tmp_path, monkeypatch):
    """resident_optimizer='ssd', the offload_dir's disk with room for its tier but not the
    save's scratch copy: a StorageError that says so, the scratch file gone and not held
    open, the trainer usable."""
    off = tmp_path / "off"
    async with SnakeTrainer(model(), data=DATA, config=cfg(off, resident_optimizer="ssd")) as t:
        await t.run(2)
        with monkeypatch.context() as m:
            no_room_under(m, off / "resident-save.bin")
            with pytest.raises(StorageError, match="scratch file") as e:
                await asyncio.wait_for(t.save(tmp_path / "ckpt"), TIMEOUT)
        assert e.value.errno == errno.ENOSPC
        assert not (off / "resident-save.bin").exists() and not [f for f in fds_under(off) if "resident-save" in f]
        assert not (tmp_path / "ckpt").exists()
        await asyncio.wait_for(t.run(1), TIMEOUT)
        got = await t.state_dict()
    assert_equal(got, await reference(tmp_path, 3, resident_optimizer="ssd"))
    await assert_clean(off)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["opt", "resident"])
async def test_a_save_whose_ssd_reads_fail_keeps_the_trainer_usable(tmp_path, kind):
    """save() reads the state on SSD (the layers' optimizer tails, the resident state's
    chunks) after applying the delayed steps; an I/O error there is a StorageError, the old
    checkpoint stays, and with the disk healthy again the trainer saves and trains on."""
    off, ckpt = tmp_path / "off", tmp_path / "ckpt"
    async with SnakeTrainer(model(), data=DATA, config=cfg(off, resident_optimizer="ssd")) as t:
        await t.run(1)
        await t.save(ckpt)
        before = tree(ckpt)
        await t.run(1)
        f = t.engine.stores[kind].file
        # the delayed steps' flush reads and writes the opt tails first: fail past those
        inject_storage(f, StorageFaults(read_error=1.0, after=6 if kind == "opt" else 0))
        with pytest.raises(StorageError):
            await asyncio.wait_for(t.save(ckpt), TIMEOUT)
        assert tree(ckpt) == before
        inner = getattr(f, "inner", f)
        inner.__dict__.pop("_preadv")  # healthy again
        inner.__dict__.pop("_pwritev")
        await t.save(ckpt)
        await asyncio.wait_for(t.run(1), TIMEOUT)
        got = await t.state_dict()
    assert_equal(got, await reference(tmp_path, 3, resident_optimizer="ssd"))
    await assert_clean(off)
    await resumes_to_reference(tmp_path, ckpt, 1, 3, resident_optimizer="ssd")


# -- load() ---------------------------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("resident", ["cpu", "ssd"])
@pytest.mark.parametrize("after", [0, 5, 14])
async def test_a_load_whose_ssd_writes_fail_closes_cleanly(tmp_path, monkeypatch, resident, after):
    """load() builds the engine (writing the model's weights to its SSD tier), then writes
    the checkpoint's state there; a write that fails (EIO) at any point: the StorageError,
    the trainer closed, nothing left behind, and the checkpoint loads elsewhere."""
    ckpt = tmp_path / "ckpt"
    async with SnakeTrainer(model(), data=DATA, config=cfg(tmp_path / "a", resident_optimizer=resident)) as t:
        await t.run(1)
        await t.save(ckpt)
    before = tree(ckpt)
    calls = [0]
    real = PosixFile._pwritev

    def pwritev(fd, bufs, offset):
        calls[0] += 1
        if calls[0] > after:
            raise OSError(errno.EIO, "Input/output error (injected)")
        return real(fd, bufs, offset)

    off = tmp_path / "b"
    t = SnakeTrainer(model(), data=DATA, config=cfg(off, resident_optimizer=resident))
    with monkeypatch.context() as m:
        m.setattr(PosixFile, "_pwritev", staticmethod(pwritev))
        t0 = time.monotonic()
        with pytest.raises(StorageError) as e:
            await asyncio.wait_for(t.load(ckpt), TIMEOUT)
        assert time.monotonic() - t0 < 5
    assert isinstance(e.value.__cause__, OSError) and e.value.errno == errno.EIO
    with pytest.raises(SnakeError):
        await t.run(1)
    await t.close()
    await assert_clean(off)
    assert tree(ckpt) == before
    await resumes_to_reference(tmp_path, ckpt, 2, 3, resident_optimizer=resident)


# -- actors ---------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_an_optimizer_worker_crashing_while_another_steps(tmp_path, monkeypatch):
    """Two optimizer workers on threads of their own, each step slowed: worker 1 raises
    while worker 0 is in a step. The run fails within seconds naming optimizer[1], and the
    step in progress ends before the threads go."""
    monkeypatch.setattr(Engine, "optimizer_on_compute", False)
    real, stepping = opt_actor.step_unit, []

    def slow(*a, **kw):
        stepping.append(threading.current_thread().name)
        time.sleep(0.3)
        return real(*a, **kw)

    monkeypatch.setattr(opt_actor, "step_unit", slow)

    def setup(t):
        t.engine.fault_hook = ActorFaults(fail={"optimizer[1]": 2})

    off, ckpt = tmp_path / "off", tmp_path / "ckpt"
    async with SnakeTrainer(model(), data=DATA, config=cfg(off, optimizer_workers=2, placement=Placement.all_ssd())) as t:
        await t.run(1)
        await t.save(ckpt)
        setup(t)
        t0 = time.monotonic()
        with pytest.raises(ActorFailed) as e:
            await asyncio.wait_for(t.run(6), TIMEOUT)
        assert time.monotonic() - t0 < 5
    assert e.value.actor == "optimizer[1]" and isinstance(e.value.__cause__, RuntimeError)
    await assert_clean(off)
    monkeypatch.undo()
    await resumes_to_reference(tmp_path, ckpt, 2, 3, placement=Placement.all_ssd())


# -- cancellation and close() -----------------------------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("resident", ["cpu", "ssd"])
@pytest.mark.parametrize("frac", [0.0, 0.3, 0.7, 1.1])
async def test_run_cancelled_at_points_of_a_step_then_closed(tmp_path, resident, frac):
    off = tmp_path / "off"
    t = SnakeTrainer(model(), data=DATA, config=cfg(off, resident_optimizer=resident))
    try:
        await asyncio.wait_for(t.run(1), TIMEOUT)
        t0 = time.monotonic()
        await asyncio.wait_for(t.run(1), TIMEOUT)
        step_s = time.monotonic() - t0
        task = asyncio.create_task(t.run(8))
        await asyncio.sleep(frac * step_s)
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, TIMEOUT)
        assert time.monotonic() - t0 < 3
        with pytest.raises(SnakeError, match="closed"):
            await t.run(1)
    finally:
        await asyncio.wait_for(t.close(), TIMEOUT)
    await assert_clean(off)


@pytest.mark.asyncio
@pytest.mark.parametrize("delay", [0.0, 0.02, 0.1, 0.3])
async def test_first_run_cancelled_at_points_then_retried_or_closed(tmp_path, delay):
    """A first run() cancelled while it sets up (can be tried again: it then trains to the
    reference weights) or in its first steps (the trainer is closed); either way close()
    leaves nothing behind."""
    off = tmp_path / "off"
    t = SnakeTrainer(model(), data=DATA, config=cfg(off, resident_optimizer="ssd"))
    try:
        task = asyncio.create_task(t.run(6))
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, TIMEOUT)
        if t.engine is None and t._broken is None:  # cancelled while setting up: a retry trains as new
            assert not snake_threads() and not fds_under(off)
            await asyncio.wait_for(t.run(2), TIMEOUT)
            got = await t.state_dict()
            assert_equal(got, await reference(tmp_path, 2, resident_optimizer="ssd"))
        else:
            with pytest.raises(SnakeError, match="closed"):
                await t.run(1)
    finally:
        await asyncio.wait_for(t.close(), TIMEOUT)
    await assert_clean(off)


def test_close_from_another_thread_while_a_run_is_in_flight(tmp_path):
    """A service: the trainer runs in a loop of its own thread, close() comes from the main
    thread's loop. The run raises CancelledError, close() returns once it is closed."""
    off = tmp_path / "off"
    t = SnakeTrainer(model(), data=batches(200, 4), config=cfg(off, resident_optimizer="ssd"))
    stepped, outcome = threading.Event(), []

    def service() -> None:
        async def main() -> None:
            try:
                await t.run(200, on_step=lambda r: stepped.set())
                outcome.append("finished")
            except asyncio.CancelledError:
                outcome.append("cancelled")
            except BaseException as exc:  # noqa: BLE001
                outcome.append(repr(exc))
        asyncio.run(main())

    th = threading.Thread(target=service)
    th.start()
    assert stepped.wait(TIMEOUT)
    time.sleep(0.05)
    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(t.close(), TIMEOUT))
    took = time.monotonic() - t0
    th.join(TIMEOUT)
    assert not th.is_alive()
    assert outcome == ["cancelled"], outcome
    assert took < 5, took
    asyncio.run(assert_clean(off))


def test_close_from_another_thread_while_a_save_is_in_flight(tmp_path, monkeypatch):
    """close() from another thread while save() writes its files (slowed): the save stops,
    the checkpoint that was there stays, and the trainer closes cleanly."""
    off, ckpt = tmp_path / "off", tmp_path / "ckpt"
    t = SnakeTrainer(model(), data=DATA, config=cfg(off))
    writing, outcome = threading.Event(), []
    real = checkpoint._write_tensors

    def slow(path, *a, **kw):
        writing.set()
        time.sleep(0.2)
        return real(path, *a, **kw)

    def service() -> None:
        async def main() -> None:
            await t.run(1)
            await t.save(ckpt)
            monkeypatch.setattr(checkpoint, "_write_tensors", slow)
            try:
                await t.save(ckpt)
                outcome.append("saved")
            except asyncio.CancelledError:
                outcome.append("cancelled")
        asyncio.run(main())

    th = threading.Thread(target=service)
    th.start()
    assert writing.wait(TIMEOUT)
    before = json_step(ckpt)
    asyncio.run(asyncio.wait_for(t.close(), TIMEOUT))
    th.join(TIMEOUT)
    assert outcome == ["cancelled"], outcome
    assert json_step(ckpt) == before == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "off"]
    asyncio.run(assert_clean(off))


def test_close_from_another_thread_while_the_engine_is_built(tmp_path, monkeypatch):
    """close() from another thread while the first run() builds its engine (each store's
    memory slowed): the build stops, its files go, and the trainer closes cleanly."""
    import snake.engine
    import snake.stores

    off = tmp_path / "off"
    t = SnakeTrainer(model(), data=DATA, config=cfg(off, resident_optimizer="ssd"))
    building, outcome = threading.Event(), []
    real = snake.stores.alloc_host_tensor

    def slow(*a, **kw):
        building.set()
        time.sleep(0.2)
        return real(*a, **kw)

    monkeypatch.setattr(snake.stores, "alloc_host_tensor", slow)
    monkeypatch.setattr(snake.engine, "alloc_host_tensor", slow)

    def service() -> None:
        async def main() -> None:
            try:
                await t.run(2)
                outcome.append("finished")
            except asyncio.CancelledError:
                outcome.append("cancelled")
        asyncio.run(main())

    th = threading.Thread(target=service)
    th.start()
    assert building.wait(TIMEOUT)
    time.sleep(0.3)
    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(t.close(), TIMEOUT))
    took = time.monotonic() - t0
    th.join(TIMEOUT)
    assert outcome == ["cancelled"], outcome
    assert took < 3, took
    asyncio.run(assert_clean(off))


def json_step(ckpt: Path) -> int:
    import json

    return json.loads((ckpt / checkpoint.MANIFEST).read_text())["step"]


# -- evaluate(), state_dict() and save() under faults and cancellation ------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("after", [0, 2])
async def test_an_evaluate_whose_param_reads_fail_keeps_the_trainer_usable(tmp_path, after):
    """evaluate() only reads the parameters (after the delayed steps, which a save applies
    too): an I/O error there is a StorageError, and with the disk healthy again the trainer
    trains on to the weights of a run never interrupted."""
    off = tmp_path / "off"
    async with SnakeTrainer(model(), data=DATA, config=cfg(off)) as t:
        await t.run(2)
        f = t.engine.stores["param"].file
        inject_storage(f, StorageFaults(read_error=1.0, after=after))
        t0 = time.monotonic()
        with pytest.raises(StorageError):
            await asyncio.wait_for(t.evaluate(batches(2, 4, seed=9)), TIMEOUT)
        assert time.monotonic() - t0 < 5
        inner = getattr(f, "inner", f)
        inner.__dict__.pop("_preadv")
        inner.__dict__.pop("_pwritev")
        await asyncio.wait_for(t.run(1), TIMEOUT)
        got = await t.state_dict()
    assert_equal(got, await reference(tmp_path, 3))
    await assert_clean(off)


@pytest.mark.asyncio
async def test_a_state_dict_whose_resident_reads_fail_keeps_the_trainer_usable(tmp_path):
    off = tmp_path / "off"
    async with SnakeTrainer(model(), data=DATA, config=cfg(off, resident_optimizer="ssd")) as t:
        await t.run(2)
        f = t.engine.stores["resident"].file
        inject_storage(f, StorageFaults(read_error=1.0))
        with pytest.raises(StorageError):
            await asyncio.wait_for(t.state_dict(), TIMEOUT)
        f.__dict__.pop("_preadv")
        f.__dict__.pop("_pwritev")
        await asyncio.wait_for(t.run(1), TIMEOUT)
        got = await t.state_dict()
    assert_equal(got, await reference(tmp_path, 3, resident_optimizer="ssd"))
    await assert_clean(off)


@pytest.mark.asyncio
@pytest.mark.parametrize("piece", [0, 1, 3, 4])  # layers 0-2, resident, rng
async def test_a_save_cancelled_at_each_file_keeps_a_whole_checkpoint(tmp_path, monkeypatch, piece):
    """save() cancelled while it writes its `piece`-th file (slowed): the checkpoint there
    is the old one, whole, or (a cancellation during the renames) the new one, whole; the
    trainer trains on to the reference weights, and the checkpoint resumes to them."""
    off, ckpt = tmp_path / "off", tmp_path / "ckpt"
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()
    real, calls = checkpoint._write_tensors, [0]

    def slow(path, *a, **kw):
        if calls[0] == piece:
            loop.call_soon_threadsafe(entered.set)
            time.sleep(0.2)
        calls[0] += 1
        return real(path, *a, **kw)

    async with SnakeTrainer(model(), data=DATA, config=cfg(off, resident_optimizer="ssd")) as t:
        await t.run(1)
        await t.save(ckpt)
        before = tree(ckpt)
        await t.run(1)
        monkeypatch.setattr(checkpoint, "_write_tensors", slow)
        save = asyncio.create_task(t.save(ckpt))
        await asyncio.wait_for(entered.wait(), TIMEOUT)
        t0 = time.monotonic()
        save.cancel()
        with pytest.raises(asyncio.CancelledError):
            await save
        assert time.monotonic() - t0 < 2
        monkeypatch.undo()
        assert tree(ckpt) == before
        assert entries(tmp_path) == ["ckpt", "off"]
        assert not [f for f in fds_under(off) if "resident-save" in f]
        await asyncio.wait_for(t.run(1), TIMEOUT)
        got = await t.state_dict()
    assert_equal(got, await reference(tmp_path, 3, resident_optimizer="ssd"))
    await assert_clean(off)
    await resumes_to_reference(tmp_path, ckpt, 2, 3, resident_optimizer="ssd")


@pytest.mark.asyncio
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2])
async def test_a_load_cancelled_at_points_closes_cleanly(tmp_path, delay):
    ckpt = tmp_path / "ckpt"
    async with SnakeTrainer(model(), data=DATA, config=cfg(tmp_path / "a", resident_optimizer="ssd")) as t:
        await t.run(1)
        await t.save(ckpt)
    before = tree(ckpt)
    off = tmp_path / "b"
    t = SnakeTrainer(model(), data=DATA, config=cfg(off, resident_optimizer="ssd"))
    try:
        task = asyncio.create_task(t.load(ckpt))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            await asyncio.wait_for(task, TIMEOUT)
            began = None  # it finished first
        except asyncio.CancelledError:
            began = t._broken is not None
        if began:  # cancelled part-way: the trainer is closed
            with pytest.raises(SnakeError, match="closed"):
                await t.run(1)
        elif began is False:  # cancelled before it began: nothing changed
            assert t.engine is None and not snake_threads()
    finally:
        await asyncio.wait_for(t.close(), TIMEOUT)
    await assert_clean(off)
    assert tree(ckpt) == before


# -- two trainers, one offload_dir --------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_second_trainer_on_a_busy_offload_dir_harms_nothing(tmp_path):
    """While A trains, B on the same offload_dir is refused (run and load alike), without
    touching A's files or lock; A trains on to the reference weights; once A is closed B
    runs there."""
    off, ckpt = tmp_path / "off", tmp_path / "ckpt"
    async with SnakeTrainer(model(), data=DATA, config=cfg(off)) as a:
        await a.run(1)
        await a.save(ckpt)
        files = sorted(p.name for p in off.iterdir())
        run = asyncio.create_task(a.run(2))
        b = SnakeTrainer(model(), data=DATA, config=cfg(off))
        with pytest.raises(ConfigError, match="in use by another snake trainer"):
            await asyncio.wait_for(b.run(1), TIMEOUT)
        c = SnakeTrainer(model(), data=DATA, config=cfg(off))
        with pytest.raises(ConfigError, match="in use by another snake trainer"):
            await asyncio.wait_for(c.load(ckpt), TIMEOUT)
        await c.close()
        assert sorted(p.name for p in off.iterdir()) == files
        await asyncio.wait_for(run, TIMEOUT)
        assert_equal(await a.state_dict(), await reference(tmp_path, 3))
    await asyncio.wait_for(b.run(3), TIMEOUT)
    assert_equal(await b.state_dict(), await reference(tmp_path, 3))
    await b.close()
    await assert_clean(off)


# -- a full disk as the engine is built -----------------------------------------------------------
@pytest.mark.asyncio
async def test_a_full_disk_at_build_time_is_refused_and_can_be_retried(tmp_path, monkeypatch):
    """The SSD tier does not fit on the offload_dir's disk: a ConfigError naming
    offload_dir before anything is written, nothing left there, and once there is room the
    same trainer trains to the reference weights."""
    off = tmp_path / "off"
    t = SnakeTrainer(model(), data=DATA, config=cfg(off, placement=Placement.all_ssd()))
    try:
        with monkeypatch.context() as m:
            free_is(m, 100 << 10)
            with pytest.raises(ConfigError, match="offload_dir"):
                await asyncio.wait_for(t.run(2), TIMEOUT)
        assert not snake_threads() and not fds_under(off)
        assert sorted(p.name for p in off.iterdir()) == []
        await asyncio.wait_for(t.run(2), TIMEOUT)
        got = await t.state_dict()
    finally:
        await t.close()
    assert_equal(got, await reference(tmp_path, 2, placement=Placement.all_ssd()))
    await assert_clean(off)


@pytest.mark.asyncio
async def test_a_disk_that_fills_during_the_build_leaves_no_file_behind(tmp_path, monkeypatch):
    """The disk fills between the space check and the files' allocation (another process
    took the space): the build fails with a StorageError (ENOSPC) and, as the README says
    of a first run() that fails before its engine exists, leaves nothing behind: no thread,
    no lock, no offload file; once there is room the same trainer runs. Found by this audit
    (round 43): the file whose allocation failed stayed (`PosixFile` closed it only)."""
    off = tmp_path / "off"
    t = SnakeTrainer(model(), data=DATA, config=cfg(off, placement=Placement.all_ssd()))
    try:
        with monkeypatch.context() as m:
            no_room_under(m, off)
            with pytest.raises(StorageError) as e:
                await asyncio.wait_for(t.run(2), TIMEOUT)
        assert e.value.errno == errno.ENOSPC
        assert not snake_threads() and not fds_under(off)
        assert sorted(p.name for p in off.iterdir()) == []
        await asyncio.wait_for(t.run(2), TIMEOUT)
        got = await t.state_dict()
    finally:
        await t.close()
    assert_equal(got, await reference(tmp_path, 2, placement=Placement.all_ssd()))
    await assert_clean(off)


@pytest.mark.asyncio
async def test_a_killed_runs_stale_tier_file_is_not_room_for_this_one(tmp_path, monkeypatch):
    """A killed run left its `resident.bin` (resident_optimizer='ssd') in the offload_dir;
    this trainer keeps that state in memory, so it never reuses that file. The disk has no
    other room: a ConfigError naming offload_dir and the stale file, before any state is
    written. Found by this audit (round 43): the space check counted every *.bin there as
    room, and the build failed at a file's fallocate (StorageError) on a real full disk,
    leaving that file behind."""
    off = tmp_path / "off"
    off.mkdir()
    (off / "resident.bin").write_bytes(b"\1" * (3 << 20))  # a killed run's, real blocks
    t = SnakeTrainer(model(), data=DATA, config=cfg(off, placement=Placement.all_ssd()))
    try:
        with monkeypatch.context() as m:
            free_is(m, 0)
            with pytest.raises(ConfigError, match="offload_dir.*does not use: resident.bin"):
                await asyncio.wait_for(t.run(2), TIMEOUT)
    finally:
        await t.close()
    assert entries(off) == ["resident.bin"]  # nothing of this trainer's left
    assert not snake_threads() and not fds_under(off)
