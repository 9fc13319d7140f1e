"""Planner accuracy (issue 3): predicted vs measured iteration time of planned configs.

    python benchmarks/plan_accuracy.py      # ~3 min on 2 cores

Profiles this machine with planner.measure_profile (through plan_for_batch, as the trainer
does), plans a GPT 4 x 512 (seq 32, global batch 8 sequences) in two settings, runs each
planned configuration with the real trainer and compares:
- io_bound: SSD capped at 75 MB/s and a CPU memory budget that holds params, checkpoints and
  ~30 % of the optimizer states;
- compute_bound: no cap, all the machine's memory.
Also runs each setting's plan at every other micro-batch count the planner considered
(same budget, planner's placement and alpha for that n) to see whether the error depends
on n. Target: |predicted - measured| / measured <= 15 %. For misses, the per-actor busy
seconds per iteration and the traffic are saved next to what the profile assumed.
Writes benchmarks/results/plan_accuracy.json and plan_accuracy.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from common import (  # type: ignore[import-not-found]
    RESULTS,
    SCRATCH,
    add_model_args,
    checked_device,
    figure,
    gpt_config,
    machine,
    on_worker,
    save,
    snake_run,
)

from planner import plan_for_batch
from planner.integrate import MEASURE_MICRO_BATCH, profile_for_config, scale_profile
from planner.profile import shape_of
from planner.solve import Infeasible
from snake import SnakeConfig
from snake.memory import RUNTIME_OVERHEAD_BYTES, device_memory, host_memory


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=4)
    add_model_args(ap, layers=4, width=512, seq=32)
    args = ap.parse_args()
    device = checked_device(args, ("steps",))
    L, C, T, B = args.layers, args.width, args.seq, 8
    steps = 2 if args.quick else args.steps
    cfg = gpt_config(L, C, T)
    t_start = time.perf_counter()
    pdir = SCRATCH / "plan-accuracy-profile"
    pdir.mkdir(parents=True, exist_ok=True)
    for f in pdir.glob("snake-profile-*.json"):
        f.unlink()  # measure afresh each run
    shape1 = shape_of(cfg, 1, T, "float32")
    budget = int(host_memory(shape1, n_micro=B, alpha=0.0, schedule="vertical", workers=2).at(1, 1, 0.3)
                 + (device_memory(shape1, n_micro=B, device_type="cpu") if device == "cpu" else 0)  # a CPU device's working set
                 + RUNTIME_OVERHEAD_BYTES)
    settings = {
        "io_bound": dict(ssd_bandwidth_bytes_per_s=75e6, cpu_memory_bytes=budget),
        "compute_bound": dict(ssd_bandwidth_bytes_per_s=None, cpu_memory_bytes=None),
    }
    out: dict = {}
    for name, kw in settings.items():
        base = SnakeConfig(micro_batches=None, placement=None, alpha=None, offload_dir=pdir, device=device, **kw)
        plan = on_worker(plan_for_batch, cfg, base, B, T, device)
        assert not isinstance(plan, Infeasible), plan
        mb0 = max(B // n for n in range(1, B + 1) if B % n == 0 and B // n <= MEASURE_MICRO_BATCH)
        prof = on_worker(profile_for_config, cfg, base, mb0, T, device)  # cached: the profile plan used
        rows = []
        ns = [plan.n_micro] + ([] if args.quick else [n for n in (1, 2, 4, 8) if n != plan.n_micro])
        for n in ns:
            # measured profiles are cached in pdir: planning at a fixed n measures (once) that
            # micro-batch size too, as the trainer's planning path does
            p = plan if n == plan.n_micro else on_worker(
                plan_for_batch, cfg, dataclasses.replace(base, micro_batches=n), B, T, device)
            if isinstance(p, Infeasible):
                rows.append({"n": n, "infeasible": p.message})
                continue
            r = snake_run(cfg, micro_batches=n, micro_batch_size=B // n, seq=T, steps=steps,
                          placement=p.placement, alpha=p.alpha, cap=kw["ssd_bandwidth_bytes_per_s"],
                          cpu_memory_bytes=kw["cpu_memory_bytes"], device=device)
            meas = r["iteration_seconds"]["median"]
            sp = scale_profile(prof, (B // n) / mb0)
            assumed = {  # what the model assumes per iteration, to set next to busy seconds
                "compute_s": L * n * (sp.fwd_seconds + sp.recompute_seconds + sp.bwd_seconds) + n * sp.pre_post_seconds,
                "ssd_bytes": p.ssd_bytes_per_iteration,
                "ssd_s_at_profile_bw": p.ssd_bytes_per_iteration / (0.5 * (prof.ssd_read_bytes_per_s + prof.ssd_write_bytes_per_s)),
            }
            row = {
                "n": n, "chosen_by_planner": n == plan.n_micro, "alpha": p.alpha,
                "placement": {k: round(getattr(p.placement, k), 4) for k in ("param", "ckpt", "opt")},
                "binding": p.binding, "layer_seconds": p.layer_seconds,
                "predicted_s": p.predicted_iteration_seconds, "measured_s": meas,
                "measured_min_s": r["iteration_seconds"]["min"], "measured_max_s": r["iteration_seconds"]["max"],
                "error": (p.predicted_iteration_seconds - meas) / meas,
                "model_assumes": assumed, "measured_ssd_bytes": r["traffic"]["ssd_bytes"],
                "busy_s_per_iteration": r["busy_s_per_iteration"], "busy_fraction": r["busy_fraction"],
                "run": r,
            }
            rows.append(row)
            print(f"{name:13s} n={n} alpha={p.alpha:.2f} place={row['placement']} "
                  f"pred {p.predicted_iteration_seconds:.3f} s meas {meas:.3f} s "
                  f"[{row['measured_min_s']:.3f}, {row['measured_max_s']:.3f}] err {row['error']:+.0%} "
                  f"binding {p.binding}", flush=True)
        out[name] = {"settings": {k: v for k, v in kw.items()}, "profile": prof.to_json(),
                     "planned_n": plan.n_micro, "rows": rows}
    result = {"machine": machine(), "model": {"n_layer": L, "n_embd": C, "seq": T, "global_batch": B},
              "settings": out, "target_abs_error": 0.15, "seconds_total": time.perf_counter() - t_start}
    name = "plan_accuracy_quick" if args.quick else "plan_accuracy"
    print(save(name, result))
    fig, (ax,) = figure(1, 1)
    for (label, s), mk in zip(out.items(), ("o", "s"), strict=True):
        ok = [r for r in s["rows"] if "predicted_s" in r]
        ax.scatter([r["measured_s"] for r in ok], [r["predicted_s"] for r in ok], marker=mk, label=label)
        for r in ok:
            ax.annotate(f"n={r['n']}" + ("*" if r["chosen_by_planner"] else ""), (r["measured_s"], r["predicted_s"]), fontsize=7)
    lim = max([r["measured_s"] for s in out.values() for r in s["rows"] if "measured_s" in r]
              + [r["predicted_s"] for s in out.values() for r in s["rows"] if "predicted_s" in r]) * 1.1
    ax.plot([0, lim], [0, lim], "k--", lw=0.8, label="exact")
    ax.plot([0, lim], [0, lim * 0.85], "k:", lw=0.6, label="+-15 %")
    ax.plot([0, lim], [0, lim * 1.15], "k:", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured iteration seconds")
    ax.set_ylabel("predicted iteration seconds")
    ax.set_title("planner prediction vs measurement (* = planner's n)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)


if __name__ == "__main__":
    main()
