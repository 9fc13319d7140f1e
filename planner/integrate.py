"""Resolving a SnakeConfig's `None` fields (micro_batches, placement, alpha) with a plan.

A trainer does, before any actor starts:

    plan = plan_for_config(model.config, config, micro_batch_size, seq_len, device)
    if isinstance(plan, Infeasible):
        raise ConfigError("placement", None, plan.message)
    config = apply_plan(config, plan)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from planner.profile import MachineProfile, measure_profile
from planner.search import search
from planner.solve import Infeasible, Plan
from snake.config import SnakeConfig
from snake.memory import ModelShape

if TYPE_CHECKING:  # importing the model pulls in torch; the planner's core does not need it
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
    model: GPTConfig | ModelShape, config: SnakeConfig, micro_batch_size: int, seq_len: int,
    device: str,
) -> MachineProfile:
    """Measured (or cached) profile with the config's memory budgets applied."""
    cfg = proxy_config(model, seq_len) if isinstance(model, ModelShape) else model
    profile = measure_profile(
        cfg, micro_batch_size=micro_batch_size, seq_len=seq_len, device=str(device),
        dtype=config.dtype, offload_dir=config.offload_dir,
        ssd_bandwidth_bytes_per_s=config.ssd_bandwidth_bytes_per_s,
    )
    if isinstance(model, ModelShape):
        profile = dataclasses.replace(profile, shape=model)
    return with_budgets(profile, config)


def with_budgets(profile: MachineProfile, config: SnakeConfig) -> MachineProfile:
    """The profile with config.cpu_memory_bytes / device_memory_bytes where they are set."""
    changes = {}
    if config.cpu_memory_bytes is not None:
        changes["cpu_memory_bytes"] = float(config.cpu_memory_bytes)
    if config.device_memory_bytes is not None:
        changes["device_memory_bytes"] = float(config.device_memory_bytes)
    return dataclasses.replace(profile, **changes)


def plan_for_config(
    model: GPTConfig | ModelShape,
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
        alphas=None if config.alpha is None else (config.alpha,),
        placement=config.placement,
        n_micro=config.micro_batches,
    )


def apply_plan(config: SnakeConfig, plan: Plan) -> SnakeConfig:
    """The config with micro_batches, placement and alpha taken from the plan."""
    return dataclasses.replace(
        config, micro_batches=plan.n_micro, placement=plan.placement, alpha=plan.alpha
    )
