"""Where compute time goes on a CPU "device" (parts 1 and 2 also on CUDA: --device cuda), side by side in one process:

1. per block: snake's forward and recompute+backward kernels (`snake.kernels.Kernels`, as
   the compute actor calls them) against a plain PyTorch block forward and a
   `torch.utils.checkpoint` forward+backward, interleaved rounds;
2. per iteration, everything in CPU memory, vertical, alpha 0: snake's kernels called in
   schedule order on one thread (no actors), the real runtime (`SnakeTrainer.run`), and
   PyTorch with per-block checkpointing (gradient accumulation + fused AdamW), alternating;
3. the runtime alone in fresh processes (as `snake train` runs), alternating: snake's
   helper threads at one intra-op thread (`snake.device.helper_thread_init`, the default on
   a CPU device) vs at torch's count (the behaviour before it) vs the default with one more
   live thread in the process that once ran a torch op (its idle OpenMP team), with the
   cores busy.

(1) says whether the kernels cost more than PyTorch's; (2) whether the runtime around them
(actors, executor hops, mover and optimizer threads on the same cores) does.

    python benchmarks/kernels.py [--rounds 4] [--seq 32] [--mbs 1] [--ab-rounds 3] [--name kernels]   # ~2.5 min here
    python benchmarks/kernels.py --device cuda --layers 8 --width 2048 --seq 512 --m 16 --rounds 3   # on a GPU: parts 1-2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from common import (
    SCRATCH,
    add_model_args,
    checked_device,
    gpt_config,
    machine,
    make_batches,
    make_model,
    on_worker,
    save,
    torch_loop,
)
from torch.utils.checkpoint import checkpoint

import snake.engine
import snake.trainer
from snake import Placement, SnakeConfig, SnakeTrainer
from snake.adapters import describe
from snake.kernels import Kernels


def per_block(cfg, seq: int, mbs: int, rounds: int, device: str = "cpu") -> dict[str, float]:
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = make_model(cfg)
    k = Kernels(describe(model), SnakeConfig(offload_dir=".", micro_batches=1), dev, 1)
    blk = model.blocks[0].to(dev)
    slot = torch.cat([p.detach().reshape(-1) for p in blk.parameters()])
    acc = torch.zeros_like(slot)
    x = torch.randn(mbs, seq, cfg.n_embd, device=dev)
    gy = torch.randn_like(x)
    xr = x.clone().requires_grad_(True)

    def torch_fwd() -> None:
        with torch.no_grad():
            blk(xr)
        sync()

    def torch_ckpt() -> None:
        checkpoint(blk, xr, use_reentrant=False).backward(gy)
        sync()

    fns = {
        "snake_fwd": lambda: (k.block_fwd(slot, x, 0, 0, 0), sync()),
        "snake_bwd": lambda: (k.block_bwd(slot, x, gy, acc, t=0, layer=0, m=0, accumulate=True), sync()),
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


def sequential_iteration(cfg, m: int, mbs: int, seq: int, device: str = "cpu") -> Callable[[], None]:
    """snake's kernels in vertical order for one iteration, on the calling thread (on CUDA
    queued without waiting, as the runtime's compute thread does; the resident step at the
    end waits for the device)."""
    dev = torch.device(device)
    model = make_model(cfg)
    k = Kernels(describe(model), SnakeConfig(offload_dir=".", micro_batches=m), dev, m)
    slots = [torch.cat([p.detach().reshape(-1) for p in b.parameters()]).to(dev) for b in model.blocks]
    accs = [torch.zeros_like(s) for s in slots]
    x, y = (t.to(dev) for t in make_batches(cfg, m * mbs, seq, 1)[0])
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


async def runtime_iteration(cfg, m: int, mbs: int, seq: int, steps: int, device: str = "cpu") -> float:
    model, data = on_worker(lambda: (make_model(cfg), make_batches(cfg, m * mbs, seq, steps)))
    with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
        conf = SnakeConfig(micro_batches=m, offload_dir=d, placement=Placement.all_cpu(), alpha=0.0, device=device)
        async with SnakeTrainer(model, data=data, config=conf) as t:
            rep = await t.run(steps)
    return statistics.median(s.seconds for s in rep.steps[1:])


@contextlib.contextmanager
def _unlimited_helpers() -> Iterator[None]:
    """The behaviour before `snake.device.helper_thread_init`: helper threads at torch's count."""
    saved = snake.engine.helper_thread_init, snake.trainer.helper_thread_init
    snake.engine.helper_thread_init = snake.trainer.helper_thread_init = lambda device: None
    try:
        yield
    finally:
        snake.engine.helper_thread_init, snake.trainer.helper_thread_init = saved


def child(args) -> None:  # type: ignore[no-untyped-def]
    """One fresh process: the runtime alone (as `snake train` runs it); prints a JSON line."""
    cfg = gpt_config(4, 512, args.seq)

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    async def go() -> dict[str, float]:
        model, data = on_worker(lambda: (make_model(cfg), make_batches(cfg, args.m * args.mbs, args.seq, 13)))
        with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
            conf = SnakeConfig(micro_batches=args.m, offload_dir=d, placement=Placement.all_cpu(), alpha=0.0,
                               device="cpu")
            async with SnakeTrainer(model, data=data, config=conf) as t:
                await t.run(3)
                c0, w0 = cpu(), time.perf_counter()
                rep = await t.run(10)
                wall = time.perf_counter() - w0
        return {"seconds": statistics.median(s.seconds for s in rep.steps), "cpu_per_wall": (cpu() - c0) / wall}

    if args.child == "unlimited":
        with _unlimited_helpers():
            print(json.dumps(asyncio.run(go())))
    elif args.child == "extra_team":  # a live thread of "the user's" that once ran a torch op
        with ThreadPoolExecutor(1, thread_name_prefix="user-thread") as ex:
            a = torch.randn(1024, 1024)
            ex.submit(lambda: a @ a).result()
            print(json.dumps(asyncio.run(go())))
    else:
        print(json.dumps(asyncio.run(go())))


def helper_threads_ab(args) -> dict:  # type: ignore[no-untyped-def]
    """3. The runtime with its helper threads at one intra-op thread (snake's default on a
    CPU device) vs at torch's count, alternating fresh processes."""
    runs: dict[str, list[dict[str, float]]] = {"limited": [], "unlimited": [], "extra_team": []}
    for _ in range(args.ab_rounds):
        for mode in runs:
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, "--seq", str(args.seq), "--mbs", str(args.mbs),
                 "--m", str(args.m)], check=True, capture_output=True, text=True,
            ).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
            print(mode, runs[mode][-1], flush=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    return {"runs": runs, "median": med,
            "limited_over_unlimited": med["limited"]["seconds"] / med["unlimited"]["seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--m", type=int, default=8, help="micro-batches per iteration in parts 2 and 3")
    ap.add_argument("--ab-rounds", type=int, default=3, help="fresh-process pairs in part 3 (CPU device only)")
    add_model_args(ap, layers=4, width=512, seq=32)
    ap.add_argument("--name", default="kernels", help="results file name (benchmarks/results/<name>.json)")
    ap.add_argument("--child", choices=("limited", "unlimited", "extra_team"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    SCRATCH.mkdir(parents=True, exist_ok=True)
    if args.child:
        child(args)
        return
    device = checked_device(args, ("rounds", "mbs", "m"))
    cfg = gpt_config(args.layers, args.width, args.seq)
    blocks = on_worker(lambda: per_block(cfg, args.seq, args.mbs, args.rounds, device))
    print({k: round(v, 3) for k, v in blocks.items()}, flush=True)
    seq_run = on_worker(lambda: sequential_iteration(cfg, args.m, args.mbs, args.seq, device))
    rows: dict[str, list[float]] = {"sequential_kernels": [], "runtime": [], "torch_ckpt": []}
    for _ in range(args.rounds):
        rows["runtime"].append(asyncio.run(runtime_iteration(cfg, args.m, args.mbs, args.seq, 5, device)))

        def seq_time() -> float:
            seq_run()
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                seq_run()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)

        rows["sequential_kernels"].append(on_worker(seq_time))
        r = on_worker(lambda: torch_loop(cfg, micro_batches=args.m, micro_batch_size=args.mbs, seq=args.seq,
                                         steps=4, activation_checkpointing=True, device=device))
        rows["torch_ckpt"].append(r["iteration_seconds"]["median"])
        print({k: round(v[-1], 3) for k, v in rows.items()}, flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "machine": machine(), "device": device,
        "model": {"n_layer": args.layers, "n_embd": args.width, "seq": args.seq, "micro_batch_size": args.mbs,
                  "micro_batches": args.m},
        "per_block": blocks, "iteration_seconds": rows, "median_seconds": med,
        "torch_ckpt_over_sequential_kernels": med["torch_ckpt"] / med["sequential_kernels"],
        "torch_ckpt_over_runtime": med["torch_ckpt"] / med["runtime"],
    }
    print(f"iteration s (median of {args.rounds}): sequential kernels {med['sequential_kernels']:.3f}, "
          f"runtime {med['runtime']:.3f}, torch+ckpt {med['torch_ckpt']:.3f}; torch/sequential "
          f"{result['torch_ckpt_over_sequential_kernels']:.2f}, torch/runtime {result['torch_ckpt_over_runtime']:.2f}")
    if args.ab_rounds < 1 or device != "cpu":  # part 3 skipped (it is about a CPU device's threads)
        print(save(args.name, result))
        return
    ab = helper_threads_ab(args)
    result["helper_threads_ab"] = ab
    print(f"helper threads, fresh processes (median of {args.ab_rounds}): one intra-op thread "
          f"{ab['median']['limited']['seconds']:.3f} s/it ({ab['median']['limited']['cpu_per_wall']:.2f} cores busy), "
          f"torch's count {ab['median']['unlimited']['seconds']:.3f} s/it "
          f"({ab['median']['unlimited']['cpu_per_wall']:.2f}); ratio {ab['limited_over_unlimited']:.2f}; "
          f"one intra-op thread with one more live thread that ran a torch op "
          f"{ab['median']['extra_team']['seconds']:.3f} s/it ({ab['median']['extra_team']['cpu_per_wall']:.2f})")
    print(save(args.name, result))


if __name__ == "__main__":
    main()
