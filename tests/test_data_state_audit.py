"""Audit of stateful data resume (commit 4708716): a data source with `state_dict()` and
`load_state_dict()` has its state taken after each batch, a checkpoint stores the one after
the last batch trained on, and `load()` hands it to the new data instead of reading the
batches trained before. These probe the edges a demanding user hits: new data given to
run(), stop() at several steps, iterators that are their own iterator, live state dicts,
saves at step 0, persistent DataLoader workers across epochs, stateless data given to a
stateful checkpoint, a cancelled load whose load_state_dict blocks, evaluate() beside
training data, a finite Epochs resumed in its last epoch, and tampered checkpoints.

Every parity check compares the fp32 masters (`trainer.state_dict()`, torch.equal) against
one uninterrupted run of the same data."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time

import pytest
import torch

from snake import DataError, DataExhausted, Epochs, Placement, SnakeError, SnakeTrainer
from snake.data_state import restore, take
from tests.helpers import batches, tiny_gpt
from tests.test_data_state import (
    AsyncCounter,
    Counter,
    Rows,
    _cfg,
    _manifest,
    _quiet_loader,
    _same,
    _state,
)

MIXED = Placement(param=0.5, ckpt=0.3, opt=0.6)
T = 60  # seconds: every awaited trainer call is bounded by this


# -- helpers (as tests/test_data_state.py's) --------------------------------------------------


def _shuffled(workers: int = 0, persistent: bool = False, n: int = 20):
    """A shuffled StatefulDataLoader over `n` rows, 4 a batch (n // 4 batches an epoch)."""
    return _quiet_loader(Rows(n), batch_size=4, drop_last=True, shuffle=True, num_workers=workers,
                         persistent_workers=persistent, generator=torch.Generator().manual_seed(3))


async def _straight(tmp, model, data, steps: int) -> dict:
    async with SnakeTrainer(model, data=data, config=_cfg(tmp)) as t:
        await asyncio.wait_for(t.run(steps), T)
        return await _state(t)


def _stopper(t: SnakeTrainer, after: int):
    """on_step that stops the run at its `after`-th step (0: the first)."""
    seen = [0]

    def on_step(_s) -> None:
        if seen[0] == after:
            t.stop()
        seen[0] += 1

    return on_step


# -- 1. run(data=new stateful data) after other data ---------------------------------------------


@pytest.mark.asyncio
async def test_1_new_stateful_data_given_to_run_resumes_in_the_new_data(tmp_path):
    """3 steps on a list, then 2 on a new Counter given to run(data=...): the checkpoint
    counts the new data's batches and holds its state; a trainer built on a fresh copy of
    the new data loads it and 6 more steps give the weights of one trainer that did 3 + 8."""
    a, b = batches(3, 4, seed=1), batches(8, 4, seed=2)
    model = tiny_gpt(n_layer=2)
    async with SnakeTrainer(model, data=list(a), config=_cfg(tmp_path / "s")) as t:
        await asyncio.wait_for(t.run(3), T)
        await asyncio.wait_for(t.run(8, data=Counter(b)), T)
        straight = await _state(t)
    async with SnakeTrainer(model, data=list(a), config=_cfg(tmp_path / "a")) as t:
        await asyncio.wait_for(t.run(3), T)
        await asyncio.wait_for(t.run(2, data=Counter(b)), T)
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
    m = _manifest(tmp_path / "ck")
    assert m["step"] == 5 and m["consumed_batches"] == 2
    assert m["data_state"] == {"dict": [["i", 2]]}
    fresh = Counter(b)
    async with SnakeTrainer(model, data=fresh, config=_cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        assert fresh.loads == [{"i": 2}]
        await asyncio.wait_for(t.run(6), T)
        assert _same(await _state(t), straight)


# -- 2. stop() at several steps, sync and async --------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("stop_after", [0, 1, 3])
async def test_2_stopped_at_any_step_saved_loaded_and_finished_is_one_run(tmp_path, is_async, stop_after):
    await _stop_save_resume(tmp_path, AsyncCounter if is_async else Counter, 10, stop_after)


async def _stop_save_resume(tmp_path, kind, steps: int, stop_after: int) -> None:
    """`steps` batches in a `kind` source, stopped after step `stop_after`, saved, loaded
    into a trainer on a fresh `kind` and finished: the checkpoint holds the position of the
    steps trained, and the end is the weights of one straight run."""
    data = batches(steps, 4)
    model = tiny_gpt(n_layer=2)
    straight = await _straight(tmp_path / "s", model, list(data), steps)
    async with SnakeTrainer(model, data=kind(data), config=_cfg(tmp_path / "a")) as t:
        report = await asyncio.wait_for(t.run(steps, on_step=_stopper(t, stop_after)), T)
        done = len(report.steps)
        assert report.stopped and 1 <= done < steps, (done, report.stopped)
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
    assert _manifest(tmp_path / "ck")["data_state"] == {"dict": [["i", done]]}
    again = kind(data)
    async with SnakeTrainer(model, data=again, config=_cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        assert again.loads == [{"i": done}]
        await asyncio.wait_for(t.run(steps - done), T)
        assert _same(await _state(t), straight)


# -- 3. an iterator that is its own iterator ------------------------------------------------------


class SelfIter:
    """`__iter__` returns self; `__next__` gives data[i]."""

    def __init__(self, data) -> None:
        self.data, self.i, self.iters, self.loads = data, 0, 0, []

    def __iter__(self):
        self.iters += 1
        return self

    def __next__(self):
        if self.i >= len(self.data):
            raise StopIteration
        self.i += 1
        return self.data[self.i - 1]

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state) -> None:
        self.loads.append(state)
        self.i = state["i"]


class AsyncSelfIter(SelfIter):
    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        try:
            return SelfIter.__next__(self)
        except StopIteration:
            raise StopAsyncIteration from None

    __iter__ = None  # type: ignore[assignment]
    __next__ = None  # type: ignore[assignment]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", [SelfIter, AsyncSelfIter])
async def test_3_an_iterator_that_is_its_own_iterator_resumes(tmp_path, kind):
    await _stop_save_resume(tmp_path, kind, 9, 2)


# -- 4. a state_dict() that returns its live, mutating dict ------------------------------------------


class LiveState:
    """state_dict() returns the one dict it keeps mutating (its count, and a tensor it
    changes in place)."""

    def __init__(self, data) -> None:
        self.data = data
        self.state = {"i": 0, "seen": torch.zeros(1, dtype=torch.int64), "log": []}

    def __iter__(self):
        while self.state["i"] < len(self.data):
            self.state["i"] += 1
            self.state["seen"] += 1
            self.state["log"].append(self.state["i"])
            yield self.data[self.state["i"] - 1]

    def state_dict(self):
        return self.state

    def load_state_dict(self, state) -> None:
        self.state = {"i": state["i"], "seen": state["seen"].clone(), "log": list(state["log"])}


@pytest.mark.asyncio
async def test_4_a_live_state_dict_is_copied_at_each_batch(tmp_path):
    data = batches(9, 4)
    model = tiny_gpt(n_layer=2)
    straight = await _straight(tmp_path / "s", model, list(data), 9)
    src = LiveState(data)
    async with SnakeTrainer(model, data=src, config=_cfg(tmp_path / "a")) as t:
        report = await asyncio.wait_for(t.run(9, on_step=_stopper(t, 1)), T)
        done = len(report.steps)
        assert src.state["i"] > done  # batches were read ahead: the live dict is past the save's point
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
    m = _manifest(tmp_path / "ck")
    tree = dict((k, v) for k, v in m["data_state"]["dict"])
    assert tree["i"] == done and tree["log"] == {"list": list(range(1, done + 1))}
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "ck" / "data.safetensors"))
    assert torch.equal(tensors[tree["seen"]["tensor"]], torch.tensor([done]))
    async with SnakeTrainer(model, data=LiveState(data), config=_cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        await asyncio.wait_for(t.run(9 - done), T)
        assert _same(await _state(t), straight)


# -- 5. saves at step 0 ---------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["never_ran", "empty_data", "stopped_at_once"])
async def test_5_a_save_at_step_0_with_stateful_data_loads(tmp_path, how):
    """A checkpoint of a trainer that trained nothing (no run; a run on empty data; a run
    stopped before its first step where the timing allows) loads into a trainer on stateful
    data, which then trains as one that never saved."""
    data = batches(6, 4)
    model = tiny_gpt(n_layer=2)
    straight = await _straight(tmp_path / "s", model, list(data), 6)
    async with SnakeTrainer(model, data=Counter([] if how == "empty_data" else data), config=_cfg(tmp_path / "a")) as t:
        done = 0
        if how == "empty_data":
            with pytest.raises(DataExhausted):
                await asyncio.wait_for(t.run(3), T)
        elif how == "stopped_at_once":
            task = asyncio.ensure_future(t.run(6))
            while not t.stop():  # noqa: ASYNC110 - stop() says when a run is there to stop
                await asyncio.sleep(0)
            done = len((await asyncio.wait_for(task, T)).steps)
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
    m = _manifest(tmp_path / "ck")
    assert m["consumed_batches"] == done
    if done == 0:
        # no batch handed out: no state, or the state at the start
        assert m.get("data_state") in (None, {"dict": [["i", 0]]})
    fresh = Counter(data)
    async with SnakeTrainer(model, data=fresh, config=_cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        await asyncio.wait_for(t.run(6 - done), T)
        assert _same(await _state(t), straight)


@pytest.mark.asyncio
async def test_5b_a_save_before_any_batch_does_not_warn_of_a_failed_state_dict(tmp_path, caplog):
    """No state is kept before the first batch, by design: a save then warns of nothing (it warned
    "its state_dict() failed there")."""
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=Counter(batches(4, 4)), config=_cfg(tmp_path / "a")) as t:
        with caplog.at_level(logging.WARNING):
            await asyncio.wait_for(t.save(tmp_path / "ck"), T)
    false_alarms = [r.getMessage() for r in caplog.records if "state_dict() failed" in r.getMessage()]
    assert not false_alarms, false_alarms


# -- 6. persistent DataLoader workers across an epoch boundary ----------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("persistent", [True, False])
async def test_6_persistent_workers_across_an_epoch_boundary_resume(tmp_path, persistent):
    """Epochs over a shuffled StatefulDataLoader (2 worker processes, 5 batches an epoch):
    7 steps stopped by stop() after its 7th (past the first epoch's end), save, load into a
    new loader, finish: the weights of 12 steps in one go."""
    model = tiny_gpt(n_layer=2)
    straight = await _straight(tmp_path / "s", model, Epochs(_shuffled(2, persistent)), 12)
    async with SnakeTrainer(model, data=Epochs(_shuffled(2, persistent)), config=_cfg(tmp_path / "a")) as t:
        report = await asyncio.wait_for(t.run(12, on_step=_stopper(t, 6)), T)
        done = len(report.steps)
        assert 5 < done < 12, done
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
    data = Epochs(_shuffled(2, persistent))
    async with SnakeTrainer(model, data=data, config=_cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        assert data.epoch == 1
        await asyncio.wait_for(t.run(12 - done), T)
        assert _same(await _state(t), straight)


@pytest.mark.asyncio
async def test_6b_a_bare_stateful_loader_with_workers_resumes_mid_epoch(tmp_path):
    """A StatefulDataLoader itself (no Epochs), 2 workers: 3 steps, save, load, 2 more."""
    model = tiny_gpt(n_layer=2)
    straight = await _straight(tmp_path / "s", model, _shuffled(2), 5)
    async with SnakeTrainer(model, data=_shuffled(2), config=_cfg(tmp_path / "a")) as t:
        await asyncio.wait_for(t.run(3), T)
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
    async with SnakeTrainer(model, data=_shuffled(2), config=_cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        await asyncio.wait_for(t.run(2), T)
        assert _same(await _state(t), straight)


# -- 7. a stateful checkpoint loaded with stateless data -----------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("plain", ["list", "iterator"])
async def test_7_stateless_data_reads_and_drops_the_batches(tmp_path, plain):
    data = batches(8, 4)
    model = tiny_gpt(n_layer=2)
    straight = await _straight(tmp_path / "s", model, list(data), 8)
    async with SnakeTrainer(model, data=Counter(data), config=_cfg(tmp_path / "a")) as t:
        await asyncio.wait_for(t.run(3), T)
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
    assert "data_state" in _manifest(tmp_path / "ck")
    given = list(data) if plain == "list" else iter(list(data))
    async with SnakeTrainer(model, data=given, config=_cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck", skip_data=True), T)
        await asyncio.wait_for(t.run(5), T)
        assert _same(await _state(t), straight)


# -- 8. a cancelled load while load_state_dict blocks -----------------------------------------------


class BlockingLoad(Counter):
    """load_state_dict() blocks until released (a loader that fetches its state remotely),
    at most `block_s`."""

    def __init__(self, data, block_s: float) -> None:
        super().__init__(data)
        self.block_s = block_s
        self.entered = threading.Event()
        self.release = threading.Event()

    def load_state_dict(self, state) -> None:
        self.entered.set()
        self.release.wait(self.block_s)
        super().load_state_dict(state)


async def _checkpoint_after_two_steps(tmp_path):
    """(data, model) and tmp_path/ck: a checkpoint of 2 steps of Counter(data)."""
    data = batches(6, 4)
    model = tiny_gpt(n_layer=2)
    async with SnakeTrainer(model, data=Counter(data), config=_cfg(tmp_path / "a")) as t:
        await asyncio.wait_for(t.run(2), T)
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
    return data, model


async def _no_snake_threads_left() -> None:
    deadline = time.monotonic() + 10
    while any(th.name.startswith("snake-") for th in threading.enumerate()) and time.monotonic() < deadline:  # noqa: ASYNC110 - threads signal nothing here
        await asyncio.sleep(0.01)
    assert not [th.name for th in threading.enumerate() if th.name.startswith("snake-")]


@pytest.mark.asyncio
async def test_8_a_cancelled_load_does_not_wait_for_a_blocked_load_state_dict(tmp_path):
    """A cancelled load() does not wait for the data's load_state_dict on the event loop (its
    thread was joined there: the whole loop stopped until load_state_dict returned)."""
    data, model = await _checkpoint_after_two_steps(tmp_path)
    src = BlockingLoad(data, block_s=4.0)
    t = SnakeTrainer(model, data=src, config=_cfg(tmp_path / "b"))
    try:
        task = asyncio.ensure_future(t.load(tmp_path / "ck"))
        deadline = time.monotonic() + T
        while not src.entered.is_set() and time.monotonic() < deadline:  # noqa: ASYNC110 - a thread's event
            await asyncio.sleep(0.01)
        assert src.entered.is_set()
        ticks = [0]

        async def heartbeat():
            while True:
                await asyncio.sleep(0.05)
                ticks[0] += 1

        beat = asyncio.ensure_future(heartbeat())
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, T)
        took = time.monotonic() - t0
        await asyncio.sleep(0.3)
        beat.cancel()
        assert took < 1.5, f"the cancelled load() took {took:.2f} s: it waited for load_state_dict on the loop"
        assert ticks[0] >= 3  # the loop ran while load_state_dict blocked
        with pytest.raises(SnakeError):  # the trainer is closed, as after any failed load
            await asyncio.wait_for(t.run(1), T)
    finally:
        src.release.set()
        await asyncio.wait_for(t.close(), T)
    await _no_snake_threads_left()


@pytest.mark.asyncio
async def test_8b_a_cancelled_load_after_load_state_dict_returns_closes_cleanly(tmp_path):
    """The same, with load_state_dict released right after the cancellation: closed, no
    thread left."""
    data, model = await _checkpoint_after_two_steps(tmp_path)
    src = BlockingLoad(data, block_s=0.5)
    t = SnakeTrainer(model, data=src, config=_cfg(tmp_path / "b"))
    task = asyncio.ensure_future(t.load(tmp_path / "ck"))
    while not src.entered.is_set():  # noqa: ASYNC110 - a thread's event
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, T)
    await asyncio.wait_for(t.close(), T)
    await _no_snake_threads_left()


# -- 9. evaluate() beside stateful training data ------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("eval_kind", ["counter", "loader"])
async def test_9_evaluate_leaves_the_training_datas_state_alone(tmp_path, eval_kind):
    data = batches(6, 4)
    model = tiny_gpt(n_layer=2)
    straight = await _straight(tmp_path / "s", model, list(data), 6)

    def eval_data():
        return Counter(batches(3, 4, seed=9)) if eval_kind == "counter" else _shuffled(0)

    train = Counter(data)
    async with SnakeTrainer(model, data=train, config=_cfg(tmp_path / "a")) as t:
        await asyncio.wait_for(t.evaluate(eval_data(), max_batches=2), T)  # before the first run too
        await asyncio.wait_for(t.run(3), T)
        report = await asyncio.wait_for(t.evaluate(eval_data(), max_batches=2), T)
        assert report.batches == 2
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
        await asyncio.wait_for(t.run(3), T)
        assert _same(await _state(t), straight)
    assert _manifest(tmp_path / "ck")["data_state"] == {"dict": [["i", 3]]}
    async with SnakeTrainer(model, data=Counter(data), config=_cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        await asyncio.wait_for(t.evaluate(eval_data(), max_batches=2), T)
        await asyncio.wait_for(t.run(3), T)
        assert _same(await _state(t), straight)


# -- 10. a finite Epochs resumed in its last epoch ----------------------------------------------------


@pytest.mark.asyncio
async def test_10_a_finite_epochs_resumed_in_its_last_epoch_runs_what_is_left(tmp_path):
    """Epochs(loader, 2), 5 batches an epoch: 7 steps, save. Loaded, run(5) trains the 3
    left and raises DataExhausted whose report has 3 steps; run() without steps trains the
    3 and returns. Both: the weights of run() over all 10."""
    model = tiny_gpt(n_layer=2)
    async with SnakeTrainer(model, data=Epochs(_shuffled(), 2), config=_cfg(tmp_path / "s")) as t:
        assert len((await asyncio.wait_for(t.run(), T)).steps) == 10
        straight = await _state(t)
    async with SnakeTrainer(model, data=Epochs(_shuffled(), 2), config=_cfg(tmp_path / "a")) as t:
        await asyncio.wait_for(t.run(7), T)
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
    async with SnakeTrainer(model, data=Epochs(_shuffled(), 2), config=_cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        with pytest.raises(DataExhausted) as err:
            await asyncio.wait_for(t.run(5), T)
        assert len(err.value.report.steps) == 3
        assert _same(await _state(t), straight)
    async with SnakeTrainer(model, data=Epochs(_shuffled(), 2), config=_cfg(tmp_path / "c")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        assert len((await asyncio.wait_for(t.run(), T)).steps) == 3
        assert _same(await _state(t), straight)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["stateful", "list"])
async def test_10b_a_checkpoint_at_the_end_of_finite_data_loads(tmp_path, kind):
    """A checkpoint of a run trained to its data's end loads (the engine sized from the batch
    shapes the manifest records), to evaluate or go on with run(data=...); before, the build
    found no batch, and the load failed and closed the trainer."""
    model = tiny_gpt(n_layer=2)

    def data():
        return Epochs(_shuffled(), 1) if kind == "stateful" else batches(5, 4)

    more = batches(1, 4, seed=8)
    async with SnakeTrainer(model, data=data(), config=_cfg(tmp_path / "a")) as t:
        await asyncio.wait_for(t.run(5), T)
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
        await asyncio.wait_for(t.run(1, data=list(more)), T)
        straight = await _state(t)
    assert _manifest(tmp_path / "ck")["batch"] == {"inputs": {"shape": [4, 16], "dtype": "int64"},
                                                   "targets": {"shape": [4, 16], "dtype": "int64"}}
    async with SnakeTrainer(model, data=data(), config=_cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        await asyncio.wait_for(t.evaluate(batches(2, 4, seed=9)), T)
        with pytest.raises(DataError, match="has 0 left|ran out after 5"):  # nothing left: no step, on no stand-in
            await asyncio.wait_for(t.run(1), T)
        await asyncio.wait_for(t.run(1, data=list(more)), T)
        assert _same(await _state(t), straight)
    # a checkpoint without the record (saved before round 42): the load says why it cannot
    _rewrite(tmp_path / "ck", lambda m: m.pop("batch"))
    async with SnakeTrainer(model, data=data(), config=_cfg(tmp_path / "c")) as t:
        with pytest.raises(DataExhausted, match="records no batch shapes.*skip_data=False"):
            await asyncio.wait_for(t.load(tmp_path / "ck"), T)


# -- 11. tampered checkpoints -------------------------------------------------------------------------


async def _stateful_ck(tmp_path, name="ck", data=None) -> None:
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=data or Epochs(_shuffled()), config=_cfg(tmp_path / f"w{name}")) as t:
        await asyncio.wait_for(t.run(3), T)
        await asyncio.wait_for(t.save(tmp_path / name), T)


def _rewrite(path, edit) -> None:
    m = _manifest(path)
    edit(m)
    (path / "manifest.json").write_text(json.dumps(m))


@pytest.mark.asyncio
@pytest.mark.parametrize("tamper", ["deleted_file", "unlisted_and_deleted", "garbage_with_new_digest"])
async def test_11_a_tampered_data_file_is_a_clear_snake_error(tmp_path, tamper):
    await _stateful_ck(tmp_path)
    ck = tmp_path / "ck"
    m = _manifest(ck)
    assert "data.safetensors" in m["files"] and "tensor" in json.dumps(m["data_state"])
    if tamper == "deleted_file":
        (ck / "data.safetensors").unlink()
        match = r"data\.safetensors is missing"
    elif tamper == "unlisted_and_deleted":
        (ck / "data.safetensors").unlink()
        _rewrite(ck, lambda m: m["files"].pop("data.safetensors"))
        match = r"lacks.*damaged"
    else:
        import hashlib

        blob = b"not a safetensors file"
        (ck / "data.safetensors").write_bytes(blob)
        _rewrite(ck, lambda m: m["files"].__setitem__(
            "data.safetensors", {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}))
        match = r"not a valid safetensors file"
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=Epochs(_shuffled()), config=_cfg(tmp_path / "b")) as t:
        with pytest.raises(SnakeError, match=match):
            await asyncio.wait_for(t.load(ck), T)


@pytest.mark.asyncio
async def test_11b_a_state_without_tensors_loads_without_its_data_file(tmp_path):
    """A Counter's state has no tensors: a manifest that does not list data.safetensors (and
    no file) still restores it."""
    data = batches(6, 4)
    await _stateful_ck(tmp_path, data=Counter(data))
    ck = tmp_path / "ck"
    (ck / "data.safetensors").unlink()
    _rewrite(ck, lambda m: m["files"].pop("data.safetensors"))
    fresh = Counter(data)
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=fresh, config=_cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.load(ck), T)
        assert fresh.loads == [{"i": 3}]


@pytest.mark.asyncio
async def test_11c_a_damaged_data_state_is_refused_before_the_trainer_changes(tmp_path):
    """A damaged data_state is refused before the load changes the trainer, which can then load
    another checkpoint, as after any other damage to the manifest (it closed the trainer)."""
    await _stateful_ck(tmp_path, "good")
    await _stateful_ck(tmp_path, "bad")
    _rewrite(tmp_path / "bad", lambda m: m.__setitem__("data_state", {"dict": [["epoch", {"what": 1}]]}))
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=Epochs(_shuffled()), config=_cfg(tmp_path / "b")) as t:
        with pytest.raises(SnakeError, match="damaged"):
            await asyncio.wait_for(t.load(tmp_path / "bad"), T)
        await asyncio.wait_for(t.load(tmp_path / "good"), T)  # as after a missing file


# -- extra probes ------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_x1_a_checkpoint_after_load_skip_data_false_resumes_the_full_data_right(tmp_path):
    """After load(skip_data=False) the data's own state is its position in the data given, not
    the checkpoint's count: a later save stores no data state, and a load of it with the full
    data reads and drops the batches (it stored the given data's state, and that load
    restored a position three batches early: batches trained twice, silently)."""
    data = batches(9, 4)
    model = tiny_gpt(n_layer=2)
    straight = await _straight(tmp_path / "s", model, list(data), 9)
    async with SnakeTrainer(model, data=Counter(data), config=_cfg(tmp_path / "a")) as t:
        await asyncio.wait_for(t.run(3), T)
        await asyncio.wait_for(t.save(tmp_path / "ck1"), T)
    # the README's way to skip unread: data that starts where the checkpoint stopped
    async with SnakeTrainer(model, data=Counter(data[3:]), config=_cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck1", skip_data=False), T)
        await asyncio.wait_for(t.run(2), T)
        await asyncio.wait_for(t.save(tmp_path / "ck2"), T)
    m = _manifest(tmp_path / "ck2")
    assert m["consumed_batches"] == 5
    async with SnakeTrainer(model, data=Counter(data), config=_cfg(tmp_path / "c")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck2"), T)  # the data from its start, as README says
        await asyncio.wait_for(t.run(4), T)
        assert _same(await _state(t), straight), f"data_state {m.get('data_state')} vs consumed 5"


def test_x2_a_namedtuple_in_a_state_comes_back_as_itself_or_is_refused():
    """A namedtuple would come back without its field names: refused, with where it is."""
    Pos = collections.namedtuple("Pos", "epoch i")
    with pytest.raises(DataError, match=r"Pos \(a tuple subclass\) at state\['pos'\].*_asdict"):
        take(lambda: {"pos": Pos(1, 2)})
    assert restore(take(lambda: collections.OrderedDict(a=(1, 2)))) == {"a": (1, 2)}  # a dict subclass: a dict


@pytest.mark.asyncio
async def test_x3_a_tensor_a_checkpoint_cannot_hold_is_refused_at_the_first_batch(tmp_path):
    """A tensor of a dtype safetensors cannot store is refused at the first batch, naming where
    it is (the run trained, and save() failed with a bare KeyError)."""
    class Complex(Counter):
        def state_dict(self):
            return {"i": self.i, "phase": torch.zeros(2, dtype=torch.complex128)}

    async with SnakeTrainer(tiny_gpt(n_layer=2), data=Complex(batches(4, 4)), config=_cfg(tmp_path / "a")) as t:
        with pytest.raises(DataError, match=r"complex128 at state\['phase'\]"):
            await asyncio.wait_for(t.run(2), T)
        assert t.engine is None  # refused at the first batch, before the first run built anything
