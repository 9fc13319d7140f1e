"""Data that stops part-way through a run (runs out, raises in its next(), gives a bad batch)
ends the run cleanly after the step before: run() raises a DataError (a DataExhausted where
it ran out) whose `report` has the steps trained, and the trainer holds exactly what a run of
that many steps leaves, for every schedule, delay ratio and placement: it matches plain
PyTorch on the batches trained, goes on training, saves and loads. Before, each of these
failed the run (ActorFailed) and closed the trainer, every step of it lost."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch

from snake import AdamW, DataError, DataExhausted, Placement, SnakeConfig, SnakeTrainer
from tests.helpers import assert_close_state, batches, reference, tiny_gpt

MIXED = Placement(param=0.3, ckpt=0.3, opt=0.3, grad=0.0)  # every kind partly on SSD, the waiting gradients too

CASES = {  # (model keywords, config keywords, frozen bottom block, reference keywords)
    "vertical-delayed": ({}, dict(alpha=0.3, placement=MIXED), False, {}),
    "vertical-now": ({}, dict(alpha=0.0, placement=MIXED), False, {}),
    "vertical-all-ssd-m1": ({}, dict(alpha=0.3, placement=Placement.all_ssd(), micro_batches=1), False, {}),
    "horizontal": ({}, dict(schedule="horizontal", alpha=0.3, placement=MIXED), False, {}),
    "horizontal-all-cpu": ({}, dict(schedule="horizontal", alpha=0.0, placement=Placement.all_cpu()), False, {}),
    "one-layer": (dict(n_layer=1), dict(alpha=0.3, placement=MIXED), False, {}),
    "frozen-bottom": ({}, dict(alpha=0.3, placement=MIXED), True, {}),
    "clipped": ({}, dict(alpha=1.0, placement=MIXED, optimizer=AdamW(max_grad_norm=0.3)), False, dict(max_norm=0.3)),
}


def _model(model_kw: dict, frozen: bool) -> torch.nn.Module:
    m = tiny_gpt(**{"n_layer": 3, "bias": False, **model_kw})
    if frozen:
        m.blocks[0].requires_grad_(False)
    return m


def _cfg(path, config_kw: dict) -> SnakeConfig:
    return SnakeConfig(**{"micro_batches": 2, "device": "cpu", "offload_dir": path, "stall_timeout_s": 20.0,
                          **config_kw})


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("left", [0, 2])
async def test_data_that_runs_out_ends_the_run_after_its_last_batch(tmp_path, case, left):
    """One step, then run(6) over `left` batches: DataExhausted after `left` steps, and the
    weights match PyTorch's over the 1 + left batches; saved, loaded into a trainer with more
    data (load(..., skip_data=False)), two more steps match PyTorch's over all of them."""
    model_kw, config_kw, frozen, ref_kw = CASES[case]
    data = batches(1 + left + 2, 4)
    seen = []
    async with SnakeTrainer(_model(model_kw, frozen), data=iter(data[: 1 + left]),
                            config=_cfg(tmp_path / "a", config_kw)) as t:
        await asyncio.wait_for(t.run(1), 60)
        with pytest.raises(DataExhausted, match=rf"ran out after {1 + left} global batches.* run\(6\) stopped "
                                                rf"cleanly after {left} of its steps, before iteration {1 + left}") as e:
            await asyncio.wait_for(t.run(6, on_step=seen.append), 60)
        assert [s.step for s in e.value.report.steps] == [s.step for s in seen] == list(range(1, 1 + left))
        assert t.engine is not None and t.engine.next_t == 1 + left
        await t.save(tmp_path / "ckpt")
        got = await t.state_dict()
    want, _ = reference(_model(model_kw, frozen), data[: 1 + left], 2 if "micro_batches" not in config_kw else 1,
                        **ref_kw)
    assert_close_state(got, want)
    async with SnakeTrainer(_model(model_kw, frozen), data=data[1 + left:], config=_cfg(tmp_path / "b", config_kw)) as t:
        await t.load(tmp_path / "ckpt", skip_data=False)
        await asyncio.wait_for(t.run(2), 60)
        got = await t.state_dict()
    want, _ = reference(_model(model_kw, frozen), data, 2 if "micro_batches" not in config_kw else 1, **ref_kw)
    assert_close_state(got, want)


class _Flaky:
    """An iterator over `data` whose next() raises once, at item `bad` (a network read that
    timed out), and goes on after it with the item it could not give."""

    def __init__(self, data, bad: int) -> None:
        self.data, self.bad, self.i, self.raised = data, bad, 0, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.i == self.bad and not self.raised:
            self.raised = True
            raise ConnectionError("the shard server timed out\n(its traceback)")
        if self.i >= len(self.data):
            raise StopIteration
        self.i += 1
        return self.data[self.i - 1]


class _AsyncOf:
    """An async iterator over a sync one (an async generator that raised would be done)."""

    def __init__(self, it) -> None:
        self.it = it

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        try:
            return next(self.it)
        except StopIteration:
            raise StopAsyncIteration from None


@pytest.mark.asyncio
@pytest.mark.parametrize("is_async", [False, True])
async def test_a_next_that_raises_stops_the_run_and_the_trainer_goes_on(tmp_path, is_async):
    """The data's next() raises at the fourth batch: run(6) raises a DataError naming it
    (its first line; the whole error is the `__cause__`) after three steps, and the next run
    trains on from the batch the data gives then, to PyTorch's weights over the six."""
    data = batches(6, 4)
    flaky = _Flaky(data, bad=3)
    source = _AsyncOf(flaky) if is_async else flaky
    cfg = _cfg(tmp_path / "off", dict(alpha=0.3, placement=MIXED))
    async with SnakeTrainer(_model({}, False), data=source, config=cfg) as t:
        with pytest.raises(DataError, match=r"^data: its next\(\) raised ConnectionError: the shard server timed out "
                                            r"\(global batch 3 of this trainer's\)\. run\(6\) stopped cleanly after 3 "
                                            r"of its steps, before iteration 3") as e:
            await asyncio.wait_for(t.run(6), 60)
        assert not isinstance(e.value, DataExhausted)
        assert isinstance(e.value.__cause__, ConnectionError) and "(its traceback)" in str(e.value.__cause__)
        assert len(e.value.report.steps) == 3
        assert e.value.report.traffic == t.traffic()  # the last step's, as a run's report has
        await asyncio.wait_for(t.run(3), 60)
        got = await t.state_dict()
    want, _ = reference(_model({}, False), data, 2)
    assert_close_state(got, want)


@pytest.mark.asyncio
async def test_a_bad_batch_after_slow_ones_stops_the_run_where_it_is(tmp_path):
    """A source slower than the steps (30 ms a batch) whose fourth batch has the wrong shape:
    the actors wait for each batch before its iteration's work, so the run stops after three
    steps with nothing of the fourth begun (the weights match PyTorch's over three batches),
    and the trainer trains on."""
    data = batches(5, 4)
    bad = (torch.zeros(6, 16, dtype=torch.long), torch.zeros(6, 16, dtype=torch.long))

    def slow():
        for item in [*data[:3], bad, *data[3:]]:
            time.sleep(0.03)
            yield item

    cfg = _cfg(tmp_path / "off", dict(alpha=0.3, placement=Placement.all_ssd()))
    async with SnakeTrainer(_model({}, False), data=slow(), config=cfg) as t:
        with pytest.raises(DataError, match=r"batch inputs have shape \(6, 16\).* after 3 of its steps") as e:
            await asyncio.wait_for(t.run(5), 60)
        assert len(e.value.report.steps) == 3
        got = await t.state_dict()
        want, _ = reference(_model({}, False), data[:3], 2)
        assert_close_state(got, want)
        await asyncio.wait_for(t.run(2), 60)
        got = await t.state_dict()
    want, _ = reference(_model({}, False), data, 2)
    assert_close_state(got, want)


# -- stop(): a run asked to end early, and an on_step that raises --------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("case", ["vertical-delayed", "horizontal", "one-layer", "vertical-all-ssd-m1"])
async def test_stop_ends_the_run_after_the_steps_begun_and_loses_no_batch(tmp_path, case):
    """stop() from on_step after the second step: run(8) returns early, its report saying
    `stopped`, after the steps already begun (two or three here: a step's reads begin while
    the one before ends). The weights match PyTorch's over the steps trained; the batches
    read for steps that did not run come first in the next run, which ends at PyTorch's
    weights over all eight batches: none lost, none trained twice."""
    model_kw, config_kw, frozen, ref_kw = CASES[case]
    micro = 2 if "micro_batches" not in config_kw else 1
    data = batches(8, 4)
    async with SnakeTrainer(_model(model_kw, frozen), data=iter(data), config=_cfg(tmp_path / "a", config_kw)) as t:
        def on_step(s):
            if s.step == 1:
                assert t.stop()

        report = await asyncio.wait_for(t.run(8, on_step=on_step), 60)
        done = len(report.steps)
        assert report.stopped and 2 <= done <= 4, done
        assert t.engine is not None and t.engine.next_t == done
        got = await t.state_dict()
        want, _ = reference(_model(model_kw, frozen), data[:done], micro, **ref_kw)
        assert_close_state(got, want)
        rest = await asyncio.wait_for(t.run(8 - done), 60)
        assert not rest.stopped and len(rest.steps) == 8 - done
        got = await t.state_dict()
    want, _ = reference(_model(model_kw, frozen), data, micro, **ref_kw)
    assert_close_state(got, want)


@pytest.mark.asyncio
async def test_stop_from_another_thread_does_not_wait_for_a_blocked_next(tmp_path):
    """A source whose fourth next() blocks (a stalled shard server), stop() from another
    thread: the run ends after its three steps at once, not waiting for that next(), which
    finishes on its own thread and gives the next run its batch; all five batches train
    once. stop() without a run in progress does nothing and says so."""
    import threading

    data = batches(5, 4)
    release = threading.Event()

    def stalls():
        for i, item in enumerate(data):
            if i == 3:
                assert release.wait(30)
            yield item

    cfg = _cfg(tmp_path / "off", dict(alpha=0.3, placement=MIXED))
    async with SnakeTrainer(_model({}, False), data=stalls(), config=cfg) as t:
        assert not t.stop()
        loop_thread = threading.get_ident()
        stopper = []

        def on_step(s):
            if s.step == 2:  # the last step with a batch: stop() once the fourth next() blocks
                def later():
                    time.sleep(0.2)
                    stopper.append((threading.get_ident() != loop_thread, t.stop()))
                threading.Thread(target=later).start()

        t0 = time.monotonic()
        report = await asyncio.wait_for(t.run(5, on_step=on_step), 30)
        assert time.monotonic() - t0 < 20
        assert stopper == [(True, True)]
        assert report.stopped and len(report.steps) == 3
        release.set()
        rest = await asyncio.wait_for(t.run(2), 30)
        assert len(rest.steps) == 2
        got = await t.state_dict()
        assert not t.stop()
    want, _ = reference(_model({}, False), data, 2)
    assert_close_state(got, want)


@pytest.mark.asyncio
async def test_stop_while_the_first_run_sets_up_trains_no_step(tmp_path):
    """stop() as the first run builds its engine: the run returns no step, `stopped`, and
    the trainer trains on from the first batch."""
    data = batches(3, 4)
    async with SnakeTrainer(_model({}, False), data=iter(data), config=_cfg(tmp_path / "off", {})) as t:
        run = asyncio.ensure_future(t.run(3))
        while t._control is None:  # noqa: ASYNC110 - run() sets it as it starts: nothing to wait on
            await asyncio.sleep(0)
        assert t.engine is None and t.stop()
        report = await asyncio.wait_for(run, 60)
        assert report.stopped and report.steps == [] and report.traffic == {}
        await asyncio.wait_for(t.run(3), 60)
        got = await t.state_dict()
    want, _ = reference(_model({}, False), data, 2)
    assert_close_state(got, want)


@pytest.mark.asyncio
async def test_an_on_step_that_raises_stops_the_run_cleanly(tmp_path):
    """on_step raises at the second step: run() raises that exception, with a note, once the
    steps begun have finished; the trainer holds them (PyTorch's weights over those steps)
    and trains on over the rest of the batches. Before, the run failed (ActorFailed) and
    closed the trainer."""
    data = batches(6, 4)
    seen = []

    def on_step(s):
        seen.append(s.step)
        if s.step == 1:
            raise KeyError("my dashboard is down")

    cfg = _cfg(tmp_path / "off", dict(alpha=0.3, placement=MIXED))
    async with SnakeTrainer(_model({}, False), data=iter(data), config=cfg) as t:
        with pytest.raises(KeyError, match="my dashboard is down") as e:
            await asyncio.wait_for(t.run(6, on_step=on_step), 60)
        assert any("on_step raised this" in n and "stopped cleanly" in n for n in e.value.__notes__)
        done = t.engine.next_t
        assert 2 <= done <= 4 and seen == list(range(done))
        got = await t.state_dict()
        assert_close_state(got, reference(_model({}, False), data[:done], 2)[0])
        await asyncio.wait_for(t.run(6 - done), 60)
        got = await t.state_dict()
    assert_close_state(got, reference(_model({}, False), data, 2)[0])


# -- run() without steps: as many as the data has left -------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("given", ["list", "generator", "loader"])
async def test_run_without_steps_trains_until_the_data_ends(tmp_path, given):
    """run() trains as many steps as the data has left: a list's or a DataLoader's length,
    or a generator's until it runs out (which ends that run as a run's end, not an error),
    to PyTorch's weights over every batch; the next run() has none left and says so."""
    from torch.utils.data import DataLoader, TensorDataset

    data = batches(5, 4)
    if given == "list":
        source = data
    elif given == "generator":
        source = (b for b in data)
    else:  # rows of the same batches, in order
        x = torch.cat([b[0] for b in data])
        y = torch.cat([b[1] for b in data])
        source = DataLoader(TensorDataset(x, y), batch_size=4)
    cfg = _cfg(tmp_path / "off", dict(alpha=0.3, placement=MIXED))
    async with SnakeTrainer(_model({}, False), data=source, config=cfg) as t:
        report = await asyncio.wait_for(t.run(), 60)
        assert len(report.steps) == 5 and not report.stopped
        assert report.traffic == t.traffic() != {}
        with pytest.raises(DataExhausted, match="no batch left|ran out after 5 global batches"):
            await asyncio.wait_for(t.run(), 60)
        got = await t.state_dict()
    assert_close_state(got, reference(_model({}, False), data, 2)[0])


@pytest.mark.asyncio
async def test_run_without_steps_refuses_a_short_last_batch_up_front(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    (x, y), = batches(1, 10)
    async with SnakeTrainer(_model({}, False), data=DataLoader(TensorDataset(x, y), batch_size=4),
                            config=_cfg(tmp_path / "off", {})) as t:
        with pytest.raises(DataError, match="drop_last=True"):
            await t.run()
        assert t.engine is None  # nothing trained, nothing built
    with pytest.raises(Exception, match=r"steps.*None: as many as the data has left"):
        async with SnakeTrainer(_model({}, False), data=[(x, y)], config=_cfg(tmp_path / "off2", {})) as t:
            await t.run(0)


@pytest.mark.asyncio
async def test_run_without_steps_checks_each_rate_as_its_batch_comes(tmp_path):
    """Over a generator, whose length is not known first, a schedule that raises at step
    index 3 stops the run cleanly after three steps with its ConfigError; the trainer holds
    them (PyTorch's weights over three batches with the same schedule) and is usable."""
    from snake import ConfigError

    def schedule(i):
        if i == 3:
            raise ValueError("past the end of my table")
        return 1.0 - 0.1 * i

    data = batches(5, 4)
    cfg = _cfg(tmp_path / "off", dict(alpha=0.0, placement=MIXED, optimizer=AdamW(lr_schedule=schedule)))
    async with SnakeTrainer(_model({}, False), data=(b for b in data), config=cfg) as t:
        with pytest.raises(ConfigError, match="at step index 3") as e:
            await asyncio.wait_for(t.run(), 60)
        assert any("stopped cleanly after 3 steps" in n for n in e.value.__notes__)
        assert t.engine is not None and t.engine.next_t == 3
        got = await t.state_dict()
    # (the reference's LambdaLR asks for the rate after each step: index 3 too, as it is)
    assert_close_state(got, reference(_model({}, False), data[:3], 2, lr_lambda=lambda i: 1.0 - 0.1 * i)[0])


# -- run(data=...): other data from this run on --------------------------------------------


def _loader(data, **kw):
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])), batch_size=4,
                      **kw)


@pytest.mark.asyncio
async def test_run_with_data_trains_epochs_and_goes_on_after_data_runs_out(tmp_path):
    """Two epochs of a 3-batch DataLoader, `run(data=loader)` each, then a generator that
    runs out part-way and `run(data=more)` after it: PyTorch's weights over every batch in
    that order, the checkpoint counting the batches of the data in use."""
    import json

    data = batches(3 + 2 + 2, 4)
    epoch, short, more = data[:3], data[3:5], data[5:]
    cfg = _cfg(tmp_path / "off", dict(alpha=0.3, placement=MIXED))
    async with SnakeTrainer(_model({}, False), data=[], config=cfg) as t:
        for _ in range(2):
            report = await asyncio.wait_for(t.run(data=_loader(epoch)), 60)
            assert len(report.steps) == 3
        with pytest.raises(DataExhausted, match=r"run\(data=\.\.\.\) with more data goes on"):
            await asyncio.wait_for(t.run(4, data=iter(short)), 60)
        await asyncio.wait_for(t.run(1, data=iter(more)), 60)
        await t.save(tmp_path / "ckpt")
        got = await t.state_dict()
    assert json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["consumed_batches"] == 1
    assert_close_state(got, reference(_model({}, False), epoch + epoch + short + more[:1], 2)[0])


@pytest.mark.asyncio
async def test_run_with_data_of_another_shape_keeps_the_old_data(tmp_path):
    """New data whose first batch has another shape is refused before anything changes: the
    trainer trains on with its own data, to PyTorch's weights."""
    data = batches(3, 4)
    cfg = _cfg(tmp_path / "off", {})
    async with SnakeTrainer(_model({}, False), data=iter(data), config=cfg) as t:
        await asyncio.wait_for(t.run(1), 60)
        with pytest.raises(DataError, match=r"new data's first batch has inputs of shape \(8, 16\) but this "
                                            r"trainer's have \(4, 16\)"):
            await t.run(1, data=iter(batches(2, 8)))
        with pytest.raises(DataError, match="expected an iterable"):
            await t.run(1, data=42)
        await asyncio.wait_for(t.run(2), 60)
        got = await t.state_dict()
    assert_close_state(got, reference(_model({}, False), data, 2)[0])


@pytest.mark.asyncio
async def test_run_with_data_after_a_stop_drops_the_old_and_its_workers(tmp_path):
    """A run stopped while its DataLoader (two worker processes) blocks in next() (its
    dataset is slow), then run(data=other): the old loader's workers end, the batches it had
    read but not trained on go with it, and the new data trains on a thread of its own,
    to PyTorch's weights over the batches trained."""
    import psutil

    class Slow(torch.utils.data.Dataset):
        def __init__(self, rows, delay_s):
            self.rows, self.delay_s = rows, delay_s

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            if i >= 8:
                time.sleep(self.delay_s)
            return self.rows[i]

    data = batches(6, 4)
    rows = [(x[i], y[i]) for x, y in data[:4] for i in range(4)]
    before = {p.pid for p in psutil.Process().children()}
    loader = torch.utils.data.DataLoader(Slow(rows, 0.5), batch_size=4, num_workers=2)
    cfg = _cfg(tmp_path / "off", dict(alpha=0.3, placement=MIXED))
    async with SnakeTrainer(_model({}, False), data=loader, config=cfg) as t:
        workers = {p.pid for p in psutil.Process().children()} - before
        assert len(workers) == 2

        def on_step(s):
            if s.step == 1:
                t.stop()

        report = await asyncio.wait_for(t.run(4, on_step=on_step), 60)
        done = len(report.steps)
        assert report.stopped and done == 2
        assert t.source.fetching()  # the old loader's next() runs on (its batch takes ~2 s)
        old_thread = t._data_ex
        await asyncio.wait_for(t.run(2, data=iter(data[4:])), 60)
        assert t._data_ex is not old_thread  # the new data got a thread of its own
        got = await t.state_dict()

        def alive() -> set[int]:
            out = set()
            for child in psutil.Process().children():
                with contextlib.suppress(psutil.NoSuchProcess):
                    if child.status() != psutil.STATUS_ZOMBIE:
                        out.add(child.pid)
            return out

        # they end once the old loader's next() in progress returns (its thread holds the
        # iterator until then: a batch of 4 slow rows, about 2 s)
        deadline = time.monotonic() + 30
        while workers & alive() and time.monotonic() < deadline:  # noqa: ASYNC110 - processes signal nothing here
            await asyncio.sleep(0.1)
        assert not workers & alive()
    assert_close_state(got, reference(_model({}, False), data[:2] + data[4:], 2)[0])


@pytest.mark.asyncio
async def test_errors_of_a_run_without_steps_name_it_as_called(tmp_path):
    """A run() without steps that the data or on_step stops names itself "run()", not by the
    count it stood for (2**62 for an iterator of unknown length)."""
    data = batches(3, 4)
    bad = (torch.zeros(6, 16, dtype=torch.long), torch.zeros(6, 16, dtype=torch.long))
    async with SnakeTrainer(_model({}, False), data=iter([data[0], bad]), config=_cfg(tmp_path / "a", {})) as t:
        with pytest.raises(DataError, match=r"\. run\(\) stopped cleanly after 1 of its steps"):
            await asyncio.wait_for(t.run(), 60)

    def on_step(s):
        raise RuntimeError("dashboard down")

    async with SnakeTrainer(_model({}, False), data=iter(data), config=_cfg(tmp_path / "b", {})) as t:
        with pytest.raises(RuntimeError) as e:
            await asyncio.wait_for(t.run(on_step=on_step), 60)
        assert any(n.startswith("snake: on_step raised this; run() stopped cleanly") for n in e.value.__notes__)


@pytest.mark.asyncio
async def test_a_run_without_steps_where_an_actor_has_nothing_to_do(tmp_path):
    """run() over a generator (its length unknown: up to 2**62 iterations) with nothing on
    SSD (the storage reader has no read in any iteration) and an optimizer worker with no
    layer (one layer, two workers): each such actor waits for every iteration to begin.
    Before, their plans ran through every iteration at once on the event loop: a hang."""
    data = batches(3, 4)
    cfg = _cfg(tmp_path / "off", dict(alpha=0.3, placement=Placement.all_cpu(), optimizer_workers=2))
    async with SnakeTrainer(_model(dict(n_layer=1), False), data=(b for b in data), config=cfg) as t:
        report = await asyncio.wait_for(t.run(), 60)
        assert len(report.steps) == 3
        got = await t.state_dict()
    assert_close_state(got, reference(_model(dict(n_layer=1), False), data, 2)[0])
