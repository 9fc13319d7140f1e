"""Resolving a SnakeConfig's `None` fields (micro_batches, placement, alpha,
resident_optimizer) with a plan.

Two situations:
- the micro-batch size is given and n grows the global batch (GreedySnake's Algorithm 1,
  `snake plan`): `plan_for_config(model_cfg, config, micro_batch_size, seq_len, device)`;
- the data fixes the global batch B (the trainer): n must divide B and the micro-batch is
  B / n: `plan_for_batch(model_cfg, config, B, seq_len, device)`; the trainer's hook
  `await plan_for_trainer(trainer, first_batch)` does this off the event loop and returns
  the resolved SnakeConfig.

    plan = plan_for_config(model.config, config, micro_batch_size, seq_len, device)
    if isinstance(plan, Infeasible):
        raise ConfigError("placement", None, plan.message)
    config = apply_plan(config, plan)
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from planner.profile import MachineProfile, measure_profile
from planner.search import search
from planner.solve import Infeasible, Plan
from snake.config import SnakeConfig
from snake.errors import ConfigError
from snake.memory import ModelShape
from snake.offload_dir import memory_fs

if TYPE_CHECKING:  # importing the model pulls in torch; the planner's core does not need it
    from snake.adapters import ModelParts
    from snake.models.gpt import GPTConfig


def proxy_config(shape: ModelShape, seq_len: int) -> GPTConfig:
    """A GPT whose block has the hidden size of `shape`, to time a block of a model that is
    only known by its shape (heads of 64 where the width allows)."""
    from snake.models.gpt import GPTConfig

    c = shape.ckpt_elems // shape.tokens_per_micro
    heads = c // 64 if c >= 64 and c % 64 == 0 else 1
    vocab = max(1, shape.resident_params // c - seq_len)
    return GPTConfig(n_layer=shape.n_layers, n_head=heads, n_embd=c, vocab_size=vocab, block_size=seq_len)


def profile_for_config(
    model: GPTConfig | ModelShape | ModelParts, config: SnakeConfig, micro_batch_size: int, seq_len: int,
    device: str, stop: threading.Event | None = None,
) -> MachineProfile:
    """Measured (or cached) profile with the config's memory budgets applied. model: a GPT
    config, a shape (a GPT block of its width is timed) or any described model (its own
    blocks, embedding and head are timed)."""
    cfg = proxy_config(model, seq_len) if isinstance(model, ModelShape) else model
    profile = measure_profile(
        cfg, micro_batch_size=micro_batch_size, seq_len=seq_len, device=str(device),
        dtype=config.dtype, offload_dir=config.offload_dir,
        ssd_bandwidth_bytes_per_s=config.ssd_bandwidth_bytes_per_s, stop=stop,
    )
    if isinstance(model, ModelShape):
        profile = dataclasses.replace(profile, shape=model)
    return with_budgets(profile, config)


def with_budgets(profile: MachineProfile, config: SnakeConfig) -> MachineProfile:
    """The profile with config.cpu_memory_bytes / device_memory_bytes where they are set,
    config.device_link_bytes_per_s, and whether config.offload_dir lives in memory."""
    cpu, dev = config.cpu_memory_bytes, config.device_memory_bytes
    link = config.device_link_bytes_per_s
    return dataclasses.replace(
        profile,
        cpu_memory_bytes=profile.cpu_memory_bytes if cpu is None else float(cpu),
        device_memory_bytes=profile.device_memory_bytes if dev is None else float(dev),
        device_link_bytes_per_s=None if link is None else float(link),
        offload_in_memory=memory_fs(config.offload_dir) is not None,
    )


def plan_for_config(
    model: GPTConfig | ModelShape | ModelParts,
    config: SnakeConfig,
    micro_batch_size: int,
    seq_len: int,
    device: str = "cpu",
    *,
    profile: MachineProfile | None = None,
) -> Plan | Infeasible:
    """Choose the config's `None` fields; fields already set are kept fixed.

    model: a GPTConfig (its block is timed) or a ModelShape (a GPT block of the same width
    is timed). profile: skip measuring (its budgets are still overridden by the config's).
    Measurements are cached in config.offload_dir, so only the first call takes seconds."""
    if profile is None:
        profile = profile_for_config(model, config, micro_batch_size, seq_len, device)
    else:
        profile = with_budgets(profile, config)
    return search(
        profile,
        schedule=config.schedule,
        workers=config.optimizer_workers,
        alphas=(config.alpha,) if config.alpha is not None
        else (1.0,) if config.steps_wait  # clipping or a dynamic loss scale: every step delayed
        else None,
        placement=config.placement,
        n_micro=config.micro_batches,
        resident=config.resident_optimizer,
    )


def apply_plan(config: SnakeConfig, plan: Plan) -> SnakeConfig:
    """The config with micro_batches, placement, alpha and resident_optimizer taken from
    the plan."""
    return dataclasses.replace(
        config, micro_batches=plan.n_micro, placement=plan.placement, alpha=plan.alpha,
        resident_optimizer=plan.resident_optimizer,
    )


MEASURE_MICRO_BATCH = 8  # plan_for_batch times blocks at a micro-batch of at most this many


def scale_profile(profile: MachineProfile, ratio: float) -> MachineProfile:
    """The profile at `ratio` x the micro-batch size: per-micro-batch times and checkpoint
    sizes scale linearly (an approximation: small micro-batches use the device less well)."""
    s = profile.shape
    shape = dataclasses.replace(
        s, ckpt_elems=round(s.ckpt_elems * ratio), tokens_per_micro=round(s.tokens_per_micro * ratio)
    )
    return dataclasses.replace(
        profile, shape=shape, fwd_seconds=profile.fwd_seconds * ratio,
        bwd_seconds=profile.bwd_seconds * ratio, recompute_seconds=profile.recompute_seconds * ratio,
        pre_post_seconds=profile.pre_post_seconds * ratio,
    )


def affine_profile(a: MachineProfile, b: MachineProfile, ratio: float) -> MachineProfile:
    """The profile at `ratio` x a's micro-batch size, per-micro-batch times interpolated
    (or extrapolated) through two measured sizes: t(mb) = t0 + slope * mb. Small micro-
    batches use a device less well than linear scaling assumes (fixed per-call costs)."""
    mb_a = a.shape.tokens_per_micro
    mb_b = b.shape.tokens_per_micro
    target = mb_a * ratio
    lin = scale_profile(a, ratio)
    if mb_a == mb_b:
        return lin

    def at(x: float, y: float) -> float:
        slope = (y - x) / (mb_b - mb_a)
        return max(x + slope * (target - mb_a), 1e-9)

    return dataclasses.replace(
        lin,
        fwd_seconds=at(a.fwd_seconds, b.fwd_seconds),
        bwd_seconds=at(a.bwd_seconds, b.bwd_seconds),
        recompute_seconds=at(a.recompute_seconds, b.recompute_seconds),
        pre_post_seconds=at(a.pre_post_seconds, b.pre_post_seconds),
    )


def plan_for_batch(
    model: GPTConfig | ModelShape | ModelParts,
    config: SnakeConfig,
    global_batch_size: int,
    seq_len: int,
    device: str = "cpu",
    *,
    profile: MachineProfile | None = None,
    max_n: int = 64,
    stop: threading.Event | None = None,
) -> Plan | Infeasible:
    """Plan for a fixed global batch: n among the divisors of global_batch_size (<= max_n),
    micro-batch = global_batch_size / n; the smallest n within 1 % of the best throughput.

    profile: measured at any micro-batch size (default: measured here at the largest
    micro-batch <= MEASURE_MICRO_BATCH that divides the batch); it is rescaled per n. stop:
    once set, the probes stop at their next round (Stopped)."""
    b = global_batch_size
    if config.micro_batches is not None:
        if b % config.micro_batches:
            raise ConfigError("micro_batches", config.micro_batches, f"must divide the batch of {b}")
        ns = [config.micro_batches]
    else:
        ns = [n for n in range(1, min(b, max_n) + 1) if b % n == 0]
    second: MachineProfile | None = None
    if profile is None:
        mb0 = max(b // n for n in range(1, b + 1) if b % n == 0 and b // n <= MEASURE_MICRO_BATCH)
        profile = profile_for_config(model, config, mb0, seq_len, device, stop)
        mb1 = min(b // n for n in ns)
        if mb1 != mb0:  # a second size: per-micro-batch time is affine, not linear, in its size
            second = profile_for_config(model, config, mb1, seq_len, device, stop)
    else:
        profile = with_budgets(profile, config)
    mb_measured = profile.shape.tokens_per_micro / seq_len
    best: Plan | None = None
    short: Infeasible | None = None
    for n in ns:
        scaled = dataclasses.replace(config, micro_batches=n)
        ratio = (b // n) / mb_measured
        at_n = affine_profile(profile, second, ratio) if second is not None else scale_profile(profile, ratio)
        r = plan_for_config(model, scaled, b // n, seq_len, device, profile=at_n)
        if isinstance(r, Infeasible):
            short = r if short is None or r.short_by < short.short_by else short  # the nearest miss
        elif best is None or r.predicted_tokens_per_s > 1.01 * best.predicted_tokens_per_s:
            best = r
    if best is None:
        assert short is not None
        if config.micro_batches is None:  # every n tried: "fewer micro-batches" cannot help
            more = "CPU memory" if short.resource == "cpu_memory" else "device memory"
            shares = "smaller CPU shares (placement), " if config.placement is not None else ""
            # the nearest miss's other fixes stay: the resident state on SSD, offload_dir on a disk
            ssd = re.search(r", resident_optimizer='ssd' \([^)]*\)", short.fix)
            disk = short.fix.split("; or ", 1)[0] + "; or " if "; or " in short.fix else ""
            return dataclasses.replace(short, fix=(
                f"{disk}{shares}a smaller global batch than {b} or shorter sequences (no number of "
                f"micro-batches dividing it, {ns[0]} to {ns[-1]}, fits){ssd.group(0) if ssd else ''}, "
                f"or give more {more}"
            ))
        return short
    return best


async def plan_for_trainer(trainer: Any, first: Any) -> SnakeConfig:
    """The trainer's hook: resolve trainer.config's None fields for the first global batch
    `first = (inputs, targets)`. Measures on a thread of its own (seconds, once per machine
    and shape; cached in offload_dir). Raises ConfigError when nothing fits."""
    from snake.blocking import name_native_thread, run_blocking
    from snake.models.gpt import GPT

    config: SnakeConfig = trainer.config
    model = trainer.parts.model
    # the built-in GPT by its config (fresh blocks are timed, as `snake plan` does); any other
    # model (Hugging Face, ModelParts), and a GPT with frozen parameters (whose CPU copy the
    # memory check counts, and a config does not say), by its own blocks, embedding and head
    whole = isinstance(model, GPT) and all(p.requires_grad for p in model.parameters())
    what: GPTConfig | ModelParts = model.config if whole else trainer.parts
    from snake.data import pair_of

    shape_in = pair_of(first)[0].shape
    b, t = int(shape_in[0]), int(shape_in[1])
    import torch

    rng = torch.get_rng_state()  # the probes draw random inputs: the user's stream stays as it was
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    stop = threading.Event()  # a cancellation stops the probes at their next round
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="snake-planner", initializer=name_native_thread) as ex:
            plan = await run_blocking(
                ex, lambda: plan_for_batch(what, config, b, t, str(trainer.device), stop=stop), on_cancel=stop.set
            )
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    trim_heap()
    if isinstance(plan, Infeasible):
        # the field left to the planner (the first of them)
        name = next(n for n in ("placement", "micro_batches", "alpha", "resident_optimizer")
                    if getattr(config, n) is None)
        raise ConfigError(name, None, f"cannot be planned: {plan.message}")
    return apply_plan(config, plan)


def trim_heap() -> None:
    """Give the memory glibc keeps of freed allocations back to the OS (malloc_trim). The
    probes' buffers and temporaries (copies of 64 MiB, an AdamW over 4 M elements, blocks
    at the micro-batch size) stayed in the process after planning: 205-213 MiB of RSS on
    GPTs of width 256-512, 113-118 MiB after the trim, ~60 MiB once the AdamW probe no
    longer imported torch._dynamo (34 MiB of it sympy, which the runtime's first backward
    imports anyway). No-op without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
