"""Algorithm 1 of GreedySnake (4.5): grow the micro-batch count until throughput saturates.

For each n (1, 2, ...), the best alpha is the argmax of predicted throughput over `alphas`,
each solved as an LP (`planner.solve`). The search keeps the smallest n that improved the
best throughput by at least 1 %, and stops after `patience` n's in a row without such a
gain, at `max_n`, or when n no longer fits in memory.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.profile import MachineProfile
from planner.solve import Infeasible, Plan, solve
from snake.config import Placement

# 0.00, 0.01, ..., 0.50. The paper's alpha is in [0, 1], but a layer's forward stage carries
# no more of any resource than its backward stage, so a delayed share above one half only
# lengthens the forward (tests/planner/test_plan_search.py checks it over both devices' time
# models). alpha = 1 is still run when clipping or a dynamic loss scale needs it.
ALPHAS = tuple(i / 100 for i in range(51))
MIN_GAIN = 1.01


def default_alphas(schedule: str) -> tuple[float, ...]:
    """Vertical: 0..0.5 by 0.01. Horizontal: 0 only (ZeRO-Infinity delays no step)."""
    return ALPHAS if schedule == "vertical" else (0.0,)


def best_alpha(
    profile: MachineProfile,
    n_micro: int,
    *,
    alphas: Sequence[float],
    schedule: str = "vertical",
    workers: int = 2,
    placement: Placement | None = None,
    resident: str | None = "cpu",
) -> Plan | Infeasible:
    """The plan of highest predicted throughput over alphas at n_micro (the smallest alpha
    among those within 1e-9 of it); the first Infeasible if none fits. resident: as
    `planner.solve.solve`."""
    best: Plan | None = None
    first_short: Infeasible | None = None
    for a in alphas:
        r = solve(
            profile, n_micro=n_micro, alpha=a, schedule=schedule, workers=workers,
            placement=placement, resident=resident,
        )
        if isinstance(r, Infeasible):
            first_short = first_short or r
        elif best is None or r.predicted_tokens_per_s > best.predicted_tokens_per_s * (1 + 1e-9):
            best = r
    if best is None:
        assert first_short is not None, "alphas must not be empty"
        return first_short
    return best


def search(
    profile: MachineProfile,
    *,
    schedule: str = "vertical",
    max_n: int = 64,
    alphas: Sequence[float] | None = None,
    patience: int = 2,
    workers: int = 2,
    placement: Placement | None = None,
    n_micro: int | None = None,
    resident: str | None = "cpu",
) -> Plan | Infeasible:
    """Smallest micro-batch count reaching saturated throughput, with its alpha and shares.

    alphas: candidates (None: `default_alphas(schedule)`). patience: n's in a row with < 1 %
    gain before stopping. placement / n_micro: fix them instead of searching. resident:
    where the resident optimizer state lives ("cpu", "ssd"; None: the faster). Returns the
    Infeasible of n = 1 (or of the fixed n) when nothing fits."""
    alphas = tuple(default_alphas(schedule) if alphas is None else alphas)
    if not alphas:
        raise ValueError("alphas must not be empty")
    def at(n: int) -> Plan | Infeasible:
        return best_alpha(
            profile, n, alphas=alphas, schedule=schedule, workers=workers, placement=placement,
            resident=resident,
        )

    if n_micro is not None:
        return at(n_micro)
    best: Plan | Infeasible = at(1)
    if isinstance(best, Infeasible):
        return best
    misses = 0
    for n in range(2, max_n + 1):
        r = at(n)
        if isinstance(r, Infeasible):
            break
        if r.predicted_tokens_per_s >= MIN_GAIN * best.predicted_tokens_per_s:
            best, misses = r, 0
        else:
            misses += 1
            if misses >= patience:
                break
    return best
