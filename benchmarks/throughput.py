"""Throughput vs micro-batches (GreedySnake Figure 10 at CPU scale), side by side:
snake vertical and snake horizontal, each with the placement the planner chooses for it
under the SAME CPU memory budget (`SnakeConfig.cpu_memory_bytes`) and the same SSD cap,
plain in-memory PyTorch with gradient accumulation with and without per-block activation
checkpointing, and the roofline min(compute, I/O).

    python benchmarks/throughput.py            # ~8 min on 2 cores (M = 1..32); --quick for a smoke run
    python benchmarks/throughput.py --fixed    # + the old fixed-placement comparison (~+3.5 min)
    python benchmarks/throughput.py --fixed-only  # only that pair, added to the saved JSON

The paper's regime, with an emulated host<->device link (BENCHMARKS.md sections 10-11; ~20-30 min,
~11 without M = 128, where horizontal has not yet flattened):

    python benchmarks/throughput.py --capped-only --budget-mib 420 --cap-mb 150 --link-mb 600 \
        --micro-batch-size 2 --ms 1,2,4,8,16,32,64,128 --name throughput_link

There horizontal moves every layer's parameters over the link twice per micro-batch and
vertical twice per iteration; the roofline adds the link (vertical's unavoidable bytes over
the cap) to compute and SSD.

Model: GPT, 8 layers, width 512, seq 32, micro-batch 1 sequence: a block's parameters
(12.6 MB fp32) are ~200x its checkpoint (64 KiB), so parameter traffic dominates as in the
paper. 8 layers, not 4: the runtime stages SSD-resident parameters through 5 layer-sized
buffers (3 load tails + 2 optimizer write-back), so with 4 layers moving parameters to SSD
never saves host memory and no budget can reproduce the paper's trade-off.

CPU memory budget (BUDGET_MIB, both schedules): room for vertical's params + checkpoints +
~30 % of the optimizer states; horizontal's per-layer fp32 gradient accumulators (8 x 12.6 MB)
take that room, so its planner puts all optimizer states and ~30 % of the parameters on SSD,
and horizontal re-reads those parameters every micro-batch. Each schedule's plan comes from
`planner.search(profile with the budget, schedule=..., n_micro=M)` on a profile measured with
the same SSD cap. Writes benchmarks/results/throughput.json and throughput.png.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import (  # type: ignore[import-not-found]
    RESULTS,
    SCRATCH,
    add_model_args,
    checked_device,
    checked_warmup,
    figure,
    gpt_config,
    machine,
    model_flops_per_token,
    on_worker,
    planner_budget,
    save,
    snake_run,
    torch_run,
)

from planner import Infeasible, measure_profile, search
from planner.integrate import with_budgets
from planner.model import vertical_phases
from planner.solve import host_budget, off_budget
from snake import Placement, SnakeConfig
from snake.memory import OPT_BYTES_PER_ELEM, host_memory

N_LAYER = 8
BUDGET_MIB = 345  # CPU memory budget of both schedules (planner and runtime)
CAP = 300e6
# the old comparison (--fixed): one placement for both schedules, no budget
PLACEMENT = Placement(param=0.5, ckpt=1.0, opt=0.0)
ALPHA_V = 0.25


def first_at(points: list[tuple[int, float]], frac: float) -> int | None:
    """Smallest M whose tokens/s reaches frac x the best of the sweep."""
    best = max(t for _, t in points)
    return min(m for m, t in points if t >= frac * best)


def plan_json(plan) -> dict:
    # the placement exact: the roofline rounds run it again under the same budget, where a
    # share rounded up (0.7347 for 0.73466) took the plan past it and the trainer refused it
    return {"alpha": plan.alpha,
            "placement": {k: getattr(plan.placement, k) for k in ("param", "ckpt", "opt")},
            "predicted_iteration_seconds": plan.predicted_iteration_seconds,
            "predicted_tokens_per_s": plan.predicted_tokens_per_s, "binding": list(plan.binding),
            "host_memory_bytes": plan.host_memory_bytes,
            "ssd_bytes_per_iteration": plan.ssd_bytes_per_iteration}


def min_opt_ssd_bytes(profile, budget: float, m: int, opt_bytes: float) -> float:
    """SSD bytes per iteration that no vertical placement under the budget avoids (alpha 0,
    parameters in CPU memory): what of the optimizer states and checkpoints does not fit next
    to the parameters is written and read once per iteration. Both kinds free room at the
    same traffic per byte, so the bound is the cheaper end: checkpoints all in CPU memory
    (their exact model, no staging pools) with the optimizer states in what is left, or all
    on SSD with their own traffic counted. (Before, the second end left the checkpoints'
    traffic out: harmless for 64 KiB checkpoints, but at seq 512 on a GPU it put the bound
    at 0.6 of the best plan's SSD bytes, BENCHMARKS.md section 8.)"""
    planned = planner_budget(budget, profile)
    room, _ = host_budget(with_budgets(profile, SnakeConfig(offload_dir=SCRATCH, cpu_memory_bytes=planned)), m)
    sh = profile.shape
    ckpt_bytes = sh.n_layers * m * sh.ckpt_elems * sh.dtype_bytes
    best = float("inf")
    for ck, exact in ((1.0, True), (0.0, False)):
        mem = host_memory(sh, n_micro=m, alpha=0.0, schedule="vertical", workers=2, ckpt_in_cpu=exact)
        o = min(1.0, max(0.0, (room - mem.at(1.0, ck, 0.0)) / mem.per_share["opt"]))
        best = min(best, 2 * opt_bytes * (1 - o) + 2 * ckpt_bytes * (1 - ck))
    return best


def recompute_min_io(result: dict) -> None:
    """The I/O roofline's bytes from the stored profiles with the current `min_opt_ssd_bytes`
    (results saved before it counted checkpoint traffic keep their old ones until reanalyzed)."""
    from planner.profile import MachineProfile

    budget = result.get("cpu_memory_budget_bytes")
    if not budget:
        return
    for label, pj in result["profiles"].items():
        prof = MachineProfile.from_json(pj)
        result["min_io_bytes"][label] = [min_opt_ssd_bytes(prof, budget, m, result["optimizer_state_bytes"])
                                         for m in result["Ms"]]


def vertical_link_bytes(profile_json: dict, m: int) -> tuple[float, float]:
    """Host->device and device->host bytes per iteration that a layer-by-layer schedule
    cannot avoid, whatever the placement: each layer's parameters in for the forward and
    again for the backward, its checkpoints, and its fp32 gradient out once (the planner's
    vertical traffic at alpha 0, `planner.model.vertical_phases`)."""
    from planner.profile import MachineProfile

    prof = MachineProfile.from_json(profile_json)
    fwd, bwd = vertical_phases(prof, m, 0.0)
    n = prof.shape.n_layers
    return (n * (fwd.traffic.h2d_bytes + bwd.traffic.h2d_bytes),
            n * (fwd.traffic.d2h_bytes + bwd.traffic.d2h_bytes))


def rooflines(result: dict, io_bytes_at) -> dict[str, list[dict]]:
    """Per pass, per M: compute roofline (PyTorch+ckpt fwd+bwd; profile for reference) and the
    I/O roofline of io_bytes_at(label, i) SSD bytes per iteration."""
    runs, ms = result["runs"], result["Ms"]
    roof: dict[str, list[dict]] = {}
    for label, p in result["profiles"].items():
        sh = p["shape"]
        per_micro = sh["n_layers"] * (p["fwd_seconds"] + p["recompute_seconds"] + p["bwd_seconds"]) + p["pre_post_seconds"]
        rows = []
        for i, m in enumerate(ms):
            io_bytes = io_bytes_at(label, i)
            if label == "capped":
                io_s = io_bytes / result["cap_bytes_per_s"]
            else:
                # reads and writes of the disk overlap when uncapped: the slower direction
                io_s = max(io_bytes / 2 / p["ssd_read_bytes_per_s"], io_bytes / 2 / p["ssd_write_bytes_per_s"])
            tok = runs["torch+ckpt"][i]["tokens_per_iteration"]
            emp = tok / runs["torch+ckpt"][i]["fwd_bwd_seconds"]["median"]
            io = tok / io_s if io_s > 0 else float("inf")
            row = {"M": m, "compute_roofline_torch_ckpt": emp,
                   "compute_roofline_profile": sh["tokens_per_micro"] / per_micro,
                   "io_roofline": io, "io_bytes": io_bytes, "roofline": min(emp, io)}
            if link := result.get("device_link_bytes_per_s"):
                h2d, d2h = vertical_link_bytes(p, m)
                row["link_roofline"] = tok / (max(h2d, d2h) / link)
                row["link_bytes"] = {"h2d": h2d, "d2h": d2h}
                row["roofline"] = min(row["roofline"], row["link_roofline"])
            rows.append(row)
        roof[label] = rows
    return roof


def pooled_roofline(result: dict, roof_capped: list[dict], sweep: bool = True) -> list[dict]:
    """Capped vertical over min(compute, I/O roofline) from every round of the pair (the
    sweep's run, unless not `sweep`, and the repeats): medians of all timed steps of vertical
    and of PyTorch+ckpt's forward+backward; also each round's own ratio. Without the sweep's
    pair only back-to-back pairs count (in the sweep the two sides run a minute apart, with
    four snake runs of the same M, SSD-heavy ones included, between them)."""
    runs, rep = result["runs"], result["roof_repeats"]
    out = []
    for i, rr in enumerate(roof_capped):
        vs = [runs["vertical_capped"][i], *rep["vertical_capped"][i]][0 if sweep else 1:]
        ts = [runs["torch+ckpt"][i], *rep["torch+ckpt"][i]][0 if sweep else 1:]
        if not vs:
            continue
        tok = vs[0]["tokens_per_iteration"]
        v_steps = [x for r in vs for x in r["step_seconds"][r.get("warmup", 1):]]
        t_steps = [x for r in ts for x in r.get("fwd_bwd_step_seconds", [])[r.get("warmup", 1):]]
        if not t_steps:  # a result from before per-step times were kept
            t_steps = [r["fwd_bwd_seconds"]["median"] for r in ts]
        compute = tok / statistics.median(t_steps)
        io = min(rr["io_roofline"], rr.get("link_roofline", float("inf")))  # the SSD and the link, if capped
        per_round = [v["tokens_per_s"] / min(tok / t["fwd_bwd_seconds"]["median"], io)
                     for v, t in zip(vs, ts, strict=True)]
        vertical = tok / statistics.median(v_steps)
        out.append({"M": rr["M"], "rounds": len(vs), "vertical": vertical, "compute_roofline_torch_ckpt": compute,
                    "io_roofline": rr["io_roofline"], "link_roofline": rr.get("link_roofline"),
                    "roofline": min(compute, io), "ratio": vertical / min(compute, io), "ratio_per_round": per_round})
    return out


def analyze(result: dict) -> None:
    """Rooflines and the issue's ratios, from the runs (so they can be recomputed).

    I/O roofline: the SSD bytes vertical cannot avoid under the budget (optimizer states
    that do not fit next to params, read + written once per iteration; `min_io_bytes`)
    over the cap (capped: reads and writes share the token bucket) or over the profile's
    measured read and write bandwidth, the slower direction (uncapped: the disk overlaps
    reads and writes, so this is an upper bound). Compute roofline: the forward + backward time
    of PyTorch with per-block checkpointing at the same M, measured in the same run (no
    optimizer step; snake overlaps it), and, for reference, the planner profile's
    (fwd + recompute + bwd) per block."""
    runs = result["runs"]
    roof = rooflines(result, lambda label, i: result["min_io_bytes"][label][i])
    # the fixed placement has no budget and all optimizer states on SSD
    roof_fixed = rooflines(result, lambda label, i: 2 * result["optimizer_state_bytes"])
    summary: dict[str, dict] = {}
    for prefix in ("", "fixed_"):
        for label in ("capped", "uncapped"):
            if f"{prefix}vertical_{label}" not in runs:
                continue
            roof_l = (roof_fixed if prefix else roof)[label]
            rvs, rhs = runs[f"{prefix}vertical_{label}"], runs[f"{prefix}horizontal_{label}"]
            v = [(r["micro_batches"], r["tokens_per_s"]) for r in rvs]
            h = [(r["micro_batches"], r["tokens_per_s"]) for r in rhs]
            vsat, hsat = max(t for _, t in v), max(t for _, t in h)
            vs_roof = [{"M": m, "vertical": t, "roofline": rr["roofline"], "ratio": t / rr["roofline"],
                        "ssd_traffic_roofline": (rv["tokens_per_iteration"] / (rv["traffic"]["ssd_bytes"] / result["cap_bytes_per_s"])
                                                 if label == "capped" and rv["traffic"]["ssd_bytes"] else None)}
                       for (m, t), rr, rv in zip(v, roof_l, rvs, strict=True)]
            spread = []
            for rv, rh in zip(rvs, rhs, strict=True):
                iv, ih = rv["iteration_seconds"], rh["iteration_seconds"]
                spread.append({"M": rv["micro_batches"], "v_over_h": ih["median"] / iv["median"],
                               "v_over_h_low": ih["min"] / iv["max"], "v_over_h_high": ih["max"] / iv["min"]})
            summary[prefix + label] = {
                "saturated_vertical_tokens_per_s": vsat, "saturated_horizontal_tokens_per_s": hsat,
                "saturated_vertical_over_horizontal": vsat / hsat,
                "M_to_90pct_vertical": first_at(v, 0.9), "M_to_90pct_horizontal": first_at(h, 0.9),
                # the same over the sweep 1..16 only
                "M_to_90pct_vertical_upto16": first_at([x for x in v if x[0] <= 16], 0.9),
                "M_to_90pct_horizontal_upto16": first_at([x for x in h if x[0] <= 16], 0.9),
                "saturated_vertical_over_horizontal_upto16": (
                    max(t for m, t in v if m <= 16) / max(t for m, t in h if m <= 16)),
                "vertical_vs_roofline": vs_roof, "vertical_over_horizontal_per_M": spread,
            }
    if "vertical_capped" in runs and "roof_repeats" in result:
        summary["capped"]["vertical_vs_roofline_pooled"] = pooled_roofline(result, roof["capped"])
        summary["capped"]["vertical_vs_roofline_back_to_back"] = pooled_roofline(result, roof["capped"], sweep=False)
        # vertical's saturation from one 3-step run per M moves with the machine's speed (a
        # fast minute at M = 32 raises the bar for M = 8): the same from all rounds pooled
        pooled_v = [(x["M"], x["vertical"]) for x in summary["capped"]["vertical_vs_roofline_pooled"]]
        summary["capped"]["M_to_90pct_vertical_pooled"] = first_at(pooled_v, 0.9)
        summary["capped"]["M_to_90pct_vertical_pooled_upto16"] = first_at([x for x in pooled_v if x[0] <= 16], 0.9)
    summary["vertical_uncapped_over_torch_ckpt"] = [] if "vertical_uncapped" not in runs else [
        {"M": rv["micro_batches"], "vertical_uncapped": rv["tokens_per_s"], "torch_ckpt": rt["tokens_per_s"],
         "ratio": rv["tokens_per_s"] / rt["tokens_per_s"],
         "snake_compute_busy_s": rv["busy_s_per_iteration"].get("compute"),
         "torch_ckpt_fwd_bwd_s": rt["fwd_bwd_seconds"]["median"]}
        for rv, rt in zip(runs["vertical_uncapped"], runs["torch+ckpt"], strict=True)]
    result["rooflines"], result["rooflines_fixed"], result["summary"] = roof, roof_fixed, summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="M in 1,2 and 2 steps: smoke test")
    ap.add_argument("--steps", type=int, default=4, help="iterations per run, --warmup of them not timed")
    ap.add_argument("--warmup", type=int, default=1,
                    help="first iterations of each run not timed (default 1; 2 where the SSD binds, section 13)")
    ap.add_argument("--fixed", action="store_true",
                    help="also run the old comparison: one fixed placement for both, no budget")
    ap.add_argument("--fixed-only", action="store_true",
                    help="run only the fixed-placement pair and add it to the saved JSON")
    ap.add_argument("--budget-mib", type=float, default=BUDGET_MIB, help="CPU memory budget of both schedules")
    ap.add_argument("--cap-mb", type=float, default=CAP / 1e6,
                    help="SSD cap of the capped pass in MB/s, reads and writes together (both schedules, profile "
                         "and PyTorch-side roofline); 650 with --budget-mib 330 is setting B of BENCHMARKS.md section 1")
    ap.add_argument("--reanalyze", action="store_true", help="recompute ratios from the saved JSON (benchmarks/results/NAME.json)")
    ap.add_argument("--capped-only", action="store_true", help="only the capped SSD (no uncapped pass)")
    ap.add_argument("--link-mb", type=float, default=None,
                    help="cap host<->device transfers at this many MB/s per direction for both schedules "
                         "(SnakeConfig.device_link_bytes_per_s: emulates a PCIe link on the CPU device)")
    ap.add_argument("--roof-rounds", type=int, default=3,
                    help="capped vertical / PyTorch+ckpt pairs per M for the roofline ratio: the main "
                         "sweep's, then (rounds - 1) more, back to back, the order alternating")
    ap.add_argument("--name", default="throughput", help="results file name (benchmarks/results/NAME.json)")
    add_model_args(ap, layers=N_LAYER, width=512, seq=32)  # the device is the same on every side
    ap.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch (default 1)")
    ap.add_argument("--ms", default="1,2,4,8,16,32",
                    help="micro-batches per iteration to sweep (the issue's 1..16, plus 32 to see "
                         "where horizontal saturates)")
    args = ap.parse_args()
    if args.reanalyze:
        import json
        result = json.loads((RESULTS / f"{args.name}.json").read_text())
        recompute_min_io(result)
        analyze(result)
        print_summary(result)
        finish(args.name, result)
        return
    if args.fixed_only:
        import json
        checked_warmup(args)
        result = json.loads((RESULTS / "throughput.json").read_text())
        cfg = gpt_config(result["model"]["n_layer"], result["model"]["n_embd"], result["model"]["seq"])
        t0 = time.perf_counter()
        for m in result["Ms"]:
            common = dict(micro_batches=m, micro_batch_size=result["model"]["micro_batch_size"],
                          seq=result["model"]["seq"], steps=args.steps, warmup=args.warmup)
            for label, cap in (("capped", CAP), ("uncapped", None)):
                run_fixed(cfg, result["runs"], m, label, cap, common)
        result["seconds_fixed_only"] = time.perf_counter() - t0
        analyze(result)
        print_summary(result)
        finish("throughput", result)
        return
    device = checked_device(args, ("micro_batch_size", "steps", "roof_rounds"))
    L, C, T, MB = args.layers, args.width, args.seq, args.micro_batch_size
    ms = [1, 2] if args.quick else [int(x) for x in args.ms.split(",")]
    if not args.quick:
        checked_warmup(args)
    steps, warmup = (2, 1) if args.quick else (args.steps, args.warmup)
    cfg = gpt_config(L, C, T)
    budget = int(args.budget_mib * 2**20)  # as stated; the planner gets planner_budget(budget)
    link = None if args.link_mb is None else args.link_mb * 1e6
    t_start = time.perf_counter()

    SCRATCH.mkdir(parents=True, exist_ok=True)
    if not args.cap_mb > 0:
        raise SystemExit(f"--cap-mb {args.cap_mb}: must be > 0 (MB/s)")
    ssd_cap = args.cap_mb * 1e6
    caps: dict[str, float | None] = {"capped": ssd_cap} if args.capped_only else {"capped": ssd_cap, "uncapped": None}
    profiles = {}
    for label, cap in caps.items():
        profiles[label] = on_worker(
            measure_profile, cfg, micro_batch_size=MB, seq_len=T, device=device, offload_dir=SCRATCH,
            ssd_bandwidth_bytes_per_s=cap, cache=False, io_bytes=(64 if args.quick else 192) << 20,
        )
    opt_bytes = L * cfg.block_params() * OPT_BYTES_PER_ELEM
    planned = planner_budget(budget, profiles["capped"])

    # the budget in the runtime's own memory model (snake.memory.host_memory), as stated
    # (common.planner_budget): the CPU device's working set as modelled until round 21
    shape = profiles["capped"].shape
    dev = off_budget(profiles["capped"], 1) - planner_budget(0, profiles["capped"])
    budget_model = {}
    for sched in ("vertical", "horizontal"):
        mem = host_memory(shape, n_micro=1, alpha=0.0, schedule=sched, workers=2)
        budget_model[sched] = {"fixed_bytes": mem.fixed_bytes, "per_share": mem.per_share,
                               "device_working_set_bytes": dev,
                               "params_ckpts_in_cpu_opt_on_ssd_bytes": mem.at(1, 1, 0) + dev,
                               "everything_in_cpu_bytes": mem.at(1, 1, 1) + dev}
        print(f"{sched:10s} host bytes at M=1, alpha 0: params+ckpts in CPU, opt on SSD "
              f"{(mem.at(1, 1, 0) + dev) / 2**20:.0f} MiB; everything in CPU {(mem.at(1, 1, 1) + dev) / 2**20:.0f} MiB")
    print(f"CPU memory budget (both schedules): {budget / 2**20:.0f} MiB; SSD cap {ssd_cap / 1e6:.0f} MB/s"
          + ("" if link is None else f"; host<->device link cap {link / 1e6:.0f} MB/s per direction"), flush=True)

    plans: dict[str, dict[str, list[dict]]] = {lab: {"vertical": [], "horizontal": []} for lab in caps}
    min_io: dict[str, list[float]] = {lab: [] for lab in caps}
    runs: dict[str, list[dict]] = {}
    for m in ms:
        common = dict(micro_batches=m, micro_batch_size=MB, seq=T, steps=steps, warmup=warmup, device=device)
        for label, cap in caps.items():
            prof = with_budgets(profiles[label], SnakeConfig(offload_dir=SCRATCH, cpu_memory_bytes=planned,
                                                             device_link_bytes_per_s=link))
            min_io[label].append(min_opt_ssd_bytes(profiles[label], budget, m, opt_bytes))
            for sched in ("vertical", "horizontal"):
                plan = search(prof, schedule=sched, n_micro=m)
                if isinstance(plan, Infeasible):
                    raise SystemExit(f"{sched} M={m} {label}: {plan.message}")
                pj = plan_json(plan)
                plans[label][sched].append(pj)
                r = snake_run(cfg, placement=plan.placement, alpha=plan.alpha, schedule=sched, cap=cap,
                              cpu_memory_bytes=planned, link=link, **common)
                r["plan"] = pj
                runs.setdefault(f"{sched}_{label}", []).append(r)
                pl = pj["placement"]
                print(f"M={m:2d} {sched:10s} {label:8s} plan p/c/o={pl['param']:.2f}/{pl['ckpt']:.2f}/{pl['opt']:.2f} "
                      f"alpha={plan.alpha:.2f} pred {plan.predicted_tokens_per_s:6.1f} | "
                      f"{r['tokens_per_s']:7.1f} tok/s ({r['iteration_seconds']['median']:.2f} s/it, "
                      f"SSD {r['traffic']['ssd_bytes'] / 1e6:.0f} MB)", flush=True)
            if args.fixed:
                run_fixed(cfg, runs, m, label, cap, common)
        for ck in (False, True):
            r = torch_run(cfg, activation_checkpointing=ck, **common)
            runs.setdefault(r["schedule"], []).append(r)
            print(f"M={m:2d} {r['schedule']:10s} {'':8s} {r['tokens_per_s']:8.1f} tok/s", flush=True)

    # The roofline ratio compares two runs a minute apart in the sweep, on a machine whose speed
    # drifts by up to ~20 % over minutes: measure the pair again, back to back, first one side
    # first, then the other, and pool the timed steps of all rounds.
    repeats: dict[str, list[list[dict]]] = {"vertical_capped": [[] for _ in ms], "torch+ckpt": [[] for _ in ms]}
    if "capped" in caps:
        for rnd in range(1, 1 if args.quick else args.roof_rounds):
            for i, m in enumerate(ms):
                common = dict(micro_batches=m, micro_batch_size=MB, seq=T, steps=steps, warmup=warmup, device=device)
                pj = plans["capped"]["vertical"][i]
                order = ("torch+ckpt", "vertical_capped") if rnd % 2 else ("vertical_capped", "torch+ckpt")
                for side in order:
                    if side == "torch+ckpt":
                        r = torch_run(cfg, activation_checkpointing=True, **common)
                    else:
                        r = snake_run(cfg, placement=Placement(**pj["placement"]), alpha=pj["alpha"], schedule="vertical",
                                      cap=ssd_cap, cpu_memory_bytes=planned, link=link, **common)
                    repeats[side][i].append(r)
                    print(f"roofline round {rnd} M={m:2d} {side:16s} {r['tokens_per_s']:7.1f} tok/s", flush=True)

    result = {
        "roof_repeats": repeats,
        "machine": machine(), "device": device,
        "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None, "model": {"n_layer": L, "n_embd": C, "seq": T, "micro_batch_size": MB,
                                          "block_params": cfg.block_params(),
                                          "params": cfg.num_params(),
                                          "flops_per_token": model_flops_per_token(cfg, T)},
        "cpu_memory_budget_bytes": budget, "device_link_bytes_per_s": link,
        "budget_model": budget_model, "plans": plans,
        "min_io_bytes": min_io,
        "fixed_placement": {"param": PLACEMENT.param, "ckpt": PLACEMENT.ckpt, "opt": PLACEMENT.opt},
        "fixed_alpha_vertical": ALPHA_V, "cap_bytes_per_s": ssd_cap, "optimizer_state_bytes": opt_bytes,
        "profiles": {k: p.to_json() for k, p in profiles.items()}, "runs": runs, "Ms": ms,
        "seconds_total": time.perf_counter() - t_start,
    }
    analyze(result)
    print_summary(result)
    print(f"total {result['seconds_total']:.0f} s")
    finish(f"{args.name}_quick" if args.quick else args.name, result)


def run_fixed(cfg, runs: dict, m: int, label: str, cap: float | None, common: dict) -> None:
    """The old comparison: PLACEMENT for both schedules, no CPU budget."""
    for sched, alpha in (("vertical", ALPHA_V), ("horizontal", 0.0)):
        r = snake_run(cfg, placement=PLACEMENT, alpha=alpha, schedule=sched, cap=cap, **common)
        runs.setdefault(f"fixed_{sched}_{label}", []).append(r)
        print(f"M={m:2d} {sched:10s} {label:8s} fixed placement "
              f"{r['tokens_per_s']:7.1f} tok/s ({r['iteration_seconds']['median']:.2f} s/it, "
              f"SSD {r['traffic']['ssd_bytes'] / 1e6:.0f} MB)", flush=True)


def print_summary(result: dict) -> None:
    for k, s in result["summary"].items():
        if isinstance(s, dict):
            print(f"{k}: saturated v/h {s['saturated_vertical_over_horizontal']:.2f}, M to 90 %: "
                  f"v {s['M_to_90pct_vertical']} h {s['M_to_90pct_horizontal']} "
                  f"(M <= 16: v/h {s.get('saturated_vertical_over_horizontal_upto16', 0):.2f}, "
                  f"v {s.get('M_to_90pct_vertical_upto16')} h {s.get('M_to_90pct_horizontal_upto16')}), "
                  "vertical / roofline "
                  + " ".join(f"{x['ratio']:.2f}" for x in s["vertical_vs_roofline"]))
            if s.get("vertical_vs_roofline_pooled"):
                print(f"{k}: vertical / roofline, all rounds pooled "
                      + " ".join(f"{x['ratio']:.2f}" for x in s["vertical_vs_roofline_pooled"])
                      + "; per round " + " ".join("/".join(f"{y:.2f}" for y in x["ratio_per_round"])
                                                  for x in s["vertical_vs_roofline_pooled"]))
            if s.get("M_to_90pct_vertical_pooled"):
                print(f"{k}: M to 90 % of vertical's best, its rounds pooled: {s['M_to_90pct_vertical_pooled']} "
                      f"(M <= 16: {s['M_to_90pct_vertical_pooled_upto16']})")
            if s.get("vertical_vs_roofline_back_to_back"):
                print(f"{k}: vertical / roofline, back-to-back pairs only "
                      + " ".join(f"{x['ratio']:.2f}" for x in s["vertical_vs_roofline_back_to_back"]))


def finish(name: str, result: dict) -> None:
    runs, roof, ms = result["runs"], result["rooflines"], result["Ms"]
    print(save(name, result))
    budget = result.get("cpu_memory_budget_bytes")
    fig, axes = figure(1, 2, size=(12, 4.5))
    for ax, label in zip(axes, ("capped", "uncapped"), strict=True):
        if label not in roof:
            ax.set_visible(False)
            continue
        for key, style, lab in (
            (f"vertical_{label}", "o-", "snake vertical (planned)"),
            (f"horizontal_{label}", "s-", "snake horizontal (planned)"),
            (f"fixed_vertical_{label}", "o--", "vertical, fixed placement"),
            (f"fixed_horizontal_{label}", "s--", "horizontal, fixed placement"),
            ("torch", "^:", "PyTorch in memory"), ("torch+ckpt", "v:", "PyTorch + checkpointing"),
        ):
            if key in runs:
                ax.plot([r["micro_batches"] for r in runs[key]], [r["tokens_per_s"] for r in runs[key]], style, label=lab)
        ax.plot(ms, [r["roofline"] for r in roof[label]], "k--",
                label="roofline min(compute, opt I/O" + (", link)" if result.get("device_link_bytes_per_s") else ")"))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches per iteration")
        ax.set_ylabel("tokens/s")
        ax.set_ylim(bottom=0)
        title = f"{label} SSD" + (f" ({result['cap_bytes_per_s'] / 1e6:.0f} MB/s)" if label == "capped" else "")
        if budget:
            title += f", CPU budget {budget / 2**20:.0f} MiB"
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)


if __name__ == "__main__":
    main()
