"""The trace summary reports the event loop thread's own CPU over run(): the scheduler every
actor message goes through, so its share says whether it keeps up."""

import asyncio
import time

import pytest

from snake import Placement, SnakeConfig, SnakeTrainer
from tests.helpers import batches, tiny_gpt


async def _run(tmp_path, name: str, burn: bool) -> dict:
    cfg = SnakeConfig(micro_batches=2, offload_dir=str(tmp_path / name), placement=Placement.all_cpu(),
                      alpha=0.0, device="cpu")
    stop = asyncio.Event()

    async def burner() -> None:  # another task on the same loop, using its thread's CPU
        while not stop.is_set():
            t0 = time.thread_time()
            while time.thread_time() - t0 < 0.01:
                pass
            await asyncio.sleep(0.002)

    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(6, 4), config=cfg) as t:
        task = asyncio.create_task(burner()) if burn else None
        await t.run(3)
        await asyncio.sleep(0.2)  # time outside run() is not counted
        await t.run(2)  # a second run adds to the first
        stop.set()
        if task is not None:
            await task
        return t.trace.summary()["event_loop"]


@pytest.mark.asyncio
async def test_loop_cpu_is_the_loop_threads_own(tmp_path):
    quiet = await _run(tmp_path, "quiet", burn=False)
    busy = await _run(tmp_path, "busy", burn=True)
    for loop in (quiet, busy):
        assert 0 < loop["cpu_s"] <= loop["run_wall_s"] * 1.02
        assert loop["cpu_fraction"] == pytest.approx(loop["cpu_s"] / loop["run_wall_s"])
    # the burner asks for 10 of every ~12 ms of the loop's thread
    assert busy["cpu_fraction"] > quiet["cpu_fraction"] + 0.2
    assert busy["cpu_s"] > quiet["cpu_s"]


def test_summary_without_runs_has_no_loop_record():
    from snake.trace import Tracer

    assert "event_loop" not in Tracer().summary()
