"""The planner's CPU memory budget against the process: peak RSS growth of planned runs.

    python benchmarks/memory_budget.py        # ~2 min on two cores (seven fresh processes)

Each configuration runs `tests/budget_child.py` in a fresh process: a GPT trained with the
planner choosing the placement (alpha 0, fixed micro-batches) under a `cpu_memory_bytes`
sized for parameters and checkpoints in CPU memory and part of the optimizer states, by the
planner's own memory model. It reports the process's peak RSS growth over the first step
(planning, its probes, the engine's build) and over the steps after it, against the budget.
Writes benchmarks/results/memory_budget.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from common import ROOT, machine, save  # type: ignore[import-not-found]

CONFIGS: dict[str, list[str]] = {
    "gpt8x256": [],
    "vocab16k": ["--vocab", "16384", "--layers", "2", "--width", "128", "--seq", "64"],
    "gpt4x512": ["--width", "512", "--layers", "4"],
    "gpt4x512_horizontal_m2": ["--width", "512", "--layers", "4", "--schedule", "horizontal", "--micro-batches", "2"],
    "gpt8x256_m4_opt0.2": ["--micro-batches", "4", "--opt-share", "0.2"],
    "gpt2x768_seq128_opt0": ["--width", "768", "--layers", "2", "--seq", "128", "--opt-share", "0"],
    "vocab32k_seq128_m2": ["--vocab", "32768", "--layers", "2", "--width", "256", "--seq", "128", "--batch", "4",
                           "--micro-batches", "2"],
}


def main() -> None:
    rows = {}
    t0 = time.perf_counter()
    mib = 2.0**20
    for name, args in CONFIGS.items():
        out = subprocess.run([sys.executable, "-m", "tests.budget_child", *args], cwd=ROOT, capture_output=True,
                             text=True, timeout=600)
        if out.returncode:
            raise SystemExit(f"{name}: {out.stderr[-2000:]}")
        r = json.loads(out.stdout)
        rows[name] = {"args": args, **r, "spare_bytes": r["budget"] - r["steady"]}
        print(f"{name:26s} budget {r['budget'] / mib:7.1f} MiB  first step {r['first'] / mib:7.1f}  "
              f"after it {r['steady'] / mib:7.1f}  spare {(r['budget'] - r['steady']) / mib:6.1f}  "
              f"placement {[round(x, 2) for x in r['placement']]}", flush=True)
    print(f"saved {save('memory_budget', {'machine': machine(), 'seconds': time.perf_counter() - t0, 'runs': rows})}")


if __name__ == "__main__":
    main()
