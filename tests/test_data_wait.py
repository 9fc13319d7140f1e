"""A slow data source as a user sees it: the data actor's wait for `next()` is a span on its
track (and has a colour of its own in the timeline), and the steps' seconds are wall time,
the wait for their batch included (`data_wait_s`), so `RunReport.tokens_per_s` is the rate
the run trained at and an input-bound run shows as one."""

from __future__ import annotations

import asyncio
import time

import pytest

from snake import SnakeConfig, SnakeTrainer
from snake.timeline import COLORS, OTHER, _color
from tests.helpers import batches, tiny_gpt

SLEEP_S = 0.2  # per batch: far longer than a step of this model


def _slow(items, *, quick: int = 0):
    """The batches, each after SLEEP_S (a loader that reads or decodes) but the first `quick`."""
    for i, item in enumerate(items):
        if i >= quick:
            time.sleep(SLEEP_S)
        yield item


def _config(tmp_path) -> SnakeConfig:
    return SnakeConfig(micro_batches=2, alpha=0.0, device="cpu", offload_dir=tmp_path)


@pytest.mark.asyncio
async def test_a_slow_source_shows_on_the_data_track(tmp_path):
    """The wait for the next batch set the actor busy (for the stall watchdog) but recorded no
    span: 8 batches of 0.3 s showed the data actor 0.3 % busy."""
    steps = 4
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=_slow(batches(steps, 4)), config=_config(tmp_path)) as t:
        await asyncio.wait_for(t.run(steps), 60)
        spans = [s for s in t.trace.spans if s.actor == "data" and s.name.startswith("next(data)")]
        busy = t.trace.summary()["actors"]["data"]["busy_s"]
    assert [s.name for s in spans] == [f"next(data) {i}" for i in range(steps)]
    # the first batch was read while the trainer set up (its shape sizes the buffers)
    assert all(s.end_s - s.start_s >= 0.8 * SLEEP_S for s in spans[1:])
    assert busy >= 0.8 * SLEEP_S * (steps - 1)
    # the timeline gives it a colour (and a legend entry) of its own, not "other"'s grey
    assert _color(spans[0].name) == COLORS["next(data)"] != OTHER


@pytest.mark.asyncio
async def test_step_seconds_are_wall_time_with_the_wait_for_data(tmp_path):
    """A step's seconds began once its batch had arrived: with slow data the steps summed to
    0.82 s of a 1.55 s run and tokens_per_s read 314 where the run trained at 165."""
    steps = 4
    data = _slow(batches(1 + steps, 4), quick=1)  # the first, set-up run's batch at once
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=data, config=_config(tmp_path)) as t:
        await asyncio.wait_for(t.run(1), 60)  # the engine is built: the next run's wall is its steps'
        t0 = time.perf_counter()
        report = await asyncio.wait_for(t.run(steps), 60)
        wall = time.perf_counter() - t0
    assert wall >= SLEEP_S * steps
    assert 0.8 * wall <= report.seconds <= wall
    tokens = sum(s.tokens for s in report.steps)
    assert tokens / wall <= report.tokens_per_s <= 1.25 * tokens / wall
    # the wait is exposed: the run's first batch came after a full sleep, and no step's
    # wait is longer than the step
    assert report.steps[0].data_wait_s >= 0.8 * SLEEP_S
    assert all(0 <= s.data_wait_s <= s.seconds for s in report.steps)
    assert report.data_wait_s == sum(s.data_wait_s for s in report.steps) >= 0.8 * SLEEP_S



@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_the_data_is_read_at_most_two_batches_ahead(tmp_path, kind):
    """The data actor's batches shared the compute actor's mailbox, whose waits for loads
    stashed every batch that came: the data actor read on without bound, all 40 batches of
    this run (onto the device, on CUDA) before its first step ended. A source of a million
    batches was read whole. Now at most the next two are read while a step runs: one in the
    batches' mailbox, one waiting to go in."""
    steps, taken = 40, [0]

    def counted():
        for item in batches(steps, 8):
            taken[0] += 1
            yield item

    async def counted_async():
        for item in counted():
            yield item

    ahead: list[int] = []
    data = counted() if kind == "sync" else counted_async()
    cfg = SnakeConfig(micro_batches=4, alpha=0.0, device="cpu", offload_dir=tmp_path)
    async with SnakeTrainer(tiny_gpt(n_layer=4), data=data, config=cfg) as t:
        await asyncio.wait_for(t.run(steps, on_step=lambda r: ahead.append(taken[0] - (r.step + 1))), 120)
    assert len(ahead) == steps
    assert max(ahead) <= 2, ahead
