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


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("ckpt", [0.0, 0.3, 0.5, 0.8, 1.0])
async def test_checkpoints_whole_units_within_the_memory_model(tmp_path, ckpt, schedule):
    """Checkpoints live as whole units, each wholly in CPU memory or wholly on SSD, about
    `ckpt` of them per layer; only the units on SSD move over it; and the host bytes they take
    (CPU units + staging pools) stay within the planner's model, at most a few units above."""
    import math

    from snake.memory import ModelShape, PoolSizes, host_memory

    n_layer, micro = 4, 5
    model = tiny_gpt(n_layer=n_layer, n_embd=64, bias=False)
    cfg = SnakeConfig(micro_batches=micro, offload_dir=tmp_path, placement=Placement(param=1.0, ckpt=ckpt, opt=1.0),
                      alpha=0.0, schedule=schedule, device="cpu")
    async with SnakeTrainer(model, data=batches(2, 2 * micro), config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(2), 60)
        e = trainer.engine
        assert e is not None
        st = e.stores["ckpt"]
        unit = st.esize * e.ckpt_elems
        units = list(st.units.values())
        assert all(u.k in (0, u.n) for u in units)
        in_cpu = [u for u in units if u.k == u.n]
        assert len(in_cpu) == math.floor(ckpt * n_layer * micro + 0.5)
        for layer in range(n_layer):
            here = sum(1 for u in in_cpu if u.key[0] == layer)
            assert math.floor(ckpt * micro) <= here <= math.ceil(ckpt * micro)
        traffic = trainer.traffic()
        assert traffic.get(("cpu", "ssd", "ckpt"), 0) == (len(units) - len(in_cpu)) * unit
        pools = [e.pools[k] for k in ("ckpt_in", "ckpt_out") if e.pools[k] is not None]
        runtime = st.cpu_bytes() + sum(p.size for p in pools) * st.max_tail_bytes
        shape = ModelShape(n_layers=n_layer, layer_params=e.P, ckpt_elems=e.ckpt_elems, resident_params=0,
                           tokens_per_micro=1, dtype_bytes=st.esize, vocab_size=0)
        mem = host_memory(shape, n_micro=micro, alpha=0.0, schedule=schedule, workers=2)
        # the model's checkpoint part: its share coefficient, plus the pools' fixed bound
        # (two pools of (micro + 1) units and their extras)
        sizes = PoolSizes()
        m_ckpt = mem.per_share["ckpt"] * ckpt + (2 * (micro + 1) + sizes.ckpt_in_extra + sizes.ckpt_out_extra) * unit
        assert runtime <= m_ckpt + 1
        assert m_ckpt - runtime <= 6 * unit
        if ckpt == 1.0:  # the planner's model for every checkpoint in CPU memory: exact
            exact = host_memory(shape, n_micro=micro, alpha=0.0, schedule=schedule, workers=2, ckpt_in_cpu=True)
            assert runtime == exact.per_share["ckpt"]
            assert exact.fixed_bytes == mem.fixed_bytes - (2 * (micro + 1) + sizes.ckpt_in_extra
                                                           + sizes.ckpt_out_extra) * unit
