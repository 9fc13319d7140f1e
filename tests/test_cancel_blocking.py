"""Cancelling a task that awaits long blocking work: state_dict() and the engine's build
stop at their next piece (a layer, a store, a buffer) instead of finishing it (round 31).
Each piece is made slow here, so the tests time the stop, not the machine."""

import asyncio
import threading
import time

import pytest
import torch

import snake.engine
import snake.state_dict
import snake.stores
from snake import SnakeTrainer
from snake.offload_dir import DirLock
from tests.helpers import batches, tiny_gpt
from tests.test_lifecycle import config, open_bin_files, snake_threads

TIMEOUT = 120
PIECE_S = 0.4  # each slowed piece; the cancelled call must return within about one


def model():
    return tiny_gpt(n_layer=8, bias=False)


async def cancel_at(coro, entered: asyncio.Event) -> float:
    """Start `coro`, cancel it once `entered` is set; the seconds it then took to raise
    CancelledError."""
    task = asyncio.create_task(coro)
    await entered.wait()
    start = time.perf_counter()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return time.perf_counter() - start


async def reference(tmp_path, data, steps: int) -> tuple[dict, dict]:
    """A trainer never cancelled: its state_dict after `steps`, and after one more run."""
    async with SnakeTrainer(model(), data=data, config=config(tmp_path / "ref")) as t:
        await t.run(steps)
        first = await t.state_dict()
        await t.run(1)
        return first, await t.state_dict()


def slowed_layer_values(module, read: list, entered: asyncio.Event):
    """`module.layer_values` (reading a layer of the model) records each layer in `read`,
    tells `entered` and takes PIECE_S more; the caller's monkeypatch puts it back."""
    real, loop = module.layer_values, asyncio.get_running_loop()

    def slow(parts, layer, named):
        read.append(layer)
        loop.call_soon_threadsafe(entered.set)
        threading.Event().wait(PIECE_S)
        return real(parts, layer, named)

    return slow


async def cancelled_then_usable(t, monkeypatch, entered, read, want, steps: int, want_after) -> None:
    """Cancel a state_dict() of `t` once its first slowed piece has begun: it stops before
    the second (`read`); then, the pieces quick again, `t` gives `want`, and after `steps`
    more steps `want_after`, as a trainer never cancelled."""
    took = await cancel_at(t.state_dict(), entered)
    assert read == [0], "stopped before layer 1"  # 8 layers: 3.2 s in all
    assert took < 4 * PIECE_S
    monkeypatch.undo()
    assert_equal(await t.state_dict(), want)
    await t.run(steps)
    assert_equal(await t.state_dict(), want_after)


def assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.asyncio
async def test_a_cancelled_state_dict_stops_at_its_next_layer(tmp_path, monkeypatch):
    """state_dict() read every layer's master weights (SSD tails included) and cloned every
    tensor before a cancellation took effect. Now it stops before the next layer: it only
    reads, so the trainer goes on as if it had never been called."""

    async def body():
        data = batches(4, 4)
        want, want_after = await reference(tmp_path, data, 2)
        async with SnakeTrainer(model(), data=data, config=config(tmp_path / "a")) as t:
            await t.run(2)
            store = t.engine.stores["opt"]
            real, read = store.read_tail, []
            loop, entered = asyncio.get_running_loop(), asyncio.Event()

            def slow(u, buf):
                if u.key[1] == 0:  # once per layer: the delayed-step flush reads only part 1
                    read.append(u.key[0])
                    loop.call_soon_threadsafe(entered.set)
                    threading.Event().wait(PIECE_S)
                return real(u, buf)

            monkeypatch.setattr(store, "read_tail", slow)
            await cancelled_then_usable(t, monkeypatch, entered, read, want, 1, want_after)

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
async def test_a_cancelled_state_dict_before_the_first_run_stops_at_its_next_layer(tmp_path, monkeypatch):
    """Before the first run state_dict() reads the model's layers (from its files, where
    they are on the meta device); a cancellation stops that before the next layer."""

    async def body():
        data = batches(4, 4)
        want_run, _ = await reference(tmp_path, data, 2)
        async with SnakeTrainer(model(), data=data, config=config(tmp_path / "a")) as t:
            want = await t.state_dict()
            read, entered = [], asyncio.Event()
            monkeypatch.setattr(snake.state_dict, "layer_values", slowed_layer_values(snake.state_dict, read, entered))
            await cancelled_then_usable(t, monkeypatch, entered, read, want, 2, want_run)

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
async def test_a_cancelled_engine_build_stops_at_its_next_piece_and_leaves_nothing(tmp_path, monkeypatch):
    """Building the engine zeroes its host memory (fresh pages: ~0.3 GiB/s, seconds for a
    mid-sized model) store by store and buffer by buffer; a cancellation waited for all of
    it. Now the build stops at its next piece, closes and removes the files it made, and
    the trainer can run again, to the weights of one never cancelled."""

    async def body():
        data = batches(4, 4)
        want, _ = await reference(tmp_path, data, 2)
        off = tmp_path / "off"
        t = SnakeTrainer(model(), data=data, config=config(off))
        loop, entered = asyncio.get_running_loop(), asyncio.Event()
        made: list[int] = []
        real = snake.stores.alloc_host_tensor

        def slow(*a, **kw):  # every store's CPU heads and every gradient buffer
            made.append(len(made))
            if len(made) == 3:  # the param and opt stores' files are open by now
                loop.call_soon_threadsafe(entered.set)
            threading.Event().wait(PIECE_S)
            return real(*a, **kw)

        monkeypatch.setattr(snake.stores, "alloc_host_tensor", slow)
        monkeypatch.setattr(snake.engine, "alloc_host_tensor", slow)
        task = asyncio.create_task(t.run(2))
        await entered.wait()
        assert len(open_bin_files(off)) == 2
        start = time.perf_counter()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        took = time.perf_counter() - start
        assert len(made) == 3, "stopped at its next piece"  # of 16 here: 6.4 s in all
        assert took < 4 * PIECE_S  # the whole work: 8 or more pieces
        assert t.engine is None
        assert not open_bin_files(off)
        assert not list(off.glob("*.bin")), "scratch space, removed"
        assert not snake_threads()
        DirLock(off).release()  # the trainer's lock is free
        monkeypatch.undo()
        try:
            await t.run(2)
            assert_equal(await t.state_dict(), want)
        finally:
            await t.close()
        assert not snake_threads()

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
async def test_a_cancelled_build_stops_writing_the_resident_state_at_its_next_parameter(tmp_path, monkeypatch):
    """With resident_optimizer='ssd' the build writes the embeddings' and head's optimizer
    state to SSD, parameter by parameter; a cancellation stops it before the next one and
    the files it made go."""
    import snake.resident

    async def body():
        off = tmp_path / "off"
        t = SnakeTrainer(model(), data=batches(4, 4), config=config(off, resident_optimizer="ssd"))
        loop, entered = asyncio.get_running_loop(), asyncio.Event()
        real, written = snake.resident.ResidentState._write, []

        def slow(self, i, *a):
            written.append(i)
            loop.call_soon_threadsafe(entered.set)
            threading.Event().wait(PIECE_S)
            return real(self, i, *a)

        monkeypatch.setattr(snake.resident.ResidentState, "_write", slow)
        took = await cancel_at(t.run(1), entered)
        assert written == [0], "stopped before the next parameter"  # of 3 here
        assert took < 4 * PIECE_S  # (3 pieces here: the count above is the check)
        assert not open_bin_files(off)
        assert not list(off.glob("*.bin"))
        assert not snake_threads()
        await t.close()

    await asyncio.wait_for(body(), TIMEOUT)


@pytest.mark.asyncio
async def test_a_cancelled_build_stops_mapping_a_streamed_models_frozen_weights(tmp_path, monkeypatch):
    """A model streamed from its files (`stream_hf`) whose layers keep frozen weights: the
    build writes each layer's to a file it maps. Cancelled there, it stops before the next
    layer and leaves the model's parameters as they were (none points at a mapping); a run
    after it maps every layer and trains."""
    import snake.kernels
    from snake.hf import stream_hf
    from tests.test_hf import VOCAB
    from tests.test_stream_hf import saved

    async def body():
        _, path = saved("llama", tmp_path)
        streamed = stream_hf(path)
        for name, p in streamed.named_parameters():
            if "mlp" in name:
                p.requires_grad_(False)
        frozen = {n: p for n, p in streamed.named_parameters() if not p.requires_grad}
        off = tmp_path / "off"
        t = SnakeTrainer(streamed, data=batches(2, 4, vocab=VOCAB), config=config(off))
        read, entered = [], asyncio.Event()
        monkeypatch.setattr(snake.kernels, "layer_values", slowed_layer_values(snake.kernels, read, entered))
        took = await cancel_at(t.run(1), entered)
        assert read == [0], "stopped before the next layer"
        assert took < 4 * PIECE_S
        assert all(streamed.get_parameter(n) is p for n, p in frozen.items()), "the model as it was"
        assert not list(off.glob("*.bin")) and not snake_threads()
        monkeypatch.undo()
        try:
            await asyncio.wait_for(t.run(1), TIMEOUT)
            assert t.engine is not None and t.engine.kernels.frozen_mapped
            assert all(getattr(streamed.get_parameter(n), "snake_mapped", False) for n in frozen)
        finally:
            await t.close()

    await asyncio.wait_for(body(), TIMEOUT)
