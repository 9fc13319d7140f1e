"""CPU memory of a Hugging Face model loaded whole (`load_hf`) against one whose layers stay
in their files (`stream_hf`), trained by snake with its parameters and optimizer states on SSD.

    python benchmarks/stream_memory.py [--layers 12] [--width 1024] [--steps 2]   # ~3 min

Saves a Llama-shaped model (bfloat16, sharded safetensors) in a temporary directory, then in
a fresh process per way, load dtype and round: loads it (in its own dtype, bfloat16, and in
float32), makes a trainer (float32 compute and masters; parameters, checkpoints and
optimizer states all on SSD, alpha 0, one micro-batch of 1 x 32 tokens) and runs `--steps`
steps. Reports the process's anonymous memory (RssAnon: what the kernel cannot drop) after
the load and its peak over the run (sampled every 20 ms), the file-backed pages it maps
(RssFile: clean pages of the safetensors files, which the kernel can drop under pressure)
at their peak, each above what the process had after importing torch and transformers, and
the seconds of the load and of each step (the peak leaves out what follows the steps: with
--peft the saves, whose peak is reported apart). The ways alternate, `--rounds` times. Writes
benchmarks/results/stream_memory.json.

--frozen: a LoRA-style fine-tune instead: every layer parameter but the attention's query
projection frozen (requires_grad_(False)) before the trainer is made, so most of each layer
streams from snake's CPU copy of the frozen weights, or for `stream_hf` where the load dtype
is the compute dtype (float32 here) from a file snake maps.

--peft: a LoRA fine-tune with PEFT instead (`get_peft_model`, rank 16 on every linear layer
of the layers, PEFT's fp32 adapters), the adapters drawn from one seed both ways (snake
initialises those of the streamed model, `snake.hf.init_adapters`, counted in the load).
With --peft each run then saves three checkpoints, timed: with the frozen base
(`save(frozen=True)`) twice (the frozen digests are taken at the first), and as a PEFT
model's by default, without it.
--compute: the compute dtype (float32, or bfloat16: then the streamed model's frozen bf16
weights are mapped where loaded in their own dtype).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import ROOT, machine, save  # type: ignore[import-not-found]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(way: str, path: str, steps: int, offload: str, dtype: str, frozen: bool, peft: bool, compute: str) -> None:
    """One run in this process; prints one JSON line."""
    import torch
    import transformers  # noqa: F401  (counted in the baseline)

    from snake import Placement, SnakeConfig, SnakeTrainer
    from snake.hf import load_hf, stream_hf

    base_anon, base_file = _status_kib("RssAnon"), _status_kib("RssFile")
    peaks = {"anon": base_anon, "file": base_file}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peaks["anon"] = max(peaks["anon"], _status_kib("RssAnon"))
            peaks["file"] = max(peaks["file"], _status_kib("RssFile"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    load_dtype = getattr(torch, dtype) if dtype != "auto" else "auto"
    model = load_hf(path, dtype=load_dtype) if way == "load_hf" else stream_hf(path, dtype=load_dtype)
    if peft:
        import warnings

        from peft import LoraConfig, get_peft_model

        from snake.hf import init_adapters

        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, init_lora_weights="gaussian",
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # PEFT reads a flag transformers 5 deprecates
            model = get_peft_model(model, lora)
        if way == "stream_hf":
            torch.manual_seed(0)  # the adapters draw as get_peft_model's drew for the model in memory
            init_adapters(model)
    loaded = time.perf_counter() - t0
    after_load = _status_kib("RssAnon")
    if frozen:
        for name, p in model.named_parameters():
            if ".layers." in name and "q_proj" not in name:
                p.requires_grad_(False)
    vocab = 32000
    g = torch.Generator().manual_seed(0)
    data = [(x[:, :-1].contiguous(), x[:, 1:].contiguous())
            for x in (torch.randint(0, vocab, (1, 33), generator=g) for _ in range(steps))]
    cfg = SnakeConfig(micro_batches=1, offload_dir=offload, placement=Placement.all_ssd(),
                      alpha=0.0, device="cpu", dtype=compute)

    saves: list[dict[str, float]] = []

    async def go() -> tuple[list[float], list[float]]:
        async with SnakeTrainer(model, data=data, config=cfg) as trainer:
            report = await trainer.run(steps)
            peaks["train"] = peaks["anon"]  # the saves' own peak apart
            peaks["anon"] = _status_kib("RssAnon")
            if peft:  # checkpoints: with the frozen base (twice: the digests are taken once), without
                for i, frozen in enumerate((True, True, None)):
                    where = Path(offload) / f"ckpt-{i}"
                    t = time.perf_counter()
                    await trainer.save(where, frozen=frozen)
                    saves.append({"frozen": bool(frozen), "seconds": time.perf_counter() - t,
                                  "mib": sum(f.stat().st_size for f in where.iterdir()) / 2**20})
            return [s.loss for s in report.steps], [s.seconds for s in report.steps]

    t1 = time.perf_counter()
    losses, step_s = asyncio.run(go())
    run_s = time.perf_counter() - t1
    done.set()
    sampler.join()
    print(json.dumps({
        "way": way, "dtype": dtype, "frozen": frozen, "peft": peft, "compute": compute, "load_s": loaded, "run_s": run_s, "step_s": step_s, "losses": losses,
        "anon_after_load_mib": (after_load - base_anon) / 1024, "anon_peak_mib": (peaks["train"] - base_anon) / 1024,
        "anon_peak_saves_mib": (peaks["anon"] - base_anon) / 1024,
        "file_peak_mib": (peaks["file"] - base_file) / 1024, "baseline_anon_mib": base_anon / 1024,
        "saves": saves,
    }))


def save_llama(path: Path, layers: int, width: int) -> tuple[int, int]:
    """A Llama-shaped model (random weights, 32 k vocabulary) saved in bfloat16, sharded, at
    `path`; returns (its parameters, those of its layers)."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=width, intermediate_size=width * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=width // 64, num_key_value_heads=width // 64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    n_layers = sum(p.numel() for p in model.model.layers.parameters())
    model.save_pretrained(str(path), max_shard_size="500MB")
    return n_params, n_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="stream_memory", help="results/<name>.json")
    ap.add_argument("--frozen", action="store_true", help="freeze every layer parameter but the query projection")
    ap.add_argument("--peft", action="store_true", help="a PEFT LoRA fine-tune (rank 16, every linear layer)")
    ap.add_argument("--compute", default="float32", choices=["float32", "bfloat16"], help="the compute dtype")
    ap.add_argument("--child", nargs=5, metavar=("WAY", "PATH", "STEPS", "OFFLOAD", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.frozen and args.peft:
        ap.error("--frozen or --peft, not both")
    if args.child:
        way, path, steps, offload, dtype = args.child
        child(way, path, int(steps), offload, dtype, args.frozen, args.peft, args.compute)
        return
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks" / "results") as tmp:
        path = Path(tmp) / "model"
        n_params, n_layers = save_llama(path, args.layers, args.width)
        print(f"model: {n_params / 1e6:.0f} M parameters ({n_layers / 1e6:.0f} M in {args.layers} layers), "
              f"bfloat16 on disk {sum(f.stat().st_size for f in path.glob('*.safetensors')) / 2**20:.0f} MiB", flush=True)
        runs = []
        ways = [(w, d) for d in ("auto", "float32") for w in ("load_hf", "stream_hf")]
        for r in range(args.rounds):
            for way, dtype in ways if r % 2 == 0 else ways[::-1]:
                off = Path(tmp) / f"off-{way}-{dtype}-{r}"
                out = subprocess.run(
                    [sys.executable, __file__, "--child", way, str(path), str(args.steps), str(off), dtype,
                     *(["--frozen"] if args.frozen else []), *(["--peft"] if args.peft else []),
                     "--compute", args.compute],
                    cwd=ROOT, capture_output=True, text=True, timeout=900,
                )
                if out.returncode:
                    raise SystemExit(f"{way}: {out.stderr[-3000:]}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                runs.append(row)
                print(f"round {r} {way:9s} {dtype:7s} load {row['load_s']:4.1f} s  anon after load "
                      f"+{row['anon_after_load_mib']:5.0f} MiB, peak +{row['anon_peak_mib']:5.0f} MiB  file pages peak "
                      f"+{row['file_peak_mib']:4.0f} MiB  steps {[round(s, 1) for s in row['step_s']]} s  "
                      f"losses {[round(x, 4) for x in row['losses']]}", flush=True)
                if row["saves"]:
                    print(f"    anonymous peak while saving +{row['anon_peak_saves_mib']:5.0f} MiB", flush=True)
                for save_ in row["saves"]:
                    print(f"    save {'with' if save_['frozen'] else 'without'} the frozen base: "
                          f"{save_['seconds']:5.2f} s, {save_['mib']:6.0f} MiB", flush=True)
    result = {"machine": machine(), "params": n_params, "layer_params": n_layers, "args": vars(args), "runs": runs}
    print(f"saved {save(args.name, result)}")


if __name__ == "__main__":
    main()
