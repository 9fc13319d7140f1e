"""Closing and cancelling a trainer inside a user's service, cases an audit (round 38) found:
two close() calls at once, a close() itself cancelled, a cancelled evaluate() or load()
whose data's next() blocks, a cancelled first run() while the planner measures the machine,
an async generator whose first run() was cancelled, a save() cancelled as it finishes, an
offload_dir removed while the trainer runs, and the data's iterator after close()."""

import asyncio
import dataclasses
import gc
import json
import shutil
import threading
import time
import weakref

import pytest
import torch

import snake.checkpoint as checkpoint
from snake import SnakeTrainer
from snake.errors import StorageError
from tests.helpers import assert_close_state, batches, tiny_gpt
from tests.test_lifecycle import config, open_bin_files, snake_threads


def _lock_free(directory) -> bool:
    from snake.offload_dir import DirLock

    try:
        DirLock(directory).release()
    except Exception:
        return False
    return True


class _Blocking:
    """An iterable whose `next()` blocks for `block_s` from batch `at` on (a stuck loader),
    or until `unblock()`."""

    def __init__(self, data, at: int, block_s: float) -> None:
        self.data, self.at, self.block_s = data, at, block_s
        self.released = threading.Event()

    def __iter__(self):
        for i, item in enumerate(self.data):
            if i >= self.at:
                self.released.wait(self.block_s)
            yield item


@pytest.fixture
def stuck():
    """`_Blocking` iterables whose stuck next() calls end with the test: their threads,
    which snake leaves to finish on their own, are gone before the next test counts
    threads."""
    made: list[_Blocking] = []

    def make(data, at: int, block_s: float) -> _Blocking:
        made.append(_Blocking(data, at, block_s))
        return made[-1]

    yield make
    for b in made:
        b.released.set()
    deadline = time.monotonic() + 10
    while any(t.name.startswith("snake-data") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.asyncio
async def test_two_closes_at_once_both_return_once_the_trainer_is_closed(tmp_path):
    """A service's shutdown handler and an `async with` exit close the trainer at once: the
    second close() used to return at once, with the threads alive, the tier files open and
    the offload_dir locked."""
    off = tmp_path / "off"
    t = SnakeTrainer(tiny_gpt(n_layer=4, bias=False), data=batches(200, 4), config=config(off))
    stepped = asyncio.Event()
    run = asyncio.create_task(t.run(200, on_step=lambda r: stepped.set()))
    await stepped.wait()
    first = asyncio.create_task(t.close())
    await asyncio.sleep(0)
    await t.close()
    assert run.done() and not snake_threads() and not open_bin_files(off) and _lock_free(off)
    await first


@pytest.mark.asyncio
async def test_a_cancelled_close_still_closes_the_trainer(tmp_path):
    """close() cancelled while it waits for a save() it cancelled: the closing goes on to
    its end. It used to leave the threads, the tier files and the lock for good, and every
    later close() did nothing."""
    off = tmp_path / "off"
    t = SnakeTrainer(tiny_gpt(n_layer=4, bias=False), data=batches(20, 4), config=config(off))
    await t.run(1)
    save = asyncio.create_task(t.save(tmp_path / "ckpt"))
    await asyncio.sleep(0.01)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(t.close(), 0.001)
    await t.close()  # waits for the one closing
    assert save.done() and not snake_threads() and not open_bin_files(off) and _lock_free(off)


@pytest.mark.asyncio
async def test_a_cancelled_evaluate_does_not_wait_for_a_blocked_next(tmp_path, stuck):
    """evaluate() under a timeout, its data's next() blocked: it returns at the timeout, as
    run() does (it used to wait for the next() to return), the trainer stays usable, and
    close() does not wait for that next() either."""
    data = batches(6, 4)
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=data, config=config(tmp_path / "off")) as t:
        await t.run(1)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await t.evaluate(stuck(batches(3, 4, seed=5), at=1, block_s=6))
        assert time.monotonic() - t0 < 3
        report = await t.evaluate(batches(2, 4, seed=5))
        assert report.batches == 2
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await t.evaluate(stuck(batches(3, 4, seed=5), at=0, block_s=6))
    assert time.monotonic() - t0 < 3  # the close() of `async with` too


@pytest.mark.asyncio
async def test_a_cancelled_load_does_not_wait_for_a_blocked_next(tmp_path, stuck):
    """load() skips the batches the checkpoint consumed; with the data's next() blocked it
    returns at the timeout (it used to wait for the next())."""
    data = batches(8, 4)
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=data, config=config(tmp_path / "a")) as t:
        await t.run(3)
        await t.save(tmp_path / "ckpt")
    t = SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=stuck(data, at=1, block_s=6), config=config(tmp_path / "b"))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await t.load(tmp_path / "ckpt")
    await t.close()
    assert time.monotonic() - t0 < 3


@pytest.mark.asyncio
async def test_cancelling_a_planned_first_run_stops_the_machine_probes(tmp_path):
    """A first run() with placement, alpha and micro_batches left to the planner, cancelled
    while its probes measure the machine: they stop at their next round (this model's probes
    run 9-12 s; the cancellation used to wait for all of them), no profile is cached, no
    thread is left, and the trainer can be given another try."""
    from snake.models import GPT, GPTConfig

    off = tmp_path / "off"
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_head=8, n_embd=512, vocab_size=256, block_size=128))
    cfg = dataclasses.replace(config(off), placement=None, alpha=None, micro_batches=None)
    t = SnakeTrainer(model, data=batches(4, 8, seq=128, vocab=256), config=cfg)
    run = asyncio.create_task(t.run(2))
    deadline = time.monotonic() + 30
    while not any(th.name.startswith("snake-probe") for th in threading.enumerate()):
        assert time.monotonic() < deadline, "the probes never started"
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    t0 = time.monotonic()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert time.monotonic() - t0 < 3
    assert not list(off.glob("snake-profile-*.json")) and not list(off.glob(".snake-profile-*"))
    assert not [n for n in snake_threads() if n.startswith(("snake-planner", "snake-probe"))]
    assert t.engine is None and t._broken is None
    await t.close()


@pytest.mark.asyncio
async def test_an_async_generator_trains_on_after_a_cancelled_first_run(tmp_path):
    """A first run() cancelled while the user's async generator awaits its first batch: the
    generator goes on (a cancellation thrown into it would end it for good, and the retry
    failed with "data: ran out after 0 global batches"), and the retry trains on the same
    batches, to the weights of a run never cancelled."""
    data = batches(4, 4)
    gate = asyncio.Event()

    async def source(wait: bool):
        for item in data:
            if wait:
                await gate.wait()
            yield item

    t = SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=source(True), config=config(tmp_path / "a"))
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await t.run(2)
    gate.set()
    async with t:
        await t.run(2)
        got = await t.state_dict()
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=source(False), config=config(tmp_path / "b")) as u:
        await u.run(2)
        want = await u.state_dict()
    assert_close_state(got, want, rtol=0, atol=0)


@pytest.mark.asyncio
async def test_a_save_cancelled_as_it_finishes_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    """A save() cancelled while it writes its manifest (a slow disk) raises the cancellation
    and keeps the checkpoint that was there; it used to publish the new one."""
    ckpt = tmp_path / "ckpt"
    writing = threading.Event()
    real = checkpoint._write_file

    def slow(path, data):
        if path.name == checkpoint.MANIFEST:
            writing.set()
            time.sleep(0.3)
        return real(path, data)

    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(6, 4), config=config(tmp_path / "off")) as t:
        await t.run(1)
        await t.save(ckpt)
        await t.run(2)
        monkeypatch.setattr(checkpoint, "_write_file", slow)
        save = asyncio.create_task(t.save(ckpt))
        assert await asyncio.to_thread(writing.wait, 30)
        save.cancel()
        with pytest.raises(asyncio.CancelledError):
            await save
        assert json.loads((ckpt / checkpoint.MANIFEST).read_text())["step"] == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "off"]  # nothing else left


@pytest.mark.asyncio
async def test_a_save_into_a_removed_offload_dir_says_so(tmp_path):
    """The offload_dir removed while the trainer runs (a temporary-files cleaner), the
    resident optimizer state on SSD: save() raises a StorageError that says so and how to
    go on (it was a bare FileNotFoundError); after the directory is made again it saves."""
    off = tmp_path / "off"
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(6, 4),
                            config=config(off, resident_optimizer="ssd")) as t:
        await t.run(1)
        shutil.rmtree(off)
        await t.run(1)
        with pytest.raises(StorageError, match="offload_dir .* is gone .* create the directory again"):
            await t.save(tmp_path / "ckpt")
        assert not (tmp_path / "ckpt").exists()
        off.mkdir()
        await t.save(tmp_path / "ckpt")
        await t.run(1)
    assert json.loads((tmp_path / "ckpt" / checkpoint.MANIFEST).read_text())["step"] == 2


class _Iterator:
    def __init__(self, data) -> None:
        self.items = iter(data)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.items)


class _Loader:
    """A DataLoader's shape: each iter() makes an iterator that owns the workers."""

    def __init__(self, data) -> None:
        self.data = data
        self.made: list[weakref.ref] = []

    def __iter__(self):
        it = _Iterator(self.data)
        self.made.append(weakref.ref(it))
        return it


@pytest.mark.asyncio
async def test_close_lets_the_data_iterator_go(tmp_path):
    """After close() the trainer holds no iterator of the data: a DataLoader's worker
    processes, which its iterator owns, end then, not when the trainer object is collected
    (a service that keeps finished jobs kept their workers)."""
    loader = _Loader(batches(4, 4))
    t = SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=loader, config=config(tmp_path / "off"))
    await t.run(1)
    await t.close()
    gc.collect()
    assert len(loader.made) == 1 and loader.made[0]() is None


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["failed", "cancelled"])
async def test_a_kept_exception_or_task_keeps_no_trainer_alive(tmp_path, how):
    """A service keeps a failed job's exception, or a cancelled job's task: it kept the
    closed trainer, its engine (tiers, buffers) and the model alive through the frames in
    the traceback, +75 MiB per job of a 3.2 M-parameter GPT (an audit, round 38). Now they
    go when the service drops the trainer and the model."""
    def bad_data():
        for j, b in enumerate(batches(12, 4)):
            if j == 8:
                raise ValueError("a bad batch")
            yield b

    kept, refs = [], []
    for i in range(2):
        model = tiny_gpt(n_layer=2, bias=False)
        t = SnakeTrainer(model, data=bad_data() if how == "failed" else batches(10, 4),
                         config=config(tmp_path / f"off{i}"))
        refs += [weakref.ref(t), weakref.ref(model)]
        task = asyncio.create_task(t.run(10))
        while t.engine is None and not task.done():  # noqa: ASYNC110 - nothing signals the engine made
            await asyncio.sleep(0.001)
        refs.append(weakref.ref(t.engine))
        if how == "cancelled":
            task.cancel()
        await asyncio.wait([task])
        if how == "failed":
            kept.append(task.exception())  # what a job record does
        else:
            kept.append(task)
        await t.close()
        del t, model
    gc.collect()
    assert kept and len(refs) == 6 and [r() for r in refs] == [None] * len(refs)
