"""Soak: 300 steps of a small model; after warm-up RSS grows < 5%, open file descriptors
and the offload_dir size stay constant."""

import asyncio
import gc
import os

import psutil
import pytest

from snake import Placement, SnakeConfig, SnakeTrainer
from tests.helpers import tiny_gpt


def _endless(batch=4, seq=16, vocab=96):
    import torch

    g = torch.Generator().manual_seed(0)
    while True:
        x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        yield x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _dir_bytes(path):
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.slow
@pytest.mark.asyncio
async def test_300_steps_flat(tmp_path):
    cfg = SnakeConfig(
        micro_batches=2, offload_dir=tmp_path, placement=Placement(param=0.5, ckpt=0.5, opt=0.5),
        alpha=0.3, device="cpu",
    )
    proc = psutil.Process()
    async with SnakeTrainer(tiny_gpt(n_layer=3, n_embd=64, bias=False), data=_endless(), config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(20), 120)
        gc.collect()
        rss0, fds0, disk0 = proc.memory_info().rss, len(os.listdir("/proc/self/fd")), _dir_bytes(tmp_path)
        report = await asyncio.wait_for(trainer.run(280), 600)
        gc.collect()
        rss1, fds1, disk1 = proc.memory_info().rss, len(os.listdir("/proc/self/fd")), _dir_bytes(tmp_path)
    assert len(report.steps) == 280
    assert fds1 == fds0
    assert disk1 == disk0
    assert rss1 < rss0 * 1.05, (rss0, rss1)
