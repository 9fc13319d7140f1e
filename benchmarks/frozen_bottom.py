"""A fine-tune of the top layers (embeddings, tied head and the bottom half of the blocks
frozen), everything in CPU memory: snake with the backward stopping at the lowest layer
that trains anything (`snake.adapters.lowest_backward`) against snake with it running down
to layer 0 as before round 36 (`Engine.skip_frozen_backward = False`), and against
in-memory PyTorch with per-layer checkpointing, whose autograd runs no backward below what
trains. Side by side in one run, alternating rounds, the order within a round rotating.

    python benchmarks/frozen_bottom.py [--rounds 4] [--steps 5] [--ms 8]
    python benchmarks/frozen_bottom.py --ckpt-share 0 --opt-share 0 --cap-mb 200   # I/O-bound

With `--ckpt-share` / `--opt-share` below 1 the checkpoints / optimizer states go that
far to SSD (capped at `--cap-mb` MB/s): the checkpoints of the frozen layers are then not
written to SSD either (`skip` only).
"""

from __future__ import annotations

import argparse
import statistics

from common import add_model_args, checked_device, gpt_config, machine, save, snake_run, torch_run

from snake import Placement
from snake.engine import Engine

MBS = 4  # sequences per micro-batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ms", default="8")
    ap.add_argument("--name", default="frozen_bottom")
    ap.add_argument("--ckpt-share", type=float, default=1.0)
    ap.add_argument("--opt-share", type=float, default=1.0)
    ap.add_argument("--cap-mb", type=float, default=None)
    add_model_args(ap, layers=8, width=512, seq=64)
    args = ap.parse_args()
    device = checked_device(args)
    n_layer, n_embd, seq = args.layers, args.width, args.seq
    frozen = n_layer // 2  # the bottom half
    placement = Placement(param=1.0, ckpt=args.ckpt_share, opt=args.opt_share)
    cap = args.cap_mb * 1e6 if args.cap_mb else None
    cfg = gpt_config(n_layer, n_embd, seq)
    rows = []
    for m in (int(x) for x in args.ms.split(",")):
        kw = dict(micro_batches=m, micro_batch_size=MBS, seq=seq, steps=args.steps, frozen=frozen, device=device)

        def snake(skip: bool, kw=kw) -> dict:
            Engine.skip_frozen_backward = skip
            try:
                return snake_run(cfg, placement=placement, alpha=0.0, cap=cap, **kw)
            finally:
                Engine.skip_frozen_backward = True

        runs = {
            "skip": lambda: snake(True),
            "full": lambda: snake(False),
            "torch": lambda kw=kw: torch_run(cfg, activation_checkpointing=True, **kw),
        }
        sides = list(runs)
        tps: dict[str, list[float]] = {s: [] for s in sides}
        losses: dict[str, list[float]] = {}
        for r in range(args.rounds):
            order = sides[r % 3:] + sides[: r % 3]
            for side in order:
                out = runs[side]()
                tps[side].append(out["tokens_per_s"])
                losses[side] = out["losses"]
        ratio = {
            "skip_over_full": [a / b for a, b in zip(tps["skip"], tps["full"], strict=True)],
            "skip_over_torch": [a / b for a, b in zip(tps["skip"], tps["torch"], strict=True)],
            "full_over_torch": [a / b for a, b in zip(tps["full"], tps["torch"], strict=True)],
        }
        row = {"micro_batches": m, "tokens_per_s": tps, "ratios": ratio, "losses": losses,
               "ratio_medians": {k: statistics.median(v) for k, v in ratio.items()}}
        rows.append(row)
        print(f"M={m:3d} tok/s: skip {statistics.median(tps['skip']):7.0f}  full {statistics.median(tps['full']):7.0f}  "
              f"torch+ckpt {statistics.median(tps['torch']):7.0f} | skip/full "
              f"{row['ratio_medians']['skip_over_full']:.2f} [{min(ratio['skip_over_full']):.2f}-"
              f"{max(ratio['skip_over_full']):.2f}]  skip/torch {row['ratio_medians']['skip_over_torch']:.2f} "
              f"[{min(ratio['skip_over_torch']):.2f}-{max(ratio['skip_over_torch']):.2f}]  full/torch "
              f"{row['ratio_medians']['full_over_torch']:.2f}", flush=True)
        # the two snake runs train the same weights: the same losses
        assert losses["skip"] == losses["full"], (losses["skip"], losses["full"])
    path = save(args.name, {"machine": machine(), "device": device,
                            "model": {"n_layer": n_layer, "n_embd": n_embd, "seq": seq, "micro_batch_size": MBS,
                                      "frozen_blocks": frozen},
                            "placement": {"param": 1.0, "ckpt": args.ckpt_share, "opt": args.opt_share},
                            "cap_mb_per_s": args.cap_mb, "rounds": args.rounds, "steps": args.steps, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
