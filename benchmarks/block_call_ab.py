"""What a change to the compute actor's kernels costs per block call: snake's `Kernels`
(block forward, then recompute + backward, as the compute actor calls them) at a base
revision against the working tree, in fresh processes, alternating, on the benchmarks' GPT
block (8 x 512 by default, cycling through the layers' parameter slots).

    python benchmarks/block_call_ab.py --base a886016 [--pairs 6] [--calls 200] [--name block_call_ab]

The base revision is checked out into a temporary git worktree (removed afterwards). Each
process warms up (16 calls), then times `--calls` calls and reports their median; the table
gives each pair's ratio (working tree / base) and the median ratio. Writes
results/<name>.json and results/<name>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from ab import ROOT, base_worktree, write_result

CHILD = """
import json, statistics, sys, time
import torch
from snake.adapters import describe
from snake.config import SnakeConfig
from snake.kernels import Kernels
from snake.models.gpt import GPT, GPTConfig
layers, width, seq, mbs, calls = (int(a) for a in sys.argv[1:6])
torch.manual_seed(0)
cfg = GPTConfig(n_layer=layers, n_embd=width, n_head=8, vocab_size=8192, block_size=max(256, seq), bias=False)
parts = describe(GPT(cfg))
k = Kernels(parts, SnakeConfig(offload_dir=".", micro_batches=1), torch.device("cpu"), 1)
slots = [torch.cat([p.detach().reshape(-1) for p in b.parameters()]) for b in parts.blocks]
x = torch.randn(mbs, seq, width)
gy = torch.randn_like(x)
acc = torch.zeros(slots[0].numel())
def one(i):
    layer = i % layers
    k.block_fwd(slots[layer], x, 0, layer, 0)
    k.block_bwd(slots[layer], x, gy, acc, t=0, layer=layer, m=0, accumulate=True)
for i in range(16):
    one(i)
ts = []
for i in range(calls):
    t0 = time.perf_counter()
    one(i)
    ts.append(time.perf_counter() - t0)
print(json.dumps({"median_s": statistics.median(ts), "snake": __import__("snake").__file__}))
"""


def run_child(tree: Path, args: argparse.Namespace) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(args.layers), str(args.width), str(args.seq), str(args.mbs), str(args.calls)],
        capture_output=True, text=True, check=True, cwd=tree, env=env,
    )
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(out["snake"]).resolve().is_relative_to(tree.resolve()), out  # the tree's own snake ran
    return float(out["median_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision to compare the working tree with")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--name", default="block_call_ab")
    args = ap.parse_args()
    pairs = []
    with base_worktree(args.base) as (base, worktree):
        for i in range(args.pairs):
            old = run_child(worktree, args)
            new = run_child(ROOT, args)
            pairs.append({"base_ms": 1e3 * old, "tree_ms": 1e3 * new, "ratio": new / old})
            print(f"pair {i + 1}: base {1e3 * old:.3f} ms, working tree {1e3 * new:.3f} ms, ratio {new / old:.3f}",
                  flush=True)
    write_result(args.name, {"base": base, "args": vars(args), "pairs": pairs}, f"per block call, working tree / {base}")

if __name__ == "__main__":
    main()
