"""Everything in CPU memory: snake vertical vs in-memory PyTorch with per-layer activation
checkpointing (the same recompute work: the compute roofline), side by side, alternating
rounds; the order within a round alternates too (snake first in even rounds, PyTorch first
in odd ones), so a machine that drifts one way over a pair does not favour one side. Issue 4
target: vertical at saturation within 10 % of PyTorch + checkpointing.

    python benchmarks/cpu_parity.py [--rounds 4] [--steps 5] [--ms 4,8,16]
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
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ms", default="4,8,16")
    args = ap.parse_args()
    ms = [int(x) for x in args.ms.split(",")]
    rows = []
    for name, n_layer, n_embd, seq, mbs in SETTINGS:
        cfg = gpt_config(n_layer, n_embd, seq)
        for m in ms:
            snake_t, torch_t, snake_steps, torch_steps = [], [], [], []
            kw = dict(micro_batches=m, micro_batch_size=mbs, seq=seq, steps=args.steps)
            for r in range(args.rounds):
                runs = {
                    "snake": lambda: snake_run(cfg, placement=Placement.all_cpu(), alpha=0.0, **kw),  # noqa: B023
                    "torch": lambda: torch_run(cfg, activation_checkpointing=True, **kw),  # noqa: B023
                }
                order = ["snake", "torch"] if r % 2 == 0 else ["torch", "snake"]
                out = {side: runs[side]() for side in order}
                snake_t.append(out["snake"]["tokens_per_s"])
                torch_t.append(out["torch"]["tokens_per_s"])
                snake_steps += out["snake"]["step_seconds"][1:]
                torch_steps += out["torch"]["step_seconds"][1:]
            ratios = [a / b for a, b in zip(snake_t, torch_t, strict=True)]
            pooled = statistics.median(torch_steps) / statistics.median(snake_steps)
            row = {
                "setting": name, "micro_batches": m, "snake_tokens_per_s": snake_t,
                "torch_ckpt_tokens_per_s": torch_t, "ratio_median": statistics.median(ratios),
                "ratios": ratios, "ratio_pooled_steps": pooled,
                "snake_step_seconds": snake_steps, "torch_step_seconds": torch_steps,
            }
            rows.append(row)
            print(f"{name:40s} M={m:3d} snake {statistics.median(snake_t):8.0f} tok/s  "
                  f"torch+ckpt {statistics.median(torch_t):8.0f} tok/s  ratio {row['ratio_median']:.2f} "
                  f"[{min(ratios):.2f}-{max(ratios):.2f}], pooled steps {pooled:.2f}", flush=True)
    save("cpu_parity", {"rows": rows})


if __name__ == "__main__":
    main()
