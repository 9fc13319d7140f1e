"""How long `trainer.stop()` takes to end a run: the time from the call to the end of the run's
last step, in steps, and how many steps finished after the call.

`stop()` ends the run before its first step not yet begun: the step running finishes, and
the next one where its reads have begun (a step's reads start while the one before ends).
This measures what that means: a GPT on the CPU device, a run(30) after two warm steps,
`stop()` called from a timer thread at a random time 0.5-1.5 s into the run (seeded), for
each setting `--runs` times:

  mixed:   every kind half on SSD, alpha 0.25 (the main job's setting);
  all-cpu: everything in CPU memory, alpha 0.

    python benchmarks/stop_latency.py [--runs 12]   # ~2 min on 2 cores

Writes benchmarks/results/stop_latency.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import threading
import time

from common import RESULTS, gpt_config, make_batches, make_model

from snake import Placement, SnakeConfig, SnakeTrainer

SETTINGS = {
    "mixed": (0.25, Placement(param=0.5, ckpt=0.5, opt=0.5)),
    "all-cpu": (0.0, Placement.all_cpu()),
}


async def once(args, setting: str, delay: float, where: str) -> dict:
    alpha, placement = SETTINGS[setting]
    cfg = gpt_config(args.layers, args.width, args.seq)
    data = make_batches(cfg, args.batch, args.seq, 40)
    config = SnakeConfig(offload_dir=where, device="cpu", micro_batches=args.m, alpha=alpha, placement=placement)
    async with SnakeTrainer(make_model(cfg), data=iter(data), config=config) as t:
        await t.run(2)
        ends: list[float] = []
        called = [0.0]

        def fire() -> None:
            called[0] = time.monotonic()
            t.stop()

        timer = threading.Timer(delay, fire)
        task = asyncio.ensure_future(t.run(30, on_step=lambda s: ends.append(time.monotonic())))
        timer.start()
        report = await task
        timer.join()
    step = statistics.median(s.seconds for s in report.steps)
    after = [e for e in ends if e > called[0]]
    return {"delay_s": delay, "steps_before": len(ends) - len(after), "steps_after": len(after),
            "latency_s": ends[-1] - called[0], "median_step_s": step, "latency_steps": (ends[-1] - called[0]) / step}


async def main_async(args) -> dict:
    rng = random.Random(args.seed)
    out: dict = {"args": vars(args), "settings": {}}
    for setting in SETTINGS:
        runs = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="snake-stop-") as d:
                runs.append(await once(args, setting, rng.uniform(0.5, 1.5), d))
        lat = [r["latency_steps"] for r in runs]
        out["settings"][setting] = {"runs": runs, "max_latency_steps": max(lat), "median_latency_steps": statistics.median(lat)}
        print(f"{setting}: steps finished after stop() {[r['steps_after'] for r in runs]}; call to the run's end in "
              f"median steps: median {statistics.median(lat):.2f}, max {max(lat):.2f} "
              f"(median step {statistics.median(r['median_step_s'] for r in runs) * 1e3:.0f} ms)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8, help="rows per global batch")
    ap.add_argument("--m", type=int, default=4, help="micro-batches")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="stop_latency")
    args = ap.parse_args()
    for name in ("runs", "layers", "width", "seq", "batch", "m"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1")
    result = asyncio.run(main_async(args))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {RESULTS / (args.name + '.json')}")


if __name__ == "__main__":
    main()
