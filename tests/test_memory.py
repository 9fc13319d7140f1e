"""Fixed pools: after a warm-up step, process RSS and the offload_dir stay flat."""

import asyncio
import gc

import psutil
import pytest

from snake import Placement, SnakeConfig, SnakeTrainer
from tests.helpers import batches, tiny_gpt


def _dir_bytes(path):
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_rss_and_offload_dir_flat(tmp_path, schedule):
    model = tiny_gpt(n_layer=4, n_embd=128, bias=False)
    cfg = SnakeConfig(
        micro_batches=3, offload_dir=tmp_path, placement=Placement(param=0.5, ckpt=0.5, opt=0.5),
        alpha=0.3, schedule=schedule, device="cpu",
    )
    proc = psutil.Process()
    async with SnakeTrainer(model, data=batches(26, 6), config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(5), 60)  # warm-up: pools, allocator caches
        gc.collect()
        rss0, disk0 = proc.memory_info().rss, _dir_bytes(tmp_path)
        for _ in range(4):
            await asyncio.wait_for(trainer.run(5), 60)
        gc.collect()
        rss1, disk1 = proc.memory_info().rss, _dir_bytes(tmp_path)
    assert disk1 == disk0
    assert rss1 - rss0 < max(0.03 * rss0, 8 * 2**20), (rss0, rss1)
