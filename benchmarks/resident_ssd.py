"""CPU memory and time per iteration of the resident (embedding, head) optimizer state in CPU
memory against on SSD (`SnakeConfig.resident_optimizer`), on a model whose vocabulary makes
the resident parameters a large part of it.

    python benchmarks/resident_ssd.py [--vocab 131072] [--width 512] [--steps 4] [--rounds 2]   # ~2 min

The built-in GPT (4 layers, tied head, `--vocab` x `--width` embedding), trained on the CPU
device with its layers' parameters, checkpoints and optimizer states all on SSD (alpha 0, one
micro-batch of 1 x 64 tokens), in a fresh process per way and round, the ways alternating.
Reports the process's anonymous memory (RssAnon) at its peak over the run, sampled every
20 ms, above what it had before the model was built, and its growth during a `save()` after
the run; the seconds of each step after the first; the SSD bytes of the last step (the trainer's traffic); and the losses, which must be
the same both ways. Last, how long a `run()` cancelled 50 ms into its resident step takes to
return (`cancel_s`). Writes benchmarks/results/<--name>.json.

--base REV: a third way, the state on SSD with REV's snake (a temporary git worktree), for an
A/B of the resident step itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _anon_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise KeyError("RssAnon")


def child(way: str, vocab: int, width: int, steps: int, offload: str) -> None:
    """One run in this process; prints one JSON line."""
    import torch

    from snake import Placement, SnakeConfig, SnakeTrainer
    from snake.models import GPT, GPTConfig

    base = _anon_kib()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], _anon_kib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=width // 64, n_embd=width, vocab_size=vocab, block_size=64))
    resident = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
    g = torch.Generator().manual_seed(0)
    data = [(x[:, :-1].contiguous(), x[:, 1:].contiguous())
            for x in (torch.randint(0, vocab, (1, 65), generator=g) for _ in range(steps + 1))]
    cfg = SnakeConfig(micro_batches=1, offload_dir=offload, placement=Placement.all_ssd(), alpha=0.0, device="cpu",
                      resident_optimizer=way)

    saving = {}

    async def go() -> tuple[list[float], list[float], dict]:
        async with SnakeTrainer(model, data=data, config=cfg) as trainer:
            report = await trainer.run(steps)
            traffic = trainer.traffic()
            saving["run_peak"] = peak[0]
            saving["before"] = peak[0] = _anon_kib()
            await trainer.save(Path(offload) / "ckpt")
            saving["peak"] = peak[0]
            saving["cancel_s"] = await _cancel_in_resident_step(trainer)
        return [s.loss for s in report.steps], [s.seconds for s in report.steps], traffic

    losses, step_s, traffic = asyncio.run(go())
    done.set()
    sampler.join()
    ssd = sum(v for (src, dst, _kind), v in traffic.items() if "ssd" in (src, dst))
    import snake

    print(json.dumps({
        "way": way, "snake": snake.__file__, "losses": losses, "step_s": step_s, "anon_peak_mib": (saving["run_peak"] - base) / 1024,
        "save_anon_growth_mib": (saving["peak"] - saving["before"]) / 1024, "baseline_anon_mib": base / 1024,
        "cancel_s": saving["cancel_s"],
        "ssd_bytes_last_step": ssd, "resident_params": resident,
        "layer_params": sum(p.numel() for p in model.blocks.parameters()),
    }))


async def _cancel_in_resident_step(trainer) -> float:  # type: ignore[no-untyped-def]
    """Seconds from cancelling a run() 50 ms into its resident step until it returns."""
    import time

    loop, started = asyncio.get_running_loop(), asyncio.Event()
    k = trainer.engine.kernels
    real = k.resident_step
    k.resident_step = lambda step: (loop.call_soon_threadsafe(started.set), real(step))[1]
    task = asyncio.create_task(trainer.run(1))
    await started.wait()
    await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="resident_ssd", help="results/<name>.json")
    ap.add_argument("--base", default=None, metavar="REV",
                    help="also run the state on SSD with this revision's snake (a git worktree), for an A/B")
    ap.add_argument("--child", nargs=2, metavar=("WAY", "OFFLOAD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.vocab, args.width, args.steps, args.child[1])
        return
    from ab import base_worktree  # type: ignore[import-not-found]
    from common import SCRATCH, machine, save  # type: ignore[import-not-found]

    with contextlib.ExitStack() as stack:
        trees = {"cpu": ROOT, "ssd": ROOT}
        if args.base:
            base, worktree = stack.enter_context(base_worktree(args.base))
            trees[f"ssd@{base}"] = worktree
        runs = _rounds(args, trees, SCRATCH)
        # the disk as the planner's probe measures it, after the runs: what its time model
        # charges the state on SSD per iteration (`planner.solve.resident_ssd_seconds`)
        from planner.probes import ssd_bytes_per_s

        read, write = ssd_bytes_per_s(SCRATCH, 1 << 30, None)
    _report(args, runs, machine, save, (read, write))


def _rounds(args: argparse.Namespace, trees: dict[str, Path], scratch: Path) -> list[dict]:
    """Every way once per round, in fresh processes, the order reversed every other round."""
    runs = []
    for r in range(args.rounds):
        for way in list(trees) if r % 2 == 0 else list(trees)[::-1]:
            off = scratch / f"resident-{way}-{r}"
            tree = trees[way]
            out = subprocess.run(
                [sys.executable, __file__, "--child", way.split("@")[0], str(off), "--vocab", str(args.vocab),
                 "--width", str(args.width), "--steps", str(args.steps)],
                cwd=tree, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(tree)},
            )
            shutil.rmtree(off, ignore_errors=True)  # its offload files and the checkpoint it saved
            if out.returncode:
                raise SystemExit(f"{way}: {out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            assert Path(row["snake"]).resolve().is_relative_to(tree.resolve()), row["snake"]  # the tree's own snake
            row["way"], row["round"] = way, r
            runs.append(row)
            print(f"round {r} resident on {way:11s}: anon peak +{row['anon_peak_mib']:5.0f} MiB (save "
                  f"+{row['save_anon_growth_mib']:4.0f} MiB)  steps "
                  f"{[round(s, 2) for s in row['step_s'][1:]]} s  SSD last step {row['ssd_bytes_last_step'] / 2**20:.0f} "
                  f"MiB  losses {[round(x, 4) for x in row['losses']]}  cancel {row['cancel_s']:.3f} s", flush=True)
    return runs


def _report(args: argparse.Namespace, runs: list[dict], machine, save,  # type: ignore[no-untyped-def]
            disk: tuple[float, float]) -> None:
    by = {w: [x for x in runs if x["way"] == w] for w in dict.fromkeys(x["way"] for x in runs)}
    same = all(x["losses"] == runs[0]["losses"] for x in runs)
    step = {w: statistics.median(s for x in by[w] for s in x["step_s"][1:]) for w in by}
    summary = {
        "resident_params": runs[0]["resident_params"], "layer_params": runs[0]["layer_params"],
        "anon_peak_mib": {w: [round(x["anon_peak_mib"]) for x in by[w]] for w in by},
        "save_anon_growth_mib": {w: [round(x["save_anon_growth_mib"]) for x in by[w]] for w in by},
        "median_step_s": step, "over_cpu_step": {w: step[w] / step["cpu"] for w in step},
        "extra_ssd_bytes_per_step": statistics.median(x["ssd_bytes_last_step"] for x in by["ssd"])
        - statistics.median(x["ssd_bytes_last_step"] for x in by["cpu"]),
        "same_losses": same,
        "cancel_s": {w: [round(x["cancel_s"], 3) for x in by[w]] for w in by},
        "probe_read_write_bytes_per_s": disk,
        # the planner's charge for the state on SSD against the measured difference
        "predicted_extra_s": runs[0]["resident_params"] * 12 * (1 / disk[0] + 1 / disk[1]),
        "measured_extra_s": {w: step[w] - step["cpu"] for w in step if w != "cpu"},
    }
    print(json.dumps(summary, indent=1))
    result = {"machine": machine(), "args": vars(args), "runs": runs, "summary": summary}
    print(f"saved {save(args.name, result)}")


if __name__ == "__main__":
    main()
