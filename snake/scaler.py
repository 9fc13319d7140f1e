"""float16's dynamic loss scale (`SnakeConfig(loss_scale=DynamicLossScale(...))`), as
`torch.amp.GradScaler` keeps it.

Iteration t's backward multiplies the loss by `scale` and each fp32 gradient by 1 / scale as
it accumulates (`Kernels`), which is GradScaler's `scale(loss)` and `unscale_` (for a power
of two, as the defaults keep it, to the bit). At the iteration's end, once every layer's
gradient norms are in (`snake.clip.GradClip`), a total norm that is not finite means an
element overflowed: none of the iteration's steps is taken (every parameter is left, as
when `GradScaler.step` skips `optimizer.step()`), and `update` backs the scale off;
otherwise it counts one more good iteration and grows the scale after `growth_interval`
of them. The learning-rate schedule still counts the iteration, as `LambdaLR` stepped
after every `scaler.step` does.

The finiteness is known only after the whole backward, so every step waits for it (alpha =
1, as clipping). SysX (section 3.2) steps first and rolls an overflowed iteration back by
inverting Adam; that inversion is not exact in floating point, so snake delays instead.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from snake.config import DynamicLossScale


def _f32(x: float) -> float:
    """x rounded to float32 (beyond its range: inf), as GradScaler's scale tensor holds it."""
    return float(torch.tensor(x, dtype=torch.float64).float())


class LossScaler:
    """The scale and the count of good iterations in a row (GradScaler's `_scale` and
    `_growth_tracker`). `update` runs once per iteration, on the compute thread, after the
    iteration's last use of `scale` and before the next iteration's first."""

    def __init__(self, cfg: DynamicLossScale) -> None:
        self.cfg = cfg
        self.scale = _f32(cfg.init_scale)
        self.growth_tracker = 0

    def update(self, found_inf: bool) -> None:
        """As `torch._amp_update_scale_` on a CPU: the products in double, stored in float32
        (`tests/test_loss_scale.py` checks this against it); a grown scale that is not finite
        is not taken."""
        c = self.cfg
        if found_inf:
            self.scale = _f32(self.scale * c.backoff_factor)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == c.growth_interval:
            grown = _f32(self.scale * c.growth_factor)
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0

    def state(self) -> dict[str, Any]:
        """For a checkpoint's manifest."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load(self, state: dict[str, Any]) -> None:
        self.scale = _f32(float(state["scale"]))
        self.growth_tracker = int(state["growth_tracker"])
