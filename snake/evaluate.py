"""Validation loss (`SnakeTrainer.evaluate`): the model's current weights over held-out
batches, forward only, streamed layer by layer as training streams them.

Each global batch is cut into micro-batches of at most the training micro-batch's rows (so
the device holds what training holds). Layer by layer: the layer's parameters go into a
device slot (its CPU head and SSD tail, and its streamed frozen parameters) while the layer
before runs over every micro-batch, whose hidden states wait in CPU memory between layers;
then the head's cross-entropy, summed over the targets trained on. Dropout is off (eval
mode), no gradient is kept, nothing is written: the trainer's state is as it was, and a run
after it goes on bitwise as without it (the pending delayed steps are applied first, as a
save applies them)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from snake.blocking import run_blocking, settle
from snake.buffers import HostBuffer
from snake.data import split_batch
from snake.device import synchronize
from snake.errors import ConfigError, DataError, SnakeError

if TYPE_CHECKING:
    from snake.engine import Engine
    from snake.trainer import SnakeTrainer

_END = object()


@dataclass(frozen=True)
class EvalReport:
    """`loss`: the mean cross-entropy over every target token trained on (not -100) in the
    batches evaluated, each token weighing the same; `tokens`: how many; `batches`: how many
    global batches; `seconds`: the wall time."""

    loss: float
    tokens: int
    batches: int
    seconds: float


async def evaluate_model(trainer: SnakeTrainer, data: Any, max_batches: int | None) -> EvalReport:
    if max_batches is not None and (isinstance(max_batches, bool) or not isinstance(max_batches, int)
                                    or max_batches < 1):
        raise ConfigError("max_batches", max_batches, "must be a positive int or None (every batch of data)")
    if hasattr(data, "__aiter__"):  # as run() takes them
        ait = aiter(data)
        it = None
    else:
        try:
            it = iter(data)
        except TypeError:
            raise DataError(
                f"evaluate: data must be an iterable or async iterable of (inputs, targets) batches, "
                f"got {type(data).__name__}"
            ) from None
    trainer._check_usable()
    if trainer._running:
        raise SnakeError("evaluate: a run(), save(), load() or evaluate() of this trainer is in progress; await it first")
    t0 = time.perf_counter()
    trainer._begin()
    try:
        if trainer.engine is None:
            await trainer._setup()
        e = trainer.engine
        assert e is not None
        await trainer._flush("evaluate")
        data_ex = trainer._data_ex
        assert data_ex is not None
        loss_sum, tokens, batches = 0.0, 0, 0
        while max_batches is None or batches < max_batches:
            item = await run_blocking(data_ex, next, it, _END) if it is not None else await anext(ait, _END)
            if item is _END:
                break
            s, n = await _one_batch(trainer, e, item)
            loss_sum, tokens, batches = loss_sum + s, tokens + n, batches + 1
        if not batches:
            raise DataError("evaluate: data gave no batch; give at least one (inputs, targets) batch")
        return EvalReport(loss_sum / tokens, tokens, batches, time.perf_counter() - t0)
    finally:
        trainer._end()


async def _one_batch(trainer: SnakeTrainer, e: Engine, item: Any) -> tuple[float, int]:
    ex = e.executors
    assert trainer._data_ex is not None
    ins, tgs = await run_blocking(trainer._data_ex, _split, trainer, e, item)
    # the engine's device slots and a staging buffer, idle outside a run; one load at a time
    slots = [s for s in (e.param_slots.try_acquire() for _ in range(2)) if s is not None]
    pool = e.pools["param_in"]
    buf = pool.try_acquire() if pool is not None else None
    assert slots and (pool is None or buf is not None), "a run's buffers are out (internal error)"

    def load(layer: int) -> asyncio.Future[torch.Tensor]:
        return asyncio.ensure_future(run_blocking(ex["io"], _load, e, layer, slots[layer % len(slots)], buf))

    ahead: asyncio.Future[torch.Tensor] | None = None
    try:
        with e.kernels.eval_mode():
            hs = await run_blocking(ex["compute"], _pre, e, ins)
            ahead = load(0)
            for layer in range(e.N):
                assert ahead is not None
                params = await ahead
                last = layer + 1 == e.N
                # the next layer's load while this one runs, into the other slot
                ahead = load(layer + 1) if not last and len(slots) > 1 else None
                hs = await run_blocking(ex["compute"], _layer, e, params, hs, layer)
                if ahead is None and not last:
                    ahead = load(layer + 1)
            return await run_blocking(ex["compute"], _head, e, hs, tgs)
    finally:
        if ahead is not None:  # a failure or cancellation: the load in flight ends before its slot goes back
            await settle(ahead)
        for s in slots:
            e.param_slots.release(s)
        if buf is not None:
            assert pool is not None
            pool.release(buf)


def _split(trainer: SnakeTrainer, e: Engine, item: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Validate a batch as training does and cut it into micro-batches of at most the
    training micro-batch's rows, on the CPU."""
    ins, tgs, _, _ = split_batch(item, micro_batches=1, device=torch.device("cpu"), expect_shape=None,
                                 vocab=trainer._vocab)
    rows = max(1, e.input_shape[0] // e.M)
    return list(ins[0].split(rows)), list(tgs[0].split(rows))


def _host(x: torch.Tensor) -> torch.Tensor:
    return x if x.device.type == "cpu" else x.to("cpu")


def _pre(e: Engine, ins: list[torch.Tensor]) -> list[torch.Tensor]:
    k = e.kernels
    return [_host(k.pre(x.to(e.device), 0, m)) for m, x in enumerate(ins)]


def _layer(e: Engine, params: torch.Tensor, hs: list[torch.Tensor], layer: int) -> list[torch.Tensor]:
    k = e.kernels
    out = [_host(k.eval_block(params, h.to(e.device), layer)) for h in hs]
    synchronize(e.device)  # the slot is free for the next load once this returns
    return out


def _head(e: Engine, hs: list[torch.Tensor], tgs: list[torch.Tensor]) -> tuple[float, int]:
    k = e.kernels
    loss, count = 0.0, 0
    for h, t in zip(hs, tgs, strict=True):
        s, n = k.eval_head(h.to(e.device), t.to(e.device))
        loss, count = loss + s, count + n
    return loss, count


def _load(e: Engine, layer: int, slot: torch.Tensor, buf: HostBuffer | None) -> torch.Tensor:
    """Blocking: `layer`'s parameters in the compute dtype as the device mover lays them out:
    a view of the CPU store where the device is the CPU and the layer has no SSD part, else
    `slot` filled with its CPU heads, its SSD tails (read through `buf`) and its streamed
    frozen parameters."""
    store = e.stores["param"]
    units = [store.unit((layer, part)) for part, n in enumerate(e.layer_parts[layer]) if n]
    if e.device.type == "cpu" and not any(u.tail_n for u in units):
        first = units[0].head_offset
        return store.cpu[first : first + e.layer_P[layer]]
    off = 0
    with torch.no_grad():
        for u in units:
            slot[off : off + u.k].copy_(store.head(u)[0])
            if u.tail_n:
                assert buf is not None
                store.read_tail(u, buf)
                slot[off + u.k : off + u.n].copy_(store.tail(u, buf)[0])
            off += u.n
        frozen = e.kernels.frozen_host[layer]
        if frozen is not None:
            slot[off : off + frozen.numel()].copy_(frozen)
    synchronize(e.device)
    return slot
