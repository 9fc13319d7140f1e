"""The trace summary reports the event loop thread's own CPU over run(): the scheduler every
actor message goes through, so its share says whether it keeps up."""

import asyncio
import time

import pytest

from snake import Placement, SnakeConfig, SnakeTrainer
from tests.helpers import batches, tiny_gpt


async def _run(tmp_path, name: str, burn: bool) -> tuple[dict, float]:
    """(the trace's event-loop record, the CPU seconds a burner task on the loop spent
    inside the runs)."""
    cfg = SnakeConfig(micro_batches=2, offload_dir=str(tmp_path / name), placement=Placement.all_cpu(),
                      alpha=0.0, device="cpu")
    stop = asyncio.Event()
    running = False
    burned = 0.0

    async def burner() -> None:  # another task on the same loop, using its thread's CPU
        nonlocal burned
        while not stop.is_set():
            if running:  # it spins only while the main task is suspended in run()
                t0 = time.thread_time()
                while time.thread_time() - t0 < 0.01:
                    pass
                burned += time.thread_time() - t0
            await asyncio.sleep(0.002)

    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(6, 4), config=cfg) as t:
        task = asyncio.create_task(burner()) if burn else None
        running = True
        await t.run(3)
        running = False
        await asyncio.sleep(0.2)  # time outside run() is not counted
        running = True
        await t.run(2)  # a second run adds to the first
        running = False
        stop.set()
        if task is not None:
            await task
        return t.trace.summary()["event_loop"], burned


@pytest.mark.asyncio
async def test_loop_cpu_is_the_loop_threads_own(tmp_path):
    """The loop's CPU is its thread's own clock over the runs: it holds all the CPU a task on
    the loop spent in them (thread clocks, so the machine's load does not move this; a
    bound on the fraction did, once, under load)."""
    quiet, _ = await _run(tmp_path, "quiet", burn=False)
    busy, burned = await _run(tmp_path, "busy", burn=True)
    for loop in (quiet, busy):
        assert 0 < loop["cpu_s"] <= loop["run_wall_s"] * 1.02
        assert loop["cpu_fraction"] == pytest.approx(loop["cpu_s"] / loop["run_wall_s"])
    assert burned > 0.05  # the burner ran inside the runs
    assert busy["cpu_s"] >= burned  # ... and its CPU is the loop thread's, counted
    assert busy["cpu_fraction"] > quiet["cpu_fraction"]


def test_summary_without_runs_has_no_loop_record():
    from snake.trace import Tracer

    assert "event_loop" not in Tracer().summary()


@pytest.mark.asyncio
async def test_threads_record_each_groups_cpu_and_run_queue_time(tmp_path):
    """Per thread group over run(): the event loop's share agrees with its own clock, the
    compute thread did the work, and a busy thread of the caller's is counted apart."""
    import hashlib
    import threading

    cfg = SnakeConfig(micro_batches=2, offload_dir=str(tmp_path), placement=Placement(param=0.5, ckpt=0.5, opt=0.5),
                      alpha=0.0, device="cpu")
    stop = threading.Event()
    chunk = b"x" * 65536

    def busy() -> None:  # hashes release the GIL: CPU the training must share the cores with
        while not stop.is_set():
            hashlib.sha256(chunk).digest()

    side = threading.Thread(target=busy, name="user-hasher")
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(4, 4), config=cfg) as t:
        await t.run(1)
        side.start()
        try:
            await t.run(3)
        finally:
            stop.set()
            side.join()
        summary = t.trace.summary()
    threads, loop = summary["threads"], summary["event_loop"]
    # (no snake-optimizer: on a CPU device AdamW runs on the compute thread)
    assert {"event loop", "snake-compute", "snake-copy", "snake-io", "other Python threads"} <= set(threads)
    for v in threads.values():
        assert v["cpu_s"] >= 0 and v["runqueue_wait_s"] >= 0
        assert v["cpu_fraction"] == pytest.approx(v["cpu_s"] / loop["run_wall_s"])
    # one thread, two clocks (its CPU-time clock and the scheduler's statistics)
    assert threads["event loop"]["cpu_s"] == pytest.approx(loop["cpu_s"], rel=0.1, abs=0.01)
    assert threads["snake-compute"]["cpu_fraction"] <= 1.02  # one thread: at most one core
    # the compute thread did the work (against the other threads of snake, not the wall
    # time: under a machine's load, 8 runnable threads on 2 cores, it had 8 % of the wall)
    assert threads["snake-compute"]["cpu_s"] > max(threads[k]["cpu_s"] for k in ("snake-copy", "snake-io"))
    # the hashing thread ran inside the runs, counted apart
    assert threads["other Python threads"]["cpu_s"] > 0.05 * loop["run_wall_s"]
