"""Where compute time goes on a CPU "device", side by side in one process:

1. per block: snake's forward and recompute+backward kernels (`snake.kernels.Kernels`, as
   the compute actor calls them) against a plain PyTorch block forward and a
   `torch.utils.checkpoint` forward+backward, interleaved rounds;
2. per iteration, everything in CPU memory, vertical, alpha 0: snake's kernels called in
   schedule order on one thread (no actors), the real runtime (`SnakeTrainer.run`), and
   PyTorch with per-block checkpointing (gradient accumulation + fused AdamW), alternating.

(1) says whether the kernels cost more than PyTorch's; (2) whether the runtime around them
(actors, executor hops, mover and optimizer threads on the same cores) does.

    python benchmarks/kernels.py [--rounds 4] [--seq 32] [--mbs 1]     # ~1.5 min here
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from common import SCRATCH, gpt_config, machine, make_batches, make_model, save, torch_loop
from torch.utils.checkpoint import checkpoint

from snake import Placement, SnakeConfig, SnakeTrainer
from snake.adapters import describe
from snake.kernels import Kernels


def per_block(cfg, seq: int, mbs: int, rounds: int) -> dict[str, float]:
    model = make_model(cfg)
    k = Kernels(describe(model), SnakeConfig(offload_dir=".", micro_batches=1), torch.device("cpu"), 1)
    blk = model.blocks[0]
    slot = torch.cat([p.detach().reshape(-1) for p in blk.parameters()])
    acc = torch.zeros_like(slot)
    x = torch.randn(mbs, seq, cfg.n_embd)
    gy = torch.randn_like(x)
    xr = x.clone().requires_grad_(True)

    def torch_fwd() -> None:
        with torch.no_grad():
            blk(xr)

    def torch_ckpt() -> None:
        checkpoint(blk, xr, use_reentrant=False).backward(gy)

    fns = {
        "snake_fwd": lambda: k.block_fwd(slot, x, 0, 0, 0),
        "snake_bwd": lambda: k.block_bwd(slot, x, gy, acc, t=0, layer=0, m=0, accumulate=True),
        "torch_fwd": torch_fwd,
        "torch_ckpt_fwd_bwd": torch_ckpt,
    }
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(rounds * 4):
        for n, f in fns.items():
            f()
            t0 = time.perf_counter()
            for _ in range(10):
                f()
            times[n].append((time.perf_counter() - t0) / 10)
    out = {n + "_ms": statistics.median(v) * 1e3 for n, v in times.items()}
    out["snake_fwd_plus_bwd_over_torch_ckpt"] = (
        (out["snake_fwd_ms"] + out["snake_bwd_ms"]) / out["torch_ckpt_fwd_bwd_ms"]
    )
    return out


def sequential_iteration(cfg, m: int, mbs: int, seq: int) -> Callable[[], None]:
    """snake's kernels in vertical order for one iteration, on the calling thread."""
    model = make_model(cfg)
    k = Kernels(describe(model), SnakeConfig(offload_dir=".", micro_batches=m), torch.device("cpu"), m)
    slots = [torch.cat([p.detach().reshape(-1) for p in b.parameters()]) for b in model.blocks]
    accs = [torch.zeros_like(s) for s in slots]
    x, y = make_batches(cfg, m * mbs, seq, 1)[0]
    xs, ys = x.chunk(m), y.chunk(m)
    n = len(slots)

    def run() -> None:
        ck = [[None] * m for _ in range(n + 1)]
        for j in range(m):
            ck[0][j] = k.pre(xs[j], 0, j)
        for layer in range(n):
            for j in range(m):
                ck[layer + 1][j] = k.block_fwd(slots[layer], ck[layer][j], 0, layer, j)
        g = [None] * m
        for j in range(m):
            _, g[j] = k.head(ck[n][j], ys[j], 0, j)
        for layer in reversed(range(n)):
            for j in range(m):
                g[j] = k.block_bwd(slots[layer], ck[layer][j], g[j], accs[layer], t=0, layer=layer, m=j,
                                   accumulate=j > 0)
        for j in range(m):
            k.pre_bwd(xs[j], g[j], 0, j)
        k.resident_step(1)

    return run


async def runtime_iteration(cfg, m: int, mbs: int, seq: int, steps: int) -> float:
    data = make_batches(cfg, m * mbs, seq, steps)
    with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
        conf = SnakeConfig(micro_batches=m, offload_dir=d, placement=Placement.all_cpu(), alpha=0.0, device="cpu")
        async with SnakeTrainer(make_model(cfg), data=data, config=conf) as t:
            rep = await t.run(steps)
    return statistics.median(s.seconds for s in rep.steps[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--m", type=int, default=8, help="micro-batches per iteration in part 2")
    args = ap.parse_args()
    SCRATCH.mkdir(parents=True, exist_ok=True)
    cfg = gpt_config(4, 512, args.seq)
    with ThreadPoolExecutor(1, thread_name_prefix="bench-kernels") as ex:  # as the compute actor
        blocks = ex.submit(per_block, cfg, args.seq, args.mbs, args.rounds).result()
        print({k: round(v, 3) for k, v in blocks.items()}, flush=True)
        seq_run = ex.submit(sequential_iteration, cfg, args.m, args.mbs, args.seq).result()
        rows: dict[str, list[float]] = {"sequential_kernels": [], "runtime": [], "torch_ckpt": []}
        for _ in range(args.rounds):
            rows["runtime"].append(asyncio.run(runtime_iteration(cfg, args.m, args.mbs, args.seq, 5)))

            def seq_time() -> float:
                seq_run()
                ts = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    seq_run()
                    ts.append(time.perf_counter() - t0)
                return statistics.median(ts)

            rows["sequential_kernels"].append(ex.submit(seq_time).result())
            r = ex.submit(lambda: torch_loop(cfg, micro_batches=args.m, micro_batch_size=args.mbs, seq=args.seq,
                                             steps=4, activation_checkpointing=True)).result()
            rows["torch_ckpt"].append(r["iteration_seconds"]["median"])
            print({k: round(v[-1], 3) for k, v in rows.items()}, flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "machine": machine(), "model": {"n_layer": 4, "n_embd": 512, "seq": args.seq, "micro_batch_size": args.mbs,
                                          "micro_batches": args.m},
        "per_block": blocks, "iteration_seconds": rows, "median_seconds": med,
        "torch_ckpt_over_sequential_kernels": med["torch_ckpt"] / med["sequential_kernels"],
        "torch_ckpt_over_runtime": med["torch_ckpt"] / med["runtime"],
    }
    print(f"iteration s (median of {args.rounds}): sequential kernels {med['sequential_kernels']:.3f}, "
          f"runtime {med['runtime']:.3f}, torch+ckpt {med['torch_ckpt']:.3f}; torch/sequential "
          f"{result['torch_ckpt_over_sequential_kernels']:.2f}, torch/runtime {result['torch_ckpt_over_runtime']:.2f}")
    print(save("kernels", result))


if __name__ == "__main__":
    main()
