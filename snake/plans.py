"""What each mover does, in which order, and from which published stage on (pure, no torch).

Stages are numbered globally: g = iteration * S + stage.index, S stages per iteration.
Each operation has a start stage (need minus lead, GreedySnake 4.2-4.4) and a sort key
that also respects its dependencies, so a mover working through its plan in order never
waits on something queued behind itself:

  h2d        param / ckpt / act_grad to the device: one stage ahead (g - 1), in the order
             the compute actor consumes them.
  ssd_read   param tails two stages ahead; backward ckpt tails one stage ahead (a forward
             stage's ckpts are handed on from their write, never read back); optimizer-state
             tails one stage before their optimizer step, with the SSD part of a delayed
             step's gradient (vertical, placement.grad < 1) after them. A forward param read also waits
             for the optimizer steps that produce it (now-step of the last iteration,
             delayed step of this one), so it is ordered after their state reads.
  optimizer  now-step of layer l (1 - alpha of it) as soon as l's gradient is complete
             (its last backward stage; at alpha = 1 it steps nothing and only takes the
             gradient); the delayed alpha share in the next iteration, two stages before
             l's forward (and never before the now-step it follows).

Each plan is iteration-major: no operation of iteration t comes before one of t - 1 (the
reads' sort key has t right after the start stage, and no read of t starts before the last
read of t - 1 does). So an actor waiting for iteration t to begin, its batch in hand
(`StageClock`), holds nothing of t - 1 back: a source slower than the steps delays the
iteration it feeds, not the one before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from snake.schedule import Load, Stage, device_loads, fwd_stage_of, last_bwd_stage_of

PARAM_LEAD = 2
CKPT_LEAD = 1
H2D_LEAD = 1
DELAYED_LEAD = 2
NOW, DELAYED = 0, 1  # parameter / optimizer-state parts of a layer

StepKind = Literal["now", "delayed"]


@dataclass(frozen=True, slots=True)
class H2DOp:
    t: int
    g: int  # global need stage
    load: Load

    @property
    def start(self) -> int:
        return self.g - H2D_LEAD


@dataclass(frozen=True, slots=True)
class StepOp:
    """An optimizer step of one part of one layer, in iteration `t` (where it runs).
    now: grads of iteration t; delayed: grads of iteration t - 1. `step` is the AdamW
    step count it applies (1-based)."""

    t: int
    layer: int
    kind: StepKind
    key: float

    @property
    def part(self) -> int:
        return NOW if self.kind == "now" else DELAYED

    @property
    def step(self) -> int:
        return self.t + 1 if self.kind == "now" else self.t

    @property
    def grads_of(self) -> int:
        return self.t if self.kind == "now" else self.t - 1


@dataclass(frozen=True, slots=True)
class ReadOp:
    """SSD -> CPU staging of one unit's tail, for a consumer ("h2d" or "optimizer")."""

    t: int
    kind: Literal["param", "ckpt", "opt", "grad"]
    unit: tuple[int, ...]
    need_version: int
    start: float
    tag: tuple  # the consumer's message key for this tail
    sort: tuple


@dataclass(frozen=True, slots=True)
class Idle:
    """Iteration t has no operation for this actor: it waits for the iteration to begin
    (`StageClock.begun`) before its plan goes on to the next. A plan of no operations at all
    (every read's unit in CPU memory, an optimizer worker with no trained layer) would
    otherwise run through every iteration at once, on the event loop: those of a run()
    without steps over data that does not say its length are 2**62."""

    t: int


class Plans:
    def __init__(self, stages: tuple[Stage, ...], n_layers: int, *, delayed: bool) -> None:
        self.stages = stages
        self.S = len(stages)
        self.n_layers = n_layers
        self.delayed = delayed
        self.loads = device_loads(stages, n_layers)
        self.fwd = {layer: fwd_stage_of(stages, layer) for layer in range(n_layers)}
        # the layers with a backward (down to `lowest_backward`), and so with optimizer steps:
        # those below train nothing
        self.stepped = sorted({s.layer for s in stages if s.phase == "bwd"})
        self.last_bwd = {layer: last_bwd_stage_of(stages, layer) for layer in self.stepped}
        # checkpoints a forward stage loads: served from the CPU copy of their write
        self.fwd_ckpt_need = {
            (ld.layer, ld.micro_batch): ld.need
            for ld in self.loads
            if ld.kind == "ckpt" and stages[ld.need].phase == "fwd"
        }

    # optimizer ------------------------------------------------------------------------
    def key_now(self, t: int, layer: int) -> float:
        return t * self.S + self.last_bwd[layer]

    def key_delayed(self, t: int, layer: int) -> float:
        return max(t * self.S + self.fwd[layer] - DELAYED_LEAD, self.key_now(t - 1, layer))

    def grad_stays(self, layer: int) -> bool:
        """The layer's delayed step comes right after its now-step of the iteration before
        (vertical: layer 0, the last backward and the first forward): the SSD part of its
        delayed gradient stays in the staging buffer it was copied into, neither written nor
        read back, which would put an SSD round trip between the two iterations."""
        return self.S + self.fwd[layer] - DELAYED_LEAD <= self.last_bwd[layer]

    def has_delayed(self, t: int, first_delayed: int) -> bool:
        return self.delayed and t >= max(1, first_delayed)

    def steps(self, t: int, layers: list[int], first_delayed: int) -> list[StepOp]:
        layers = [layer for layer in layers if layer in self.last_bwd]
        ops = [StepOp(t, layer, "now", self.key_now(t, layer)) for layer in layers]
        if self.has_delayed(t, first_delayed):
            ops += [StepOp(t, layer, "delayed", self.key_delayed(t, layer)) for layer in layers]
        return sorted(ops, key=lambda o: (o.key, o.part, o.layer))

    def worker_plan(self, iterations: Iterable[int], layers: list[int], first_delayed: int) -> Iterator[StepOp | Idle]:
        for t in iterations:
            steps = self.steps(t, layers, first_delayed)
            if not steps:
                yield Idle(t)
            yield from steps

    # h2d ------------------------------------------------------------------------------
    def h2d_plan(self, iterations: Iterable[int]) -> Iterator[H2DOp | Idle]:
        for t in iterations:
            if not self.loads:
                yield Idle(t)
            for ld in self.loads:
                yield H2DOp(t, t * self.S + ld.need, ld)

    # ssd_read -------------------------------------------------------------------------
    def read_plan(
        self,
        iterations: Iterable[int],
        has_tail: Callable[[str, tuple[int, ...]], bool],
        first_delayed: int,
    ) -> Iterator[ReadOp | Idle]:
        """Each iteration's reads in their sort order, the iterations one after the other
        (no read of t sorts before one of t - 1: `tests/test_schedule.py`)."""
        for t in iterations:
            reads = self._reads(t, has_tail, first_delayed)
            if not reads:
                yield Idle(t)
            yield from reads

    def _reads(self, t: int, has_tail: Callable[[str, tuple[int, ...]], bool], first_delayed: int) -> list[ReadOp]:
        ops: list[ReadOp] = []
        seq = 0
        for step in self.steps(t, self.stepped, first_delayed):
            unit = (step.layer, step.part)
            opt_start = step.key - 1
            if has_tail("opt", unit):
                opt_tag: tuple = ("tail", "opt", unit, step.t, step.kind)
                sort = (opt_start, t, 0, step.key, step.part, step.layer, 0)
                ops.append(ReadOp(t, "opt", unit, step.step - 1, opt_start, opt_tag, sort))
                seq += 1
            if step.kind == "delayed" and has_tail("grad", unit) and not self.grad_stays(step.layer):
                # written by the layer's now-step of the iteration before, so never ahead of
                # the reads that step's stage needs (the reader would wait for the write
                # while they wait behind it); and ahead of the param read that waits for this step
                grad_start = max(opt_start, min(self.key_now(t - 1, step.layer) + 1, step.key))
                grad_tag: tuple = ("tail", "grad", unit, step.t, step.kind)
                sort = (grad_start, t, 0, step.key, step.part, step.layer, 1)
                ops.append(ReadOp(t, "grad", unit, step.grads_of + 1, grad_start, grad_tag, sort))
                seq += 1
        for ld in self.loads:
            g = t * self.S + ld.need
            if ld.kind == "param":
                start: float = float(g - PARAM_LEAD)
                stage = self.stages[ld.need]
                if stage.phase == "fwd" and stage.index == self.fwd[ld.layer] and ld.layer in self.last_bwd:
                    start = max(start, self.key_now(t - 1, ld.layer))
                    if self.has_delayed(t, first_delayed):
                        start = max(start, self.key_delayed(t, ld.layer))
                for part in (NOW, DELAYED):
                    unit = (ld.layer, part)
                    if has_tail("param", unit):
                        tag = ("tail", "param", unit, g)
                        ops.append(ReadOp(t, "param", unit, t, start, tag, (start, t, 1, g, seq, 0)))
                        seq += 1
            elif ld.kind == "ckpt" and self.stages[ld.need].phase == "bwd":
                unit = (ld.layer, ld.micro_batch)
                if has_tail("ckpt", unit):
                    tag = ("tail", "ckpt", unit, g)
                    ops.append(ReadOp(t, "ckpt", unit, t + 1, g - CKPT_LEAD, tag, (g - CKPT_LEAD, t, 1, g, seq, 0)))
                    seq += 1
        return sorted(ops, key=lambda op: op.sort)
