"""Child process of tests/test_memory_budget.py: trains a GPT with the planner choosing the
placement under a CPU memory budget, and prints (JSON) the process's peak RSS growth over
the first step (planning included) and over the steps after it, next to the budget. A fresh
process, so the growth is snake's. Run as `python -m tests.budget_child` (Linux: it reads
/proc/self/status and resets the peak through /proc/self/clear_refs)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile

import highspy  # noqa: F401  (imported before the baseline, as the trainer's planning would)
import torch

from planner.profile import shape_of
from snake import AdamW, Placement, SnakeConfig, SnakeTrainer
from snake.memory import RUNTIME_OVERHEAD_BYTES, device_memory, host_memory
from snake.models.gpt import GPT, GPTConfig


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--schedule", default="vertical")
    ap.add_argument("--opt-share", type=float, default=0.5, help="the budget is sized for this optimizer share")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fixed", help="a fixed placement param,ckpt,opt,grad instead of the planner's")
    ap.add_argument("--alpha", type=float, default=0.0)
    ap.add_argument("--clip", type=float, help="max_grad_norm (with --fixed: every step waits, alpha 1)")
    args = ap.parse_args()
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=4, vocab_size=args.vocab,
                    block_size=max(64, args.seq))
    torch.manual_seed(0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(args.steps + 1)]
    data = [(x, torch.roll(x, -1, 1)) for x in xs]
    with tempfile.TemporaryDirectory() as d:
        # the budget: the memory model's host bytes with params and checkpoints in CPU memory
        # and opt-share of the optimizer states, plus what the planner takes off the budget
        # on a CPU device (planner.solve.off_budget): the device's working set and the
        # runtime's overhead
        m = args.micro_batches
        shape = shape_of(cfg, args.batch // m, args.seq, "float32")
        mem = host_memory(shape, n_micro=m, alpha=0.0, schedule=args.schedule, workers=2)
        budget = int(mem.at(1.0, 1.0, args.opt_share) + device_memory(shape, n_micro=m, device_type="cpu") + RUNTIME_OVERHEAD_BYTES)
        config = SnakeConfig(offload_dir=d, device="cpu", micro_batches=args.micro_batches, alpha=0.0,
                             placement=None, schedule=args.schedule, cpu_memory_bytes=budget)
        if args.fixed:  # the memory model's bytes for it, next to what the process takes
            shares = [float(v) for v in args.fixed.split(",")]
            placement = Placement(**dict(zip(("param", "ckpt", "opt", "grad"), shares, strict=True)))
            optimizer = AdamW(max_grad_norm=args.clip) if args.clip else AdamW()
            config = dataclasses.replace(config, placement=placement, alpha=args.alpha, optimizer=optimizer,
                                         cpu_memory_bytes=None)
            mem = host_memory(shape, n_micro=m, alpha=args.alpha, schedule=args.schedule, workers=2)
            budget = int(mem.at(*shares))  # (the CPU placement alone, no device or overhead)
        base = status("VmRSS")
        reset_peak()
        async with SnakeTrainer(model, data=data, config=config) as trainer:
            await trainer.run(1)  # plans (measures this machine: the probes), builds, warms up
            first = status("VmHWM") - base
            reset_peak()
            await trainer.run(args.steps)
            steady = status("VmHWM") - base
            placement = trainer.config.placement
            traffic = trainer.traffic()
    json.dump({"budget": budget, "first": first, "steady": steady,
               "placement": [placement.param, placement.ckpt, placement.opt, placement.grad],
               "grad_ssd_bytes": traffic.get(("cpu", "ssd", "grad"), 0)}, sys.stdout)


if __name__ == "__main__":
    asyncio.run(main())
