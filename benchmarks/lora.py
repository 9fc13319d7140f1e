"""A LoRA fine-tune (PEFT) of a Llama, everything in CPU memory: snake against plain PyTorch
training the same PEFT model in memory with per-layer activation checkpointing (the same
recompute work), side by side in rounds whose order alternates. Two cases:
- `bf16`: the model in bfloat16 with PEFT's default fp32 adapters: snake holds the adapters
  on the device in fp32 (no layer streams a trained element) and streams the frozen bf16
  base weights; PyTorch trains the model as it is (torch AdamW on the adapters).
- `fp32`: the model in float32: the adapters stream and step with their layer.
A third side, `stream`, is snake on the same PEFT model of the base saved as a checkpoint
and loaded with `snake.hf.stream_hf` (its layer weights left in their files; snake maps
the frozen ones from a file of its own and initialises the adapters, which then take the
in-memory model's values).

    python benchmarks/lora.py [--rounds 3] [--steps 4] [--micro-batches 4] [--device cuda]   # ~4 min

Writes benchmarks/results/<--name>.json: tokens per second of each side and round, their
per-round ratios, and both sides' losses (which must agree).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F
from common import SCRATCH, default_device, machine, on_worker, save  # type: ignore[import-not-found]

from snake import Placement, SnakeConfig, SnakeTrainer

LAYERS, WIDTH, FFN, HEADS, VOCAB, SEQ, MBS = 8, 512, 1376, 8, 1024, 128, 2
LORA = dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")


def llama(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=SEQ)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).to(dtype)


def lora_model(dtype: torch.dtype):
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT reads transformers' deprecated checkpointing flag
        model = get_peft_model(llama(dtype), LoraConfig(**LORA))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # B away from its zero start: every adapter gets gradients at once
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def streamed_lora(base, directory):
    """The PEFT model of the checkpoint in `directory` loaded with stream_hf, its adapters
    `base`'s (a PEFT model of the same weights in memory)."""
    from peft import LoraConfig, get_peft_model

    from snake.hf import init_adapters, stream_hf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(stream_hf(directory), LoraConfig(**LORA))
    init_adapters(model)
    adapters = {n: p for n, p in base.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(adapters[n])
    return model


def data(m: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (m * MBS, SEQ), generator=g), torch.randint(0, VOCAB, (m * MBS, SEQ), generator=g))
            for _ in range(steps)]


async def snake_side(model, batches, m: int, dtype: str, device: str) -> dict:
    with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
        cfg = SnakeConfig(micro_batches=m, offload_dir=d, placement=Placement.all_cpu(), alpha=0.0, device=device,
                          dtype=dtype)
        async with SnakeTrainer(model, data=batches, config=cfg) as t:
            report = await t.run(len(batches))
            held = t.engine.layer_P == [0] * LAYERS
    secs = [s.seconds for s in report.steps[1:]]
    return {"seconds": secs, "losses": [s.loss for s in report.steps], "adapters_held": held}


def torch_side(model, batches, m: int, device: str) -> dict:
    """Plain PyTorch on the PEFT model as it is, on `device` (the in-memory baseline):
    gradient accumulation, per-layer checkpointing (transformers' own), torch's fused AdamW
    on the adapters."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = model.to(dev)
    batches = [(x.to(dev), y.to(dev)) for x, y in batches]
    model.base_model.model.config.use_cache = False
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    secs, losses = [], []
    for x, y in batches:
        sync()
        t0 = time.perf_counter()
        total = 0.0
        for xc, yc in zip(x.chunk(m), y.chunk(m), strict=True):
            logits = model(input_ids=xc).logits
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), yc.reshape(-1)) / m
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        secs.append(time.perf_counter() - t0)
        losses.append(total)
    return {"seconds": secs[1:], "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--name", default="lora")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is a GPU, else cpu)")
    args = ap.parse_args()
    device = args.device or default_device()
    SCRATCH.mkdir(parents=True, exist_ok=True)
    m = args.micro_batches
    tokens = m * MBS * SEQ
    batches = data(m, args.steps)
    rows = []
    for case, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        base = on_worker(lora_model, dtype)
        saved = tempfile.TemporaryDirectory(dir=SCRATCH)
        on_worker(llama, dtype).save_pretrained(saved.name)  # the base's weights, for stream_hf
        sides: dict[str, list[float]] = {"snake": [], "stream": [], "torch": []}
        losses: dict[str, list[float]] = {}
        held = None
        snake_dtype = "bfloat16" if dtype == torch.bfloat16 else "float32"
        for r in range(args.rounds):
            order = ["snake", "stream", "torch"] if r % 2 == 0 else ["torch", "stream", "snake"]
            for side in order:
                if side == "snake":
                    out = asyncio.run(snake_side(copy.deepcopy(base), batches, m, snake_dtype, device))
                    held = out["adapters_held"]
                elif side == "stream":
                    out = asyncio.run(snake_side(streamed_lora(base, saved.name), batches, m, snake_dtype, device))
                else:
                    out = on_worker(torch_side, copy.deepcopy(base), batches, m, device)
                sides[side].append(tokens / statistics.median(out["seconds"]))
                losses[side] = out["losses"]
        saved.cleanup()
        ratios = [a / b for a, b in zip(sides["snake"], sides["torch"], strict=True)]
        stream_ratios = [a / b for a, b in zip(sides["stream"], sides["snake"], strict=True)]
        row = {"case": case, "tokens_per_s": sides, "ratios": ratios, "ratio_median": statistics.median(ratios),
               "stream_over_snake": stream_ratios, "stream_over_snake_median": statistics.median(stream_ratios),
               "losses": losses, "adapters_held": held}
        rows.append(row)
        print(f"{case}: snake {statistics.median(sides['snake']):7.0f} tok/s  torch+ckpt "
              f"{statistics.median(sides['torch']):7.0f} tok/s  snake/torch {row['ratio_median']:.2f} "
              f"[{min(ratios):.2f}-{max(ratios):.2f}]  streamed {statistics.median(sides['stream']):7.0f} tok/s, "
              f"streamed/snake {row['stream_over_snake_median']:.2f} [{min(stream_ratios):.2f}-{max(stream_ratios):.2f}]"
              f"  adapters held: {held}  last losses {losses['snake'][-1]:.4f} / {losses['stream'][-1]:.4f} / "
              f"{losses['torch'][-1]:.4f}", flush=True)
    path = save(args.name, {"machine": machine(), "device": device, "model": {"layers": LAYERS, "width": WIDTH, "ffn": FFN, "seq": SEQ,
                                                            "micro_batch_size": MBS, "lora": LORA},
                            "micro_batches": m, "rounds": args.rounds, "steps": args.steps, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
