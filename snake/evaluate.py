"""Validation loss (`SnakeTrainer.evaluate`): the model's current weights over held-out
batches, forward only, streamed layer by layer as training streams them.

Each global batch is cut into micro-batches of at most the training micro-batch's rows (so
the device holds what training holds). Batches go through the model a pass at a time: a
pass streams every layer once, and runs each layer over every micro-batch of the pass's
batches while the next layer loads into the other device slot. Between layers their hidden
states wait in CPU memory that training uses only within an iteration and leaves idle
between runs (its checkpoint store's CPU share and staging buffers, and vertical's
inter-layer gradients: `_Arena`), each overwritten in place by the layer's output. So a
pass takes as many batches as those buffers hold (at least one, in memory of its own where
they hold none), and the model is read once per pass, not once per batch.

Then the head's cross-entropy, summed over the targets trained on. Dropout is off (eval
mode), no gradient is kept, nothing is written to the trainer's state: a run after it goes
on bitwise as without it (the pending delayed steps are applied first, as a save applies
them; what a run keeps in the buffers lent to a pass is written afresh each iteration).
The work is traced on the actors' tracks (`eval read`, `eval param`, `eval fwd`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from snake.blocking import retrieved, run_blocking, settle
from snake.buffers import HostBuffer
from snake.data import IGNORE_INDEX, Vocab, check_container, next_raised, split_batch
from snake.device import Copier, helper_thread_init, synchronize
from snake.errors import ConfigError, DataError
from snake.io.base import align_up

if TYPE_CHECKING:
    from snake.engine import Engine
    from snake.trainer import SnakeTrainer

_END = object()
R = TypeVar("R")
_CARVE = 64  # alignment of the hidden states carved from the arena (a cache line)


@dataclass(frozen=True)
class EvalReport:
    """`loss`: the mean cross-entropy over every target token trained on (not -100) in the
    batches evaluated, each token weighing the same; `tokens`: how many; `batches`: how many
    global batches; `seconds`: the wall time; `passes`: how many times the model was
    streamed (each pass reads every layer once, for all of its batches)."""

    loss: float
    tokens: int
    batches: int
    seconds: float
    passes: int = 1


@dataclass
class _Batch:
    hs: list[torch.Tensor]  # each micro-batch's hidden state, in CPU memory
    tgs: list[torch.Tensor]


def _check_per_pass(batches_per_pass: object) -> None:
    if batches_per_pass is not None and (isinstance(batches_per_pass, bool) or not isinstance(batches_per_pass, int)
                                         or batches_per_pass < 1):
        raise ConfigError("batches_per_pass", batches_per_pass,
                          "must be a positive int, or None (as many batches as training's idle buffers hold)")


async def evaluate_model(trainer: SnakeTrainer, data: Any, max_batches: int | None,
                         batches_per_pass: int | None = None) -> EvalReport:
    if max_batches is not None and (isinstance(max_batches, bool) or not isinstance(max_batches, int)
                                    or max_batches < 1):
        raise ConfigError("max_batches", max_batches, "must be a positive int or None (every batch of data)")
    _check_per_pass(batches_per_pass)
    check_container(data, "evaluate: data")
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
    trainer._check_idle("evaluate")
    t0 = time.perf_counter()
    trainer._begin()
    # a sync iterator's next() on a thread of its own: a cancellation (a timeout, close())
    # does not wait for it, as run() does not (the user's code may block for long); the
    # thread ends when it returns, and training's data thread is not kept waiting
    data_ex = None if it is None else ThreadPoolExecutor(
        1, thread_name_prefix="snake-data", initializer=helper_thread_init(trainer.device))
    fetch: asyncio.Future[Any] | None = None
    first: list[Any] = []  # the first batch, taken before the engine is set up

    taken = [0]  # batches the data gave

    async def next_batch() -> Any:
        nonlocal fetch
        if first:
            return first.pop()
        try:
            if data_ex is None:
                item = await anext(ait, _END)
            else:
                fetch = asyncio.get_running_loop().run_in_executor(data_ex, _next, it)
                fetch.add_done_callback(retrieved)  # its error, where no one awaits it any more
                item = await asyncio.shield(fetch)
        except DataError:
            raise
        except Exception as exc:  # the user's iterator: a DataError, as in run()
            raise next_raised(exc, f"evaluate's batch {taken[0]}") from exc
        taken[0] += 1
        return item

    try:
        # the first batch checked before anything is set up (the engine, its files and
        # threads, before a first run): no batch, or one that is not a pair of token-id
        # tensors, is a DataError that leaves the trainer as it was
        item = await next_batch()
        if item is _END:
            raise DataError("evaluate: data gave no batch; give at least one (inputs, targets) batch")
        split_batch(item, micro_batches=1, device=trainer.device, expect_shape=None, vocab=Vocab(), no_targets_ok=True)
        first.append(item)
        if trainer.engine is None:
            await trainer._setup()
        e = trainer.engine
        assert e is not None
        await trainer._flush("evaluate")
        arena = _Arena(e)
        try:
            with e.kernels.eval_mode():
                loss_sum, tokens, batches, passes = await _passes(trainer, e, arena, next_batch, max_batches,
                                                                  batches_per_pass)
        finally:
            arena.close()
        if not tokens:  # each batch may have none (padding alone), but not all of them
            raise DataError(f"evaluate: every target of the {batches} batches evaluated is {IGNORE_INDEX} (not "
                            "trained on): their mean loss would be 0/0; give batches with targets")
        return EvalReport(loss_sum / tokens, tokens, batches, time.perf_counter() - t0, passes)
    finally:
        if data_ex is not None:  # joined unless the user's next() still runs there
            data_ex.shutdown(wait=fetch is None or fetch.done(), cancel_futures=True)
        trainer._end()


def _next(it: Iterator[Any] | None) -> Any:
    assert it is not None
    return next(it, _END)


async def _passes(trainer: SnakeTrainer, e: Engine, arena: _Arena, next_batch: Callable[[], Awaitable[Any]],
                  max_batches: int | None, per_pass: int | None) -> tuple[float, int, int, int]:
    """Pass after pass until the data ends or `max_batches`: (summed loss, tokens, batches,
    passes). A pass takes batches while the arena holds their hidden states (or up to
    `per_pass`, past the arena in their own memory); the first that does not fit starts the
    next pass."""
    loss_sum, tokens, batches, passes = 0.0, 0, 0, 0
    carried: _Batch | None = None
    done = False
    while not done:
        arena.reset()
        group: list[_Batch] = []
        if carried is not None:
            first = await _placed(e, arena, carried, required=True)
            assert first is not None
            group.append(first)
            carried = None
        while (max_batches is None or batches + len(group) < max_batches) and (
                per_pass is None or len(group) < per_pass):
            item = await next_batch()
            if item is _END:
                done = True
                break
            b = await _first(trainer, e, item)
            placed = await _placed(e, arena, b, required=not group or per_pass is not None)
            if placed is None:  # the arena is full: this batch starts the next pass
                carried = b
                break
            group.append(placed)
        else:
            done = max_batches is not None and batches + len(group) >= max_batches
        if not group:
            break
        for s, n in await _one_pass(e, group):
            loss_sum, tokens, batches = loss_sum + s, tokens + n, batches + 1
        passes += 1
    return loss_sum, tokens, batches, passes


async def _traced(e: Engine, actor: str, label: str, executor: str, fn: Callable[..., R], *args: Any,
                  link: str | None = None, nbytes: int = 0) -> R:
    """`fn(*args)` on one of the engine's executors, as a span on `actor`'s track."""
    start = e.tracer.now()
    try:
        return await run_blocking(e.executors[executor], fn, *args)
    finally:
        e.tracer.add(actor, label, start, e.tracer.now(), link=link, bytes=nbytes)
        if link is not None:  # moved as well as copied, as training's Traffic counts it
            e.tracer.moved(link, nbytes)


async def _first(trainer: SnakeTrainer, e: Engine, item: Any) -> _Batch:
    """A batch checked and cut into micro-batches (on the data thread), and its embedding."""
    assert trainer._data_ex is not None
    ins, tgs = await run_blocking(trainer._data_ex, _split, trainer, e, item)
    hs = await _traced(e, "compute", "eval pre", "compute", _pre, e, ins)
    return _Batch(hs, tgs)


async def _placed(e: Engine, arena: _Arena, b: _Batch, *, required: bool) -> _Batch | None:
    """`b` with its hidden states copied into the arena; where it has no room, `b` as it is
    (its own memory) if `required`, else None."""
    views = arena.take(b.hs)
    if views is None:
        return b if required else None
    await run_blocking(e.executors["compute"], _copy_all, views, b.hs)
    return _Batch(views, b.tgs)


async def _one_pass(e: Engine, group: list[_Batch]) -> list[tuple[float, int]]:
    """Every layer once over every micro-batch of `group`, in place; then each batch's head
    loss: (summed cross-entropy, target tokens) per batch."""
    # the engine's device slots and a staging buffer, idle outside a run; one load at a time
    slots = [s for s in (e.param_slots.try_acquire() for _ in range(2)) if s is not None]
    pool = e.pools["param_in"]
    buf = pool.try_acquire() if pool is not None else None
    assert slots and (pool is None or buf is not None), "a run's buffers are out (internal error)"
    hs = [h for b in group for h in b.hs]
    # on CUDA the loads' copies go on a stream of their own: on the I/O thread's default
    # stream, the compute stream, each waited behind the layer running, and none overlapped it
    copier = Copier(e.device)

    def load(layer: int) -> asyncio.Future[torch.Tensor]:
        return asyncio.ensure_future(_load_traced(e, layer, slots[layer % len(slots)], buf, copier))

    ahead: asyncio.Future[torch.Tensor] | None = None
    try:
        ahead = load(0)
        for layer in range(e.N):
            assert ahead is not None
            params = await ahead
            last = layer + 1 == e.N
            # the next layer's load while this one runs, into the other slot
            ahead = load(layer + 1) if not last and len(slots) > 1 else None
            await _traced(e, "compute", f"eval fwd L{layer}", "compute", _layer, e, params, hs, layer)
            if ahead is None and not last:
                ahead = load(layer + 1)
        return [await _traced(e, "compute", "eval head", "compute", _head, e, b.hs, b.tgs) for b in group]
    finally:
        if ahead is not None:  # a failure or cancellation: the load in flight ends before its slot goes back
            await settle(ahead)
        for s in slots:
            e.param_slots.release(s)
        if buf is not None:
            assert pool is not None
            pool.release(buf)


async def _load_traced(e: Engine, layer: int, slot: torch.Tensor, buf: HostBuffer | None,
                       copier: Copier) -> torch.Tensor:
    times: list[tuple[str, float, float, str, int]] = []
    try:
        params = await run_blocking(e.executors["io"], _load, e, layer, slot, buf, times, copier)
    finally:
        # each copy is moved too (the link's totals: moved >= copied, as in training); not
        # the training step's Traffic, which counts per iteration (`trainer.traffic()`)
        for actor, start, end, link, nbytes in times:
            e.tracer.add(actor, f"eval {'read' if actor == 'ssd_read' else 'param'} L{layer}", start, end,
                         link=link, bytes=nbytes)
            e.tracer.moved(link, nbytes)
    if not any(actor == "h2d" for actor, *_ in times):  # used in place (a CPU device): moved, not copied
        e.tracer.moved("cpu->gpu", e.layer_P[layer] * e.stores["param"].esize)
    frozen = e.kernels.frozen_host[layer]
    if frozen is not None and e.device.type == "cpu":  # read in place too: moved, not copied
        e.tracer.moved("cpu->gpu", frozen.numel() * frozen.element_size())
    return params


class _Arena:
    """Host memory a pass's hidden states borrow: what training uses only within an
    iteration (the checkpoint store's CPU share, the checkpoint staging buffers, vertical's
    inter-layer gradients), idle between runs. The pools' buffers are taken out (and given
    back by `close`), so a pool check sees them lent. Carved in order, each view aligned to
    a cache line."""

    def __init__(self, e: Engine) -> None:
        self._lent: list[tuple[Any, HostBuffer]] = []
        regions: list[torch.Tensor] = []
        for kind in ("ckpt", "act_grad"):
            store = e.stores.get(kind)
            if store is not None and store.cpu.numel():
                regions.append(store.cpu.view(torch.uint8))
        for name in ("ckpt_in", "ckpt_out"):
            pool = e.pools.get(name)
            while pool is not None and (b := pool.try_acquire()) is not None:
                self._lent.append((pool, b))
                regions.append(b.data)
        self._regions = sorted(regions, key=lambda r: -r.numel())  # the largest first: fewer left over
        self.reset()

    def reset(self) -> None:
        self._used = [0] * len(self._regions)

    def take(self, like: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Views shaped and typed as `like`'s tensors, or None (and nothing taken) where they
        do not all fit."""
        used = list(self._used)
        out = []
        for t in like:
            nb = t.numel() * t.element_size()
            for i, r in enumerate(self._regions):
                start = align_up(used[i], _CARVE)
                if start + nb <= r.numel():
                    out.append(r[start : start + nb].view(t.dtype).view(t.shape))
                    used[i] = start + nb
                    break
            else:
                return None
        self._used = used
        return out

    def close(self) -> None:
        for pool, b in self._lent:
            pool.release(b)
        self._lent = []


def _split(trainer: SnakeTrainer, e: Engine, item: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Validate a batch as training does and cut it into micro-batches of at most the
    training micro-batch's rows, on the CPU."""
    ins, tgs, _, _ = split_batch(item, micro_batches=1, device=torch.device("cpu"), expect_shape=None,
                                 vocab=trainer._vocab, no_targets_ok=True)
    rows = max(1, e.input_shape[0] // e.M)
    return list(ins[0].split(rows)), list(tgs[0].split(rows))


def _host(x: torch.Tensor) -> torch.Tensor:
    return x if x.device.type == "cpu" else x.to("cpu")


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


def _pre(e: Engine, ins: list[torch.Tensor]) -> list[torch.Tensor]:
    k = e.kernels
    # contiguous and its own: a pass overwrites it with each layer's output
    return [_host(k.pre(x.to(e.device), 0, m)).contiguous() for m, x in enumerate(ins)]


def _layer(e: Engine, params: torch.Tensor, hs: list[torch.Tensor], layer: int) -> None:
    """The layer over every hidden state, each replaced by its output (a block keeps the
    hidden state's shape)."""
    k = e.kernels
    for h in hs:
        h.copy_(k.eval_block(params, h.to(e.device), layer))
    synchronize(e.device)  # the slot is free for the next load once this returns


def _head(e: Engine, hs: list[torch.Tensor], tgs: list[torch.Tensor]) -> tuple[float, int]:
    k = e.kernels
    loss, count = 0.0, 0
    for h, t in zip(hs, tgs, strict=True):
        s, n = k.eval_head(h.to(e.device), t.to(e.device))
        loss, count = loss + s, count + n
    return loss, count


def _load(e: Engine, layer: int, slot: torch.Tensor, buf: HostBuffer | None,
          times: list[tuple[str, float, float, str, int]], copier: Copier) -> torch.Tensor:
    """Blocking: `layer`'s parameters in the compute dtype as the device mover lays them out:
    a view of the CPU store where the device is the CPU and the layer has no SSD part, else
    `slot` filled with its CPU heads, its SSD tails (read through `buf`) and its streamed
    frozen parameters, by `copier` (on CUDA its own stream, waited for before this returns;
    the slot's last reader, the layer before the one before, was waited for by `_layer`).
    Appends to `times` the spans of its reads and copies (the event loop adds them to the
    trace)."""
    store = e.stores["param"]
    now = e.tracer.now
    units = [store.unit((layer, part)) for part, n in enumerate(e.layer_parts[layer]) if n or not e.layer_P[layer]]
    if e.device.type == "cpu" and not any(u.tail_n for u in units):
        first = units[0].head_offset
        return store.cpu[first : first + e.layer_P[layer]]
    off, start = 0, now()
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for u in units:
            pairs.append((slot[off : off + u.k], store.head(u)[0]))
            if u.tail_n:
                assert buf is not None
                copier.copy(pairs)  # (waited for: `buf` takes the next tail)
                pairs = []
                r0 = now()
                store.read_tail(u, buf)
                times.append(("ssd_read", r0, now(), "ssd->cpu", store.tail_bytes(u)))
                copier.copy([(slot[off + u.k : off + u.n], store.tail(u, buf)[0])])
            off += u.n
        frozen = e.kernels.frozen_host[layer]
        if frozen is not None and e.device.type != "cpu":  # a CPU device reads them in place
            pairs.append((slot[off : off + frozen.numel()], frozen))
            off += frozen.numel()
        copier.copy(pairs)
    times.append(("h2d", start, now(), "cpu->gpu", off * slot.element_size()))
    return slot
