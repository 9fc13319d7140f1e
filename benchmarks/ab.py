"""What the A/B benchmarks share (`block_call_ab.py`, `train_ab.py`): a base revision checked
out into a temporary git worktree, and the result written as JSON and a bar chart of the
per-pair ratios."""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@contextlib.contextmanager
def base_worktree(revision: str) -> Iterator[tuple[str, Path]]:
    """(the revision's short hash, a worktree of it), removed afterwards."""
    base = subprocess.run(["git", "rev-parse", "--short", revision], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="snake-ab-"))
    worktree = tmp / "base"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(worktree), base], check=True, cwd=ROOT)
    try:
        yield base, worktree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], check=False, cwd=ROOT)
        shutil.rmtree(tmp, ignore_errors=True)


def write_result(name: str, result: dict, ylabel: str) -> None:
    """Print the median of result["pairs"]' ratios, add it to `result`, and write
    results/<name>.json and results/<name>.png."""
    ratios = [p["ratio"] for p in result["pairs"]]
    result["median_ratio"] = statistics.median(ratios)
    print(f"working tree / {result['base']}: median {result['median_ratio']:.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(range(1, len(ratios) + 1), ratios)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("pair")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0.8, 1.2)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=100)
