"""Everything in CPU memory: snake vertical vs in-memory PyTorch with per-layer activation
checkpointing (the same recompute work: the compute roofline), side by side, alternating
rounds. Issue 4 target: vertical at saturation within 10 % of PyTorch + checkpointing.

    python benchmarks/cpu_parity.py [--rounds 3] [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics

from common import gpt_config, save, snake_run, torch_run

from snake import Placement

SETTINGS = [  # (name, n_layer, n_embd, seq, micro-batch size)
    ("wide-short (throughput.py's model)", 4, 512, 32, 1),
    ("wide, 4 x 64 tokens per micro-batch", 4, 512, 64, 4),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--ms", default="4,8,16")
    args = ap.parse_args()
    ms = [int(x) for x in args.ms.split(",")]
    rows = []
    for name, n_layer, n_embd, seq, mbs in SETTINGS:
        cfg = gpt_config(n_layer, n_embd, seq)
        for m in ms:
            snake_t, torch_t = [], []
            for _ in range(args.rounds):
                kw = dict(micro_batches=m, micro_batch_size=mbs, seq=seq, steps=args.steps)
                s = snake_run(cfg, placement=Placement.all_cpu(), alpha=0.0, **kw)
                p = torch_run(cfg, activation_checkpointing=True, **kw)
                snake_t.append(s["tokens_per_s"])
                torch_t.append(p["tokens_per_s"])
            ratios = [a / b for a, b in zip(snake_t, torch_t, strict=True)]
            row = {
                "setting": name, "micro_batches": m, "snake_tokens_per_s": snake_t,
                "torch_ckpt_tokens_per_s": torch_t, "ratio_median": statistics.median(ratios),
                "ratios": ratios,
            }
            rows.append(row)
            print(f"{name:40s} M={m:3d} snake {statistics.median(snake_t):8.0f} tok/s  "
                  f"torch+ckpt {statistics.median(torch_t):8.0f} tok/s  ratio {row['ratio_median']:.2f} "
                  f"[{min(ratios):.2f}-{max(ratios):.2f}]", flush=True)
    save("cpu_parity", {"rows": rows})


if __name__ == "__main__":
    main()
