"""Layers of two kinds against layers all alike: a DeepSeek-V3-style Hugging Face model (its
first layers dense, routed experts after them) and the same model with every layer of
experts (`first_k_dense_replace=0`), each trained by snake (vertical, everything in CPU
memory) and by in-memory PyTorch with the model's own per-layer activation checkpointing
(the same recompute work), alternating rounds (the order within a round alternates too).
What it shows: whether streaming layers of two kinds (a shell per kind, each layer's own
sizes) costs snake anything against PyTorch that layers all alike do not; and each layer's
bytes moved per iteration against its own parameters (no padding to the largest kind).

    python benchmarks/kinds.py [--rounds 3] [--steps 4] [--m 4] [--name kinds]
    python benchmarks/kinds.py --device cuda --layers 8 --width 2048 --seq 512 --m 8   # on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from common import RESULTS, SCRATCH, checked_device, figure, machine, on_worker, save

from snake import Placement, SnakeConfig, SnakeTrainer


def make_model(dense_layers: int, args: argparse.Namespace) -> torch.nn.Module:
    import transformers as tf

    from snake.hf import load_hf

    cfg = tf.DeepseekV3Config(
        hidden_size=args.width, intermediate_size=4 * args.width, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=8, vocab_size=args.vocab, max_position_embeddings=args.seq,
        kv_lora_rank=args.width // 4, q_lora_rank=args.width // 2, qk_rope_head_dim=32, qk_nope_head_dim=32,
        v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=args.width,
        n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=dense_layers,
        bos_token_id=0, eos_token_id=1, pad_token_id=None,
    )
    torch.manual_seed(0)
    return load_hf(cfg)


def make_batches(args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (args.m * args.mbs, args.seq)
    return [(torch.randint(0, args.vocab, shape, generator=g), torch.randint(0, args.vocab, shape, generator=g))
            for _ in range(args.steps)]


async def snake_async(dense: int, args: argparse.Namespace) -> dict[str, Any]:
    model, data = on_worker(lambda: (make_model(dense, args), make_batches(args)))
    with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
        conf = SnakeConfig(micro_batches=args.m, offload_dir=d, placement=Placement.all_cpu(), alpha=0.0,
                           device=args.device)
        async with SnakeTrainer(model, data=data, config=conf) as t:
            report = await t.run(args.steps)
            traffic = t.traffic()
            sizes = list(t.engine.layer_P) if t.engine is not None else []
    secs = [s.seconds for s in report.steps[1:]]
    return {"step_seconds": [s.seconds for s in report.steps], "tokens_per_s": report.steps[-1].tokens / statistics.median(secs),
            "param_h2d_bytes": traffic.get(("cpu", "gpu", "param"), 0), "layer_params": sizes}


def torch_loop(dense: int, args: argparse.Namespace) -> dict[str, Any]:
    """In-memory PyTorch: on CUDA the model, its optimizer states and the batches on the GPU,
    each timestamp after the GPU's work."""
    dev = torch.device(args.device)
    model = make_model(dense, args).to(dev)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    data = [(x.to(dev), y.to(dev)) for x, y in make_batches(args)]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = []
    for x, y in data:
        sync()
        t0 = time.perf_counter()
        for xi, yi in zip(x.chunk(args.m), y.chunk(args.m), strict=True):
            logits = model(xi, use_cache=False).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yi.reshape(-1)) / args.m
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        steps.append(time.perf_counter() - t0)
    return {"step_seconds": steps, "tokens_per_s": args.m * args.mbs * args.seq / statistics.median(steps[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--m", type=int, default=4, help="micro-batches per iteration")
    ap.add_argument("--mbs", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--dense", type=int, default=2, help="dense layers first in the two-kinds model")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA if present)")
    ap.add_argument("--name", default="kinds")
    args = ap.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps: at least 2 (the first is a warm-up)")
    args.device = checked_device(args, ("rounds", "m", "mbs", "dense", "vocab"))
    SCRATCH.mkdir(parents=True, exist_ok=True)
    variants = {"two kinds": args.dense, "all alike": 0}
    runs: dict[str, dict[str, list]] = {v: {"snake": [], "torch": []} for v in variants}
    for r in range(args.rounds):
        for variant, dense in variants.items():
            order = ["snake", "torch"] if r % 2 == 0 else ["torch", "snake"]
            for side in order:
                out = (asyncio.run(snake_async(dense, args)) if side == "snake"
                       else on_worker(torch_loop, dense, args))
                runs[variant][side].append(out)
                print(f"round {r + 1} {variant:9s} {side:5s} {out['tokens_per_s']:8.1f} tok/s", flush=True)
    rows = {}
    for variant, sides in runs.items():
        ratios = [s["tokens_per_s"] / t["tokens_per_s"] for s, t in zip(sides["snake"], sides["torch"], strict=True)]
        last = sides["snake"][-1]
        esize = 4  # fp32
        rows[variant] = {
            "snake_tokens_per_s": [s["tokens_per_s"] for s in sides["snake"]],
            "torch_ckpt_tokens_per_s": [t["tokens_per_s"] for t in sides["torch"]],
            "ratios": ratios, "ratio_median": statistics.median(ratios),
            "layer_params": last["layer_params"],
            # vertical: each layer's parameters reach the device twice per iteration
            "param_h2d_bytes": last["param_h2d_bytes"], "param_h2d_bytes_own_sizes": 2 * esize * sum(last["layer_params"]),
        }
    pair = [a / b for a, b in zip(rows["two kinds"]["ratios"], rows["all alike"]["ratios"], strict=True)]
    result = {"machine": machine(), "args": vars(args), "variants": rows,
              "two_kinds_over_alike_per_round": pair, "two_kinds_over_alike": statistics.median(pair)}
    for variant, row in rows.items():
        print(f"{variant:9s} snake / PyTorch+ckpt median {row['ratio_median']:.3f} "
              f"[{min(row['ratios']):.3f}-{max(row['ratios']):.3f}]; layer params {row['layer_params']}; "
              f"param bytes to the device {row['param_h2d_bytes']} (own sizes x 2: {row['param_h2d_bytes_own_sizes']})")
    print(f"two kinds / all alike, ratio of ratios per round: {' '.join(f'{x:.3f}' for x in pair)}; "
          f"median {result['two_kinds_over_alike']:.3f}")
    print(f"wrote {save(args.name, result)}")
    fig, (ax,) = figure()
    for i, (variant, row) in enumerate(rows.items()):
        ax.scatter([i] * len(row["ratios"]), row["ratios"], label=variant)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), list(rows))
    ax.set_ylabel("snake / PyTorch + checkpointing (tokens/s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{args.name}.png", dpi=100)


if __name__ == "__main__":
    main()
