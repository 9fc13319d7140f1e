"""How far the compute thread runs ahead of the device (round 11), variants side by side:

- `ahead`: the runtime. On CUDA a job's kernels are only queued (its outputs are handed on
  at its end mark), and the next stage's first micro-batch is queued before a stage's last
  jobs are collected (`Compute._ahead`).
- `collect_first`: a stage's jobs are all collected before the next stage's first is queued.
- `wait_each_job` (CUDA only): also the host waits for each job's kernels before the next
  (the runtime before round 11, whose kernels each ended with a stream synchronize).

    python benchmarks/stage_overlap.py             # ~1.5 min on 2 cores (CPU device)
    python benchmarks/stage_overlap.py --device cuda --layers 8 --width 2048 --seq 512 --ms 4,16

Everything in CPU memory, so the compute actor sets the pace and its idle time shows. The
variants run in alternating rounds in one process. Per run: the median iteration time, the
compute actor's idle share of the time between its first and last span of the timed
iterations (gaps between consecutive spans, split into gaps inside a stage and gaps at a stage
boundary), and how many stage boundaries had the next stage's first job queued ahead.
Writes benchmarks/results/stage_overlap.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any

from common import (  # type: ignore[import-not-found]
    RESULTS,
    SCRATCH,
    add_model_args,
    checked_device,
    figure,
    gpt_config,
    machine,
    make_batches,
    make_model,
    on_worker,
    save,
)

import snake.engine
from snake import Placement, SnakeConfig, SnakeTrainer
from snake.actors import compute
from snake.device import StreamMarks

VARIANTS = ("ahead", "collect_first", "wait_each_job")


class _WaitEachJob(StreamMarks):
    """Marks come in (start, end) pairs per micro-batch: wait for each end as it is made."""

    def __init__(self, device) -> None:  # type: ignore[no-untyped-def]
        super().__init__(device)
        self.n = 0

    def mark(self):  # type: ignore[no-untyped-def]
        ev = super().mark()
        self.n += 1
        if self.n % 2 == 0:
            ev.synchronize()
        return ev


async def one_run(cfg, *, m: int, seq: int, steps: int, schedule: str, variant: str, device: str) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    model, data = on_worker(lambda: (make_model(cfg), make_batches(cfg, m, seq, steps)))
    queued = {"ahead": 0, "not": 0}
    real = compute.Compute._ahead

    async def counted(self, run, nxt, batch):  # type: ignore[no-untyped-def]
        out = await real(self, run, nxt, batch) if variant == "ahead" else None
        queued["ahead" if out is not None and out.pending else "not"] += 1
        return out

    compute.Compute._ahead = counted  # type: ignore[method-assign]
    marks = snake.engine.stream_marks
    if variant == "wait_each_job":
        snake.engine.stream_marks = _WaitEachJob  # type: ignore[assignment]
    try:
        with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
            conf = SnakeConfig(micro_batches=m, offload_dir=d, placement=Placement.all_cpu(), alpha=0.0,
                               schedule=schedule, device=device)
            async with SnakeTrainer(model, data=data, config=conf) as t:
                report = await t.run(steps)
                spans = [s for s in t.trace.spans if s.actor == "compute"]
    finally:
        compute.Compute._ahead = real  # type: ignore[method-assign]
        snake.engine.stream_marks = marks
    # the timed iterations: after the first "loss" span (the end of the warm-up iteration)
    warm_end = next(s.end_s for s in spans if s.name == "loss")
    timed = sorted((s for s in spans if s.start_s >= warm_end), key=lambda s: s.start_s)
    within = boundary = 0.0
    for a, b in zip(timed, timed[1:], strict=False):
        gap = max(0.0, b.start_s - a.end_s)
        if a.name.split()[:2] == b.name.split()[:2]:
            within += gap
        else:
            boundary += gap
    wall = timed[-1].end_s - timed[0].start_s
    secs = [s.seconds for s in report.steps[1:]]
    return {"iteration_s": statistics.median(secs), "step_seconds": secs,
            "idle_within_stage": within / wall, "idle_at_boundary": boundary / wall,
            "boundaries_queued_ahead": queued["ahead"], "boundaries": queued["ahead"] + queued["not"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of both variants")
    ap.add_argument("--steps", type=int, default=4, help="iterations per run (first discarded)")
    ap.add_argument("--ms", default="4,8", help="micro-batches per iteration")
    ap.add_argument("--schedules", default="vertical,horizontal")
    ap.add_argument("--name", default="stage_overlap")
    add_model_args(ap, layers=8, width=512, seq=32)
    args = ap.parse_args()
    device = checked_device(args, positive=("rounds", "steps"))
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first iteration is a warm-up)")
    try:
        ms = [int(x) for x in args.ms.split(",")]
    except ValueError:
        ms = []
    if not ms or min(ms) < 1:
        raise SystemExit(f"--ms {args.ms}: give positive integers separated by commas, e.g. 4,8")
    schedules = args.schedules.split(",")
    if any(s not in ("vertical", "horizontal") for s in schedules):
        raise SystemExit(f"--schedules {args.schedules}: give vertical and/or horizontal, e.g. vertical,horizontal")
    SCRATCH.mkdir(parents=True, exist_ok=True)
    cfg = gpt_config(args.layers, args.width, args.seq)
    variants = VARIANTS if device.startswith("cuda") else VARIANTS[:2]
    rows: dict[str, list[dict[str, Any]]] = {}
    t0 = time.perf_counter()
    for rnd in range(args.rounds):
        for schedule in schedules:
            for m in ms:
                order = variants if rnd % 2 == 0 else tuple(reversed(variants))
                for variant in order:
                    r = asyncio.run(one_run(cfg, m=m, seq=args.seq, steps=args.steps, schedule=schedule,
                                            variant=variant, device=device))
                    key = f"{schedule} M={m} {variant}"
                    rows.setdefault(key, []).append(r)
                    print(f"round {rnd} {key:32s} {r['iteration_s']:.3f} s/it, compute idle "
                          f"{r['idle_within_stage']:.3f} within + {r['idle_at_boundary']:.3f} at boundaries, "
                          f"{r['boundaries_queued_ahead']}/{r['boundaries']} queued ahead", flush=True)
    summary: dict[str, dict[str, float]] = {}
    for schedule in schedules:
        for m in ms:
            a = rows[f"{schedule} M={m} ahead"]
            entry: dict[str, Any] = {
                f"{v}_{f}": statistics.median(r[f] for r in rows[f"{schedule} M={m} {v}"])
                for v in variants for f in ("iteration_s", "idle_within_stage", "idle_at_boundary")
            }
            for v in variants[1:]:  # per round: the runtime's iteration time over the variant's
                ratios = [x["iteration_s"] / y["iteration_s"] for x, y in zip(a, rows[f"{schedule} M={m} {v}"], strict=True)]
                entry[f"ahead_over_{v}"] = statistics.median(ratios)
                entry[f"ahead_over_{v}_rounds"] = ratios
            summary[f"{schedule} M={m}"] = entry
    for k, e in summary.items():
        print(f"{k:16s} " + "; ".join(
            f"ahead/{v} iteration time {e[f'ahead_over_{v}']:.3f} (rounds "
            f"{', '.join(f'{x:.3f}' for x in e[f'ahead_over_{v}_rounds'])})" for v in variants[1:])
            + "; idle at boundaries " + " / ".join(f"{e[f'{v}_idle_at_boundary']:.3f}" for v in variants))
    fig, (ax,) = figure()
    keys = list(summary)
    w = 0.8 / len(variants)
    for i, v in enumerate(variants):
        xs = [x + w * i for x in range(len(keys))]
        ax.bar(xs, [summary[k][f"{v}_idle_at_boundary"] for k in keys], width=w, label=f"{v}: at stage boundaries")
        ax.bar(xs, [summary[k][f"{v}_idle_within_stage"] for k in keys], width=w,
               bottom=[summary[k][f"{v}_idle_at_boundary"] for k in keys], alpha=0.4, label=f"{v}: inside a stage")
    ax.set_xticks([x + 0.4 - w / 2 for x in range(len(keys))], keys)
    ax.set_ylabel("compute actor idle, share of wall")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = save(args.name, {"machine": machine(), "device": device, "model": {"layers": args.layers, "width": args.width}, "seq": args.seq,
                           "rows": rows, "summary": summary, "seconds": time.perf_counter() - t0})
    fig.savefig(RESULTS / f"{args.name}.png", dpi=110)
    print(out)


if __name__ == "__main__":
    main()
