"""An exception inside any actor surfaces from run() within 5 s, names the actor, and
leaves no task, thread or open file behind."""

import asyncio
import errno
import os
import threading
import time

import pytest
import torch

from snake import ActorFailed, ModelParts, Placement, SnakeConfig, SnakeError, SnakeTrainer
from snake.errors import DataError
from tests.helpers import batches, tiny_gpt


class FailingFile:
    """Fake storage for tests: delegates to the real file, fails the chosen call."""

    def __init__(self, inner, fail: str, after: int = 0):
        self.inner, self.fail, self.after = inner, fail, after
        self.path, self.backend = inner.path, "failing"

    def _maybe_fail(self, op):
        if op == self.fail:
            if self.after <= 0:
                raise OSError(errno.EIO, f"injected {op} error")
            self.after -= 1

    def pread(self, buf, offset):
        self._maybe_fail("pread")
        self.inner.pread(buf, offset)

    def pwrite(self, buf, offset):
        self._maybe_fail("pwrite")
        self.inner.pwrite(buf, offset)

    def close(self):
        self.inner.close()


def _snake_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("snake-")]


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _fails_cleanly(trainer, actor: str, cause_type=OSError):
    threads, fds = threading.active_count(), _fds()
    t0 = time.monotonic()
    with pytest.raises(ActorFailed) as e:
        await asyncio.wait_for(trainer.run(3), 30)
    assert time.monotonic() - t0 < 5
    assert e.value.actor == actor
    assert isinstance(e.value.__cause__, cause_type)
    assert actor in str(e.value)
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
    assert not _snake_threads()  # the trainer's executor threads are gone
    assert threading.active_count() <= threads
    assert _fds() <= fds  # its files (and lock) are closed
    assert not [p for p in os.listdir("/proc/self/fd") if ".bin" in _target(p)]
    with pytest.raises(SnakeError, match="closed"):
        await trainer.run(1)
    return e.value


def _config(tmp_path, **kw):
    base = dict(micro_batches=2, offload_dir=tmp_path, placement=Placement.all_ssd(), alpha=0.3, device="cpu")
    base.update(kw)
    return SnakeConfig(**base)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind,op,actor", [("ckpt", "pwrite", "ssd_write"), ("param", "pread", "ssd_read"), ("opt", "pread", "ssd_read"),
                                            ("grad", "pwrite", "ssd_write"), ("grad", "pread", "ssd_read")])
async def test_io_error_surfaces(tmp_path, kind, op, actor):
    async with SnakeTrainer(tiny_gpt(bias=False), data=batches(5, 4), config=_config(tmp_path)) as trainer:
        await trainer.run(1)
        store = trainer.engine.stores[kind]
        store.file = FailingFile(store.file, op, after=1)
        err = await _fails_cleanly(trainer, actor)
        assert err.iteration is not None


@pytest.mark.asyncio
async def test_a_bad_later_batch_stops_the_run_cleanly(tmp_path):
    """Three batches for run(3) (a list too short is refused up front), the second one bad:
    the run stops cleanly after the first step and raises the DataError, no thread or file
    of a run left, and the trainer goes on with the third batch. Before, the run failed
    (ActorFailed) and closed the trainer, its steps lost."""
    bad = (torch.zeros(6, 16, dtype=torch.long), torch.zeros(6, 16, dtype=torch.long))
    data = [batches(1, 4)[0], bad, batches(1, 4)[0]]
    async with SnakeTrainer(tiny_gpt(bias=False), data=data, config=_config(tmp_path)) as trainer:
        await trainer.run(1)
        threads, fds = threading.active_count(), _fds()
        with pytest.raises(DataError, match=r"shape .* stopped cleanly after 0 of its steps, before iteration 1") as e:
            await asyncio.wait_for(trainer.run(2), 30)
        assert e.value.report.steps == []
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
        assert threading.active_count() <= threads and _fds() <= fds
        report = await asyncio.wait_for(trainer.run(1), 30)
        assert [s.step for s in report.steps] == [1]


@pytest.mark.asyncio
async def test_exception_in_compute(tmp_path):
    model = tiny_gpt(bias=False)
    calls = {"n": 0}

    def block_fn(block, x):
        calls["n"] += 1
        if calls["n"] > 30:
            raise RuntimeError("boom in a block")
        return block(x)

    parts = ModelParts(model=model, blocks=list(model.blocks), blocks_prefix="blocks",
                       pre=lambda m, i: m.embed(i), post=lambda m, h: m.head(h), block_fn=block_fn)
    async with SnakeTrainer(parts, data=batches(5, 4), config=_config(tmp_path)) as trainer:
        err = await _fails_cleanly(trainer, "compute", RuntimeError)
        assert err.layer is not None and err.micro_batch is not None


@pytest.mark.asyncio
async def test_cancellation_stops_within_5s_and_closes(tmp_path):
    async with SnakeTrainer(tiny_gpt(bias=False), data=batches(50, 4), config=_config(tmp_path)) as trainer:
        threads = threading.active_count()
        task = asyncio.ensure_future(trainer.run(50))
        await asyncio.sleep(1.0)
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - t0 < 5
        assert threading.active_count() <= threads
        assert not _snake_threads()
        with pytest.raises(SnakeError, match="closed"):
            await trainer.run(1)


@pytest.mark.asyncio
async def test_second_trainer_on_same_dir_is_refused(tmp_path):
    cfg = _config(tmp_path)
    async with SnakeTrainer(tiny_gpt(bias=False), data=batches(2, 4), config=cfg) as a:
        await a.run(1)
        async with SnakeTrainer(tiny_gpt(bias=False), data=batches(2, 4), config=cfg) as b:
            with pytest.raises(SnakeError, match="in use by another snake trainer"):
                await b.run(1)


@pytest.mark.asyncio
async def test_offload_files_are_private(tmp_path):
    off = tmp_path / "off"
    async with SnakeTrainer(tiny_gpt(bias=False), data=batches(2, 4), config=_config(off)) as trainer:
        await trainer.run(1)
        assert (off.stat().st_mode & 0o777) == 0o700
        files = list(off.glob("*.bin"))
        assert {f.name for f in files} == {"param.bin", "opt.bin", "ckpt.bin", "grad.bin"}
        assert all((f.stat().st_mode & 0o777) == 0o600 for f in files)


@pytest.mark.asyncio
# (checkpoints are rewritten each iteration before they are read: a flip between runs is
# overwritten, not read; within an iteration the same check covers them)
@pytest.mark.parametrize("kind", ["opt", "param", "grad"])
async def test_flipped_bytes_on_ssd_are_detected(tmp_path, kind):
    from snake.errors import StorageError

    async with SnakeTrainer(tiny_gpt(bias=False), data=batches(5, 4), config=_config(tmp_path)) as trainer:
        await trainer.run(1)
        store = trainer.engine.stores[kind]
        # (layer 0's waiting gradient stays in its staging buffer: never on SSD)
        unit = next(u for u in store.units.values() if u.tail_n and not (kind == "grad" and u.key[0] == 0))
        path = store.file.path
        _flip_byte(path, unit.file_offset + 5)  # another process corrupts the block on disk
        err = await _fails_cleanly(trainer, "ssd_read", StorageError)
        msg = str(err.__cause__)
        assert "checksum mismatch" in msg and kind in msg and str(path) in msg and "layer" in msg


def _flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
