"""What float16's overflow check at a static loss scale costs beside an optimizer step: each
layer's complete fp32 gradient is summed once it is in host memory (`Kernels.check_finite`,
on the device mover's copy thread; the resident parameters' before their step), one more
read of it. Side by side in one process, rounds interleaved, on one flat unit of `--elems`
elements:
  - `step`: AdamW alone (`snake.optim.adamw_step`, torch's fused kernel);
  - `checked`: the check, then the same AdamW step.
`checked / step - 1` is the check's work relative to the step's (on a GPU the copy thread
that does it mostly waits for its copies; on a CPU device every thread shares the cores).

    python benchmarks/overflow_check.py [--elems 12582912] [--rounds 20] [--threads 1]

`--threads`: torch's threads for the steps (1: an optimizer worker's on a CPU device, where
the compute keeps the others; 0: torch's default, as the workers have on CUDA). Reports
medians over rounds of seconds per step and the ratio. Writes
benchmarks/results/<--name>.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import machine, on_worker, save  # type: ignore[import-not-found]

from snake import AdamW
from snake.optim import adamw_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--elems", type=int, default=12 * 1024 * 1024, help="elements of the unit (12 M: a 1024-wide GPT layer)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--name", default="overflow_check")
    a = ap.parse_args()
    if a.elems < 1 or a.rounds < 1 or a.threads < 0:
        ap.error("--elems and --rounds must be >= 1, --threads >= 0")
    result = {"machine": machine(), "args": vars(a), **on_worker(measure, a)}
    t = result["median_s"]
    print(f"step {t['step'] * 1e3:.2f} ms  checked {t['checked'] * 1e3:.2f} ms  "
          f"checked/step {result['ratio']:.3f}  -> {save(a.name, result)}")


def measure(a: argparse.Namespace) -> dict:
    if a.threads:
        torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(a.elems, generator=gen)
    grad = torch.randn(a.elems, generator=gen) * 1e-3
    m, v = torch.zeros(a.elems), torch.zeros(a.elems)
    opt = AdamW(lr=1e-6)
    k = [1]

    def step() -> None:
        adamw_step([master], [grad], [m], [v], step=k[0], opt=opt, lr=opt.lr)
        k[0] += 1

    def checked() -> None:
        # Kernels.check_finite on one gradient
        if not torch.isfinite(torch.stack([grad.sum(dtype=torch.float32)]).sum()):
            raise AssertionError("the benchmark's gradient is finite")
        step()

    runs = {"step": step, "checked": checked}
    times: dict[str, list[float]] = {n: [] for n in runs}
    for fn in runs.values():  # warm-up
        fn()
    for r in range(a.rounds):
        names = list(runs)[r % 2 :] + list(runs)[: r % 2]
        for n in names:
            t0 = time.perf_counter()
            runs[n]()
            times[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(ts) for n, ts in times.items()}
    ratios = [c / s for c, s in zip(times["checked"], times["step"], strict=True)]
    return {"median_s": med, "ratio": med["checked"] / med["step"], "ratio_per_round": ratios,
            "threads": torch.get_num_threads()}


if __name__ == "__main__":
    main()
