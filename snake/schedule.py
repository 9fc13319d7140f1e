"""The stage order of one iteration, and what each stage must find on the device.

Pure: no torch. A stage is the compute of one layer in one phase over some micro-batches.

vertical: layer-major. Forward layers 0..N-1, each over all M micro-batches, the order
    alternating per layer (0..M-1, then M-1..0, ...) so that the last micro-batch's output
    is the next stage's first input and stays on the device (GreedySnake 3.4, 4.2). The
    backward continues the snake over layers N-1..0.
horizontal: micro-batch-major (ZeRO-Infinity): for each micro-batch, forward over all layers
    then backward over all layers.

`transfer_plan` derives from the stages which inputs are loaded onto the device (and which
stay there: "carried"), and when each load may start: the need stage minus its lead
(reverse scheduling, GreedySnake 4.2-4.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Phase = Literal["fwd", "bwd"]
Mode = Literal["vertical", "horizontal"]


@dataclass(frozen=True, slots=True)
class Stage:
    index: int
    phase: Phase
    layer: int
    micro_batches: tuple[int, ...]


def build_schedule(n_layers: int, n_micro: int, mode: Mode, lowest: int = 0) -> tuple[Stage, ...]:
    """The stages of one iteration; the backward runs down to layer `lowest` only (below it
    nothing is trained: `snake.adapters.lowest_backward`)."""
    if n_layers < 1 or n_micro < 1:
        raise ValueError(f"need n_layers >= 1 and n_micro >= 1, got {n_layers}, {n_micro}")
    if not 0 <= lowest < n_layers:
        raise ValueError(f"need 0 <= lowest < n_layers, got {lowest}")
    stages: list[tuple[Phase, int, tuple[int, ...]]] = []
    if mode == "vertical":
        up = tuple(range(n_micro))
        down = up[::-1]
        k = 0
        for layer in range(n_layers):
            stages.append(("fwd", layer, up if k % 2 == 0 else down))
            k += 1
        for layer in reversed(range(lowest, n_layers)):
            stages.append(("bwd", layer, up if k % 2 == 0 else down))
            k += 1
    elif mode == "horizontal":
        for m in range(n_micro):
            stages.extend(("fwd", layer, (m,)) for layer in range(n_layers))
            stages.extend(("bwd", layer, (m,)) for layer in reversed(range(lowest, n_layers)))
    else:
        raise ValueError(f"mode={mode!r} must be 'vertical' or 'horizontal'")
    return tuple(Stage(i, p, layer, mbs) for i, (p, layer, mbs) in enumerate(stages))


Kind = Literal["param", "ckpt", "act_grad"]


@dataclass(frozen=True, slots=True)
class Load:
    """Bring `kind` for (layer, micro_batch) onto the device before stage `need` runs.

    `layer` names the unit: for "ckpt" the block whose *input* it is, for "act_grad" the
    block whose *output gradient* it is (the gradient flowing into layer `layer` from above,
    i.e. produced by layer+1 or by the head when layer == N-1). micro_batch is -1 for params.
    """

    kind: Kind
    layer: int
    micro_batch: int
    need: int


@dataclass(frozen=True, slots=True)
class StagePlan:
    """For one stage: whether its first input is carried on the device from the stage before,
    and whether its last output must also be kept there for the next stage."""

    carry_in: bool
    keep_out: bool


def carries(stages: tuple[Stage, ...], n_layers: int) -> tuple[StagePlan, ...]:
    out = []
    for i, s in enumerate(stages):
        prev = stages[i - 1] if i > 0 else None
        nxt = stages[i + 1] if i + 1 < len(stages) else None
        out.append(StagePlan(_chained(prev, s, n_layers), _chained(s, nxt, n_layers)))
    return tuple(out)


def _chained(a: Stage | None, b: Stage | None, n_layers: int) -> bool:
    """Does stage b consume, as its first micro-batch's input, what stage a produced last?"""
    if a is None or b is None or a.micro_batches[-1] != b.micro_batches[0]:
        return False
    if a.phase == "fwd" and b.phase == "fwd":
        return b.layer == a.layer + 1
    if a.phase == "fwd" and b.phase == "bwd":  # the head's gradient of the last layer
        return a.layer == n_layers - 1 and b.layer == n_layers - 1
    if a.phase == "bwd" and b.phase == "bwd":
        return b.layer == a.layer - 1
    return False


def device_loads(stages: tuple[Stage, ...], n_layers: int) -> tuple[Load, ...]:
    """Every device input of one iteration, in the order the compute actor consumes them."""
    plans = carries(stages, n_layers)
    loads: list[Load] = []
    for s, p in zip(stages, plans, strict=True):
        loads.append(Load("param", s.layer, -1, s.index))
        for j, m in enumerate(s.micro_batches):
            first = j == 0
            if s.phase == "fwd":
                if s.layer > 0 and not (first and p.carry_in):
                    loads.append(Load("ckpt", s.layer, m, s.index))
            else:
                loads.append(Load("ckpt", s.layer, m, s.index))
                if not (first and p.carry_in):
                    loads.append(Load("act_grad", s.layer, m, s.index))
    return tuple(loads)


def stored_outputs(stages: tuple[Stage, ...], n_layers: int) -> frozenset[tuple[Kind, int, int]]:
    """Which (kind, layer, micro_batch) outputs must be written to the host: every block input
    checkpoint, and every inter-layer gradient that is not carried on the device."""
    loaded = device_loads(stages, n_layers)
    return frozenset((ld.kind, ld.layer, ld.micro_batch) for ld in loaded if ld.kind != "param")


def fwd_stage_of(stages: tuple[Stage, ...], layer: int) -> int:
    """Index of the first forward stage of `layer` (the one a delayed optimizer step precedes)."""
    return next(s.index for s in stages if s.phase == "fwd" and s.layer == layer)


def last_bwd_stage_of(stages: tuple[Stage, ...], layer: int) -> int:
    """Index of the last backward stage of `layer` (after which its gradient is complete)."""
    return max(s.index for s in stages if s.phase == "bwd" and s.layer == layer)
