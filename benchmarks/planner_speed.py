"""How fast the planner is: one LP solve (target < 20 ms) and a whole search (< 2 s).

Uses a fixed synthetic profile (a ~1.2B-parameter GPT on a GPU box with 16 GiB of host
memory and a 2 GB/s SSD), so the numbers do not depend on measuring this machine.

    python benchmarks/planner_speed.py        # prints one JSON object
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from planner import MachineProfile, roofline, search, solve  # noqa: E402
from snake.memory import ModelShape  # noqa: E402


def profile() -> MachineProfile:
    shape = ModelShape(
        n_layers=24, layer_params=12 * 2048 * 2048, ckpt_elems=4 * 1024 * 2048,
        resident_params=50304 * 2048, tokens_per_micro=4 * 1024, dtype_bytes=2, vocab_size=50304,
    )
    return MachineProfile(
        fwd_seconds=0.010, recompute_seconds=0.010, bwd_seconds=0.020, pre_post_seconds=0.015,
        h2d_bytes_per_s=20e9, d2h_bytes_per_s=20e9, ssd_read_bytes_per_s=2e9,
        ssd_write_bytes_per_s=1.5e9, adam_elems_per_s=1.9e9, cpu_memory_bytes=16 * 2.0**30,
        device_memory_bytes=40 * 2.0**30, shape=shape, device="cuda",
    )


def median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = profile()
    solve(p, n_micro=8, alpha=0.2)  # warm-up (imports, HiGHS)
    plan = search(p)
    result = {
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()})",
        "lp_solve_ms": 1e3 * median_seconds(lambda: solve(p, n_micro=8, alpha=0.2), 200),
        "search_vertical_s": median_seconds(lambda: search(p), 5),
        "search_horizontal_s": median_seconds(lambda: search(p, schedule="horizontal"), 5),
        "roofline_1_to_32_s": median_seconds(lambda: roofline(p, range(1, 33)), 1),
        "searched": {"n_micro": plan.n_micro, "alpha": plan.alpha,
                     "tokens_per_s": round(plan.predicted_tokens_per_s, 1)},
        "targets": {"lp_solve_ms": 20, "search_vertical_s": 2},
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
