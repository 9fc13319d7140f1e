"""Shared helpers of the benchmarks: models, data, one snake run, one plain-PyTorch run.

Every run uses a fresh model (same seed) and a fresh offload directory; the first step of
each run is a warm-up and is discarded from every timing.

No parallel torch op runs on the main thread (the event loop's) of a benchmark: a thread
that ran one keeps an idle OpenMP team for as long as it lives, and with one more team in
the process libgomp treats the cores as oversubscribed and stops spinning between parallel
regions, which slows every kernel of the run measured next, snake's and PyTorch's alike (the
PyTorch + checkpointing loop at 8 x 512, M = 16: 2.24 s per iteration next to such a team
vs 1.64 s without, top of BENCHMARKS.md). Models, data and profiles are built on a fresh
thread that exits (`on_worker`); PyTorch runs on one too.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from snake import Placement, SnakeConfig, SnakeTrainer  # noqa: E402
from snake.models import GPT, GPTConfig  # noqa: E402

T = TypeVar("T")
RESULTS = ROOT / "benchmarks" / "results"
# offload dirs: on the real disk (O_DIRECT works there; /tmp may be tmpfs elsewhere)
SCRATCH = Path(os.environ.get("SNAKE_BENCH_DIR", ROOT / "benchmarks" / ".scratch"))
MB = 1e6


def machine() -> dict[str, Any]:
    try:
        cpu = next(
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    return {
        "host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
        "load_avg_at_start": os.getloadavg(),
    }


def gpt_config(n_layer: int, n_embd: int, seq: int, vocab: int = 256) -> GPTConfig:
    return GPTConfig(n_layer=n_layer, n_head=max(1, n_embd // 64), n_embd=n_embd,
                     vocab_size=vocab, block_size=seq)


def default_device() -> str:
    """What the benchmarks run on unless told: the GPU where there is one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_model_args(ap, *, layers: int, width: int, seq: int) -> None:  # type: ignore[no-untyped-def]
    """--device, --layers, --width, --seq on a script's parser (its CPU-scale model as defaults)."""
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is a GPU, else cpu)")
    ap.add_argument("--layers", type=int, default=layers, help=f"GPT blocks (default {layers})")
    ap.add_argument("--width", type=int, default=width, help=f"GPT width n_embd, heads of 64 (default {width})")
    ap.add_argument("--seq", type=int, default=seq, help=f"tokens per sequence (default {seq})")


def checked_warmup(args) -> None:  # type: ignore[no-untyped-def]
    """--warmup must leave at least one timed iteration of --steps; exits with the fix."""
    if args.warmup < 1:
        raise SystemExit(f"--warmup {args.warmup}: must be >= 1 (the first iteration is never timed)")
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps {args.steps} --warmup {args.warmup}: --steps must exceed --warmup "
                         f"(e.g. --steps {args.warmup + 3})")


def checked_device(args, positive: tuple[str, ...] = ()) -> str:  # type: ignore[no-untyped-def]
    """The device the parsed `args` ask for (`add_model_args`), after checking it and that the
    model flags and `positive` (more int flags) are >= 1; exits with the flag and the fix."""
    for flag in ("layers", "width", "seq", *positive):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    device = args.device or default_device()
    if not (device == "cpu" or device.startswith("cuda")):
        raise SystemExit(f"--device {device}: must be cpu or cuda[:N]")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: no CUDA device here; use --device cpu")
    return device


def make_model(cfg: GPTConfig, seed: int = 0, frozen: int = 0) -> GPT:
    """The GPT of `cfg`; `frozen` > 0: its embeddings (and so the tied head) and its bottom
    `frozen` blocks frozen, a fine-tune of the top layers."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    if frozen:
        model.wte.weight.requires_grad_(False)
        model.wpe.weight.requires_grad_(False)
        for blk in model.blocks[:frozen]:
            blk.requires_grad_(False)
    return model


def make_batches(cfg: GPTConfig, global_batch: int, seq: int, n: int, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, cfg.vocab_size, (global_batch, seq), generator=g),
         torch.randint(0, cfg.vocab_size, (global_batch, seq), generator=g))
        for _ in range(n)
    ]


def model_flops_per_token(cfg: GPTConfig, seq: int) -> float:
    """6 x (block params + head matmul) + attention (12 x layers x seq x width), per token:
    model FLOPs (recomputation not counted)."""
    n = cfg.n_layer * cfg.block_params() + cfg.vocab_size * cfg.n_embd
    return 6.0 * n + 12.0 * cfg.n_layer * seq * cfg.n_embd


def stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def traffic_summary(traffic: dict[tuple[str, str, str], int]) -> dict[str, Any]:
    """Bytes per link (src->dst) and per link and kind, one iteration."""
    links: dict[str, int] = defaultdict(int)
    kinds: dict[str, int] = {}
    for (src, dst, kind), b in sorted(traffic.items()):
        links[f"{src}->{dst}"] += b
        kinds[f"{src}->{dst}:{kind}"] = b
    ssd = sum(b for (s, d, _k), b in traffic.items() if "ssd" in (s, d))
    return {"links": dict(links), "by_kind": kinds, "ssd_bytes": ssd}


async def snake_run_async(
    cfg: GPTConfig, *, micro_batches: int, micro_batch_size: int, seq: int, steps: int,
    placement: Placement | None, alpha: float | None, schedule: str = "vertical",
    cap: float | None = None, cpu_memory_bytes: int | None = None, seed: int = 0,
    probe=None, link: float | None = None, device: str = "cpu", warmup: int = 1, frozen: int = 0,
) -> dict[str, Any]:
    """One trainer, `steps` iterations; the first `warmup` are not timed. Where the SSD
    binds, the first iterations run faster than the steady state: the optimizer-state tail
    buffers' write-behind fills over them (up to ~0.4 s of SSD time here, BENCHMARKS.md
    section 13). `probe`: an async callable started next to run() (for loop-lag
    measurements); its result goes in out['probe']."""
    model, data = on_worker(lambda: (make_model(cfg, seed, frozen),
                                     make_batches(cfg, micro_batches * micro_batch_size, seq, steps)))
    with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
        conf = SnakeConfig(
            micro_batches=micro_batches, offload_dir=d, placement=placement, alpha=alpha,
            schedule=schedule, device=device, ssd_bandwidth_bytes_per_s=cap,
            cpu_memory_bytes=cpu_memory_bytes, seed=seed, device_link_bytes_per_s=link,
        )
        async with SnakeTrainer(model, data=data, config=conf) as t:
            stop = asyncio.Event()
            ptask = asyncio.create_task(probe(stop)) if probe else None
            t0 = time.perf_counter()
            report = await t.run(steps)
            wall = time.perf_counter() - t0
            stop.set()
            probe_out = await ptask if ptask else None
            summ = t.trace.summary()
            n_spans = len(t.trace.spans)
            traffic = t.traffic()
            resolved = t.config
    secs = [s.seconds for s in report.steps[warmup:]]
    tokens = report.steps[-1].tokens
    it = statistics.median(secs)
    return {
        "schedule": schedule, "micro_batches": micro_batches, "cap_bytes_per_s": cap, "device": device,
        "placement": {k: getattr(resolved.placement, k) for k in ("param", "ckpt", "opt")},
        "alpha": resolved.alpha,
        "step_seconds": [s.seconds for s in report.steps], "warmup": warmup, "iteration_seconds": stats(secs),
        "tokens_per_iteration": tokens, "tokens_per_s": tokens / it,
        "tflops": model_flops_per_token(cfg, seq) * tokens / it / 1e12,
        "losses": [s.loss for s in report.steps],
        "traffic": traffic_summary(traffic),
        "busy_fraction": {a: round(v["busy_fraction"], 3) for a, v in summ["actors"].items()},
        "busy_s_per_iteration": {a: v["busy_s"] / steps for a, v in summ["actors"].items()},
        "links": summ["links"], "wall_s": wall, "probe": probe_out,
        "spans_per_iteration": n_spans / steps,
    }


def snake_run(cfg: GPTConfig, **kw) -> dict[str, Any]:
    SCRATCH.mkdir(parents=True, exist_ok=True)
    return asyncio.run(snake_run_async(cfg, **kw))


def on_worker(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on a fresh thread that exits before the next measurement (see
    the module doc)."""
    with ThreadPoolExecutor(1, thread_name_prefix="bench-worker") as ex:
        return ex.submit(fn, *args, **kwargs).result()


def torch_run(cfg: GPTConfig, **kw) -> dict[str, Any]:
    """`torch_loop` on a fresh worker thread, as snake's compute actor runs its kernels."""
    return on_worker(lambda: torch_loop(cfg, **kw))


def torch_loop(
    cfg: GPTConfig, *, micro_batches: int, micro_batch_size: int, seq: int, steps: int,
    activation_checkpointing: bool, seed: int = 0, device: str = "cpu", warmup: int = 1, frozen: int = 0,
) -> dict[str, Any]:
    """Plain in-memory PyTorch: gradient accumulation over micro-batches + torch.optim.AdamW
    (fused where the build has it), optionally torch.utils.checkpoint per block. On CUDA the
    model, its optimizer states and the batches live on the GPU (the in-memory baseline) and
    each timestamp waits for the GPU. The first `warmup` iterations are not timed."""
    dev = torch.device(device)
    model = make_model(cfg, seed, frozen).to(dev)
    data = [(x.to(dev), y.to(dev)) for x, y in make_batches(cfg, micro_batches * micro_batch_size, seq, steps)]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    try:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    step_s, fb_s, opt_s, losses = [], [], [], []
    for x, y in data:
        sync()
        t0 = time.perf_counter()
        total = 0.0
        for xi, yi in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
            h = model.embed(xi)
            for blk in model.blocks:
                h = checkpoint(blk, h, use_reentrant=False) if activation_checkpointing else blk(h)
            logits = model.head(h)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yi.reshape(-1)) / micro_batches
            loss.backward()
            total += float(loss.detach())
        sync()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t2 = time.perf_counter()
        step_s.append(t2 - t0)
        fb_s.append(t1 - t0)
        opt_s.append(t2 - t1)
        losses.append(total)
    it = statistics.median(step_s[warmup:])
    tokens = micro_batches * micro_batch_size * seq
    return {
        "schedule": "torch+ckpt" if activation_checkpointing else "torch", "micro_batches": micro_batches,
        "device": device,
        "step_seconds": step_s, "warmup": warmup, "iteration_seconds": stats(step_s[warmup:]),
        "fwd_bwd_seconds": stats(fb_s[warmup:]), "fwd_bwd_step_seconds": fb_s,
        "optimizer_seconds": stats(opt_s[warmup:]),
        "tokens_per_iteration": tokens, "tokens_per_s": tokens / it,
        "tflops": model_flops_per_token(cfg, seq) * tokens / it / 1e12, "losses": losses,
    }


def planner_budget(stated_bytes: float, profile: Any) -> int:
    """The planner's cpu_memory_bytes for a benchmark budget `stated_bytes` (--budget-mib).

    The benchmarks state budgets as the memory model stood until round 21: the placed data
    and the CPU device's working set then modelled. Since then the planner's budget also
    covers the runtime's overhead (`RUNTIME_OVERHEAD_BYTES`) and, on a CPU device (where
    the device's working set is host memory), the parameter gradients (three times a
    layer's and pre/post's) and the head's logits. Those are added here, so every recorded
    command plans the placements it did (BENCHMARKS.md, round 21)."""
    from snake.memory import HEAD_FP32_BYTES_PER_LOGIT, RUNTIME_OVERHEAD_BYTES

    shape, db = profile.shape, profile.shape.dtype_bytes
    working_set = (3 * (shape.layer_params + shape.resident_params) * db
                   + shape.tokens_per_micro * shape.vocab_size * (db + HEAD_FP32_BYTES_PER_LOGIT))
    return int(stated_bytes + RUNTIME_OVERHEAD_BYTES + (working_set if profile.device == "cpu" else 0))


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def save(name: str, result: dict[str, Any]) -> Path:
    """Write benchmarks/results/NAME.json; returns its path relative to the repository (what
    the scripts print, so their logs name no directory outside it)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    return path.relative_to(ROOT)


def figure(nrows: int = 1, ncols: int = 1, size=(7, 4.5)):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(nrows * ncols)]
    return fig, axes
