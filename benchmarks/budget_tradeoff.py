"""The planner's predicted throughput curves of both schedules over a range of CPU memory
budgets, from the capped profile that `throughput.py` measured and saved: why, on this
machine, "saturated vertical / horizontal >= 1.9x" and "vertical reaches 90 % of its
saturation with half the micro-batches" pull the budget in opposite directions.

    python benchmarks/budget_tradeoff.py [--budgets 345,360,380,400,420,440] [--ms 1,2,4,8,16,32]

Planner predictions only (no training); `throughput.py --capped-only --budget-mib B --name
throughput_budgetB` measures a budget for real. Writes benchmarks/results/budget_tradeoff.json.
"""

from __future__ import annotations

import argparse
import json

from common import RESULTS, SCRATCH, save  # type: ignore[import-not-found]
from throughput import first_at  # type: ignore[import-not-found]

from planner import Infeasible, search
from planner.integrate import with_budgets
from planner.profile import MachineProfile
from snake import SnakeConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="345,360,380,400,420,440", help="MiB")
    ap.add_argument("--ms", default="1,2,4,8,16,32")
    args = ap.parse_args()
    saved = json.loads((RESULTS / "throughput.json").read_text())
    base = MachineProfile.from_json(saved["profiles"]["capped"])
    ms = [int(x) for x in args.ms.split(",")]
    rows = []
    for mib in (float(b) for b in args.budgets.split(",")):
        prof = with_budgets(base, SnakeConfig(offload_dir=SCRATCH, cpu_memory_bytes=int(mib * 2**20)))
        curves: dict[str, list[tuple[int, float]]] = {}
        for sched in ("vertical", "horizontal"):
            pts = []
            for m in ms:
                plan = search(prof, schedule=sched, n_micro=m)
                pts.append((m, 0.0 if isinstance(plan, Infeasible) else plan.predicted_tokens_per_s))
            curves[sched] = pts
        v, h = curves["vertical"], curves["horizontal"]
        row = {
            "budget_mib": mib, "vertical": v, "horizontal": h,
            "saturated_vertical_over_horizontal": max(t for _, t in v) / max(t for _, t in h),
            "M_to_90pct_vertical": first_at(v, 0.9), "M_to_90pct_horizontal": first_at(h, 0.9),
        }
        rows.append(row)
        print(f"{mib:5.0f} MiB  vertical {[round(t) for _, t in v]}  horizontal {[round(t) for _, t in h]}  "
              f"saturated v/h {row['saturated_vertical_over_horizontal']:.2f}  M to 90 %: "
              f"v {row['M_to_90pct_vertical']} h {row['M_to_90pct_horizontal']}", flush=True)
    print(save("budget_tradeoff", {"Ms": ms, "cap_bytes_per_s": saved["cap_bytes_per_s"], "rows": rows}))


if __name__ == "__main__":
    main()
