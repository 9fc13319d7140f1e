"""What a data source that draws from torch's global random generator costs on a CPU device.

On a CPU device dropout draws from torch's global generator, which snake's compute thread
seeds around each block (the recompute's masks must be the forward's). A sync source seen
drawing from it at its first batch (nanoGPT's get_batch with torch.randint, a DataLoader
shuffling without generator=) therefore takes turns with those seeded stretches: while its
next() runs, no block starts. A source that does not draw is read alongside the blocks as
before. This measures the two side by side on the same batches, in pairs alternating
which goes first: the same random windows, once from a generator that does not touch the
global generator and once from one that draws them from it, each next() taking `--next-ms`
more of waiting (a loader's I/O; 0: the draw alone).

    python benchmarks/data_rng.py [--pairs 4] [--steps 8] [--next-ms 0,20]   # ~2 min on 2 cores

Writes benchmarks/results/data_rng.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

from common import SCRATCH, gpt_config, machine, make_model, on_worker, save  # type: ignore[import-not-found]


def windows(tokens, rows: int, seq: int, n: int, wait_s: float, drawn: bool, seed: int):  # type: ignore[no-untyped-def]
    """n batches of random windows of `tokens`: drawn from torch's global generator
    (`drawn`, as nanoGPT's get_batch does) or from a generator of their own; each next()
    waits `wait_s` first."""
    import torch

    own = torch.Generator().manual_seed(seed)
    for _ in range(n):
        if wait_s:
            time.sleep(wait_s)
        hi = len(tokens) - seq - 1
        ix = torch.randint(hi, (rows,)) if drawn else torch.randint(hi, (rows,), generator=own)
        yield (torch.stack([tokens[i : i + seq] for i in ix]), torch.stack([tokens[i + 1 : i + 1 + seq] for i in ix]))


async def one_run(args: argparse.Namespace, drawn: bool, wait_s: float, where: Path) -> dict:
    import torch

    from snake import Placement, SnakeConfig, SnakeTrainer

    cfg = dataclasses.replace(gpt_config(args.layers, args.width, args.seq), dropout=args.dropout)
    model = on_worker(make_model, cfg, 0)
    tokens = on_worker(lambda: torch.randint(cfg.vocab_size, (1 << 16,), generator=torch.Generator().manual_seed(3)))
    torch.manual_seed(1234)
    config = SnakeConfig(device="cpu", micro_batches=args.m, alpha=0.0, offload_dir=where,
                         placement=Placement(param=1.0, ckpt=1.0, opt=1.0))
    data = windows(tokens, args.batch, args.seq, args.steps + 1, wait_s, drawn, seed=1234)
    async with SnakeTrainer(model, data=data, config=config) as t:
        report = await t.run(args.steps + 1)
        draws = t.source.draws_rng
    steps = [s.seconds for s in report.steps[1:]]  # the first is the warm-up
    return {"drawn": drawn, "draws_rng": draws, "wait_ms": wait_s * 1e3, "step_s": steps,
            "median_step_s": statistics.median(steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--m", type=int, default=4, help="micro-batches")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--next-ms", default="0,20", help="comma-separated waits in each next()")
    args = ap.parse_args()
    SCRATCH.mkdir(parents=True, exist_ok=True)
    out: dict = {"machine": machine(), "args": vars(args), "settings": []}
    for wait_ms in (float(v) for v in args.next_ms.split(",")):
        pairs = []
        for i in range(args.pairs):
            got = {}
            for drawn in ((False, True) if i % 2 == 0 else (True, False)):
                with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
                    got[drawn] = asyncio.run(one_run(args, drawn, wait_ms / 1e3, Path(d)))
            assert got[True]["draws_rng"] and not got[False]["draws_rng"]
            ratio = got[True]["median_step_s"] / got[False]["median_step_s"]
            pairs.append({"own_generator": got[False], "global_generator": got[True], "ratio": ratio})
            print(f"next() +{wait_ms:.0f} ms, pair {i}: own generator {got[False]['median_step_s']:.3f} s/step, "
                  f"global generator {got[True]['median_step_s']:.3f} s/step, ratio {ratio:.3f}", flush=True)
        ratios = [p["ratio"] for p in pairs]
        out["settings"].append({"next_ms": wait_ms, "pairs": pairs, "median_ratio": statistics.median(ratios)})
        print(f"next() +{wait_ms:.0f} ms: global / own generator, median {statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}-{max(ratios):.3f}]", flush=True)
    print(f"saved {save('data_rng', out)}")


if __name__ == "__main__":
    main()
