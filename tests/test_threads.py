"""On a CPU device only the compute thread runs torch ops on several intra-op threads; every
other snake thread uses one, and nothing outside snake's threads changes."""

import threading

import pytest
import torch

from snake import Placement, SnakeConfig, SnakeTrainer
from tests.helpers import batches, tiny_gpt


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # so that "one" and "torch's count" differ on any machine
    yield 2
    torch.set_num_threads(before)


def _new_thread_count() -> int:
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
    t.start()
    t.join()
    return out[0]


async def _on_every_executor(tmp_path, fn):  # type: ignore[no-untyped-def]
    """fn's result on a thread of each executor of a CPU-device trainer that has trained."""
    cfg = SnakeConfig(micro_batches=2, offload_dir=str(tmp_path), placement=Placement(param=0.5, ckpt=0.5, opt=0.5),
                      alpha=0.0, device="cpu", optimizer_workers=2)
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(3, 4), config=cfg) as trainer:
        await trainer.run(2)
        ex = trainer.engine.executors
        return {name: ex[name].submit(fn).result() for name in ex}


@pytest.mark.asyncio
async def test_cpu_device_helper_threads_use_one_intraop_thread(tmp_path, two_threads):
    counts = await _on_every_executor(tmp_path, torch.get_num_threads)
    # AdamW runs on the compute thread on a CPU device (Engine.optimizer_runs_on_compute)
    assert counts == {"compute": two_threads, "copy": 1, "h2d": 1, "io": 1, "optimizer": two_threads, "data": 1,
                      "sync": 1}
    # the caller's thread and threads made later keep torch's count
    assert torch.get_num_threads() == two_threads
    assert _new_thread_count() == two_threads


def _omp_workers() -> set[int]:
    """OS threads of this process that Python did not start (OpenMP workers, mostly)."""
    import os

    python_ids = {t.native_id for t in threading.enumerate()}
    return {int(t) for t in os.listdir("/proc/self/task")} - python_ids


def test_event_loop_thread_runs_no_parallel_torch_op(tmp_path, two_threads):
    """Training, state_dict, save and load. A parallel torch op on the event loop's thread would give it an OpenMP team that lives as
    long as the thread; on a CPU device that team makes the compute kernels' OpenMP workers
    stop spinning and every kernel slower. The loop runs on a fresh thread here, so the team
    would be new and still alive after the trainer closed its own threads."""
    import asyncio
    import time

    before = _omp_workers()
    leftover: list[set[int]] = []

    async def train() -> None:
        # 8 x 32 x 256 floats per micro-batch: the embedding is large enough to run in parallel
        cfg = SnakeConfig(micro_batches=2, offload_dir=str(tmp_path), placement=Placement.all_cpu(),
                          alpha=0.0, device="cpu")
        data = batches(3, 16, seq=32)
        async with SnakeTrainer(tiny_gpt(n_layer=2, n_embd=256), data=data, config=cfg) as t:
            await t.state_dict()  # before the first run and after it
            await t.run(2)
            await t.state_dict()
            await t.save(tmp_path / "ck")
        again = SnakeConfig(micro_batches=2, offload_dir=str(tmp_path / "again"), placement=Placement.all_cpu(),
                            alpha=0.0, device="cpu")
        async with SnakeTrainer(tiny_gpt(n_layer=2, n_embd=256), data=data, config=again) as t:
            await t.load(tmp_path / "ck")
            await t.run(1)

    def loop_then_look() -> None:
        asyncio.run(train())
        deadline = time.monotonic() + 5  # still on the loop's thread: its team would be alive
        while _omp_workers() - before and time.monotonic() < deadline:
            time.sleep(0.05)  # the compute thread's workers leave with it
        leftover.append(_omp_workers() - before)

    loop_thread = threading.Thread(target=loop_then_look)
    loop_thread.start()
    loop_thread.join()
    assert leftover == [set()]


def _own_os_name() -> str:
    with open("/proc/thread-self/comm") as f:
        return f.read().strip()


@pytest.mark.asyncio
async def test_snake_threads_carry_their_names_in_the_os(tmp_path):
    """top -H, py-spy and perf show OS thread names: each snake thread has its own."""
    names = await _on_every_executor(tmp_path, _own_os_name)
    assert {k: v for k, v in names.items() if k != "io"} == {
        "compute": "snake-compute_0", "copy": "snake-copy_0", "data": "snake-data_0",
        "optimizer": "snake-compute_0",  # on a CPU device AdamW runs on the compute thread
        "h2d": "snake-copy_0",  # on a CPU device both copy directions share one thread (on CUDA: snake-h2d_0)
        "sync": "snake-sync_0",  # waits for the compute stream's marks (used on CUDA only)
    }
    assert names["io"] in ("snake-io_0", "snake-io_1")
    assert _own_os_name() != "snake-compute_0"  # the caller's thread keeps its name


@pytest.mark.asyncio
@pytest.mark.parametrize("on_compute", [True, False])
@pytest.mark.parametrize("opt_share", [1.0, 0.5])
async def test_cpu_device_runs_adamw_on_the_compute_thread(tmp_path, monkeypatch, opt_share, on_compute):
    """On a CPU device AdamW queues on the compute thread (between jobs, on the kernels'
    cores) instead of taking a core from them, whether or not its states live on the SSD;
    with `Engine.optimizer_on_compute` off (the benchmarks' A/B) it has threads of its own,
    named in the OS, with one intra-op thread each."""
    import snake.actors.optimizer as opt_actor
    from snake.engine import Engine

    monkeypatch.setattr(Engine, "optimizer_on_compute", on_compute)
    seen: list[tuple[str, int]] = []
    real = opt_actor.step_unit

    def spy(*a, **k):  # type: ignore[no-untyped-def]
        seen.append((_own_os_name(), torch.get_num_threads()))
        return real(*a, **k)

    monkeypatch.setattr(opt_actor, "step_unit", spy)
    cfg = SnakeConfig(micro_batches=2, offload_dir=str(tmp_path), placement=Placement(param=1.0, ckpt=1.0, opt=opt_share),
                      alpha=0.0, device="cpu")
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(3, 4), config=cfg) as trainer:
        await trainer.run(2)
        shared = trainer.engine.executors["optimizer"] is trainer.engine.executors["compute"]
    assert shared == on_compute
    if on_compute:
        assert seen and set(seen) == {("snake-compute_0", torch.get_num_threads())}
    else:
        assert seen and set(seen) == {("snake-optimizer", 1)}  # "snake-optimizer_N" cut to 15 bytes


def _started(ctx) -> object:  # type: ignore[no-untyped-def]
    p = ctx.Process(target=int)
    p.start()
    return p


def test_a_process_forked_from_a_pool_thread_exits_cleanly():
    """A DataLoader's workers are forked from snake's data thread, a ThreadPoolExecutor's:
    on CPython 3.11 such a child failed at its exit (gh-88110: it joined its own thread),
    exit code 1, and torch's SIGCHLD handler raised "DataLoader worker exited unexpectedly"
    into whatever the main thread ran (`snake.blocking` forgets the pool's threads in a
    forked child; tests/test_data_state.py trains across epochs with workers)."""
    import multiprocessing
    from concurrent.futures import ThreadPoolExecutor

    import snake.blocking  # noqa: F401  (what registers the at-fork hook)

    ctx = multiprocessing.get_context("fork")
    with ThreadPoolExecutor(1) as ex:
        p = ex.submit(_started, ctx).result()
    p.join(30)  # type: ignore[attr-defined]
    assert p.exitcode == 0  # type: ignore[attr-defined]
