"""What a change costs a whole training run: the main job (`snake train`, the README's
embedded GPT on the bundled text, SSD tier included) at a base revision against the working
tree, in fresh processes, alternating. Where `block_call_ab.py` times the compute actor's
kernels alone, this times everything an iteration does: the movers, the optimizer steps
and the event loop too.

    python benchmarks/train_ab.py --base 6a1a4ef [--pairs 4] [--steps 30] [--name train_ab]

Any further arguments go to `snake train` in both trees (e.g. `--dtype bfloat16`). The base
revision is checked out into a temporary git worktree (removed afterwards). Each run's
seconds per iteration is the median of its steps after the first (warm-up); the table
gives each pair's ratio (working tree / base) and the median ratio. Writes
results/<name>.json and results/<name>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ab import ROOT, base_worktree, write_result

CHILD = "import sys, snake, snake.cli; print('SNAKE', snake.__file__); sys.exit(snake.cli.main(sys.argv[1:]))"


def run_child(tree: Path, out: Path, args: argparse.Namespace, extra: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = ["train", "--steps", str(args.steps), "--out", str(out), "--offload-dir", str(out / "off"), *extra]
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, check=True,
                          cwd=tree, env=env)
    used = next(line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("SNAKE "))
    assert Path(used).resolve().is_relative_to(tree.resolve()), used  # the tree's own snake ran
    report = json.loads((out / "report.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    steps = report["steps"][1:]
    return {"step_s": statistics.median(s["seconds"] for s in steps),
            "last_loss": report["steps"][-1]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision to compare the working tree with")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--name", default="train_ab")
    args, extra = ap.parse_known_args()
    pairs = []
    with base_worktree(args.base) as (base, worktree), tempfile.TemporaryDirectory(prefix="snake-ab-runs-") as tmp:
        for i in range(args.pairs):
            old = run_child(worktree, Path(tmp) / "run-base", args, extra)
            new = run_child(ROOT, Path(tmp) / "run-tree", args, extra)
            ratio = new["step_s"] / old["step_s"]
            pairs.append({"base": old, "tree": new, "ratio": ratio})
            print(f"pair {i + 1}: base {old['step_s']:.3f} s/iteration (loss {old['last_loss']:.4f}), working tree "
                  f"{new['step_s']:.3f} s (loss {new['last_loss']:.4f}), ratio {ratio:.3f}", flush=True)
    write_result(args.name, {"base": base, "args": vars(args), "train_args": extra, "pairs": pairs},
                 f"s per iteration, tree / {base}")

if __name__ == "__main__":
    main()
