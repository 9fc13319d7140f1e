"""What clipping by the global gradient norm costs: seconds per iteration of three trainers
of one model, side by side in one process, rounds interleaved:
  - `alpha0`: no clipping, every step right after its layer's backward (alpha = 0);
  - `alpha1`: no clipping, every step delayed into the next iteration (alpha = 1);
  - `clip`: alpha = 1 and `AdamW(max_grad_norm=...)`, a bound every step's norm exceeds.
`clip / alpha1` is what the norms and the wait for them cost; `alpha1 / alpha0` what
delaying every step costs, which clipping needs. With `--dtype float16` every trainer
computes in float16 (a static loss scale of 1024) and a fourth one is added:
  - `dynamic`: alpha = 1 and a dynamic loss scale (`DynamicLossScale(init_scale=1024)`: no
    step overflows here, so every step is taken, as in the others);
`dynamic / alpha1` is what the dynamic scale's norms and the wait for them cost. With
`--grad-share G` a trainer is added:
  - `clip_ssd`: as `clip`, with `placement.grad = G`: the gradients that wait for the next
    iteration beyond what the stale parameters hold (and the share G) go to SSD and back;
`clip_ssd / clip` is what moving them costs, with its grad bytes per iteration.

    python benchmarks/clip.py [--layers 8] [--width 512] [--seq 128] [--micro-batches 4]
                              [--micro-batch-size 2] [--placement 0.5,0.5,0.5] [--rounds 6]
                              [--steps 2] [--dtype float16] [--grad-share 0] [--ssd-cap 1e8]
                              # ~3 min on 2 cores (float32)

CPU device unless CUDA is present. Each trainer takes one warm-up step, then per round each
runs `--steps` steps, in an order that rotates. Reports medians over rounds of seconds per
iteration and the ratios. Writes benchmarks/results/<--name>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics

from common import (  # type: ignore[import-not-found]
    SCRATCH,
    add_model_args,
    checked_device,
    gpt_config,
    machine,
    make_batches,
    make_model,
    on_worker,
    save,
)

from snake import AdamW, DynamicLossScale, Placement, SnakeConfig, SnakeTrainer

WAYS = {
    "alpha0": dict(alpha=0.0, optimizer=AdamW(lr=1e-4)),
    "alpha1": dict(alpha=1.0, optimizer=AdamW(lr=1e-4)),
    "clip": dict(alpha=1.0, optimizer=AdamW(lr=1e-4, max_grad_norm=0.01)),
}


def _placement(text: str) -> Placement:
    param, ckpt, opt = (float(x) for x in text.split(","))
    return Placement(param=param, ckpt=ckpt, opt=opt)


def _placement_of(args: argparse.Namespace, name: str) -> Placement:
    if name == "clip_ssd":
        return dataclasses.replace(args.placement, grad=args.grad_share)
    return args.placement


async def measure(args: argparse.Namespace, device: str) -> dict:
    cfg = gpt_config(args.layers, args.width, args.seq)
    rows = args.micro_batches * args.micro_batch_size
    data = on_worker(make_batches, cfg, rows, args.seq, 1 + args.rounds * args.steps)
    ways = dict(WAYS)
    if args.dtype == "float16":
        ways["dynamic"] = dict(alpha=1.0, optimizer=AdamW(lr=1e-4), loss_scale=DynamicLossScale(init_scale=1024.0))
    if args.grad_share is not None:
        ways["clip_ssd"] = WAYS["clip"]
    trainers = {}
    for name, kw in ways.items():
        config = SnakeConfig(micro_batches=args.micro_batches, offload_dir=SCRATCH / f"clip-{name}",
                             placement=_placement_of(args, name), device=device, dtype=args.dtype,
                             ssd_bandwidth_bytes_per_s=args.ssd_cap, **kw)  # type: ignore[arg-type]
        trainers[name] = SnakeTrainer(on_worker(make_model, cfg), data=data, config=config)
    times: dict[str, list[float]] = {name: [] for name in ways}
    grad_bytes: dict[str, dict[str, int]] = {}
    norms: list[float] = []
    skipped = 0
    try:
        for t in trainers.values():
            await t.run(1)  # warm-up (and setup)
        names = list(ways)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                report = await trainers[name].run(args.steps)
                times[name].append(report.seconds / args.steps)
                if name == "clip":
                    norms += [s.grad_norm for s in report.steps]
                skipped += sum(s.skipped for s in report.steps)
                traffic = trainers[name].traffic()
                grad_bytes[name] = {"cpu->ssd": traffic.get(("cpu", "ssd", "grad"), 0),
                                    "ssd->cpu": traffic.get(("ssd", "cpu", "grad"), 0)}
            print(f"round {r}: " + ", ".join(f"{n} {times[n][-1]:.3f} s" for n in ways), flush=True)
    finally:
        for t in trainers.values():
            await t.close()
    med = {name: statistics.median(v) for name, v in times.items()}
    out = {
        "times": times, "median_s": med, "clip_norms": norms, "skipped_steps": skipped,
        "clip_over_alpha1": med["clip"] / med["alpha1"],
        "alpha1_over_alpha0": med["alpha1"] / med["alpha0"],
        "clip_over_alpha0": med["clip"] / med["alpha0"],
    }
    if "dynamic" in med:
        out["dynamic_over_alpha1"] = med["dynamic"] / med["alpha1"]
    if "clip_ssd" in med:
        out["clip_ssd_over_clip"] = med["clip_ssd"] / med["clip"]
        out["grad_bytes_per_iteration"] = grad_bytes
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, layers=8, width=512, seq=128)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=2, help="steps per trainer and round")
    ap.add_argument("--placement", type=_placement, default=Placement(param=0.5, ckpt=0.5, opt=0.5),
                    help="param,ckpt,opt CPU shares")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"],
                    help="compute dtype; float16 adds the dynamic loss scale's trainer")
    ap.add_argument("--grad-share", type=float, default=None,
                    help="add clip_ssd: clipping with this placement.grad (the waiting gradients' CPU share)")
    ap.add_argument("--ssd-cap", type=float, default=None, help="cap the SSD tier at this many bytes/s (I/O-bound)")
    ap.add_argument("--name", default="clip", help="results/<name>.json")
    args = ap.parse_args()
    device = checked_device(args, ("micro_batches", "micro_batch_size", "rounds", "steps"))
    result = asyncio.run(measure(args, device))
    for k, v in result.items():
        if k not in ("times", "clip_norms"):
            print(f"{k}: {v}")
    print(f"clip norms (every one above the bound 0.01): min {min(result['clip_norms']):.3f}")
    args.placement = str(args.placement)
    print(f"saved {save(args.name, {'machine': machine(), 'args': vars(args), **result})}")


if __name__ == "__main__":
    main()
