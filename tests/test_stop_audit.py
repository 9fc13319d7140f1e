"""An audit of stopping runs early (trainer.stop(), an on_step that raises), data that stops
part-way, run() without steps and run(data=...): as a service embedding snake would use
them. Each test checks the weights against plain PyTorch over exactly the batches trained
(in order), the exception types documented, no hang (every run under a timeout), the
trainer usable afterwards, and no snake-* thread left after close()."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch

from snake import (
    AdamW,
    ConfigError,
    DataError,
    DataExhausted,
    DynamicLossScale,
    Placement,
    SnakeConfig,
    SnakeTrainer,
)
from snake.data import pair_of
from tests.helpers import assert_close_state, batches, optimizer_options, reference, tiny_gpt

MIXED = Placement(param=0.3, ckpt=0.3, opt=0.3, grad=0.0)


def _model(n_layer: int = 2) -> torch.nn.Module:
    return tiny_gpt(n_layer=n_layer, bias=False)


def _cfg(path, **kw) -> SnakeConfig:
    return SnakeConfig(**{"micro_batches": 2, "device": "cpu", "offload_dir": path, "stall_timeout_s": 20.0,
                          "alpha": 0.3, "placement": MIXED, **kw})


def _snake_threads() -> list[threading.Thread]:
    return [th for th in threading.enumerate() if th.name.startswith("snake-") and th.is_alive()]


async def _no_snake_threads(deadline_s: float = 5.0) -> None:
    end = time.monotonic() + deadline_s
    while _snake_threads() and time.monotonic() < end:  # noqa: ASYNC110 - threads signal nothing here
        await asyncio.sleep(0.05)
    assert not _snake_threads(), [th.name for th in _snake_threads()]


def _stop_at(t: SnakeTrainer, step: int):
    def on_step(s):
        if s.step == step:
            assert t.stop()
    return on_step


async def _agen(items, delay: float = 0.0):
    for item in items:
        await asyncio.sleep(delay)
        yield item


# -- stop(): many times, from many threads, at the edges --------------------------------------


@pytest.mark.asyncio
async def test_stop_many_times_before_during_and_after_runs(tmp_path):
    """stop() before any run and after close() does nothing and returns False; called five
    times in a row from on_step it stops the run once; the run after it is not stopped (no
    stop carried over); the weights are PyTorch's over every batch in order; no snake-*
    thread is left after close()."""
    data = batches(6, 4)
    t = SnakeTrainer(_model(), data=iter(data), config=_cfg(tmp_path / "off"))
    try:
        assert not t.stop() and not t.stop()

        def on_step(s):
            if s.step == 0:
                assert all(t.stop() for _ in range(5))

        report = await asyncio.wait_for(t.run(6, on_step=on_step), 60)
        done = len(report.steps)
        assert report.stopped and 1 <= done <= 3
        assert not t.stop()
        rest = await asyncio.wait_for(t.run(6 - done), 60)
        assert not rest.stopped and len(rest.steps) == 6 - done
        got = await t.state_dict()
    finally:
        await t.close()
    assert not t.stop()
    assert_close_state(got, reference(_model(), data, 2)[0])
    await _no_snake_threads()


@pytest.mark.asyncio
async def test_stop_from_many_threads_at_once(tmp_path):
    """Eight threads call stop() at the same moment (a barrier) while the run is in
    progress: each returns True, the run stops once with a report `stopped`, and the next
    run trains the rest: PyTorch's weights over all eight batches, none lost or twice."""
    data = batches(8, 4)
    async with SnakeTrainer(_model(), data=iter(data), config=_cfg(tmp_path / "off")) as t:
        barrier = threading.Barrier(8)
        said: list[bool] = []
        threads: list[threading.Thread] = []

        def stopper():
            barrier.wait(10)
            said.append(t.stop())

        def on_step(s):
            if s.step == 1:
                threads.extend(threading.Thread(target=stopper) for _ in range(8))
                for th in threads:
                    th.start()
                for th in threads:
                    th.join(10)

        report = await asyncio.wait_for(t.run(8, on_step=on_step), 60)
        assert said == [True] * 8
        done = len(report.steps)
        assert report.stopped and 2 <= done <= 4
        got = await t.state_dict()
        assert_close_state(got, reference(_model(), data[:done], 2)[0])
        rest = await asyncio.wait_for(t.run(8 - done), 60)
        assert not rest.stopped
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data, 2)[0])


@pytest.mark.asyncio
async def test_stop_at_the_last_step_is_not_a_stopped_run(tmp_path):
    """stop() from on_step at a run's last step: every step trained, `stopped` is False
    (nothing was cut short), and the next run is not stopped by it."""
    data = batches(5, 4)
    async with SnakeTrainer(_model(), data=iter(data), config=_cfg(tmp_path / "off")) as t:
        report = await asyncio.wait_for(t.run(3, on_step=_stop_at(t, 2)), 60)
        assert len(report.steps) == 3 and not report.stopped
        rest = await asyncio.wait_for(t.run(2), 60)
        assert len(rest.steps) == 2 and not rest.stopped
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data, 2)[0])


@pytest.mark.asyncio
@pytest.mark.parametrize("case", ["alpha0", "alpha0.3", "alpha1", "horizontal", "all-ssd"])
async def test_stop_then_save_and_load_into_a_fresh_trainer(tmp_path, case):
    """stop() part-way through run(6), save(), then a fresh trainer over the same data
    load()s it (skipping the batches consumed: the unread ones are not counted) and trains
    the rest: PyTorch's weights over all six batches, for delay ratios 0, 0.3 and 1, the
    horizontal schedule and everything on SSD."""
    kw = {"alpha0": dict(alpha=0.0), "alpha0.3": dict(alpha=0.3), "alpha1": dict(alpha=1.0),
          "horizontal": dict(schedule="horizontal", alpha=0.3),
          "all-ssd": dict(alpha=0.3, placement=Placement.all_ssd())}[case]
    data = batches(6, 4)
    async with SnakeTrainer(_model(3), data=list(data), config=_cfg(tmp_path / "a", **kw)) as t:
        report = await asyncio.wait_for(t.run(6, on_step=_stop_at(t, 1)), 60)
        done = len(report.steps)
        assert report.stopped and 2 <= done <= 4
        await t.save(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["consumed_batches"] == manifest["step"] == done
    async with SnakeTrainer(_model(3), data=list(data), config=_cfg(tmp_path / "b", **kw)) as t:
        await t.load(tmp_path / "ckpt")
        rest = await asyncio.wait_for(t.run(), 60)
        assert len(rest.steps) == 6 - done
        got = await t.state_dict()
    assert_close_state(got, reference(_model(3), data, 2)[0])
    await _no_snake_threads()


@pytest.mark.asyncio
@pytest.mark.parametrize("option", list(optimizer_options()))
async def test_stop_with_each_optimizer_option(tmp_path, option):
    """A stopped run and its continuation with a steep learning-rate schedule, no_decay
    groups or clipping (alpha 1): PyTorch's weights with the same option over every batch,
    and those over the batches trained right after the stop."""
    adamw, ref_kw, alpha = optimizer_options()[option]
    data = batches(5, 4)  # the steep schedule has six factors; the reference asks for one past the last step
    async with SnakeTrainer(_model(), data=iter(data), config=_cfg(tmp_path / "off", alpha=alpha,
                                                                    optimizer=adamw)) as t:
        report = await asyncio.wait_for(t.run(5, on_step=_stop_at(t, 0)), 60)
        done = len(report.steps)
        assert report.stopped and 1 <= done <= 3
        got = await t.state_dict()
        assert_close_state(got, reference(_model(), data[:done], 2, **ref_kw)[0])
        await asyncio.wait_for(t.run(5 - done), 60)
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data, 2, **ref_kw)[0])


@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_a_stopped_low_precision_run_equals_one_not_stopped(tmp_path, dtype):
    """float16 with a dynamic loss scale (alpha 1) and bfloat16: a run stopped part-way and
    continued ends bit for bit where the same run not stopped does (the loss scale and the
    compute-dtype copies carried across the stop)."""
    kw = dict(dtype=dtype, alpha=1.0 if dtype == "float16" else 0.3)
    if dtype == "float16":
        kw["loss_scale"] = DynamicLossScale(init_scale=2.0**10, growth_interval=2)
    data = batches(6, 4)
    async with SnakeTrainer(_model(), data=iter(data), config=_cfg(tmp_path / "a", **kw)) as t:
        straight = await asyncio.wait_for(t.run(6), 60)
        want = await t.state_dict()
    async with SnakeTrainer(_model(), data=iter(data), config=_cfg(tmp_path / "b", **kw)) as t:
        first = await asyncio.wait_for(t.run(6, on_step=_stop_at(t, 1)), 60)
        assert first.stopped
        second = await asyncio.wait_for(t.run(6 - len(first.steps)), 60)
        got = await t.state_dict()
    assert [s.loss for s in first.steps + second.steps] == [s.loss for s in straight.steps]
    for k in want:
        assert torch.equal(got[k], want[k]), k


# -- on_step that raises ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_on_step_that_raises_at_the_last_step(tmp_path):
    """on_step raises at the run's last step: run() raises it (with the note), every step
    is trained and kept, and the trainer goes on to PyTorch's weights over all batches."""
    data = batches(5, 4)

    def on_step(s):
        if s.step == 2:
            raise KeyError("dashboard down")

    async with SnakeTrainer(_model(), data=iter(data), config=_cfg(tmp_path / "off")) as t:
        with pytest.raises(KeyError, match="dashboard down") as e:
            await asyncio.wait_for(t.run(3, on_step=on_step), 60)
        assert any("on_step raised this" in n for n in e.value.__notes__)
        assert t.engine is not None and t.engine.next_t == 3
        await asyncio.wait_for(t.run(2), 60)
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data, 2)[0])


@pytest.mark.asyncio
async def test_an_on_step_that_calls_stop_and_raises(tmp_path):
    """on_step calls stop() and then raises: run() raises the exception (not a `stopped`
    report), and the trainer holds what was trained and goes on, losing no batch."""
    data = batches(6, 4)
    async with SnakeTrainer(_model(), data=iter(data), config=_cfg(tmp_path / "off")) as t:
        def on_step(s):
            if s.step == 1:
                t.stop()
                raise ValueError("quota exceeded")

        with pytest.raises(ValueError, match="quota exceeded"):
            await asyncio.wait_for(t.run(6, on_step=on_step), 60)
        done = t.engine.next_t
        assert 2 <= done <= 4
        await asyncio.wait_for(t.run(6 - done), 60)
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data, 2)[0])


# -- async data ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_stop_over_an_async_generator_loses_no_batch(tmp_path):
    """An async generator (slow: 20 ms a batch) stopped from on_step: the batches it gave
    and the one its __anext__ was getting come first in the next run; PyTorch's weights over
    all of them."""
    data = batches(6, 4)
    async with SnakeTrainer(_model(), data=_agen(data, 0.02), config=_cfg(tmp_path / "off")) as t:
        report = await asyncio.wait_for(t.run(6, on_step=_stop_at(t, 1)), 60)
        done = len(report.steps)
        assert report.stopped and 2 <= done <= 4
        await asyncio.wait_for(t.run(6 - done), 60)
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data, 2)[0])
    await _no_snake_threads()


@pytest.mark.asyncio
async def test_run_with_an_async_generator_after_a_stop(tmp_path):
    """A stopped run, then run(data=async generator): the old batches read ahead are
    dropped with the old data, the new ones train: PyTorch's weights over the old batches
    trained and then the new ones; a stop in the new data's run works the same."""
    old, new = batches(6, 4), batches(5, 4, seed=7)
    async with SnakeTrainer(_model(), data=iter(old), config=_cfg(tmp_path / "off")) as t:
        report = await asyncio.wait_for(t.run(6, on_step=_stop_at(t, 0)), 60)
        done = len(report.steps)
        second = await asyncio.wait_for(t.run(5, data=_agen(new), on_step=_stop_at(t, done + 1)), 60)
        assert second.stopped
        more = await asyncio.wait_for(t.run(), 60)  # the async generator's rest
        assert len(second.steps) + len(more.steps) == 5
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), old[:done] + new, 2)[0])


# -- run() without steps ---------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("given", ["list", "generator"])
async def test_stop_during_a_run_without_steps(tmp_path, given):
    """run() without steps stopped part-way: `stopped`; run() without steps again trains
    exactly the rest (a list's count includes the batches handed back); PyTorch's weights
    over every batch."""
    data = batches(6, 4)
    source = list(data) if given == "list" else (b for b in data)
    async with SnakeTrainer(_model(), data=source, config=_cfg(tmp_path / "off")) as t:
        report = await asyncio.wait_for(t.run(on_step=_stop_at(t, 1)), 60)
        done = len(report.steps)
        assert report.stopped and 2 <= done <= 4
        rest = await asyncio.wait_for(t.run(), 60)
        assert len(rest.steps) == 6 - done and not rest.stopped
        with pytest.raises(DataExhausted):
            await asyncio.wait_for(t.run(), 60)
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data, 2)[0])


@pytest.mark.asyncio
async def test_run_without_steps_on_an_empty_list_leaves_the_trainer_usable(tmp_path):
    """run() on an empty list: DataExhausted before anything is built; run(data=...) then
    trains; run(data=[]) later is refused and keeps the data in use."""
    data = batches(4, 4)
    async with SnakeTrainer(_model(), data=[], config=_cfg(tmp_path / "off")) as t:
        with pytest.raises(DataExhausted, match="no batch left"):
            await asyncio.wait_for(t.run(), 60)
        assert t.engine is None
        await asyncio.wait_for(t.run(2, data=list(data)), 60)
        with pytest.raises(DataError):
            await asyncio.wait_for(t.run(data=[]), 60)
        rest = await asyncio.wait_for(t.run(), 60)
        assert len(rest.steps) == 2
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data, 2)[0])


# -- run(data=...) ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_run_with_hf_dict_batches_after_a_stop(tmp_path):
    """run(data=...) of Hugging Face-style mappings ({"input_ids": ...}) after a stopped run
    of pairs: trained as the pairs they stand for (pair_of): PyTorch's weights over the old
    batches trained, then the new ones."""
    old = batches(5, 4)
    ids = [torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    new = [{"input_ids": x} for x in ids]
    async with SnakeTrainer(_model(), data=iter(old), config=_cfg(tmp_path / "off")) as t:
        report = await asyncio.wait_for(t.run(5, on_step=_stop_at(t, 0)), 60)
        done = len(report.steps)
        assert report.stopped
        more = await asyncio.wait_for(t.run(data=new), 60)
        assert len(more.steps) == 3
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), old[:done] + [pair_of(b) for b in new], 2)[0])


@pytest.mark.asyncio
async def test_new_data_of_another_shape_keeps_the_batches_a_stop_handed_back(tmp_path):
    """After a stop, run(data=...) of another shape is refused: the old data is kept with
    the batches read for steps that did not run, which the next run trains first."""
    data = batches(6, 4)
    async with SnakeTrainer(_model(), data=iter(data), config=_cfg(tmp_path / "off")) as t:
        report = await asyncio.wait_for(t.run(6, on_step=_stop_at(t, 0)), 60)
        done = len(report.steps)
        with pytest.raises(DataError, match="new data's first batch"):
            await asyncio.wait_for(t.run(1, data=iter(batches(2, 8))), 60)
        await asyncio.wait_for(t.run(6 - done), 60)
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data, 2)[0])


@pytest.mark.asyncio
async def test_run_with_data_then_checkpoint_counts_the_new_data(tmp_path):
    """A stop, run(data=new) stopped again, save(): consumed_batches counts only the new
    data's batches trained; a fresh trainer over the new data load()s it and trains the rest:
    PyTorch's weights over the old batches trained and all the new ones."""
    old, new = batches(5, 4), batches(6, 4, seed=3)
    async with SnakeTrainer(_model(), data=iter(old), config=_cfg(tmp_path / "a")) as t:
        first = await asyncio.wait_for(t.run(5, on_step=_stop_at(t, 0)), 60)
        second = await asyncio.wait_for(t.run(6, data=list(new), on_step=_stop_at(t, len(first.steps) + 1)), 60)
        assert second.stopped
        n_new = len(second.steps)
        await t.save(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["consumed_batches"] == n_new
    assert manifest["step"] == len(first.steps) + n_new
    async with SnakeTrainer(_model(), data=list(new), config=_cfg(tmp_path / "b")) as t:
        await t.load(tmp_path / "ckpt")
        await asyncio.wait_for(t.run(), 60)
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), old[: len(first.steps)] + new, 2)[0])


class _RaisesFirst:
    """An iterator whose first next() raises (a shard server down), then gives `data`."""

    def __init__(self, data) -> None:
        self.data, self.raised = list(data), False

    def __iter__(self):
        return self

    def __next__(self):
        if not self.raised:
            self.raised = True
            raise ConnectionError("shard server down")
        if not self.data:
            raise StopIteration
        return self.data.pop(0)


@pytest.mark.asyncio
async def test_run_with_data_whose_first_next_raises_is_a_data_error(tmp_path):
    """run(data=...) whose first next() raises (ConnectionError) is a DataError with the
    error as its `__cause__`, as every other next() that raises, and the old data is kept.
    Before the fix the user's exception came out of run() as it was."""
    data = batches(3, 4)
    async with SnakeTrainer(_model(), data=iter(data), config=_cfg(tmp_path / "off")) as t:
        await asyncio.wait_for(t.run(1), 60)
        with pytest.raises(DataError) as e:
            await asyncio.wait_for(t.run(1, data=_RaisesFirst(batches(2, 4, seed=9))), 60)
        assert isinstance(e.value.__cause__, ConnectionError)
        await asyncio.wait_for(t.run(2), 60)
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data, 2)[0])


@pytest.mark.asyncio
async def test_first_run_whose_first_next_raises_leaves_the_trainer_usable(tmp_path):
    """The first run's data raises in its first next(): a DataError, nothing built, and a
    retry (the data giving its batches now) trains. Before the fix the ConnectionError came
    out as it was and closed the trainer ("this trainer stopped after ConnectionError ...
    it is closed" for every later call)."""
    data = batches(2, 4)
    async with SnakeTrainer(_model(), data=_RaisesFirst(data), config=_cfg(tmp_path / "off")) as t:
        with pytest.raises(DataError) as e:
            await asyncio.wait_for(t.run(2), 60)
        assert isinstance(e.value.__cause__, ConnectionError)
        await asyncio.wait_for(t.run(2), 60)
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data, 2)[0])


@pytest.mark.asyncio
async def test_a_run_with_data_refused_by_its_schedule_changes_nothing(tmp_path):
    """run(steps, data=new) whose learning-rate schedule fails at one of its steps is a
    ConfigError, and nothing changes: the next run() trains the old data's batches. Before
    the fix the new data had already replaced the old (run() swapped it in before it
    checked the rates)."""
    def schedule(i):
        if i >= 4:
            raise ValueError("past my table")
        return 1.0

    data, other = batches(6, 4), batches(4, 4, seed=11)
    cfg = _cfg(tmp_path / "off", optimizer=AdamW(lr_schedule=schedule))
    async with SnakeTrainer(_model(), data=iter(data), config=cfg) as t:
        await asyncio.wait_for(t.run(1), 60)
        with pytest.raises(ConfigError, match="step index"):
            await asyncio.wait_for(t.run(4, data=iter(other)), 60)
        await asyncio.wait_for(t.run(2), 60)
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data[:3], 2)[0])


@pytest.mark.asyncio
async def test_stop_while_run_with_data_reads_the_new_first_batch(tmp_path):
    """stop() while run(data=slow) waits for the new data's first batch (a DataLoader
    starting its workers) ends that run before its first step: it is in progress. Before
    the fix stop() returned False there and the run trained every step."""
    data, slow_new = batches(2, 4), batches(3, 4, seed=5)

    def slow():
        time.sleep(0.5)
        yield from slow_new

    async with SnakeTrainer(_model(), data=iter(data), config=_cfg(tmp_path / "off")) as t:
        await asyncio.wait_for(t.run(1), 60)
        run = asyncio.ensure_future(t.run(3, data=slow()))
        await asyncio.sleep(0.2)  # the new data's first next() is sleeping
        said = t.stop()
        report = await asyncio.wait_for(run, 60)
        assert said and report.stopped and len(report.steps) == 0, (said, len(report.steps))


@pytest.mark.asyncio
async def test_a_cancelled_run_with_data_does_not_hold_up_the_old_data(tmp_path):
    """run(data=stuck) cancelled (asyncio.timeout) while the new data's first next()
    blocks: the old data is kept, and the next run() starts at once on it. Before the fix
    the stuck next() held the trainer's one data thread, and the next run's reads of the
    old data queued behind it (here until it was released after 5 s)."""
    data = batches(3, 4)
    release = threading.Event()

    def stuck():
        release.wait(5)
        yield from batches(2, 4, seed=4)

    async with SnakeTrainer(_model(), data=iter(data), config=_cfg(tmp_path / "off")) as t:
        await asyncio.wait_for(t.run(1), 60)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await t.run(1, data=stuck())
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(t.run(2), 60)
            took = time.monotonic() - t0
        finally:
            release.set()
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data, 2)[0])
    assert took < 3, f"the next run waited {took:.1f} s for the cancelled new data's next()"


# -- evaluate() between stopped runs -----------------------------------------------------------


@pytest.mark.asyncio
async def test_evaluate_between_stopped_runs_changes_nothing(tmp_path):
    """evaluate() after a stopped run and after a second one: the loss of PyTorch's weights
    over the batches trained so far, and the runs then train on as without it (PyTorch's
    weights over every batch, none lost)."""
    data, held = batches(6, 4), batches(2, 4, seed=13)

    def val_loss(state):
        m = _model()
        m.load_state_dict(state)
        m.eval()
        with torch.no_grad():
            losses = [torch.nn.functional.cross_entropy(m(x).reshape(-1, 96), y.reshape(-1)) for x, y in held]
        return float(sum(losses) / len(losses))

    async with SnakeTrainer(_model(), data=iter(data), config=_cfg(tmp_path / "off")) as t:
        report = await asyncio.wait_for(t.run(6, on_step=_stop_at(t, 0)), 60)
        done = len(report.steps)
        val = await asyncio.wait_for(t.evaluate(held), 60)
        assert val.loss == pytest.approx(val_loss(reference(_model(), data[:done], 2)[0]), rel=1e-4)
        second = await asyncio.wait_for(t.run(6 - done, on_step=_stop_at(t, done)), 60)
        done += len(second.steps)
        await asyncio.wait_for(t.evaluate(held), 60)
        await asyncio.wait_for(t.run(6 - done), 60)
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data, 2)[0])


@pytest.mark.asyncio
async def test_evaluate_after_a_stop_does_not_wait_for_the_blocked_next(tmp_path):
    """A run stopped while the data's next() blocks (a stalled shard server), then
    evaluate(held_out): evaluate does not wait for the training data's next(). Before the
    fix it split its batches on the data thread that next() held (here 5 s)."""
    data, held = batches(4, 4), batches(1, 4, seed=13)
    release = threading.Event()

    def stalls():
        for i, item in enumerate(data):
            if i == 2:
                release.wait(5)
            yield item

    async with SnakeTrainer(_model(), data=stalls(), config=_cfg(tmp_path / "off")) as t:
        def on_step(s):
            if s.step == 1:
                threading.Timer(0.2, t.stop).start()

        report = await asyncio.wait_for(t.run(4, on_step=on_step), 30)
        assert report.stopped and len(report.steps) == 2
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(t.evaluate(held), 30)
            took = time.monotonic() - t0
        finally:
            release.set()
        await asyncio.wait_for(t.run(2), 30)
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data, 2)[0])
    assert took < 3, f"evaluate() waited {took:.1f} s for the training data's blocked next()"


@pytest.mark.asyncio
async def test_a_cancelled_run_with_async_data_keeps_the_old_data(tmp_path):
    """run(data=async generator) cancelled (asyncio.timeout) while its first __anext__
    waits: the old data is kept, with the batches a stop handed back, and trains on at once
    to PyTorch's weights; the new generator's wait is cancelled (its `finally` runs)."""
    data = batches(5, 4)
    never = asyncio.Event()
    ended = []

    async def waits():
        try:
            await never.wait()
            yield data[0]
        finally:
            ended.append(True)

    async with SnakeTrainer(_model(), data=iter(data), config=_cfg(tmp_path / "off")) as t:
        report = await asyncio.wait_for(t.run(5, on_step=_stop_at(t, 0)), 60)
        done = len(report.steps)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await t.run(1, data=waits())
        assert ended == [True]
        await asyncio.wait_for(t.run(5 - done), 10)
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data, 2)[0])


@pytest.mark.asyncio
async def test_stop_during_a_run_without_steps_over_a_dataloader(tmp_path):
    """run() without steps over a DataLoader (drop_last) stopped part-way, then run() again:
    exactly the batches left (the ones handed back counted), PyTorch's weights over the
    epoch; then run(data=loader) trains a second epoch."""
    from torch.utils.data import DataLoader, TensorDataset

    data = batches(5, 4)
    rows = TensorDataset(torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data]))
    async with SnakeTrainer(_model(), data=DataLoader(rows, batch_size=4, drop_last=True),
                            config=_cfg(tmp_path / "off")) as t:
        report = await asyncio.wait_for(t.run(on_step=_stop_at(t, 1)), 60)
        done = len(report.steps)
        assert report.stopped and 2 <= done <= 4
        rest = await asyncio.wait_for(t.run(), 60)
        assert len(rest.steps) == 5 - done
        again = await asyncio.wait_for(t.run(data=DataLoader(rows, batch_size=4, drop_last=True)), 60)
        assert len(again.steps) == 5
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data + data, 2)[0])


@pytest.mark.asyncio
async def test_close_after_a_cancelled_run_with_data_does_not_block(tmp_path):
    """After run(data=stuck) is cancelled while the new data's first next() blocks, close()
    returns at once. Before the fix it joined the data thread, which the dropped new
    source's next() still held, blocking the event loop until that returned (here 5 s)."""
    release = threading.Event()

    def stuck():
        release.wait(5)
        yield from batches(2, 4, seed=4)

    t = SnakeTrainer(_model(), data=iter(batches(2, 4)), config=_cfg(tmp_path / "off"))
    try:
        await asyncio.wait_for(t.run(1), 60)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await t.run(1, data=stuck())
        t0 = time.monotonic()
        await t.close()
        took = time.monotonic() - t0
    finally:
        release.set()
        await t.close()
    assert took < 2, f"close() took {took:.1f} s, joining the cancelled new data's next()"


@pytest.mark.asyncio
@pytest.mark.parametrize("is_async", [False, True])
async def test_evaluate_data_whose_next_raises_is_a_data_error(tmp_path, is_async):
    """evaluate()'s data raising in its next() (after one batch) is a DataError naming the
    batch, with the user's error as its `__cause__`, as run()'s data is; the trainer
    trains on. Before, the user's exception came out as it was."""
    held = batches(1, 4, seed=13)

    def bad():
        yield held[0]
        raise ConnectionError("shard server down\n(its traceback)")

    async def bad_async():
        for item in bad():
            yield item

    data = batches(3, 4)
    async with SnakeTrainer(_model(), data=iter(data), config=_cfg(tmp_path / "off")) as t:
        await asyncio.wait_for(t.run(1), 60)
        with pytest.raises(DataError, match=r"^data: its next\(\) raised ConnectionError: shard server down "
                                            r"\(evaluate's batch 1\)$") as e:
            await asyncio.wait_for(t.evaluate(bad_async() if is_async else bad()), 60)
        assert isinstance(e.value.__cause__, ConnectionError)
        await asyncio.wait_for(t.run(2), 60)
        got = await t.state_dict()
    assert_close_state(got, reference(_model(), data, 2)[0])
