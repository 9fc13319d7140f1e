"""Delayed optimizer step and planned placement in an I/O-bound setting (GreedySnake
Figures 11 and 12 at CPU scale), side by side in one run:

- Figure 11: alpha = 0 vs the planner's alpha (placement fixed: params and checkpoints in
  CPU memory, optimizer states on SSD), throughput vs micro-batches;
- Figure 12: everything on SSD vs the planner's placement for a CPU memory budget that
  holds about half of the optimizer states (alpha from the planner in both).

    python benchmarks/delay_and_ssd.py          # ~4.5 min on 2 cores; --quick for a smoke run

Model as in throughput.py (GPT 4 x 512, seq 32, micro-batch 1), SSD capped at 300 MB/s.
Writes benchmarks/results/delay_and_ssd.json and delay_and_ssd.png.
"""

from __future__ import annotations

import argparse
import time

from common import (  # type: ignore[import-not-found]
    RESULTS,
    SCRATCH,
    add_model_args,
    checked_device,
    checked_warmup,
    figure,
    gpt_config,
    machine,
    on_worker,
    save,
    snake_run,
)

from planner import measure_profile
from planner.integrate import with_budgets
from planner.search import ALPHAS, best_alpha
from planner.solve import Plan
from snake import Placement, SnakeConfig
from snake.memory import host_memory

CAP = 300e6
OPT_ON_SSD = Placement(param=1.0, ckpt=1.0, opt=0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=7, help="iterations per run, --warmup of them not timed")
    ap.add_argument("--warmup", type=int, default=3,
                    help="first iterations not timed: here the SSD binds, and the optimizer-state write-behind "
                         "fills over the first two or three (BENCHMARKS.md section 13)")
    ap.add_argument("--rounds", type=int, default=2)
    add_model_args(ap, layers=4, width=512, seq=32)
    args = ap.parse_args()
    device = checked_device(args, ("steps", "rounds"))
    rounds = 1 if args.quick else args.rounds
    L, C, T, MB = args.layers, args.width, args.seq, 1
    ms = [1, 4] if args.quick else [1, 2, 4, 8]
    if not args.quick:
        checked_warmup(args)
    steps, warmup = (2, 1) if args.quick else (args.steps, args.warmup)
    cfg = gpt_config(L, C, T)
    t_start = time.perf_counter()
    SCRATCH.mkdir(parents=True, exist_ok=True)
    prof = on_worker(measure_profile, cfg, micro_batch_size=MB, seq_len=T, device=device, offload_dir=SCRATCH,
                     ssd_bandwidth_bytes_per_s=CAP, cache=False)

    rows = []
    for m in ms:
        # budget: what the runtime needs with params + ckpts in CPU and half the optimizer
        # states, plus what the planner takes off the budget (the runtime's overhead and the
        # CPU device's own working set)
        from planner.solve import off_budget
        mem = host_memory(prof.shape, n_micro=m, alpha=0.25, schedule="vertical", workers=2)
        budget = int(mem.at(1.0, 1.0, 0.5) + off_budget(prof, m))
        p_fixed = best_alpha(prof, m, alphas=ALPHAS, placement=OPT_ON_SSD)
        p_budget = best_alpha(with_budgets(prof, SnakeConfig(offload_dir=SCRATCH, cpu_memory_bytes=budget)),
                              m, alphas=ALPHAS)
        p_allssd = best_alpha(prof, m, alphas=ALPHAS, placement=Placement.all_ssd())
        for p in (p_fixed, p_budget, p_allssd):
            assert isinstance(p, Plan), p
        common = dict(micro_batches=m, micro_batch_size=MB, seq=T, steps=steps, warmup=warmup, cap=CAP, device=device)
        row = {"M": m, "cpu_memory_budget": budget,
               "planned_alpha_opt_on_ssd": p_fixed.alpha,
               "planned_budget": {"alpha": p_budget.alpha, "placement": {
                   k: round(getattr(p_budget.placement, k), 4) for k in ("param", "ckpt", "opt")},
                   "predicted_s": p_budget.predicted_iteration_seconds, "binding": p_budget.binding},
               "all_ssd_alpha": p_allssd.alpha, "runs": {}}
        confs = {
            "alpha0": (OPT_ON_SSD, 0.0, None),
            "alpha_planned": (OPT_ON_SSD, p_fixed.alpha, None),
            "all_ssd": (Placement.all_ssd(), p_allssd.alpha, None),
            "planned_placement": (p_budget.placement, p_budget.alpha, budget),
        }
        tries: dict[str, list[dict]] = {k: [] for k in confs}
        for _ in range(rounds):  # rounds interleave the four configs: load hits all alike
            for name, (pl, a, mem_b) in confs.items():
                r = snake_run(cfg, placement=pl, alpha=a, cpu_memory_bytes=mem_b, **common)
                tries[name].append(r)
                print(f"M={m:2d} {name:18s} alpha={a:.2f} {r['tokens_per_s']:7.1f} tok/s "
                      f"({r['iteration_seconds']['median']:.2f} s/it, SSD {r['traffic']['ssd_bytes'] / 1e6:.0f} MB)",
                      flush=True)
        for name, rs in tries.items():
            rs.sort(key=lambda r: r["tokens_per_s"])
            r = dict(rs[len(rs) // 2])  # the median round (upper median for 2)
            r["tokens_per_s_rounds"] = [x["tokens_per_s"] for x in rs]
            pred = {"alpha0": None, "alpha_planned": p_fixed, "all_ssd": p_allssd,
                    "planned_placement": p_budget}[name]
            r["predicted_iteration_seconds"] = pred.predicted_iteration_seconds if pred else None
            row["runs"][name] = r
        rr = row["runs"]
        row["alpha_planned_over_alpha0"] = rr["alpha_planned"]["tokens_per_s"] / rr["alpha0"]["tokens_per_s"]
        row["planned_over_all_ssd"] = rr["planned_placement"]["tokens_per_s"] / rr["all_ssd"]["tokens_per_s"]
        rows.append(row)

    result = {"machine": machine(), "model": {"n_layer": L, "n_embd": C, "seq": T, "micro_batch_size": MB},
              "cap_bytes_per_s": CAP, "profile": prof.to_json(), "rows": rows,
              "seconds_total": time.perf_counter() - t_start}
    name = "delay_and_ssd_quick" if args.quick else "delay_and_ssd"
    print(save(name, result))

    fig, (a1, a2) = figure(1, 2, size=(12, 4.5))
    for ax, keys, title in (
        (a1, (("alpha0", "o-", "alpha = 0"), ("alpha_planned", "s-", "planned alpha")),
         "Fig. 11: delayed step (opt on SSD)"),
        (a2, (("all_ssd", "o-", "all on SSD"), ("planned_placement", "s-", "planned placement")),
         "Fig. 12: placement (I/O-bound)"),
    ):
        for key, style, lab in keys:
            ax.plot(ms, [r["runs"][key]["tokens_per_s"] for r in rows], style, label=lab)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches per iteration")
        ax.set_ylabel("tokens/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{title}, SSD {CAP / 1e6:.0f} MB/s")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)


if __name__ == "__main__":
    main()
