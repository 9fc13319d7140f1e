"""The compute actor: owns the device and walks the schedule (GreedySnake 3.4, 4.2-4.3).

| consumes  | BatchReady, ParamsOnDevice, ActivationOnDevice (ckpt, act_grad)      |
| produces  | ActivationProduced (ckpt, act_grad), GradsProduced, StepReport        |
| waits for | its inputs for the stage it is about to run                          |
| unblocked | by h2d (loads), data (batches)                                        |

Before each stage it publishes the stage's index on the clock: movers start each
operation a fixed number of stages ahead of the stage that needs it (reverse scheduling).
The first input of a stage may be carried on the device from the stage before (snake
order). Heavy work runs on the compute executor; the event loop stays free. Within a stage
the micro-batches are independent, so up to WINDOW of them are queued on the (one-thread,
FIFO) executor at once: the thread goes from one micro-batch to the next without waiting
for the event loop to hand it the next one (that hop left the compute thread idle ~9 % of
the time at 32-token micro-batches on a 2-core CPU). Each queued job runs a micro-batch's
whole chain (pre + block forward for layer 0, block forward + head for the last layer,
block backward + pre backward for layer 0); on a CPU device, where the event loop and the
kernels share the cores and every hand-over between them costs the kernels, a job runs up
to CPU_GROUP consecutive micro-batches whose inputs are already in (never waiting for more),
each still traced as its own span. On a CPU device a job also writes its outputs
whose store units live wholly in CPU memory straight into them (`Engine.inline_store`), and
the actor marks them written itself: no d2h copy for those (with a metered link, d2h charges
the link's time first, in order with its copies, and marks them). On CUDA the compute thread only
queues a job's kernels on the device: the job is done when the device reaches its end mark
(`Engine.marks`, waited for on the sync thread), so the thread queues the next job while the
device still runs this one, and each micro-batch's trace span is its time on the device.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from snake.actors.base import Actor
from snake.blocking import settle, wait_blocking
from snake.channels import Mailbox, StageClock
from snake.engine import Engine
from snake.messages import ActivationProduced, BatchReady, GradsProduced, ParamsOnDevice, Stop
from snake.schedule import Stage, StagePlan, carries

WINDOW = 2  # jobs queued on the compute executor at once, within a stage
# On a CPU device: the most micro-batches one job runs (those whose inputs are in when it is
# queued), so that the event loop and the compute thread trade places less often.
CPU_GROUP = 4


@dataclass(slots=True)
class _Part:
    """A micro-batch's work in a job."""

    label: str
    j: int  # index in the stage
    m: int  # micro-batch
    fn: Callable[[], Any]  # blocking: runs on the compute thread
    times: list[float] = field(default_factory=lambda: [0.0, 0.0])  # start, end there (tracer clock)
    buf: torch.Tensor | None = None  # its gradient buffer (horizontal backward)
    # the job wrote its (first, last) stored output into CPU memory itself (Engine.inline_store)
    inline: tuple[bool, bool] = (False, False)
    marks: tuple[Any, Any] | None = None  # on CUDA: its start and end on the compute stream


@dataclass(slots=True)
class _Job:
    """Consecutive micro-batches of a stage, run one after the other on the compute thread."""

    parts: list[_Part]
    fut: asyncio.Future[list[Any]]


@dataclass(slots=True)
class _Box:
    """The output a stage keeps on the device for the next stage's first micro-batch (snake
    order). The job making it fills it on the compute thread; the job using it runs after
    on the same (FIFO, one-thread) executor and, on CUDA, the same stream, so it may be
    queued before the first is done."""

    tensor: torch.Tensor | None = None


@dataclass(slots=True)
class _StageRun:
    """A stage as the compute actor runs it."""

    t: int
    g: int
    stage: Stage
    sp: StagePlan
    params: ParamsOnDevice
    box_in: _Box | None  # the output the stage before kept (if sp.carry_in)
    acc: torch.Tensor | None  # vertical backward: the stage's gradient slot
    box_out: _Box | None = None  # where this stage keeps its last output (if sp.keep_out)
    pending: deque[_Job] = field(default_factory=deque)  # queued jobs not yet handed on
    j: int = 0  # the next micro-batch's index in the stage

    def __post_init__(self) -> None:
        if self.sp.keep_out:
            self.box_out = _Box()


@dataclass(frozen=True, slots=True)
class StepReport:
    step: int
    loss: float
    # wall time from the end of the step before (the start of the run for its first) to this
    # step's end, the wait for its batch included: over a run they add up to its wall time
    # with the last on_step's (RunReport.tail_s; each other on_step's is the next step's)
    seconds: float
    tokens: int  # the batch's target positions, those at IGNORE_INDEX included (computed over)
    lr: float  # the optimizer's rate for this step (`AdamW.lr_at`)
    # with AdamW.max_grad_norm or a dynamic loss scale: the gradients' global 2-norm, before
    # clipping (what clip_grad_norm_ returns; inf or nan where one overflowed); None without
    grad_norm: float | None = None
    # float16: the loss scale this step's backward used; None in other dtypes
    loss_scale: float | None = None
    # a dynamic loss scale's overflow: no parameter was stepped (as GradScaler.step skips
    # optimizer.step()); the learning-rate schedule counted the step all the same
    skipped: bool = False
    # of `seconds`, the time the compute actor waited for this step's batch (the data actor
    # reads a few ahead, so ~0 unless the data is slower than the steps: an input-bound run)
    data_wait_s: float = 0.0


class Compute(Actor):
    name = "compute"

    def __init__(
        self,
        engine: Engine,
        *,
        inbox: Mailbox,
        batches: Mailbox,
        d2h: Mailbox,
        clock: StageClock,
        reports: list[StepReport],
        on_step: Callable[[StepReport], None] | None = None,
    ) -> None:
        super().__init__(engine.tracer)
        self._inflight = 0  # jobs handed to the compute thread and not yet done there
        self.e = engine
        self.inbox = inbox
        self.batches = batches  # the data actor's, apart: a batch never waits in `inbox`'s stash
        self.d2h = d2h
        self.clock = clock
        self.reports = reports
        self.on_step = on_step
        self.carry_plan = carries(engine.stages, engine.N)
        bwd = [s for s in engine.stages if s.phase == "bwd"]
        self.first_bwd = {layer: min(s.index for s in bwd if s.layer == layer) for layer in engine.plans.stepped}
        self.last_bwd = {layer: max(s.index for s in bwd if s.layer == layer) for layer in engine.plans.stepped}
        self.group = CPU_GROUP if engine.device.type == "cpu" else 1

    async def _k(self, label: str, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        call = functools.partial(fn, *args, **kwargs)
        self._inflight += 1  # as a job (`_start`): a queued job's end must not mark the actor idle
        try:
            return await self.work(self.e.executors["compute"], label, call)
        finally:
            self._inflight -= 1

    async def run(self) -> None:
        e = self.e
        t0 = time.perf_counter()  # the step's start: the run's, then the step before's end
        e.tail_s = 0.0
        for t in self.clock.iterations():
            self.at(t)
            waited = time.perf_counter()
            if not await self.clock.runs(t):
                break  # the run stopped before iteration t (the data, or a stop asked for)
            batch: BatchReady = await self.batches.take(("batch", t))
            await self.clock.took(t)
            waited = time.perf_counter() - waited
            losses: list[torch.Tensor] = []
            box: _Box | None = None  # the output the stage before kept on the device
            ahead: _StageRun | None = None  # the next stage, its first job maybe already queued
            stages = list(zip(e.stages, self.carry_plan, strict=True))
            try:
                for i, (stage, sp) in enumerate(stages):
                    g = t * e.S + stage.index
                    self.at(t, stage.layer)
                    await self.clock.publish(g)
                    if ahead is not None:
                        run, ahead = ahead, None
                    else:
                        params = await self.inbox.take(("param", g))
                        acc = await e.grad_slots.acquire() if e.vertical and stage.phase == "bwd" else None
                        run = _StageRun(t, g, stage, sp, params, box, acc)
                    nxt = (t * e.S + stages[i + 1][0].index, *stages[i + 1]) if i + 1 < len(stages) else None
                    try:
                        ahead = await self._stage(run, batch, losses, nxt)
                    finally:
                        if run.params.pooled:
                            e.param_slots.release(run.params.slot)
                    box = run.box_out
            except BaseException:  # cancelled between two stages: the next one's queued job first
                if ahead is not None:
                    await self._drop(ahead)
                raise
            self.at(t)
            clip = None
            if e.clip is not None:  # every layer's gradient norms are in: the coefficient is the step's
                await e.clip.layers_in(t)
                clip = functools.partial(e.clip.finish, t)
            try:
                moved = await self._k("resident step", e.kernels.resident_step, t + 1, clip)
            finally:  # its SSD transfers (the state there), traced as the storage movers' are
                for actor, label, start, end, link, nbytes in e.kernels.resident.take_transfers():
                    e.tracer.add(actor, label, start, end, link=link, bytes=nbytes)
            if e.clip is not None:
                e.clip.mark_ready(t)
            if moved:  # the resident optimizer state on SSD: read and written back once each
                e.traffic.add(t, "ssd", "cpu", "opt", moved // 2)
                e.traffic.add(t, "cpu", "ssd", "opt", moved // 2)
            loss = await self._k("loss", _total, losses)
            scale = e.clip.scales[t] if e.scaler is not None and e.clip is not None else e.kernels.scale
            end = time.perf_counter()
            report = StepReport(t, loss, end - t0, batch.tokens, e.config.optimizer.lr_at(t + 1),
                                None if e.clip is None else e.clip.totals[t],
                                scale if e.config.dtype == "float16" else None,
                                e.clip is not None and e.clip.skips[t], waited)
            t0 = end  # on_step's time is the next step's: the steps' seconds add up to the run's
            self.reports.append(report)
            if self.on_step is not None:
                try:
                    self.on_step(report)
                except Exception as exc:  # the run stops before its next step not begun, then raises it
                    self.clock.request_stop(exc)
        # the last on_step's time, which no next step takes: the run report's (RunReport.tail_s)
        e.tail_s = time.perf_counter() - t0 if self.reports else 0.0
        await self.d2h.put(Stop(self.name))

    # -- queued jobs --------------------------------------------------------------------
    async def _start(self, parts: list[_Part]) -> _Job:
        if self.busy is None:  # as Actor.work: busy from before the fault hook on
            self.busy = (parts[0].label, self.tracer.now())
        # in flight from here on: an earlier job that ends while the fault hook (tests) holds
        # this one must not mark the actor idle
        self._inflight += 1
        try:
            if self.fault_hook is not None:
                for part in parts:
                    await self.fault_hook(self.name, part.label)
        except BaseException:
            self._job_done(None)
            raise
        now = self.tracer.now
        marks = self.e.marks

        def call() -> list[Any]:
            out = []
            for part in parts:
                part.times[0] = now()
                start = marks.mark() if marks is not None else None
                try:
                    out.append(part.fn())
                finally:
                    part.times[1] = now()
                    if marks is not None:
                        part.marks = (start, marks.mark())
            return out

        fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().run_in_executor(self.e.executors["compute"], call)
        if marks is not None:  # queued on the device, not done: done when its end mark is reached
            fut = asyncio.ensure_future(self._reached(fut, parts, marks))
        fut.add_done_callback(self._job_done)
        return _Job(parts, fut)

    async def _reached(self, launched: asyncio.Future[list[Any]], parts: list[_Part], marks: Any) -> list[Any]:
        """A job whose kernels the compute thread queued on the device (CUDA): its outputs
        once the device has run them, waited for on the sync thread. The compute thread
        meanwhile queues the next job (up to WINDOW), so the device does not idle while the
        host hands one job's outputs on and starts the next. The parts' trace spans become
        the device's: from their marks, anchored where the job's last mark was seen."""
        loop = asyncio.get_running_loop()
        sync = self.e.executors["sync"]
        try:
            out = await wait_blocking(launched)
        except BaseException:
            # kernels the job queued before it failed may still read the stage's buffers
            await settle(loop.run_in_executor(sync, marks.drain))
            raise
        await wait_blocking(loop.run_in_executor(sync, self._device_times, parts, marks))
        return out

    def _device_times(self, parts: list[_Part], marks: Any) -> None:
        """Blocking (sync thread): wait for the job's last mark, then set each part's span
        to its time on the device, counted back from then."""
        last = parts[-1].marks
        assert last is not None
        marks.wait(last[1])
        seen = self.tracer.now()
        for part in parts:
            assert part.marks is not None
            start, end = part.marks
            stop = seen - marks.seconds(end, last[1])
            part.times[0], part.times[1] = stop - marks.seconds(start, end), stop

    def _job_done(self, _: asyncio.Future | None) -> None:
        # a finished job the actor has not collected yet (it may be waiting for the next
        # one's inputs) is not work in progress: the watchdog must not blame it for a stall
        self._inflight -= 1
        if self._inflight == 0:
            self.busy = None

    async def _finish(self, job: _Job, pending: deque[_Job], t: int, layer: int) -> list[Any]:
        self.at(t, layer, job.parts[-1].m)
        try:
            # cancelled: the run is torn down (`on_cancel` sets the engine's stop), so a job
            # that waits for a data source's next() (`Kernels.rng`) gives up instead
            return await wait_blocking(job.fut, self.on_cancel)
        finally:
            for part in job.parts:
                if part.times[1]:
                    self.tracer.add(self.name, part.label, part.times[0], part.times[1])
            self.busy = (pending[0].parts[0].label, self.tracer.now()) if pending and self._inflight else None

    async def _drain(self, pending: deque[_Job]) -> None:
        """After a failure or cancellation: let queued jobs finish (they use the stage's
        buffers) before the error propagates. The run is torn down: the engine's stop is set
        first, so that a queued job waiting for a data source's next() gives up
        (`Kernels.rng`)."""
        if pending:
            self.e.stop.set()
        while pending:
            await settle(pending.popleft().fut)
        self.busy = None

    async def _inputs(self, keys: list[tuple], first: bool) -> list[torch.Tensor] | None:
        """The tensors of these inbox messages: waited for by a job's first micro-batch; for
        a later one only if all are already in (None otherwise: the job ends before it)."""
        if not first and not self.inbox.ready(*keys):
            return None
        return [(await self.inbox.take(k)).tensor for k in keys]

    # -- stages ------------------------------------------------------------------------
    async def _stage(
        self, run: _StageRun, batch: BatchReady, losses: list[torch.Tensor],
        nxt: tuple[int, Stage, StagePlan] | None,
    ) -> _StageRun | None:
        """Queue the stage's micro-batches (up to WINDOW jobs at once), then, before collecting
        the last ones, the next stage's first if everything it needs is already in (never
        waiting: the stage's own outputs and buffers are handed on only below). Returns that
        next stage (None if it was not ready); hands the stage's gradient slot on."""
        pending = run.pending
        n = len(run.stage.micro_batches)
        group = self.group if run.stage.phase == "fwd" or self.e.vertical else 1
        ahead: _StageRun | None = None
        try:
            while run.j < n:
                parts: list[_Part] = []
                while run.j < n and len(parts) < group:
                    part = await self._part(run, batch, wait=not parts)
                    if part is None:
                        break
                    parts.append(part)
                pending.append(await self._start(parts))
                if len(pending) >= WINDOW:
                    await self._done(run, pending.popleft(), losses)
            if nxt is not None:
                ahead = await self._ahead(run, nxt, batch)
            while pending:
                await self._done(run, pending.popleft(), losses)
        except BaseException:
            await self._drain(pending)
            if ahead is not None:
                await self._drop(ahead)
            raise
        if run.acc is not None:
            await self.d2h.put(GradsProduced(run.t, run.stage.layer, -1, run.acc, True, True))
        return ahead

    async def _ahead(self, run: _StageRun, nxt: tuple[int, Stage, StagePlan], batch: BatchReady) -> _StageRun | None:
        """The next stage with its first micro-batch queued, if its parameters (and on the
        vertical backward its gradient slot) are in; None otherwise, nothing taken."""
        e = self.e
        g, stage, sp = nxt
        await asyncio.sleep(0)
        if not self.inbox.ready(("param", g)):
            return None
        acc = None
        if e.vertical and stage.phase == "bwd":
            acc = e.grad_slots.try_acquire()
            if acc is None:
                return None
        params = await self.inbox.take(("param", g))
        ahead = _StageRun(run.t, g, stage, sp, params, run.box_out, acc)
        try:
            part = await self._part(ahead, batch, wait=False)
            if part is not None:
                ahead.pending.append(await self._start([part]))
        except BaseException:
            await self._drop(ahead)
            raise
        return ahead

    async def _drop(self, ahead: _StageRun) -> None:
        """After a failure or cancellation: let the next stage's queued job finish, then
        return its parameter slot."""
        try:
            await self._drain(ahead.pending)
        finally:
            if ahead.params.pooled:
                self.e.param_slots.release(ahead.params.slot)

    async def _part(self, run: _StageRun, batch: BatchReady, wait: bool) -> _Part | None:
        """The stage's next micro-batch as a part of a job, its inputs taken from the inbox
        (waited for if `wait`, else None unless all are in)."""
        e, t, g, layer, sp = self.e, run.t, run.g, run.stage.layer, run.sp
        j = run.j
        m = run.stage.micro_batches[j]
        last = j == len(run.stage.micro_batches) - 1
        keep = run.box_out if last and sp.keep_out else None
        carried = j == 0 and sp.carry_in
        self.at(t, layer, m)
        if run.stage.phase == "fwd":
            out_kind, out_layer = self._fwd_output(layer)
            x: torch.Tensor | _Box | None = None
            if layer == 0:
                pass  # the job embeds its tokens
            elif carried:
                assert run.box_in is not None
                x = run.box_in
            else:
                got = await self._inputs([("ckpt", g, layer, m)], first=wait)
                if got is None:
                    return None
                x = got[0]
            stores = (layer == 0 and ("ckpt", 0, m) in e.stored, (out_kind, out_layer, m) in e.stored)
            sinks = (
                e.inline_store("ckpt", 0, m) if stores[0] else None,
                e.inline_store(out_kind, out_layer, m) if stores[1] and (out_kind == "ckpt" or keep is None) else None,
            )
            fn = functools.partial(self._fwd_job, run.params.slot, x, batch, t, layer, m, sinks, keep)
            run.j += 1
            return _Part(f"fwd L{layer} mb{m}", j, m, fn, inline=(sinks[0] is not None, sinks[1] is not None))
        keys = [("ckpt", g, layer, m)] + ([] if carried else [("act_grad", g, layer, m)])
        buf = run.acc
        if buf is None and not wait:  # horizontal: each micro-batch has a gradient buffer of its own
            buf = e.grad_slots.try_acquire()
            if buf is None:
                return None
        got = await self._inputs(keys, first=wait)
        if got is None:
            if run.acc is None and buf is not None:
                e.grad_slots.release(buf)
            return None
        if buf is None:
            buf = await e.grad_slots.acquire()
        x_in, gy = (got[0], run.box_in) if carried else (got[0], got[1])
        assert gy is not None
        sink = e.inline_store("act_grad", layer - 1, m) if layer > e.lowest and keep is None else None
        bwd = functools.partial(
            self._bwd_job, run.params.slot, x_in, gy, buf, batch, t, layer, m, run.acc is not None and j > 0, sink, keep
        )
        run.j += 1
        return _Part(f"bwd L{layer} mb{m}", j, m, bwd, buf=buf, inline=(False, sink is not None))

    def _fwd_output(self, layer: int) -> tuple[str, int]:
        """(kind, layer) of the stored unit a layer's forward output goes to: the next
        layer's input checkpoint; for the last layer, the head's gradient into it."""
        n = self.e.N
        return ("act_grad", n - 1) if layer == n - 1 else ("ckpt", layer + 1)

    async def _done(self, run: _StageRun, job: _Job, losses: list[torch.Tensor]) -> None:
        """Hand a finished job's outputs on."""
        t, layer, sp = run.t, run.stage.layer, run.sp
        outs = await self._finish(job, run.pending, t, layer)
        last = len(run.stage.micro_batches) - 1
        if run.stage.phase == "fwd":
            out_kind, out_layer = self._fwd_output(layer)
            for part, (first, loss, out) in zip(job.parts, outs, strict=True):
                # each output a later stage loads (`Engine.stored`): not layer 0's input where
                # no backward recomputes from it, nor below the lowest layer with a backward a
                # checkpoint that stays on the device for the next stage
                if first is not None and ("ckpt", 0, part.m) in self.e.stored:
                    await self._stored("ckpt", t, 0, part.m, first, part.inline[0])
                if loss is not None:
                    losses.append(loss)
                if (out_kind, out_layer, part.m) in self.e.stored and (
                        out_kind == "ckpt" or not (part.j == last and sp.keep_out)):
                    await self._stored(out_kind, t, out_layer, part.m, out, part.inline[1])
            return
        for part, gx in zip(job.parts, outs, strict=True):
            if run.acc is None:
                assert part.buf is not None
                first_mb = run.stage.index == self.first_bwd[layer]
                last_mb = run.stage.index == self.last_bwd[layer]
                await self.d2h.put(GradsProduced(t, layer, part.m, part.buf, first_mb, last_mb))
            if layer > self.e.lowest and not (part.j == last and sp.keep_out):
                await self._stored("act_grad", t, layer - 1, part.m, gx, part.inline[1])

    def _fwd_job(
        self, slot: torch.Tensor, x: torch.Tensor | _Box | None, batch: BatchReady, t: int, layer: int, m: int,
        sinks: tuple[torch.Tensor | None, torch.Tensor | None], keep: _Box | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """Blocking: (layer-0 checkpoint or None, loss share or None, output). Each output
        with a sink (Engine.inline_store) is also written there; the output is also kept in
        `keep` for the next stage's first job."""
        k = self.e.kernels
        first = None
        if layer == 0:
            x = first = k.pre(batch.inputs[m], t, m)
        y = k.block_fwd(slot, _tensor(x), t, layer, m)
        loss = None
        if layer == self.e.N - 1:
            loss, y = k.head(y, batch.targets[m], t, m, trained=batch.trained)
        for out, sink in zip((first, y), sinks, strict=True):
            if sink is not None and out is not None:
                sink.copy_(out.reshape(-1))
        if keep is not None:
            keep.tensor = y
        return first, loss, y

    async def _stored(self, kind: str, t: int, layer: int, m: int, tensor: torch.Tensor, inline: bool) -> None:
        """Hand an output to the host tiers: d2h copies it there, or the job already wrote
        it into CPU memory (inline) and only the bookkeeping is left."""
        e = self.e
        if not inline or e.links:  # a metered link: d2h charges it, then marks the unit
            await self.d2h.put(ActivationProduced(kind, t, layer, m, None if inline else tensor))
            return
        e.traffic.add(t, "gpu", "cpu", kind, e.ckpt_elems * e.stores[kind].esize)
        await e.ledger.mark((kind, layer, m), t + 1)

    def _bwd_job(
        self, slot: torch.Tensor, x: torch.Tensor, gy: torch.Tensor | _Box, buf: torch.Tensor, batch: BatchReady,
        t: int, layer: int, m: int, accumulate: bool, sink: torch.Tensor | None, keep: _Box | None,
    ) -> torch.Tensor | None:
        """Blocking: the gradient into the block's input (None for the lowest layer with a
        backward: layer 0's pre backward runs here too, where pre trains anything), also
        written into `sink` if given (Engine.inline_store) and kept in `keep` for the next
        stage's first job."""
        e, k = self.e, self.e.kernels
        gx = k.block_bwd(slot, x, _tensor(gy), buf, t=t, layer=layer, m=m, accumulate=accumulate,
                         input_grad=layer > e.lowest or e.pre_trains)
        if layer == e.lowest:
            if e.pre_trains:
                assert gx is not None
                k.pre_bwd(batch.inputs[m], gx, t, m)
            return None
        assert gx is not None
        if sink is not None:
            sink.copy_(gx.reshape(-1))
        if keep is not None:
            keep.tensor = gx
        return gx


def _tensor(x: torch.Tensor | _Box | None) -> torch.Tensor:
    """On the compute thread: a job's input, or the output a job before it kept (`_Box`)."""
    if isinstance(x, _Box):
        assert x.tensor is not None, "the kept output of the stage before was not made"
        return x.tensor
    assert x is not None
    return x


def _total(losses: list[torch.Tensor]) -> float:
    return float(torch.stack(losses).sum().item())
