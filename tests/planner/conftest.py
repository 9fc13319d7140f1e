"""Synthetic machine profiles: no torch, no disk, numbers chosen to hit each regime."""

from __future__ import annotations

import dataclasses

import pytest

from planner.profile import MachineProfile
from snake.memory import ModelShape

GiB = float(1 << 30)


def synthetic_profile(**changes) -> MachineProfile:
    """A GPU box training a ~1.2B-parameter GPT (24 layers of 2048, bf16, 4 x 1024 tokens per
    micro-batch): 16 GiB of host memory, a 2 GB/s SSD, 1.9 G elem/s CPU Adam."""
    shape = ModelShape(
        n_layers=24,
        layer_params=12 * 2048 * 2048,
        ckpt_elems=4 * 1024 * 2048,
        resident_params=50304 * 2048,
        tokens_per_micro=4 * 1024,
        dtype_bytes=2,
        vocab_size=50304,
    )
    base = MachineProfile(
        fwd_seconds=0.010,
        recompute_seconds=0.010,
        bwd_seconds=0.020,
        pre_post_seconds=0.015,
        h2d_bytes_per_s=20e9,
        d2h_bytes_per_s=20e9,
        ssd_read_bytes_per_s=2.0e9,
        ssd_write_bytes_per_s=1.5e9,
        adam_elems_per_s=1.9e9,
        cpu_memory_bytes=16 * GiB,
        device_memory_bytes=40 * GiB,
        shape=shape,
        device="cuda",
    )
    return dataclasses.replace(base, **changes)


@pytest.fixture
def profile() -> MachineProfile:
    return synthetic_profile()
