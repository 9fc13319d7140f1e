"""A trainer's life inside a user's service: failures part-way through state_dict/save,
cancellation while it is being set up, close() during a run, a second event loop, a
trainer dropped without close(), and what it leaves on the user's objects and directory.
Each case was a bug found by an audit (round 20)."""

import asyncio
import gc
import os
import stat
import threading

import pytest
import torch

from snake import Placement, SnakeConfig, SnakeError, SnakeTrainer
from snake.errors import ConfigError, StorageError
from snake.faults import StorageFaults, inject_storage
from tests.helpers import batches, tiny_gpt

MIXED = Placement(param=0.3, ckpt=0.3, opt=0.3)


def config(directory, **kw) -> SnakeConfig:
    base = dict(micro_batches=2, offload_dir=directory, placement=MIXED, alpha=0.3, device="cpu", stall_timeout_s=60)
    base.update(kw)
    return SnakeConfig(**base)


def open_bin_files(directory) -> list[str]:
    """The .bin files of `directory` this process holds open."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)) and target.endswith(".bin"):
            out.append(target)
    return out


def snake_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("snake-")]


@pytest.mark.asyncio
@pytest.mark.parametrize("call", ["state_dict", "save"])
async def test_a_flush_that_fails_part_way_closes_the_trainer(tmp_path, call):
    """state_dict() and save() first apply the pending delayed steps, layer by layer in
    place. An I/O error after the first layer used to leave the trainer usable, and a retry
    stepped that layer twice: wrong weights, no error. Now the trainer is closed."""
    async with SnakeTrainer(tiny_gpt(n_layer=3, bias=False), data=batches(4, 4), config=config(tmp_path / "off")) as t:
        await t.run(2)
        # per layer the flush reads, then writes the opt tail: fail the second layer's write
        inject_storage(t.engine.stores["opt"].file, StorageFaults(write_error=1.0, after=3))
        with pytest.raises(StorageError):
            await (t.state_dict() if call == "state_dict" else t.save(tmp_path / "ckpt"))
        assert t.engine is None
        with pytest.raises(SnakeError, match="failed applying the delayed optimizer steps"):
            await t.state_dict()
        with pytest.raises(SnakeError, match="closed"):
            await t.run(1)
    assert not open_bin_files(tmp_path / "off")


@pytest.mark.asyncio
async def test_a_flush_that_fails_before_any_change_can_be_retried(tmp_path):
    """A read error on the first layer's tail changes nothing: the trainer stays usable and
    the retry gives the weights of a clean run."""
    data = batches(4, 4)
    async with SnakeTrainer(tiny_gpt(n_layer=3, bias=False), data=data, config=config(tmp_path / "a")) as t:
        await t.run(2)
        want = await t.state_dict()
    async with SnakeTrainer(tiny_gpt(n_layer=3, bias=False), data=data, config=config(tmp_path / "b")) as t:
        await t.run(2)
        file = t.engine.stores["opt"].file
        inject_storage(file, StorageFaults(read_error=1.0))
        with pytest.raises(StorageError):
            await t.state_dict()
        file.__dict__.pop("_preadv")  # the disk is healthy again
        got = await t.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.asyncio
async def test_cancelled_while_the_engine_is_built_closes_its_files(tmp_path, monkeypatch):
    """A cancellation that arrives while the engine is being built (its files open) waited
    for the build and dropped the finished engine, its files open until the process ended."""
    import snake.trainer

    built = threading.Event()

    class SlowEngine(snake.trainer.Engine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            built.set()
            threading.Event().wait(0.5)  # the files are open: time to cancel

    monkeypatch.setattr(snake.trainer, "Engine", SlowEngine)
    off = tmp_path / "off"
    t = SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(2, 4), config=config(off))
    task = asyncio.create_task(t.run(1))
    assert await asyncio.to_thread(built.wait, 60)
    assert open_bin_files(off)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not open_bin_files(off)
    await t.close()
    assert not snake_threads()


@pytest.mark.asyncio
async def test_an_engine_that_fails_after_opening_its_files_closes_them(tmp_path, monkeypatch):
    from snake.engine import Engine

    def no_memory(self):
        raise MemoryError("no room for the staging pools")

    import snake.stores

    made = []
    real_open = snake.stores.open_storage

    def recording_open(path, *a, **kw):
        made.append(path)
        return real_open(path, *a, **kw)

    monkeypatch.setattr(Engine, "_make_pools", no_memory)
    monkeypatch.setattr(snake.stores, "open_storage", recording_open)
    off = tmp_path / "off"
    t = SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(2, 4), config=config(off))
    with pytest.raises(MemoryError):
        await t.run(1)
    assert made, "the files were made"
    assert not open_bin_files(off)
    assert not list(off.glob("*.bin")), "and removed: scratch space"
    await t.close()
    assert not snake_threads()


@pytest.mark.asyncio
async def test_close_during_a_run_cancels_it_and_waits(tmp_path):
    """close() while run() was in progress shut the executors under the running actors
    (a misleading 'cannot schedule new futures' failure) and released the lock early."""
    off = tmp_path / "off"
    t = SnakeTrainer(tiny_gpt(n_layer=3, bias=False), data=batches(50, 4), config=config(off))
    stepped = asyncio.Event()
    task = asyncio.create_task(t.run(50, on_step=lambda r: stepped.set()))
    await stepped.wait()
    await t.close()
    assert task.done()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not snake_threads()
    assert not open_bin_files(off)
    # the lock is free: another trainer can use the directory
    async with SnakeTrainer(tiny_gpt(n_layer=3, bias=False), data=batches(1, 4), config=config(off)) as other:
        await other.run(1)


def test_a_second_event_loop_is_refused_before_anything_changes(tmp_path):
    """asyncio.run() per call (a sync wrapper, a notebook): the engine's queues belong to
    the first loop, and run() in a second one failed inside an actor and lost the training.
    Now it is refused up front; the trainer keeps its state, which save()/state_dict() can
    read from any loop."""
    data = batches(3, 4)
    t = SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=data, config=config(tmp_path / "off"))
    asyncio.run(t.run(1))
    with pytest.raises(SnakeError, match="another event loop"):
        asyncio.run(t.run(1))
    got = asyncio.run(t.state_dict())
    asyncio.run(t.close())

    async def one_loop():
        async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=data, config=config(tmp_path / "ref")) as r:
            await r.run(1)
            return await r.state_dict()

    want = asyncio.run(one_loop())
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.asyncio
async def test_a_trainer_dropped_without_close_frees_its_directory(tmp_path):
    off = tmp_path / "off"
    t = SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(2, 4), config=config(off))
    await t.run(1)
    t.engine.shutdown_executors()  # as the interpreter would at exit; the lock and files stay
    with pytest.warns(ResourceWarning, match="never"):
        del t
        gc.collect()
    assert not open_bin_files(off)
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(1, 4), config=config(off)) as t2:
        await t2.run(1)


@pytest.mark.asyncio
async def test_an_existing_directory_keeps_its_mode(tmp_path):
    """Only a directory snake creates is made 0700; one the user gave (a shared scratch
    directory, a mount point) was chmodded too."""
    off = tmp_path / "shared"
    off.mkdir(mode=0o755)
    os.chmod(off, 0o755)
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(1, 4), config=config(off)) as t:
        await t.run(1)
    assert stat.S_IMODE(off.stat().st_mode) == 0o755
    new = tmp_path / "new" / "off"
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(1, 4), config=config(new)) as t:
        await t.run(1)
    assert stat.S_IMODE(new.stat().st_mode) == 0o700


@pytest.mark.asyncio
async def test_the_users_model_gets_its_modes_back(tmp_path):
    model = tiny_gpt(n_layer=2, bias=False)
    model.eval()
    model.blocks[1].train()
    want = {name: m.training for name, m in model.named_modules()}
    async with SnakeTrainer(model, data=batches(1, 4), config=config(tmp_path / "off")) as t:
        await t.run(1)
    assert {name: m.training for name, m in model.named_modules()} == want


@pytest.mark.asyncio
async def test_an_async_on_step_is_refused(tmp_path):
    """An async on_step was called and never awaited: the user's code silently never ran."""

    async def on_step(report):
        pass

    class Hook:
        async def __call__(self, report):
            pass

    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(1, 4), config=config(tmp_path / "off")) as t:
        for hook in (on_step, Hook(), "not callable"):
            with pytest.raises(ConfigError, match="on_step"):
                await t.run(1, on_step=hook)
        assert t.engine is None  # refused before anything was set up
        await t.run(1, on_step=lambda r: None)


def test_a_bad_model_leaves_no_new_offload_dir(tmp_path):
    off = tmp_path / "new" / "off"
    with pytest.raises(SnakeError):
        SnakeTrainer(torch.nn.Linear(2, 2), data=batches(1, 4), config=config(off))
    assert not (tmp_path / "new").exists()


class SlowData:
    """A sync iterable whose next() blocks at the chosen batches (a stuck loader)."""

    def __init__(self, data, slow: dict[int, float]) -> None:
        self.data, self.slow = data, slow

    def __iter__(self):
        for i, item in enumerate(self.data):
            if i in self.slow:
                threading.Event().wait(self.slow[i])
            yield item


@pytest.mark.asyncio
async def test_a_timeout_does_not_wait_for_a_blocked_data_source_nor_lose_its_batch(tmp_path):
    """asyncio.timeout around run() waited for the user's blocking next() to return; now it
    ends run() at once, and the batch that next() returns is the next one handed out."""
    import time

    data = batches(2, 4)
    t = SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=SlowData(data, {0: 1.5}), config=config(tmp_path / "a"))
    start = time.perf_counter()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await t.run(2)
    assert time.perf_counter() - start < 1.0
    await t.run(2)  # cancelled before the engine existed: the trainer can go on
    got = await t.state_dict()
    await t.close()
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=data, config=config(tmp_path / "b")) as ref:
        await ref.run(2)
        want = await ref.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k


class BriefData:
    """A sync iterable whose next() at batch `at` signals `entered`, then takes `seconds`."""

    def __init__(self, data, at: int, seconds: float) -> None:
        self.data, self.at, self.seconds = data, at, seconds
        self.entered = threading.Event()

    def __iter__(self):
        for i, item in enumerate(self.data):
            if i == self.at:
                self.entered.set()
                threading.Event().wait(self.seconds)
            yield item


@pytest.mark.asyncio
async def test_close_while_a_quick_next_runs_joins_the_data_thread(tmp_path):
    """close() during a run whose data next() was still running left the data thread
    behind: the trainer did not join it while the loop had not yet seen the call return
    (CI saw 'snake-data_0' after close). A next() that returns within a short grace is now
    waited for and its thread joined."""
    data = BriefData(batches(50, 4), at=3, seconds=0.03)
    t = SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=data, config=config(tmp_path / "off"))
    task = asyncio.create_task(t.run(50))
    await asyncio.to_thread(data.entered.wait, 30)
    await t.close()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not snake_threads()


@pytest.mark.asyncio
async def test_the_stall_watchdog_names_a_blocked_data_source(tmp_path):
    import time

    from snake import ActorFailed

    slow = SlowData(batches(3, 4), {2: 4.0})
    start = time.perf_counter()
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=slow, config=config(tmp_path, stall_timeout_s=0.5)) as t:
        with pytest.raises(ActorFailed, match="'data'.*next\\(data\\)"):
            await t.run(3)
    assert time.perf_counter() - start < 3.0
    # the data thread ends when the user's next() returns (not joined while it runs)
    for thread in threading.enumerate():
        if thread.name.startswith("snake-data"):
            await asyncio.to_thread(thread.join, 10)
    assert not snake_threads()


@pytest.mark.asyncio
async def test_a_list_too_short_for_the_run_is_refused_up_front(tmp_path):
    """A list of 3 batches and run(5) trained 3 iterations, then failed and lost them all;
    a list says its length, so the run is refused before it starts, and the trainer goes on."""
    from snake import DataError

    off = tmp_path / "off"
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(3, 4), config=config(off)) as t:
        with pytest.raises(DataError, match=r"run\(5\) needs 5 more global batches but the data has 3 left"):
            await t.run(5)
        assert not off.exists() or not list(off.glob("*.bin"))
        await t.run(2)
        with pytest.raises(DataError, match="has 1 left"):
            await t.run(2)
        report = await t.run(1)
        assert len(report.steps) == 1


@pytest.mark.asyncio
async def test_a_second_save_during_a_save_is_refused_by_name(tmp_path):
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(1, 4), config=config(tmp_path / "off")) as t:
        await t.run(1)
        first = asyncio.create_task(t.save(tmp_path / "a"))
        await asyncio.sleep(0)  # the first save has begun
        with pytest.raises(SnakeError, match=r"save: a run\(\), save\(\), load\(\), evaluate\(\) or state_dict\(\) of this trainer is in progress"):
            await t.save(tmp_path / "b")
        await first
    assert (tmp_path / "a" / "manifest.json").is_file()


@pytest.mark.asyncio
async def test_a_run_or_save_during_a_state_dict_is_refused_by_name(tmp_path):
    """state_dict() reads the stores through a staging buffer of the run's: a run, save or
    evaluate started meanwhile is refused, as one during a save is, and vice versa."""
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(3, 4), config=config(tmp_path / "off")) as t:
        await t.run(1)
        reading = asyncio.create_task(t.state_dict())
        await asyncio.sleep(0)  # it has begun
        for call in (lambda: t.run(1), lambda: t.save(tmp_path / "a"), lambda: t.evaluate(batches(1, 4))):
            with pytest.raises(SnakeError, match="in progress"):
                await call()
        state = await reading
        running = asyncio.create_task(t.run(1))
        await asyncio.sleep(0)
        with pytest.raises(SnakeError, match="in progress"):
            await t.state_dict()
        await running
        assert (await t.state_dict()).keys() == state.keys()
