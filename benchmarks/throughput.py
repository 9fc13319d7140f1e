"""Throughput vs micro-batches (GreedySnake Figure 10 at CPU scale), side by side:
snake vertical, snake horizontal (same placement, same SSD cap), plain in-memory PyTorch
with gradient accumulation with and without per-block activation checkpointing, and the
roofline (min of the compute roofline and the I/O roofline: optimizer states read and
written once per iteration over the measured SSD bandwidth).

    python benchmarks/throughput.py            # ~6 min on 2 cores; --quick for a smoke run

Model: GPT, 4 layers, width 512, seq 32, micro-batch 1 sequence: a block's parameters
(12.6 MB fp32) are ~200x its checkpoint (64 KiB), so parameter traffic dominates as in the
paper. Placement (both schedules): params half on SSD, checkpoints in CPU memory,
optimizer states all on SSD. Vertical delays alpha=0.25 of the step; horizontal 0
(ZeRO-Infinity). Writes benchmarks/results/throughput.json and throughput.png.
"""

from __future__ import annotations

import argparse
import time

from common import (  # type: ignore[import-not-found]
    RESULTS,
    SCRATCH,
    figure,
    gpt_config,
    machine,
    model_flops_per_token,
    save,
    snake_run,
    torch_run,
)

from planner import measure_profile
from snake import Placement
from snake.memory import OPT_BYTES_PER_ELEM

PLACEMENT = Placement(param=0.5, ckpt=1.0, opt=0.0)
ALPHA_V = 0.25
CAP = 300e6


def first_at(points: list[tuple[int, float]], frac: float) -> int | None:
    """Smallest M whose tokens/s reaches frac x the best of the sweep."""
    best = max(t for _, t in points)
    return min(m for m, t in points if t >= frac * best)


def analyze(result: dict) -> None:
    """Rooflines and the issue's ratios, from the runs (so they can be recomputed).

    I/O roofline: optimizer states read + written once per iteration; capped: at the token
    bucket's rate (reads and writes share it); uncapped: at the profile's measured read and
    write bandwidth. Compute roofline: the forward + backward time of PyTorch with per-block
    checkpointing at the same M, measured in the same run (no optimizer step; snake overlaps
    it), and, for reference, the planner profile's (fwd + recompute + bwd) per block."""
    runs, ms, opt_bytes = result["runs"], result["Ms"], result["optimizer_state_bytes"]
    roof: dict[str, list[dict]] = {}
    for label, p in result["profiles"].items():
        if label == "capped":
            io_s = 2 * opt_bytes / result["cap_bytes_per_s"]
        else:
            io_s = opt_bytes / p["ssd_read_bytes_per_s"] + opt_bytes / p["ssd_write_bytes_per_s"]
        sh = p["shape"]
        per_micro = sh["n_layers"] * (p["fwd_seconds"] + p["recompute_seconds"] + p["bwd_seconds"]) + p["pre_post_seconds"]
        rows = []
        for i, m in enumerate(ms):
            tok = runs["torch+ckpt"][i]["tokens_per_iteration"]
            emp = tok / runs["torch+ckpt"][i]["fwd_bwd_seconds"]["median"]
            io = tok / io_s
            rows.append({"M": m, "compute_roofline_torch_ckpt": emp,
                         "compute_roofline_profile": sh["tokens_per_micro"] / per_micro,
                         "io_roofline": io, "roofline": min(emp, io)})
        roof[label] = rows
    summary: dict[str, dict] = {}
    for label in ("capped", "uncapped"):
        v = [(r["micro_batches"], r["tokens_per_s"]) for r in runs[f"vertical_{label}"]]
        h = [(r["micro_batches"], r["tokens_per_s"]) for r in runs[f"horizontal_{label}"]]
        vsat, hsat = max(t for _, t in v), max(t for _, t in h)
        vs_roof = [{"M": m, "vertical": t, "roofline": rr["roofline"], "ratio": t / rr["roofline"],
                    "ssd_traffic_roofline": (rv["tokens_per_iteration"] / (rv["traffic"]["ssd_bytes"] / result["cap_bytes_per_s"])
                                             if label == "capped" else None)}
                   for (m, t), rr, rv in zip(v, roof[label], runs[f"vertical_{label}"], strict=True)]
        spread = []
        for rv, rh in zip(runs[f"vertical_{label}"], runs[f"horizontal_{label}"], strict=True):
            iv, ih = rv["iteration_seconds"], rh["iteration_seconds"]
            spread.append({"M": rv["micro_batches"], "v_over_h": ih["median"] / iv["median"],
                           "v_over_h_low": ih["min"] / iv["max"], "v_over_h_high": ih["max"] / iv["min"]})
        summary[label] = {
            "saturated_vertical_tokens_per_s": vsat, "saturated_horizontal_tokens_per_s": hsat,
            "saturated_vertical_over_horizontal": vsat / hsat,
            "M_to_90pct_vertical": first_at(v, 0.9), "M_to_90pct_horizontal": first_at(h, 0.9),
            "vertical_vs_roofline": vs_roof, "vertical_over_horizontal_per_M": spread,
        }
    summary["vertical_uncapped_over_torch_ckpt"] = [
        {"M": rv["micro_batches"], "vertical_uncapped": rv["tokens_per_s"], "torch_ckpt": rt["tokens_per_s"],
         "ratio": rv["tokens_per_s"] / rt["tokens_per_s"],
         "snake_compute_busy_s": rv["busy_s_per_iteration"].get("compute"),
         "torch_ckpt_fwd_bwd_s": rt["fwd_bwd_seconds"]["median"]}
        for rv, rt in zip(runs["vertical_uncapped"], runs["torch+ckpt"], strict=True)]
    result["rooflines"], result["summary"] = roof, summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="M in 1,2 and 2 steps: smoke test")
    ap.add_argument("--steps", type=int, default=4, help="iterations per run (first discarded)")
    ap.add_argument("--reanalyze", action="store_true", help="recompute ratios from the saved JSON")
    args = ap.parse_args()
    if args.reanalyze:
        import json
        result = json.loads((RESULTS / "throughput.json").read_text())
        analyze(result)
        finish("throughput", result)
        return
    L, C, T, MB = 4, 512, 32, 1
    ms = [1, 2] if args.quick else [1, 2, 4, 8, 16]
    steps = 2 if args.quick else args.steps
    cfg = gpt_config(L, C, T)
    t_start = time.perf_counter()

    SCRATCH.mkdir(parents=True, exist_ok=True)
    profiles = {}
    for label, cap in (("capped", CAP), ("uncapped", None)):
        profiles[label] = measure_profile(
            cfg, micro_batch_size=MB, seq_len=T, device="cpu", offload_dir=SCRATCH,
            ssd_bandwidth_bytes_per_s=cap, cache=False, io_bytes=(64 if args.quick else 192) << 20,
        )
    opt_bytes = L * cfg.block_params() * OPT_BYTES_PER_ELEM

    runs: dict[str, list[dict]] = {}
    for m in ms:
        common = dict(micro_batches=m, micro_batch_size=MB, seq=T, steps=steps)
        for label, cap in (("capped", CAP), ("uncapped", None)):
            for sched, alpha in (("vertical", ALPHA_V), ("horizontal", 0.0)):
                r = snake_run(cfg, placement=PLACEMENT, alpha=alpha, schedule=sched, cap=cap, **common)
                runs.setdefault(f"{sched}_{label}", []).append(r)
                print(f"M={m:2d} {sched:10s} {label:8s} {r['tokens_per_s']:8.1f} tok/s "
                      f"({r['iteration_seconds']['median']:.2f} s/it)", flush=True)
        for ck in (False, True):
            r = torch_run(cfg, activation_checkpointing=ck, **common)
            runs.setdefault(r["schedule"], []).append(r)
            print(f"M={m:2d} {r['schedule']:10s} {'':8s} {r['tokens_per_s']:8.1f} tok/s", flush=True)

    result = {
        "machine": machine(), "model": {"n_layer": L, "n_embd": C, "seq": T, "micro_batch_size": MB,
                                          "block_params": cfg.block_params(),
                                          "params": cfg.num_params(),
                                          "flops_per_token": model_flops_per_token(cfg, T)},
        "placement": {"param": PLACEMENT.param, "ckpt": PLACEMENT.ckpt, "opt": PLACEMENT.opt},
        "alpha_vertical": ALPHA_V, "cap_bytes_per_s": CAP, "optimizer_state_bytes": opt_bytes,
        "profiles": {k: p.to_json() for k, p in profiles.items()}, "runs": runs, "Ms": ms,
        "seconds_total": time.perf_counter() - t_start,
    }
    analyze(result)
    finish("throughput_quick" if args.quick else "throughput", result)


def finish(name: str, result: dict) -> None:
    runs, roof, ms = result["runs"], result["rooflines"], result["Ms"]
    print(save(name, result))
    fig, axes = figure(1, 2, size=(12, 4.5))
    for ax, label in zip(axes, ("capped", "uncapped"), strict=True):
        for key, style, lab in (
            (f"vertical_{label}", "o-", "snake vertical"), (f"horizontal_{label}", "s-", "snake horizontal"),
            ("torch", "^:", "PyTorch in memory"), ("torch+ckpt", "v:", "PyTorch + checkpointing"),
        ):
            ax.plot([r["micro_batches"] for r in runs[key]], [r["tokens_per_s"] for r in runs[key]], style, label=lab)
        ax.plot(ms, [r["roofline"] for r in roof[label]], "k--", label="roofline min(compute, opt I/O)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches per iteration")
        ax.set_ylabel("tokens/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{label} SSD" + (f" ({CAP / 1e6:.0f} MB/s)" if label == "capped" else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)


if __name__ == "__main__":
    main()
