"""Learning-rate schedules: `AdamW(lr=..., lr_schedule=f)` steps iteration i (0-based) with
`lr * f(i)`, as `torch.optim.lr_scheduler.LambdaLR(optimizer, f)` stepped once after each
`optimizer.step()` does. A schedule is any callable from the step index to a factor; the
three here are those of transformers (`get_constant_schedule_with_warmup`,
`get_linear_schedule_with_warmup`, `get_cosine_with_min_lr_schedule_with_warmup` with its
`min_lr_rate`; `get_cosine_schedule_with_warmup` where it is 0),
to the bit within `total_steps` (tests/test_lr_schedule.py), and stay at their last
factor after it, where transformers' cosine would rise again.

A delayed share of a step (alpha) is applied in the next iteration with its own
iteration's rate, so the schedule gives the weights of plain PyTorch for every delay ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from snake.errors import ConfigError


def _steps(name: str, value: object, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigError(name, value, f"must be an integer >= {least}")


def _ratio(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not (0.0 <= value <= 1.0):
        raise ConfigError(name, value, "must be a number in [0, 1]", "the factor the rate ends at")


def _warmup(step: int, warmup_steps: int) -> float:
    return float(step) / float(max(1, warmup_steps))


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupConstant:
    """0 -> 1 linearly over `warmup_steps` (the first step's factor is 0, as in
    transformers), then 1."""

    warmup_steps: int = 0

    def __post_init__(self) -> None:
        _steps("lr_schedule.warmup_steps", self.warmup_steps, 0)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        return 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class _Decay:
    total_steps: int
    warmup_steps: int = 0
    min_ratio: float = 0.0

    def __post_init__(self) -> None:
        _steps("lr_schedule.total_steps", self.total_steps, 1)
        _steps("lr_schedule.warmup_steps", self.warmup_steps, 0)
        if self.warmup_steps > self.total_steps:
            raise ConfigError(
                "lr_schedule.warmup_steps", self.warmup_steps,
                f"must be <= total_steps={self.total_steps}", "the warm-up is part of the schedule's steps",
            )
        _ratio("lr_schedule.min_ratio", self.min_ratio)

    def _progress(self, step: int) -> float:
        span = float(max(1, self.total_steps - self.warmup_steps))
        return min(float(step - self.warmup_steps) / span, 1.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupLinear(_Decay):
    """0 -> 1 linearly over `warmup_steps`, then linearly down to `min_ratio` at
    `total_steps`, and `min_ratio` after. With min_ratio 0: transformers'
    `get_linear_schedule_with_warmup`."""

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        if self.min_ratio == 0.0:  # transformers' own expression, to the bit
            return max(0.0, float(self.total_steps - step) / float(max(1, self.total_steps - self.warmup_steps)))
        return (1.0 - self._progress(step)) * (1.0 - self.min_ratio) + self.min_ratio


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupCosine(_Decay):
    """0 -> 1 linearly over `warmup_steps`, then half a cosine down to `min_ratio` at
    `total_steps`, and `min_ratio` after: transformers'
    `get_cosine_with_min_lr_schedule_with_warmup` (`min_lr_rate=min_ratio`)."""

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * self._progress(step)))
        factor = factor * (1 - self.min_ratio) + self.min_ratio
        return max(0.0, factor)


SCHEDULES = {"constant": WarmupConstant, "linear": WarmupLinear, "cosine": WarmupCosine}


def describe(schedule: Any) -> Any:
    """A JSON value naming `schedule` (a checkpoint's manifest, `snake train`'s report):
    the built-in ones with their fields, another callable by its name."""
    if schedule is None:
        return None
    for name, cls in SCHEDULES.items():
        if type(schedule) is cls:
            return {"kind": name, **{f: getattr(schedule, f) for f in cls.__dataclass_fields__}}
    return {"kind": "callable", "name": getattr(schedule, "__qualname__", type(schedule).__qualname__)}


def check_rates(opt: Any, steps: range) -> None:
    """Evaluate `opt`'s rate at every AdamW step count in `steps` (1-based) before a run:
    a schedule that raises or gives a rate that is not a finite number >= 0 is a
    ConfigError naming the step, before any state changes."""
    if opt.lr_schedule is None:
        return
    for step in steps:
        try:
            rate = opt.lr_at(step)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(
                "optimizer.lr_schedule", describe(opt.lr_schedule),
                f"raised {type(exc).__name__}: {exc} at step index {step - 1}",
                "it is called with each step's 0-based index and must return a number",
            ) from exc
        if not isinstance(rate, float) or not math.isfinite(rate) or rate < 0:
            raise ConfigError(
                "optimizer.lr_schedule", describe(opt.lr_schedule),
                f"gives the rate {rate!r} at step index {step - 1}",
                "the factor times lr must be a finite number >= 0",
            )
