"""Clipping the gradients by their global norm (`AdamW(max_grad_norm=...)`), as
`torch.nn.utils.clip_grad_norm_` before `optimizer.step()`: every trained parameter's
gradient is multiplied by min(1, max_norm / (total_norm + 1e-6)), total_norm being the 2-norm
of the per-parameter 2-norms (in the model's parameter order).

The coefficient needs the whole iteration's gradient, so every step waits for it: clipping
runs at alpha = 1, where each layer's whole step is delayed into the next iteration
(GreedySnake 2: clipping "forces the optimizer to wait until the entire backward pass
completes"). Each layer's per-parameter norms are taken as its gradient completes, on the
device mover's copy thread (`add_layer`); at the iteration's end the compute actor waits
for them all (`layers_in`) and, on its thread, adds the resident parameters' norms and
computes the coefficient (`finish`), which the next iteration's delayed steps (and a
flush) wait for (`coef`) and multiply their gradients by. With `max_grad_norm=math.inf` the
norm is measured the same way, at any alpha, and no step waits for it.

With a dynamic loss scale (`snake.scaler`) the same total norm says whether any gradient
overflowed: `finish` then also decides whether the iteration's steps are skipped
(`skipped`) and updates the scale; the steps wait for that verdict as they wait for a
coefficient (`waits`).
"""

from __future__ import annotations

import asyncio
import math

import torch

from snake.adapters import ModelParts, flat_named, resident_named_params
from snake.scaler import LossScaler


def layer_norms(flat: torch.Tensor, numels: list[int]) -> list[torch.Tensor]:
    """Blocking: the 2-norm of each parameter's gradient in a layer's flat fp32 gradient."""
    return [torch.linalg.vector_norm(g) for g in flat[: sum(numels)].split(numels)]


class GradClip:
    """The per-iteration state of clipping and of a dynamic loss scale: the norms that came
    in, the coefficients and the skipped iterations."""

    def __init__(self, max_norm: float | None, parts: ModelParts, scaler: LossScaler | None = None, *,
                 lowest: int = 0) -> None:
        """`lowest`: the lowest layer with a backward (`lowest_backward`): those below add no norms."""
        self.max_norm = math.inf if max_norm is None else float(max_norm)
        self.clips = math.isfinite(self.max_norm)  # math.inf: the norm is measured, nothing waits for it
        self.scaler = scaler
        self.waits = self.clips or scaler is not None  # every step waits for `finish`
        self.n_layers = len(parts.blocks) - lowest
        # per trained parameter in the model's order (tied ones once): (layer, index in its
        # flat state), or (-1, index in the resident lists)
        res = {n: i for i, (n, _) in enumerate(resident_named_params(parts))}
        prefix = parts.blocks_prefix + "."
        flat = [{n: j for j, (n, _) in enumerate(flat_named(b))} for b in parts.blocks]
        self.order: list[tuple[int, int]] = []
        for name, p in parts.model.named_parameters():
            if name in res:
                self.order.append((-1, res[name]))
            elif p.requires_grad and name.startswith(prefix):
                layer, _, pname = name[len(prefix):].partition(".")
                if pname in flat[int(layer)]:
                    self.order.append((int(layer), flat[int(layer)][pname]))
        self._norms: dict[int, dict[int, list[torch.Tensor]]] = {}
        self._in: dict[int, asyncio.Event] = {}
        self._ready: dict[int, asyncio.Event] = {}
        self.coefs: dict[int, torch.Tensor | None] = {}  # iteration -> min(1, clip coefficient), fp32 0-d
        self.totals: dict[int, float] = {}  # iteration -> the total norm before clipping
        self.skips: dict[int, bool] = {}  # iteration -> its steps are skipped (a gradient overflowed)
        self.scales: dict[int, float] = {}  # iteration -> the loss scale its backward used

    def _event(self, events: dict[int, asyncio.Event], t: int) -> asyncio.Event:
        if t not in events:
            events[t] = asyncio.Event()
        return events[t]

    def add_layer(self, t: int, layer: int, norms: list[torch.Tensor]) -> None:
        """On the event loop: layer `layer`'s gradient of iteration `t` is complete."""
        got = self._norms.setdefault(t, {})
        got[layer] = norms
        if len(got) == self.n_layers:
            self._event(self._in, t).set()

    async def layers_in(self, t: int) -> None:
        """Every layer's norms of iteration `t` are in."""
        await self._event(self._in, t).wait()

    def finish(self, t: int, resident: list[torch.Tensor]) -> tuple[torch.Tensor | None, bool]:
        """Blocking, once `layers_in(t)`: the total norm with the resident parameters' norms
        (`resident`, one per resident parameter); the coefficient (None without clipping)
        and whether the iteration's steps are skipped (a dynamic loss scale, and a norm
        that is not finite: some element overflowed), kept for `coef` and `skipped`; the
        loss scale updated. Returns (coefficient, skipped)."""
        layers = self._norms.pop(t)
        norms = [(resident[i] if layer < 0 else layers[layer][i]).to("cpu", torch.float32) for layer, i in self.order]
        total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        coef = torch.clamp(self.max_norm / (total + 1e-6), max=1.0) if self.clips else None
        skip = False
        if self.scaler is not None:
            skip = not math.isfinite(float(total))
            self.scales[t] = self.scaler.scale
            self.scaler.update(skip)
        self.coefs[t] = coef
        self.skips[t] = skip
        self.totals[t] = float(total)
        for old in [k for k in self.coefs if k < t - 1]:  # a delayed step needs only the last one
            self.coefs.pop(old)
            for d in (self.totals, self.skips, self.scales):
                d.pop(old, None)
        self._in.pop(t, None)
        return coef, skip

    def mark_ready(self, t: int) -> None:
        """On the event loop, after `finish(t)`."""
        self._event(self._ready, t).set()
        for old in [k for k in self._ready if k < t - 1]:
            self._ready.pop(old)

    async def coef(self, t: int) -> tuple[torch.Tensor | None, bool]:
        """The coefficient of iteration `t` and whether its steps are skipped, once the
        compute actor has them."""
        if t not in self.coefs:  # set, whole, by finish()
            await self._event(self._ready, t).wait()
        return self.coefs[t], self.skips[t]

    def verdict(self, t: int) -> tuple[torch.Tensor | None, bool]:
        """`coef` of an iteration already finished (a flush, outside a run)."""
        return self.coefs[t], self.skips[t]


def scale(grads: list[torch.Tensor], coef: torch.Tensor | None) -> None:
    """Multiply the gradients by the clip coefficient in place, as clip_grad_norm_ does (a
    coefficient of 1, no clipping, leaves them as they are)."""
    if coef is None or float(coef) >= 1.0:
        return
    for g in grads:
        g.mul_(coef.to(g.device))


def json_float(x: float | None) -> float | str | None:
    """A number as a strict JSON value: one that is not finite (max_grad_norm=math.inf, an
    overflowed step's norm) as "inf", "-inf" or "nan" (JSON has neither)."""
    return x if x is None or math.isfinite(x) else str(x)
