"""The roofline of GreedySnake 3.1 next to both schedules' predictions, per micro-batch count.

Compute roofline: no I/O at all, n x (forward + recompute + backward) per layer plus the
resident pre/post work. I/O roofline: the optimizer states of every layer read and written
once per iteration over the SSD (all on SSD, as in the paper), whatever n is; a placement
that keeps optimizer states in CPU memory can beat it.
"""

from __future__ import annotations

from collections.abc import Iterable

from planner.profile import MachineProfile
from planner.search import best_alpha, default_alphas
from planner.solve import Plan
from snake.memory import OPT_BYTES_PER_ELEM


def compute_roofline(profile: MachineProfile, n: int) -> float:
    """Tokens/s with compute only."""
    s = profile.shape
    per_micro = s.n_layers * (
        profile.fwd_seconds + profile.recompute_seconds + profile.bwd_seconds
    ) + profile.pre_post_seconds
    return s.tokens_per_micro / per_micro


def io_roofline(profile: MachineProfile, n: int) -> float:
    """Tokens/s if an iteration took exactly one read and one write of all optimizer states."""
    s = profile.shape
    opt = s.n_layers * s.layer_params * OPT_BYTES_PER_ELEM
    seconds = opt / profile.ssd_read_bytes_per_s + opt / profile.ssd_write_bytes_per_s
    return n * s.tokens_per_micro / seconds


def _throughput(r) -> float | None:
    return r.predicted_tokens_per_s if isinstance(r, Plan) else None


def roofline(profile: MachineProfile, ns: Iterable[int], *, workers: int = 2) -> list[dict]:
    """One dict per n: compute_roofline_tokens_per_s, io_roofline_tokens_per_s, and the
    best predicted vertical_tokens_per_s / horizontal_tokens_per_s (None where n does not
    fit in memory)."""
    rows = []
    for n in ns:
        vertical = best_alpha(profile, n, alphas=default_alphas("vertical"), workers=workers)
        horizontal = best_alpha(
            profile, n, alphas=default_alphas("horizontal"), schedule="horizontal", workers=workers
        )
        rows.append(
            {
                "n": n,
                "compute_roofline_tokens_per_s": compute_roofline(profile, n),
                "io_roofline_tokens_per_s": io_roofline(profile, n),
                "vertical_tokens_per_s": _throughput(vertical),
                "horizontal_tokens_per_s": _throughput(horizontal),
            }
        )
    return rows


def plot_roofline(rows: list[dict], path: str, *, title: str = "") -> None:
    """Save the roofline and both schedules' predictions as an image (matplotlib, Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ns = [r["n"] for r in rows]
    roof = [min(r["compute_roofline_tokens_per_s"], r["io_roofline_tokens_per_s"]) for r in rows]
    # the I/O roof moves every optimizer state through the SSD (the paper's setting): a plan
    # that keeps some of them in CPU memory moves less and can sit above it
    ax.plot(ns, roof, "k--", label="roofline: min(compute, all optimizer states via SSD)")
    for key, style, label in (
        ("vertical_tokens_per_s", "o-", "vertical (GreedySnake)"),
        ("horizontal_tokens_per_s", "s-", "horizontal (ZeRO-Infinity)"),
    ):
        pts = [(r["n"], r[key]) for r in rows if r[key] is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=label, markersize=3)
    ax.set_xlabel("micro-batches per iteration")
    ax.set_ylabel("predicted tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
