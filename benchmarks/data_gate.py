"""What waiting for each step's batch costs: the working tree against a base revision.

Since round 41 no actor starts any work of a step before its batch is in hand (so data that
runs out or fails part-way ends the run cleanly, `tests/test_data_stops.py`). The data
actor reads two batches ahead, so within a run the wait should cost nothing while the data
keeps ahead; each run's first step's reads (its parameters' and optimizer states' SSD
tails) now wait for its first batch. This measures both, in fresh processes alternating
base and tree, on a GPT with every kind half on SSD and a source whose next() takes
`--next-ms` (a loader's I/O):

  steady:  run(--steps): the median step after the first;
  per run: --runs calls of run(1) (a loop that saves or evaluates between steps): the
           median wall time of a call after the first.

    python benchmarks/data_gate.py --base 2fa50e2 [--pairs 4] [--next-ms 20]   # ~3 min on 2 cores

Writes benchmarks/results/data_gate.json and .png (the per-run ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ab import ROOT, base_worktree, write_result

CHILD = r'''
import asyncio, json, statistics, sys, time
sys.path.insert(0, sys.argv[1])  # benchmarks/ of the working tree: common.py
import snake
from common import gpt_config, make_batches, make_model
from snake import Placement, SnakeConfig, SnakeTrainer

layers, width, seq, m, steps, runs, next_ms, where = sys.argv[2:]
layers, width, seq, m, steps, runs, next_ms = int(layers), int(width), int(seq), int(m), int(steps), int(runs), float(next_ms)
cfg = gpt_config(layers, width, seq)
data = make_batches(cfg, 2 * m, seq, 4)

def slow():
    i = 0
    while True:
        time.sleep(next_ms / 1e3)
        yield data[i % len(data)]
        i += 1

def config(sub):
    return SnakeConfig(device="cpu", micro_batches=m, alpha=0.0, offload_dir=f"{where}/{sub}",
                       placement=Placement(param=0.5, ckpt=0.5, opt=0.5))

async def main():
    async with SnakeTrainer(make_model(cfg), data=slow(), config=config("steady")) as t:
        rep = await t.run(steps + 1)
    steady = statistics.median(s.seconds for s in rep.steps[1:])
    walls = []
    async with SnakeTrainer(make_model(cfg), data=slow(), config=config("runs")) as t:
        for _ in range(runs + 1):
            t0 = time.perf_counter()
            await t.run(1)
            walls.append(time.perf_counter() - t0)
    print("RESULT", json.dumps({"snake": snake.__file__, "steady_step_s": steady,
                                "per_run_s": statistics.median(walls[1:])}))

asyncio.run(main())
'''


def run_child(tree: Path, args: argparse.Namespace, where: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [str(ROOT / "benchmarks"), args.layers, args.width, args.seq, args.m, args.steps, args.runs, args.next_ms,
            where]
    done = subprocess.run([sys.executable, "-c", CHILD, *map(str, argv)], capture_output=True, text=True, check=True,
                          cwd=tree, env=env)
    out = json.loads(next(line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("RESULT ")))
    assert Path(out["snake"]).resolve().is_relative_to(tree.resolve()), out["snake"]  # the tree's own snake ran
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision to compare the working tree with")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--m", type=int, default=4, help="micro-batches")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--next-ms", type=float, default=20.0)
    ap.add_argument("--name", default="data_gate")
    args = ap.parse_args()
    pairs = []
    with base_worktree(args.base) as (base, worktree), tempfile.TemporaryDirectory(prefix="snake-gate-") as tmp:
        for i in range(args.pairs):
            old = run_child(worktree, args, f"{tmp}/base{i}")
            new = run_child(ROOT, args, f"{tmp}/tree{i}")
            pair = {"base": old, "tree": new, "ratio": new["per_run_s"] / old["per_run_s"],
                    "steady_ratio": new["steady_step_s"] / old["steady_step_s"]}
            pairs.append(pair)
            print(f"pair {i + 1}: steady step base {old['steady_step_s']:.3f} s, tree {new['steady_step_s']:.3f} s "
                  f"(ratio {pair['steady_ratio']:.3f}); run(1) base {old['per_run_s']:.3f} s, tree "
                  f"{new['per_run_s']:.3f} s (ratio {pair['ratio']:.3f})", flush=True)
    steady = [p["steady_ratio"] for p in pairs]
    print(f"steady step, tree / {base}: median {statistics.median(steady):.3f} [{min(steady):.3f}-{max(steady):.3f}]")
    write_result(args.name, {"base": base, "args": vars(args), "pairs": pairs,
                             "median_steady_ratio": statistics.median(steady)},
                 f"s per run(1), tree / {base}")


if __name__ == "__main__":
    main()
