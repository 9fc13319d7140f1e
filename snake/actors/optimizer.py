"""A CPU optimizer worker; the pool is `optimizer_workers` of them, layer l on worker
l % workers (GreedySnake 4.3-4.4).

| consumes  | its plan (snake.plans.worker_plan), GradsOnHost, TailOnHost (opt, grad)|
| produces  | updated master/m/v and compute-dtype params: heads in place, tails as  |
|           | WriteTail -> ssd_write; the SSD part of a delayed gradient (WriteTail);|
|           | ledger marks                                                           |
| waits for | the layer's gradient (now-step), the clock (delayed step: two stages   |
|           | before the layer's forward), the opt tail, the delayed gradient's SSD  |
|           | part, a param or gradient staging buffer                               |
| unblocked | by d2h (gradients), ssd_read (opt tails), ssd_write (buffers)          |

now-step: the first (1 - alpha) of the layer's elements, as soon as the gradient is in
CPU memory, overlapping the backward of later layers. delayed step: the remaining alpha,
in the next iteration before the layer's forward; its gradient waits (vertical: in the
memory of the layer's CPU-resident delayed parameters, which are stale until this step
rewrites them, GreedySnake 4.4, then in the grad store's CPU head up to placement.grad, the
rest on SSD; horizontal: the layer's accumulator). AdamW is element-wise, so the split gives the result
of alpha = 0 (to the last bit of a few elements: snake.optim.adamw_step). At alpha = 1
the now-step has no elements and only keeps the gradient: every step can then wait for
the whole iteration's gradient.
"""

from __future__ import annotations

import bisect
import itertools

import torch

from snake.actors.base import Actor
from snake.buffers import BufferPool, HostBuffer
from snake.channels import Mailbox, StageClock
from snake.clip import scale
from snake.engine import Engine
from snake.messages import GradsOnHost, Stop, WriteTail
from snake.optim import adamw_step
from snake.plans import DELAYED, Idle, StepOp
from snake.stores import Unit, scatter


class OptimizerWorker(Actor):
    def __init__(
        self,
        engine: Engine,
        index: int,
        *,
        inbox: Mailbox,
        ssd_write: Mailbox,
        clock: StageClock,
    ) -> None:
        super().__init__(engine.tracer)
        self.name = f"optimizer[{index}]"
        self.e = engine
        self.index = index
        self.inbox = inbox
        self.ssd_write = ssd_write
        self.clock = clock
        self.layers = [layer for layer in range(engine.N) if layer % engine.workers == index]

    async def run(self) -> None:
        for op in self.e.plans.worker_plan(self.clock.iterations(), self.layers, self.e.first_delayed):
            if isinstance(op, Idle):  # no layer of this worker's steps in this iteration
                self.at(op.t)
                await self.clock.begun(op.t)
                continue
            self.at(op.t, op.layer)
            if not await self.clock.runs(op.t):
                continue  # the run stopped before this iteration (the data, or a stop asked for)
            await self.step(op)
        await self.ssd_write.put(Stop(self.name))

    async def step(self, op: StepOp) -> None:
        e = self.e
        n_now, n_del = e.layer_parts[op.layer]
        n = n_now + n_del
        host: torch.Tensor | None = None
        gtail: HostBuffer | None = None
        gpool: BufferPool[HostBuffer] | None = None
        otail = ptail = kept = None
        grads: torch.Tensor | list[torch.Tensor]
        coef: torch.Tensor | None = None
        skip = False
        if op.kind == "now":
            msg: GradsOnHost = await self.inbox.take(("grads", op.t, op.layer))
            host = msg.buf
            full = host if host is not None else e.accumulators[op.layer]
            grads = full[:n_now]
            # the layer's backward is done: which parameters had no gradient at all
            skipped = e.kernels.take_skipped(op.t, op.layer)
            if n_del:
                e.delayed_skips[op.layer] = skipped
            if not n_now:  # alpha = 1: no element steps now
                await self._keep(op, full, host)
                return
        else:
            await self.clock.wait_for(op.key)  # type: ignore[arg-type]
            # with clipping, the coefficient of the iteration these gradients are of; with a
            # dynamic loss scale, whether its steps are skipped
            if e.clip is not None and e.clip.waits:
                coef, skip = await e.clip.coef(op.t - 1)
            full = None
            grads = e.delayed_grads[op.layer] if e.vertical else e.accumulators[op.layer][n_now:n]
            gu = e.delayed_tail(op.layer)
            if gu is not None and op.layer in e.held_grads:  # kept in its staging buffer
                gtail, gpool = e.held_grads.pop(op.layer), e.pools["grad_out"]
            elif gu is not None:  # the gradient's SSD part, staged by ssd_read
                gtail = (await self.inbox.take(("tail", "grad", (op.layer, DELAYED), op.t, op.kind))).buf
                gpool = e.pools["grad_in"]
            if gu is not None and gtail is not None:
                grads = [*grads, e.stores["grad"].tail(gu, gtail)[0]]
            skipped = e.delayed_skips.pop(op.layer, ())
            if skip:
                e.kernels.miss_step(op.layer, skipped)
        counts = e.kernels.layer_steps(op.layer, op.step, skipped)
        ostore, pstore = e.stores["opt"], e.stores["param"]
        ou = ostore.unit((op.layer, op.part))
        pu = pstore.unit((op.layer, op.part))
        try:
            if ou.tail_n:
                otail = (await self.inbox.take(("tail", "opt", (op.layer, op.part), op.t, op.kind))).buf
            ppool = e.pools["param_out"]
            ptail = await ppool.acquire() if pu.tail_n and ppool is not None else None
            keep = full[n_now:n] if full is not None and e.vertical and n_del else None
            kept = await self._kept_tail(op.layer) if keep is not None else None

            def work() -> None:
                step_unit(e, grads, ou, otail, pu, ptail, op.step,
                          counts=counts, layer=op.layer, first=0 if op.kind == "now" else n_now, clip=coef, skip=skip)
                if keep is not None:
                    # into the layer's delayed parameter share (stale now), its grad store head and tail
                    scatter([keep], self._room(op.layer, kept))

            try:
                await self.work(e.executors["optimizer"], f"adamw L{op.layer} {op.kind}", work)
            except BaseException:
                for buf, pool in ((otail, e.pools["opt"]), (ptail, ppool), (kept, e.pools.get("grad_out"))):
                    if buf is not None and pool is not None:
                        pool.release(buf)
                raise
        finally:  # the gradient's buffers, read now (or the step failed)
            self._release(host)
            if gtail is not None and gpool is not None:
                gpool.release(gtail)
        await self._store(op, ou, otail, "opt")
        await self._store(op, pu, ptail, "param")
        await self._write_kept(op, kept)

    async def _keep(self, op: StepOp, full: torch.Tensor, host: torch.Tensor | None) -> None:
        """The now-step of a layer with no now elements (alpha = 1): its whole gradient
        waits for the delayed step, vertical in the layer's delayed room (the host buffer
        comes back), horizontal in its accumulator."""
        e = self.e
        kept = None
        try:
            if e.vertical:
                n = e.layer_P[op.layer]
                kept = await self._kept_tail(op.layer)
                await self.work(e.executors["optimizer"], f"grads L{op.layer} keep", scatter,
                                [full[:n]], self._room(op.layer, kept))
        except BaseException:
            pool = e.pools.get("grad_out")
            if kept is not None and pool is not None:
                pool.release(kept)
            raise
        finally:
            self._release(host)
        await self._write_kept(op, kept)

    async def _kept_tail(self, layer: int) -> HostBuffer | None:
        """A staging buffer for the SSD part of the layer's delayed gradient, if it has one."""
        pool = self.e.pools.get("grad_out")
        return await pool.acquire() if pool is not None and self.e.delayed_tail(layer) is not None else None

    def _room(self, layer: int, kept: HostBuffer | None) -> list[torch.Tensor]:
        """Where the layer's delayed gradient waits: its CPU room, then `kept` (its SSD part)."""
        e = self.e
        u = e.delayed_tail(layer)
        return e.delayed_grads[layer] + ([e.stores["grad"].tail(u, kept)[0]] if kept is not None and u else [])

    async def _write_kept(self, op: StepOp, kept: HostBuffer | None) -> None:
        """The SSD part of a delayed gradient of iteration op.t to ssd_write (version t + 1:
        the delayed step of iteration t + 1 reads it)."""
        if kept is None:
            return
        e = self.e
        if e.plans.grad_stays(op.layer):  # its delayed step comes next: no SSD round trip
            e.held_grads[op.layer] = kept
            return
        u = e.delayed_tail(op.layer)
        pool = e.pools["grad_out"]
        assert u is not None and pool is not None
        await self.ssd_write.put(WriteTail(op.t, e.stores["grad"], u, kept, pool, ("grad", op.layer, DELAYED), op.t + 1))


    def _release(self, host: torch.Tensor | None) -> None:
        """The host buffer a now-step's gradient came in, or on a CPU device the slot itself."""
        e = self.e
        if host is not None:
            (e.grad_host if e.grad_host is not None else e.grad_slots).release(host)

    async def _store(self, op: StepOp, u: Unit, buf: HostBuffer | None, kind: str) -> None:
        e = self.e
        key = (kind, op.layer, op.part)
        if buf is None:
            await e.ledger.mark(key, op.step)
            return
        pool = e.pools["opt" if kind == "opt" else "param_out"]
        assert pool is not None
        await self.ssd_write.put(WriteTail(op.t, e.stores[kind], u, buf, pool, key, op.step))


def step_unit(
    e: Engine,
    grads: torch.Tensor | list[torch.Tensor],
    ou: Unit,
    otail: HostBuffer | None,
    pu: Unit,
    ptail: HostBuffer | None,
    step: int,
    *,
    counts: list[int | None] | None = None,
    layer: int = 0,
    first: int = 0,
    clip: torch.Tensor | None = None,
    skip: bool = False,
) -> None:
    """Blocking: AdamW on one part of one layer, its state split between the CPU head and
    the staged SSD tail, its gradient one tensor or consecutive pieces; then the new
    compute-dtype parameters into the param unit's head (in place) and staged tail. The
    gradient is read in full before any parameter is written (it may live in the memory of
    the delayed parameters it updates). `counts`: per parameter of the layer, its own step
    count, None to leave it (`Kernels.layer_steps`; the part starts at element `first` of
    the layer); without them every element takes `step`. `clip`: the coefficient of global-
    norm clipping, which scales the gradient (in place) first. `skip`: an iteration whose
    steps a dynamic loss scale skips (an overflow): no AdamW, the state as it was, and the
    compute-dtype parameters written from the masters all the same (vertical keeps the
    delayed gradient in their memory)."""
    ostore, pstore = e.stores["opt"], e.stores["param"]
    pieces = [ostore.head(ou)]
    if otail is not None:
        pieces.append(ostore.tail(ou, otail))
    if not skip:
        _adamw_unit(e, grads, pieces, step, counts=counts, layer=layer, first=first, clip=clip)
    dst = [pstore.head(pu)[0]]
    if ptail is not None:
        dst.append(pstore.tail(pu, ptail)[0])
    scatter([p[0] for p in pieces], dst)


def _adamw_unit(
    e: Engine,
    grads: torch.Tensor | list[torch.Tensor],
    pieces: list[torch.Tensor],
    step: int,
    *,
    counts: list[int | None] | None,
    layer: int,
    first: int,
    clip: torch.Tensor | None,
) -> None:
    """step_unit's AdamW on the unit's `pieces` (rows: master, m, v; the CPU head, then the staged tail)."""
    scale(grads if isinstance(grads, list) else [grads], clip)
    cuts = _aligned([[p[0] for p in pieces], [p[1] for p in pieces], [p[2] for p in pieces],
                     grads if isinstance(grads, list) else [grads]])
    steps: int | list[int] = step
    k = e.kernels
    decays = k.layer_decay[layer]
    decay: list[bool] | None = None
    if counts is not None or decays is not None:
        numels = k.kind_numels[k.kinds[layer]]
        cuts, steps, decay = _by_parameter(cuts, first, numels, counts or [step] * len(numels),
                                           decays or [True] * len(numels))
    adamw_step([c[0] for c in cuts], [c[3] for c in cuts], [c[1] for c in cuts], [c[2] for c in cuts],
               step=steps, opt=e.config.optimizer, lr=e.config.optimizer.lr_at(step), decay=decay)


def flush_delayed(e: Engine) -> None:
    """Blocking, outside any run: apply the delayed (alpha) steps still pending from the
    last iteration, so that the stores hold the fully updated model."""
    from snake.buffers import alloc_host

    t = e.next_t
    if not e.plans.has_delayed(t, e.first_delayed):
        return
    ostore, pstore = e.stores["opt"], e.stores["param"]
    coef, skip = e.clip.verdict(t - 1) if e.clip is not None and e.clip.waits else (None, False)
    e.flush_partial = False  # no layer changed yet: a failure here can be retried
    obuf = alloc_host(max(ostore.max_tail_bytes, 1), pin=False)
    pbuf = alloc_host(max(pstore.max_tail_bytes, 1), pin=False)
    gstore = e.stores.get("grad")
    gbuf = alloc_host(gstore.max_tail_bytes, pin=False) if gstore is not None and gstore.max_tail_bytes else None
    for layer in range(e.N):
        n_now, n_del = e.layer_parts[layer]
        grads = e.delayed_grads[layer] if e.vertical else e.accumulators[layer][n_now : n_now + n_del]
        ou, pu = ostore.unit((layer, 1)), pstore.unit((layer, 1))
        gu = e.delayed_tail(layer)
        if gu is not None:  # the gradient's SSD part, kept in its staging buffer or on SSD
            assert gstore is not None and gbuf is not None
            held = e.held_grads.get(layer)  # released by the caller once every layer is stepped
            if held is None:
                gstore.read_tail(gu, gbuf)
            grads = [*grads, gstore.tail(gu, gbuf if held is None else held)[0]]
        if ou.tail_n:
            ostore.read_tail(ou, obuf)
        e.flush_partial = True  # from here the CPU copies change in place
        skipped = e.delayed_skips.pop(layer, ())
        if skip:
            e.kernels.miss_step(layer, skipped)
        counts = e.kernels.layer_steps(layer, t, skipped)
        step_unit(e, grads, ou, obuf if ou.tail_n else None, pu, pbuf if pu.tail_n else None, t,
                  counts=counts, layer=layer, first=n_now, clip=coef, skip=skip)
        if ou.tail_n:
            ostore.write_tail(ou, obuf)
        if pu.tail_n:
            pstore.write_tail(pu, pbuf)
        e.ledger.set(("opt", layer, 1), t)
        e.ledger.set(("param", layer, 1), t)
    e.first_delayed = t + 1
    e.flush_partial = False


def _by_parameter(
    cuts: list[tuple[torch.Tensor, ...]], first: int, numels: list[int], counts: list[int | None],
    decays: list[bool],
) -> tuple[list[tuple[torch.Tensor, ...]], list[int], list[bool]]:
    """Cut aligned pieces (consecutive elements of a layer from element `first`) further at
    the layer's parameter boundaries (`numels`); keep each piece with its parameter's step
    count and weight-decay flag, dropping those of parameters left this step (count None)."""
    bounds = list(itertools.accumulate(numels))
    out: list[tuple[torch.Tensor, ...]] = []
    steps: list[int] = []
    decay: list[bool] = []
    pos = first
    for cut in cuts:
        n, a = cut[0].numel(), 0
        while a < n:
            i = bisect.bisect_right(bounds, pos + a)
            b = min(n, bounds[i] - pos)
            count = counts[i]
            if count is not None:
                out.append(tuple(c[a:b] for c in cut))
                steps.append(count)
                decay.append(decays[i])
            a = b
        pos += n
    return out, steps, decay


def _aligned(runs: list[list[torch.Tensor]]) -> list[tuple[torch.Tensor, ...]]:
    """Cut several runs of flat tensors (each run the same total length, split differently)
    at the union of their boundaries: tuples of equal-length views, one per run, in order."""
    total = sum(t.numel() for t in runs[0])
    assert all(sum(t.numel() for t in r) == total for r in runs), "runs differ in length"
    pos = [[0, 0] for _ in runs]  # (tensor index, offset in it) per run
    out = []
    done = 0
    while done < total:
        n = min(r[i].numel() - off for r, (i, off) in zip(runs, pos, strict=True))
        if n == 0:  # an empty tensor in some run: step over it
            for r, p in zip(runs, pos, strict=True):
                if r[p[0]].numel() == p[1]:
                    p[0], p[1] = p[0] + 1, 0
            continue
        out.append(tuple(r[i][off : off + n] for r, (i, off) in zip(runs, pos, strict=True)))
        for r, p in zip(runs, pos, strict=True):
            p[1] += n
            if p[1] == r[p[0]].numel():
                p[0], p[1] = p[0] + 1, 0
        done += n
    return out
