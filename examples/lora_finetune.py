"""A LoRA fine-tune of a local Hugging Face checkpoint with snake, end to end:

1. load the checkpoint with `snake.hf.load_hf` (bf16 here: its files are mapped, not copied),
   or with --stream `snake.hf.stream_hf`, which leaves the layers' weights in their files
   (a base model larger than CPU memory: snake streams its frozen weights from a file it
   maps, and initialises the adapters PEFT leaves with them, as PEFT would),
2. put LoRA adapters into it with PEFT (`get_peft_model`; PEFT keeps them in fp32, and snake
   holds them on the device in fp32 while the frozen bf16 base weights stream),
3. train with `SnakeTrainer`, checking the held-out loss between runs and saving an atomic
   checkpoint (resume with `trainer.load`),
4. write the trained adapters with PEFT's own `save_pretrained`, and load them back; the
   checkpoint's adapters go to PEFT's format too, as `snake export CKPT --peft DIR` writes
   them from a shell (no process of the training needed).

    python examples/lora_finetune.py MODEL_DIR OUT_DIR [--steps 20] [--stream]
    python examples/lora_finetune.py --demo OUT_DIR        # a tiny Llama made here (no download)

MODEL_DIR: a local directory with config.json and *.safetensors (a decoder-only model
`snake.hf.supported()` lists). The data is counting sequences of the model's token ids, to
keep the example self-contained: replace `batches` with your own (inputs, targets) tensors.
"""

from __future__ import annotations

import argparse
import asyncio
import warnings
from pathlib import Path

import torch

from snake import AdamW, Placement, SnakeConfig, SnakeTrainer
from snake.hf import load_hf, stream_hf


def batches(vocab: int, n: int, batch: int = 8, seq: int = 64, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` (inputs, targets) batches, targets the inputs shifted by one: counting sequences
    (a random start, a stride of 1 to 3) that a fine-tune can learn."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        tokens = (start + stride * torch.arange(seq + 1)) % vocab
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def demo_checkpoint(directory: Path) -> Path:
    """A tiny Llama saved as a Hugging Face checkpoint, for --demo."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(directory))
    return directory


async def finetune(model_dir: Path, out: Path, steps: int, *, lr: float = 3e-3,
                   device: str | None = None, stream: bool = False) -> dict[str, float]:
    """LoRA-tune the checkpoint at `model_dir` (`stream`: its layers' weights left in their
    files); the adapters go to out/adapter, snake's checkpoint to out/ckpt. Returns the
    held-out loss before and after."""
    from peft import LoraConfig, PeftModel, get_peft_model

    base = (stream_hf if stream else load_hf)(model_dir, dtype=torch.bfloat16)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PEFT reads a flag transformers 5 deprecates
        model = get_peft_model(base, lora)
    vocab = base.config.vocab_size
    train, held_out = batches(vocab, steps), batches(vocab, 2, seed=1)
    config = SnakeConfig(
        micro_batches=2, dtype="bfloat16", offload_dir=out / "offload", device=device, optimizer=AdamW(lr=lr),
        placement=Placement(param=0.5, ckpt=0.5, opt=0.5),  # half of each on the SSD tier
    )
    async with SnakeTrainer(model, data=train, config=config) as trainer:
        before = (await trainer.evaluate(held_out)).loss
        half = steps // 2
        await trainer.run(half)
        print(f"step {half}: held-out loss {(await trainer.evaluate(held_out)).loss:.4f}")
        await trainer.save(out / "ckpt")  # atomic; a new trainer resumes from it with load()
        await trainer.run(steps - half)
        after = (await trainer.evaluate(held_out)).loss
        # the adapters' trained values by the base model's names (the frozen weights are
        # neither copied nor read)
        state = await trainer.state_dict(trained_only=True)
    model.get_base_model().load_state_dict(state, strict=False)
    model.save_pretrained(str(out / "adapter"))  # PEFT's own format: the adapters alone
    # anyone can load them onto the base checkpoint with PEFT; they give the held-out loss
    # snake measured
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        again = PeftModel.from_pretrained(load_hf(model_dir, dtype=torch.bfloat16), str(out / "adapter"))
    with torch.no_grad():
        loss = sum(torch.nn.functional.cross_entropy(again.eval()(x).logits.float().flatten(0, 1), y.flatten())
                   for x, y in held_out) / len(held_out)
    assert abs(float(loss) - after) < 0.02, (float(loss), after)
    # the mid-run checkpoint's adapters, as `snake export out/ckpt --peft out/adapter-half` writes them
    from snake.export import export_checkpoint_peft

    export_checkpoint_peft(out / "ckpt", out / "adapter-half")
    print(f"held-out loss {before:.4f} -> {after:.4f}; adapters in {out / 'adapter'} (step {half}'s in "
          f"{out / 'adapter-half'})")
    return {"before": before, "after": after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", nargs="?", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate (LoRA's are larger than a full fine-tune's)")
    ap.add_argument("--demo", action="store_true", help="fine-tune a tiny Llama made here instead of MODEL_DIR")
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA if present)")
    ap.add_argument("--stream", action="store_true",
                    help="leave the layers' weights in their files (snake.hf.stream_hf): a base larger than CPU memory")
    args = ap.parse_args()
    if args.demo == (args.model_dir is not None):
        ap.error("give MODEL_DIR or --demo (not both)")
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = demo_checkpoint(args.out / "demo-model") if args.demo else args.model_dir
    asyncio.run(finetune(model_dir, args.out, args.steps, lr=args.lr, device=args.device, stream=args.stream))


if __name__ == "__main__":
    main()
