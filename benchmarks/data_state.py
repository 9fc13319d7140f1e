"""What keeping a stateful loader's state costs, and what it saves at a resume.

Since round 42 snake takes a stateful data source's `state_dict()` after each batch it reads
(on the data thread) and a checkpoint holds the one after the last batch trained on; `load()`
hands it to the new loader instead of reading and dropping every batch trained before. This
measures, on a small GPT on the CPU device, over a map-style dataset whose rows take
`--row-ms` each to get (a decode, a read), shuffled:

  snapshot: one `snake.data_state.take` of `Epochs(StatefulDataLoader)`'s state (median of
            200), against the median training step;
  steady:   the median step of `--steps` steps with Epochs(StatefulDataLoader) against
            Epochs(DataLoader), same rows and order, alternating `--pairs` times;
  load:     `load()` of a checkpoint taken after `--trained` steps, with the stateful loader
            (its state restored) against the plain one (the batches read and dropped),
            alternating, each in a new trainer.

    python benchmarks/data_state.py [--pairs 3] [--trained 120] [--row-ms 0.5] [--workers 0]   # ~2 min on 2 cores

Writes benchmarks/results/data_state.json and .png (the per-pair load-time ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import warnings

import torch
from ab import write_result
from common import gpt_config, make_model
from torch.utils.data import DataLoader, Dataset

from snake import Epochs, Placement, SnakeConfig, SnakeTrainer
from snake.data_state import take


class Rows(Dataset):
    """`n` (inputs, targets) rows of `seq` tokens, each taking `row_ms` to get."""

    def __init__(self, n: int, seq: int, vocab: int, row_ms: float) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, vocab, (n, seq + 1), generator=g)
        self.row_s = row_ms / 1e3

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.row_s:
            time.sleep(self.row_s)
        return self.x[i, :-1], self.x[i, 1:]


def loader(rows: Rows, batch: int, stateful: bool, workers: int = 0):
    kw = dict(batch_size=batch, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(3),
              num_workers=workers)
    if not stateful:
        return Epochs(DataLoader(rows, **kw))
    from torchdata.stateful_dataloader import StatefulDataLoader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its notice of a deprecated torch call
        return Epochs(StatefulDataLoader(rows, **kw))


def config(where: str, m: int) -> SnakeConfig:
    return SnakeConfig(device="cpu", micro_batches=m, alpha=0.0, offload_dir=where,
                       placement=Placement(param=0.5, ckpt=0.5, opt=0.5))


async def steady(args, cfg, rows, stateful: bool, where: str) -> float:
    async with SnakeTrainer(make_model(cfg), data=loader(rows, args.batch, stateful, args.workers), config=config(where, args.m)) as t:
        rep = await t.run(args.steps + 1)
    return statistics.median(s.seconds for s in rep.steps[1:])


async def load_time(args, cfg, rows, stateful: bool, ckpt: str, where: str) -> float:
    async with SnakeTrainer(make_model(cfg), data=loader(rows, args.batch, stateful, args.workers), config=config(where, args.m)) as t:
        t0 = time.perf_counter()
        await t.load(ckpt)
        return time.perf_counter() - t0


async def main_async(args) -> dict:
    cfg = gpt_config(args.layers, args.width, args.seq)
    rows = Rows(args.batch * (args.trained + args.steps + 8), args.seq, cfg.vocab_size, args.row_ms)
    probe = loader(rows, args.batch, True, args.workers)
    it = iter(probe)
    next(it)
    snaps = []
    for _ in range(200):
        t0 = time.perf_counter()
        take(probe.state_dict)
        snaps.append(time.perf_counter() - t0)
    del it
    pairs = []
    with tempfile.TemporaryDirectory(prefix="snake-datastate-") as tmp:
        # the checkpoints, one per kind (the same weights: same rows, order and seed)
        for kind in ("plain", "stateful"):
            data = loader(rows, args.batch, kind == "stateful", args.workers)
            async with SnakeTrainer(make_model(cfg), data=data, config=config(f"{tmp}/train-{kind}", args.m)) as t:
                await t.run(args.trained)
                await t.save(f"{tmp}/ck-{kind}")
        for i in range(args.pairs):
            plain_step = await steady(args, cfg, rows, False, f"{tmp}/s{i}p")
            state_step = await steady(args, cfg, rows, True, f"{tmp}/s{i}s")
            plain_load = await load_time(args, cfg, rows, False, f"{tmp}/ck-plain", f"{tmp}/l{i}p")
            state_load = await load_time(args, cfg, rows, True, f"{tmp}/ck-stateful", f"{tmp}/l{i}s")
            pair = {"plain_step_s": plain_step, "stateful_step_s": state_step,
                    "steady_ratio": state_step / plain_step, "plain_load_s": plain_load,
                    "stateful_load_s": state_load, "ratio": state_load / plain_load}
            pairs.append(pair)
            print(f"pair {i + 1}: step plain {plain_step * 1e3:.1f} ms, stateful {state_step * 1e3:.1f} ms (ratio "
                  f"{pair['steady_ratio']:.3f}); load plain {plain_load:.2f} s, stateful {state_load:.2f} s "
                  f"(ratio {pair['ratio']:.3f})", flush=True)
    snap = statistics.median(snaps)
    step = statistics.median(p["plain_step_s"] for p in pairs)
    print(f"snapshot: median {snap * 1e6:.0f} us = {snap / step * 100:.3f} % of the median step ({step * 1e3:.1f} ms)")
    steady_ratios = [p["steady_ratio"] for p in pairs]
    print(f"steady step, stateful / plain: median {statistics.median(steady_ratios):.3f} "
          f"[{min(steady_ratios):.3f}-{max(steady_ratios):.3f}]")
    return {"base": "the plain DataLoader (load s)", "args": vars(args), "pairs": pairs, "snapshot_s": snap,
            "snapshot_share_of_step": snap / step, "median_steady_ratio": statistics.median(steady_ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16, help="rows per global batch")
    ap.add_argument("--m", type=int, default=2, help="micro-batches")
    ap.add_argument("--steps", type=int, default=12, help="steps timed per steady run")
    ap.add_argument("--trained", type=int, default=120, help="steps the checkpoint was taken after")
    ap.add_argument("--row-ms", type=float, default=0.5, help="time to get one row")
    ap.add_argument("--workers", type=int, default=0, help="the loaders' worker processes")
    ap.add_argument("--name", default="data_state")
    args = ap.parse_args()
    for name in ("pairs", "layers", "width", "seq", "batch", "m", "steps", "trained"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.row_ms < 0 or args.workers < 0:
        raise SystemExit("--row-ms and --workers must be >= 0")
    result = asyncio.run(main_async(args))
    write_result(args.name, result, "load s, stateful / plain")


if __name__ == "__main__":
    main()
