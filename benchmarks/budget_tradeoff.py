"""The planner's predicted throughput curves of both schedules over a range of CPU memory
budgets, from the capped profile that `throughput.py` measured and saved: why, on this
machine, "saturated vertical / horizontal >= 1.9x" and "vertical reaches 90 % of its
saturation with half the micro-batches" pull the budget in opposite directions.

    python benchmarks/budget_tradeoff.py [--budgets 345,360,380,400,420,440] [--ms 1,2,4,8,16,32]
    python benchmarks/budget_tradeoff.py --source throughput_run_y --caps 650,1000,1400 --name budget_tradeoff_y

Planner predictions only (no training) from the capped profile saved by a throughput.py run
(`--source`, default `throughput`); `--caps` (MB/s) replaces its SSD read and write bandwidth
with each cap in turn, to look for a setting on a machine other than the one it was measured
on. `throughput.py --capped-only --budget-mib B --cap-mb C --name ...` measures one for real.
Writes benchmarks/results/NAME.json (default budget_tradeoff).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from common import RESULTS, SCRATCH, planner_budget, save  # type: ignore[import-not-found]
from throughput import first_at  # type: ignore[import-not-found]

from planner import Infeasible, search
from planner.integrate import with_budgets
from planner.profile import MachineProfile
from snake import SnakeConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="345,360,380,400,420,440", help="MiB")
    ap.add_argument("--ms", default="1,2,4,8,16,32")
    ap.add_argument("--source", default="throughput", help="throughput.py results whose capped profile to use (results/NAME.json)")
    ap.add_argument("--caps", default=None, help="SSD caps in MB/s to predict (default: the source's own cap)")
    ap.add_argument("--links", default=None,
                    help="host<->device link caps in MB/s per direction to predict (SnakeConfig.device_link_bytes_per_s, "
                         "throughput.py --link-mb); default: the source's own (none unless it ran with --link-mb)")
    ap.add_argument("--compute-scale", type=float, default=1.0,
                    help="multiply the profile's block and pre/post times (e.g. measured / probed compute)")
    ap.add_argument("--name", default="budget_tradeoff", help="results file (benchmarks/results/NAME.json)")
    args = ap.parse_args()
    src = RESULTS / f"{args.source}.json"
    if not src.exists():
        ap.error(f"--source {args.source}: no {src.name} in benchmarks/results; run throughput.py --name {args.source} first")
    saved = json.loads(src.read_text())
    base = MachineProfile.from_json(saved["profiles"]["capped"])
    k = args.compute_scale
    if k <= 0:
        ap.error(f"--compute-scale {k}: must be > 0 (1 keeps the probed times)")
    base = dataclasses.replace(base, fwd_seconds=base.fwd_seconds * k, recompute_seconds=base.recompute_seconds * k,
                               bwd_seconds=base.bwd_seconds * k, pre_post_seconds=base.pre_post_seconds * k)
    def numbers(flag: str, text: str, kind=float) -> list:  # type: ignore[no-untyped-def]
        try:
            xs = [kind(x) for x in text.split(",")]
        except ValueError:
            ap.error(f"{flag} {text!r}: give comma-separated positive numbers, e.g. 345,380")
        if not xs or min(xs) <= 0:
            ap.error(f"{flag} {text!r}: every value must be > 0")
        return xs

    ms = numbers("--ms", args.ms, int)
    caps = [saved["cap_bytes_per_s"]] if args.caps is None else [c * 1e6 for c in numbers("--caps", args.caps)]
    budgets = numbers("--budgets", args.budgets)
    links: list[float | None] = ([saved.get("device_link_bytes_per_s")] if args.links is None
                                 else [x * 1e6 for x in numbers("--links", args.links)])
    rows = []
    for cap, mib, link in ((c, b, x) for c in caps for b in budgets for x in links):
        prof = with_budgets(base, SnakeConfig(offload_dir=SCRATCH, cpu_memory_bytes=planner_budget(mib * 2**20, base),
                                              device_link_bytes_per_s=link))
        prof = dataclasses.replace(prof, ssd_read_bytes_per_s=cap, ssd_write_bytes_per_s=cap)
        curves: dict[str, list[tuple[int, float]]] = {}
        for sched in ("vertical", "horizontal"):
            pts = []
            for m in ms:
                plan = search(prof, schedule=sched, n_micro=m)
                pts.append((m, 0.0 if isinstance(plan, Infeasible) else plan.predicted_tokens_per_s))
            curves[sched] = pts
        v, h = curves["vertical"], curves["horizontal"]
        row = {
            "budget_mib": mib, "cap_bytes_per_s": cap, "link_bytes_per_s": link, "vertical": v, "horizontal": h,
            "saturated_vertical_over_horizontal": max(t for _, t in v) / max(t for _, t in h),
            "M_to_90pct_vertical": first_at(v, 0.9), "M_to_90pct_horizontal": first_at(h, 0.9),
        }
        rows.append(row)
        print(f"{cap / 1e6:5.0f} MB/s {mib:5.0f} MiB link {'-' if link is None else round(link / 1e6)}  vertical {[round(t) for _, t in v]}  horizontal {[round(t) for _, t in h]}  "
              f"saturated v/h {row['saturated_vertical_over_horizontal']:.2f}  M to 90 %: "
              f"v {row['M_to_90pct_vertical']} h {row['M_to_90pct_horizontal']}", flush=True)
    print(save(args.name, {"source": args.source, "compute_scale": k, "Ms": ms, "caps_bytes_per_s": caps, "links_bytes_per_s": links, "rows": rows}))


if __name__ == "__main__":
    main()
