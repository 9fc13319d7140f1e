"""What `trainer.evaluate` costs: seconds per global batch of the streamed evaluation
against a training step of the same trainer, and against PyTorch's eval forward of the
model in memory (the compute alone). Three ways of evaluating, side by side:
- `grouped`: as `evaluate` runs by default: each pass over the model takes as many batches
  as the CPU memory training leaves idle between runs holds, each layer's load into one
  device slot while the layer before runs in the other;
- `per_batch`: one batch per pass (`batches_per_pass=1`; round 29's evaluate): the model
  read once per batch;
- `one_slot`: one batch per pass with one slot (the benchmark holds the other): each load
  after the layer before, no overlap.

    python benchmarks/evaluate.py [--layers 8] [--width 1024] [--seq 128] [--micro-batches 4]
                                  [--micro-batch-size 2] [--batches 8] [--rounds 4]
                                  [--ssd-mb-per-s MB]                        # ~5 min

One trainer (CPU device unless CUDA is present; `--placement`, all on SSD by default: every
load reads the layer from the disk; `--ssd-mb-per-s` caps the disk, the I/O-bound regime of
a fast device), one warm-up step, then per round, in an order that alternates: one training
step and an `evaluate` of `--batches` global batches each way. PyTorch's eval forward runs on
the same batches after the rounds. Reports medians over rounds of seconds per global batch,
the passes each way took, and the losses (evaluate's and PyTorch's, which must agree).
Writes benchmarks/results/<--name>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from common import (  # type: ignore[import-not-found]
    RESULTS,
    SCRATCH,
    add_model_args,
    checked_device,
    figure,
    gpt_config,
    machine,
    make_batches,
    make_model,
    on_worker,
    save,
)

from snake import Placement, SnakeConfig, SnakeTrainer


def _placement(text: str) -> Placement:
    param, ckpt, opt = (float(x) for x in text.split(","))
    return Placement(param=param, ckpt=ckpt, opt=opt)


def _with_state(model, state):  # type: ignore[no-untyped-def]
    m = copy.deepcopy(model)
    m.load_state_dict(state)
    return m


def torch_eval(model, data, device: str) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """PyTorch's eval forward of `model` (in memory) over `data`: (seconds per batch, loss)."""
    m = copy.deepcopy(model).to(device).eval()
    total, count, times = 0.0, 0, []
    with torch.no_grad():
        for x, y in data:
            t0 = time.perf_counter()
            logits = m(x.to(device))
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.to(device).reshape(-1),
                                   reduction="sum")
            total, count = total + float(loss), count + y.numel()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), total / count


async def measure(args: argparse.Namespace, device: str) -> dict:
    cfg = gpt_config(args.layers, args.width, args.seq)
    model = on_worker(make_model, cfg)
    rows = args.micro_batches * args.micro_batch_size
    train = on_worker(make_batches, cfg, rows, args.seq, args.rounds + 1)
    held = on_worker(make_batches, cfg, rows, args.seq, args.batches, seed=2)
    cap = int(args.ssd_mb_per_s * 1e6) if args.ssd_mb_per_s else None
    config = SnakeConfig(micro_batches=args.micro_batches, offload_dir=SCRATCH / "evaluate", placement=args.placement,
                         alpha=0.0, device=device, ssd_bandwidth_bytes_per_s=cap)
    ways = ("grouped", "per_batch", "one_slot")
    times: dict[str, list[float]] = {"train_step": [], **{w: [] for w in ways}}
    losses: dict[str, list[float]] = {w: [] for w in ways}
    passes: dict[str, int] = {}
    async with SnakeTrainer(model, data=train, config=config) as trainer:
        await trainer.run(1)  # warm-up (and setup)
        e = trainer.engine
        assert e is not None

        async def step() -> None:
            report = await trainer.run(1)
            times["train_step"].append(report.seconds)

        async def evaluate(name: str) -> None:
            held_slot = e.param_slots.try_acquire() if name == "one_slot" else None
            try:
                t0 = time.perf_counter()
                report = await trainer.evaluate(held, batches_per_pass=None if name == "grouped" else 1)
                times[name].append((time.perf_counter() - t0) / report.batches)
                losses[name].append(report.loss)
                passes[name] = report.passes
            finally:
                if held_slot is not None:
                    e.param_slots.release(held_slot)

        order = [step, *(lambda w=w: evaluate(w) for w in ways)]
        for r in range(args.rounds):
            for way in order if r % 2 == 0 else order[::-1]:
                await way()
            # every round evaluates the same weights each way: losses within float sums' order
            assert max(losses[w][-1] for w in ways) - min(losses[w][-1] for w in ways) < 1e-5 * losses["grouped"][-1]
            print(f"round {r}: train step {times['train_step'][-1]:.3f} s, evaluate per batch " + ", ".join(
                f"{w} {times[w][-1]:.3f} s" for w in ways), flush=True)
        final = (await trainer.evaluate(held)).loss  # the weights PyTorch gets next
        state = await trainer.state_dict()
        param_bytes = sum(s.file_bytes for k, s in e.stores.items() if k == "param")
    trained = on_worker(_with_state, model, state)
    torch_s, torch_loss = on_worker(torch_eval, trained, held, device)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "times": times, "median_s": med, "torch_eval_s_per_batch": torch_s,
        "evaluate_loss": final, "torch_loss": torch_loss,
        "param_bytes_on_ssd": param_bytes,
        "passes": passes,
        "per_batch_over_grouped": med["per_batch"] / med["grouped"],
        "one_slot_over_per_batch": med["one_slot"] / med["per_batch"],
        "grouped_over_train_step": med["grouped"] / med["train_step"],
        "grouped_over_torch": med["grouped"] / torch_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, layers=8, width=1024, seq=128)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--batches", type=int, default=8, help="global batches per evaluation")
    ap.add_argument("--ssd-mb-per-s", type=float, default=None, help="cap the disk at this many MB/s")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--placement", type=_placement, default=Placement.all_ssd(), help="param,ckpt,opt CPU shares")
    ap.add_argument("--name", default="evaluate", help="results/<name>.json")
    args = ap.parse_args()
    device = checked_device(args, ("micro_batches", "micro_batch_size", "batches", "rounds"))
    result = asyncio.run(measure(args, device))
    summary = {k: v for k, v in result.items() if k != "times"}
    for k, v in summary.items():
        print(f"{k}: {v}")
    args.placement = str(args.placement)
    print(f"saved {save(args.name, {'machine': machine(), 'args': vars(args), **result})}")
    plot(result, args)


def plot(result: dict, args: argparse.Namespace) -> None:
    """Seconds per global batch of each round, each way, and PyTorch's forward in memory."""
    fig, (ax,) = figure()
    ways = ["grouped", "per_batch", "one_slot"]
    for i, w in enumerate(ways):
        xs = result["times"][w]
        ax.scatter([i] * len(xs), xs, label=f"{w} ({result['passes'][w]} passes)")
    ax.axhline(result["torch_eval_s_per_batch"], color="k", lw=0.8, label="PyTorch eval forward, in memory")
    ax.set_xticks(range(len(ways)), ways)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("seconds per global batch")
    cap = f", SSD capped at {args.ssd_mb_per_s:g} MB/s" if args.ssd_mb_per_s else ""
    ax.set_title(f"evaluate: {args.batches} batches, {args.layers} x {args.width}{cap}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.name}.png", dpi=100)


if __name__ == "__main__":
    main()
