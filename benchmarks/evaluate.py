"""What `trainer.evaluate` costs: seconds per global batch of the streamed evaluation (each
layer's parameters loaded into one device slot while the layer before runs in the other)
against a training step of the same trainer, against the same evaluation with one slot
(each load after the layer before: no overlap), and against PyTorch's eval forward of the
model in memory (the compute alone).

    python benchmarks/evaluate.py [--layers 8] [--width 1024] [--seq 128] [--micro-batches 4]
                                  [--micro-batch-size 2] [--batches 3] [--rounds 4]   # ~3 min

One trainer (CPU device unless CUDA is present; `--placement`, all on SSD by default: every
load reads the layer from the disk), one warm-up step, then per round, in an order that
alternates: one training step, `evaluate` of `--batches` global batches with two slots, and
with one (the benchmark holds the other). PyTorch's eval forward runs on the same batches
after the rounds. Reports medians over rounds of seconds per global batch and the losses
(evaluate's and PyTorch's, which must agree). Writes benchmarks/results/<--name>.json.
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
    SCRATCH,
    add_model_args,
    checked_device,
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
    config = SnakeConfig(micro_batches=args.micro_batches, offload_dir=SCRATCH / "evaluate", placement=args.placement,
                         alpha=0.0, device=device)
    times: dict[str, list[float]] = {"train_step": [], "evaluate_two_slots": [], "evaluate_one_slot": []}
    losses: dict[str, list[float]] = {"evaluate_two_slots": [], "evaluate_one_slot": []}
    async with SnakeTrainer(model, data=train, config=config) as trainer:
        await trainer.run(1)  # warm-up (and setup)
        e = trainer.engine
        assert e is not None

        async def step() -> None:
            report = await trainer.run(1)
            times["train_step"].append(report.seconds)

        async def evaluate(slots: int) -> None:
            name = "evaluate_two_slots" if slots == 2 else "evaluate_one_slot"
            held_slot = e.param_slots.try_acquire() if slots == 1 else None
            try:
                t0 = time.perf_counter()
                report = await trainer.evaluate(held)
                times[name].append((time.perf_counter() - t0) / report.batches)
                losses[name].append(report.loss)
            finally:
                if held_slot is not None:
                    e.param_slots.release(held_slot)

        ways = [step, lambda: evaluate(2), lambda: evaluate(1)]
        for r in range(args.rounds):
            for way in ways if r % 2 == 0 else ways[::-1]:
                await way()
            # every round evaluates the same weights twice (two slots, one): one loss
            assert losses["evaluate_two_slots"][-1] == losses["evaluate_one_slot"][-1]
            print(f"round {r}: train step {times['train_step'][-1]:.3f} s, evaluate per batch "
                  f"{times['evaluate_two_slots'][-1]:.3f} s (two slots) {times['evaluate_one_slot'][-1]:.3f} s "
                  f"(one)", flush=True)
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
        "evaluate_over_train_step": med["evaluate_two_slots"] / med["train_step"],
        "one_slot_over_two": med["evaluate_one_slot"] / med["evaluate_two_slots"],
        "evaluate_over_torch": med["evaluate_two_slots"] / torch_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap, layers=8, width=1024, seq=128)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--batches", type=int, default=3, help="global batches per evaluation")
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


if __name__ == "__main__":
    main()
