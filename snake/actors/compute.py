"""The compute actor: owns the device and walks the schedule (GreedySnake 3.4, 4.2-4.3).

| consumes  | BatchReady, ParamsOnDevice, ActivationOnDevice (ckpt, act_grad)      |
| produces  | ActivationProduced (ckpt, act_grad), GradsProduced, StepReport        |
| waits for | its inputs for the stage it is about to run                          |
| unblocked | by h2d (loads), data (batches)                                        |

Before each stage it publishes the stage's index on the clock: movers start each
operation a fixed number of stages ahead of the stage that needs it (reverse scheduling).
The first input of a stage may be carried on the device from the stage before (snake
order). Heavy work runs on the compute executor; the event loop stays free.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from snake.actors.base import Actor
from snake.channels import Mailbox, StageClock
from snake.engine import Engine
from snake.messages import ActivationProduced, BatchReady, GradsProduced, Stop
from snake.schedule import Stage, StagePlan, carries


@dataclass(frozen=True, slots=True)
class StepReport:
    step: int
    loss: float
    seconds: float
    tokens: int


class Compute(Actor):
    name = "compute"

    def __init__(
        self,
        engine: Engine,
        *,
        inbox: Mailbox,
        d2h: Mailbox,
        clock: StageClock,
        iterations: range,
        reports: list[StepReport],
        on_step: Callable[[StepReport], None] | None = None,
    ) -> None:
        super().__init__(engine.tracer)
        self.e = engine
        self.inbox = inbox
        self.d2h = d2h
        self.clock = clock
        self.iterations = iterations
        self.reports = reports
        self.on_step = on_step
        self.carry_plan = carries(engine.stages, engine.N)
        bwd = [s for s in engine.stages if s.phase == "bwd"]
        self.first_bwd = {layer: min(s.index for s in bwd if s.layer == layer) for layer in range(engine.N)}
        self.last_bwd = {layer: max(s.index for s in bwd if s.layer == layer) for layer in range(engine.N)}

    async def _k(self, label: str, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        call = functools.partial(fn, *args, **kwargs)
        return await self.work(self.e.executors["compute"], label, call)

    async def run(self) -> None:
        e = self.e
        for t in self.iterations:
            self.at(t)
            batch: BatchReady = await self.inbox.take(("batch", t))
            t0 = time.perf_counter()
            losses: list[torch.Tensor] = []
            carry: torch.Tensor | None = None
            for stage, sp in zip(e.stages, self.carry_plan, strict=True):
                g = t * e.S + stage.index
                self.at(t, stage.layer)
                await self.clock.publish(g)
                params = await self.inbox.take(("param", g))
                try:
                    if stage.phase == "fwd":
                        carry = await self._forward(t, g, stage, sp, params.slot, batch, carry, losses)
                    else:
                        carry = await self._backward(t, g, stage, sp, params.slot, batch, carry)
                finally:
                    if params.pooled:
                        e.param_slots.release(params.slot)
            self.at(t)
            await self._k("resident step", e.kernels.resident_step, t + 1)
            loss = await self._k("loss", _total, losses)
            report = StepReport(t, loss, time.perf_counter() - t0, batch.tokens)
            self.reports.append(report)
            if self.on_step is not None:
                self.on_step(report)
        await self.d2h.put(Stop(self.name))

    async def _forward(
        self,
        t: int,
        g: int,
        stage: Stage,
        sp: StagePlan,
        slot: torch.Tensor,
        batch: BatchReady,
        carry: torch.Tensor | None,
        losses: list[torch.Tensor],
    ) -> torch.Tensor | None:
        e, k, layer = self.e, self.e.kernels, stage.layer
        last = len(stage.micro_batches) - 1
        out_carry = None
        for j, m in enumerate(stage.micro_batches):
            self.at(t, layer, m)
            if layer == 0:
                x = await self._k(f"pre mb{m}", k.pre, batch.inputs[m], t, m)
                await self.d2h.put(ActivationProduced("ckpt", t, 0, m, x))
            elif j == 0 and sp.carry_in:
                assert carry is not None
                x = carry
            else:
                x = (await self.inbox.take(("ckpt", g, layer, m))).tensor
            y = await self._k(f"fwd L{layer} mb{m}", k.block_fwd, slot, x, t, layer, m)
            if layer == e.N - 1:
                loss, out = await self._k(f"head mb{m}", k.head, y, batch.targets[m], t, m)
                losses.append(loss)
                kind, out_layer = "act_grad", e.N - 1
            else:
                out, kind, out_layer = y, "ckpt", layer + 1
            keep = j == last and sp.keep_out
            if kind == "ckpt" or not keep:
                await self.d2h.put(ActivationProduced(kind, t, out_layer, m, out))
            if keep:
                out_carry = out
        return out_carry

    async def _backward(
        self,
        t: int,
        g: int,
        stage: Stage,
        sp: StagePlan,
        slot: torch.Tensor,
        batch: BatchReady,
        carry: torch.Tensor | None,
    ) -> torch.Tensor | None:
        e, k, layer = self.e, self.e.kernels, stage.layer
        last = len(stage.micro_batches) - 1
        out_carry = None
        acc = None
        if e.vertical:  # the first micro-batch writes the slot, the others add to it
            acc = await e.grad_slots.acquire()
        for j, m in enumerate(stage.micro_batches):
            self.at(t, layer, m)
            x = (await self.inbox.take(("ckpt", g, layer, m))).tensor
            if j == 0 and sp.carry_in:
                assert carry is not None
                gy = carry
            else:
                gy = (await self.inbox.take(("act_grad", g, layer, m))).tensor
            buf = acc if acc is not None else await e.grad_slots.acquire()
            gx = await self._k(
                f"bwd L{layer} mb{m}", k.block_bwd, slot, x, gy, buf,
                t=t, layer=layer, m=m, accumulate=acc is not None and j > 0,
            )
            if acc is None:
                first = stage.index == self.first_bwd[layer]
                lastmb = stage.index == self.last_bwd[layer]
                await self.d2h.put(GradsProduced(t, layer, m, buf, first, lastmb))
            if layer == 0:
                await self._k(f"pre bwd mb{m}", k.pre_bwd, batch.inputs[m], gx, t, m)
            elif j == last and sp.keep_out:
                out_carry = gx
            else:
                await self.d2h.put(ActivationProduced("act_grad", t, layer - 1, m, gx))
        if acc is not None:
            await self.d2h.put(GradsProduced(t, layer, -1, acc, True, True))
        return out_carry


def _total(losses: list[torch.Tensor]) -> float:
    return float(torch.stack(losses).sum().item())
