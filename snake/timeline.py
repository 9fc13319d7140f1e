"""A per-actor Gantt chart of a trace: one row per actor, one bar per span, coloured by
what it moves or computes, so a reader sees at a glance who works and who waits."""

from __future__ import annotations

from pathlib import Path

from snake.trace import Span

COLORS = {
    "fwd": "#4c72b0",
    "bwd": "#dd8452",
    "head": "#8172b3",
    "pre": "#937860",
    "param": "#55a868",
    "ckpt": "#64b5cd",
    "act_grad": "#da8bc3",
    "grads": "#c44e52",
    "opt": "#ccb974",
    "adamw": "#8c8c8c",
    "batch": "#bbbbbb",
    "next(data)": "#e7298a",  # the wait for the user's data to give the next batch
    "eval": "#bcbd22",  # evaluate's loads and layers (snake.evaluate)
}
OTHER = "#999999"  # a span whose name has no colour of its own ("loss", "resident step")
ORDER = ["data", "compute", "h2d", "d2h", "ssd_read", "ssd_write"]


def _color(name: str) -> str:
    return COLORS.get(name.split(" ")[0], OTHER)


def plot_timeline(
    spans: list[Span], path: str | Path, *, window_s: float | None = None, title: str = "", dropped: int = 0
) -> None:
    """Write a PNG. `window_s`: show only the last that many seconds (None: everything).
    Every track of the trace gets its row, also one idle in the window. The x axis is the
    trace's own clock (seconds since the trainer was made), so a window says where in the
    run it is; the title says how much of the trace it shows. `dropped`: spans the tracer
    recorded but did not keep (the oldest), said in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not spans:
        raise ValueError("the trace has no spans to plot")
    end = max(s.end_s for s in spans)
    first = min(s.start_s for s in spans)
    start = first if window_s is None else max(first, end - window_s)
    actors = sorted({s.actor for s in spans}, key=lambda a: (ORDER.index(a) if a in ORDER else len(ORDER), a))
    spans = [s for s in spans if s.end_s >= start]
    row = {a: i for i, a in enumerate(actors)}
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.55 * len(actors)))
    by_color: dict[str, list[tuple[float, float]]] = {}
    by_row: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for s in spans:
        lo = max(s.start_s, start)
        by_row.setdefault((row[s.actor], _color(s.name)), []).append((lo, max(s.end_s - lo, 1e-5)))
    for (r, color), bars in by_row.items():
        ax.broken_barh(bars, (r - 0.38, 0.76), facecolors=color, edgecolors="none")
        by_color.setdefault(color, [])
    busy = {a: sum(s.end_s - max(s.start_s, start) for s in spans if s.actor == a) for a in actors}
    wall = max(end - start, 1e-9)
    ax.set_yticks(range(len(actors)))
    ax.set_yticklabels([f"{a}  ({100 * busy[a] / wall:.0f}% busy)" for a in actors])
    ax.invert_yaxis()
    ax.set_xlim(start, start + wall)
    ax.set_xlabel("seconds since the trainer was made (busy %: over the window shown)")
    ax.grid(axis="x", alpha=0.3)
    used = {k: v for k, v in [*COLORS.items(), ("other", OTHER)] if v in by_color}
    ax.legend(
        handles=[Patch(color=v, label=k) for k, v in used.items()],
        loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.02 * len(actors) / 4), ncol=min(len(used), 11), fontsize=8,
        frameon=False,
    )
    if not title:
        title = "snake: per-actor timeline (gaps are waits)"
        if start > first:
            title += f"; the last {wall:.2f} s of {end - first:.2f} s traced"
        if dropped:
            title += f"; the oldest {dropped} spans were not kept"
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
