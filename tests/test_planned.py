"""Leaving micro_batches, placement and alpha to the planner: the trainer profiles, plans,
and trains with the plan (still exactly plain PyTorch); a model that cannot fit fails
before training, naming the short resource."""

import asyncio

import pytest

from planner.model import KINDS, phases_for
from planner.profile import MachineProfile
from snake import ConfigError, Placement, SnakeConfig, SnakeTrainer
from snake.memory import ModelShape
from tests.helpers import assert_close_state, batches, reference, tiny_gpt


@pytest.mark.asyncio
async def test_planner_resolves_none_fields_and_training_matches(tmp_path):
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(2, 8)
    cfg = SnakeConfig(micro_batches=None, placement=None, alpha=None, offload_dir=tmp_path, device="cpu")
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(2), 120)
        resolved = trainer.config
        state = await trainer.state_dict()
    assert resolved.micro_batches is not None and 8 % resolved.micro_batches == 0
    assert resolved.placement is not None and resolved.alpha is not None
    want, _ = reference(model, data, resolved.micro_batches)
    assert_close_state(state, want)


@pytest.mark.asyncio
async def test_config_that_cannot_fit_fails_before_training(tmp_path):
    off = tmp_path / "off"
    cfg = SnakeConfig(micro_batches=None, placement=None, alpha=None, offload_dir=off, device="cpu",
                      cpu_memory_bytes=64 * 1024)
    async with SnakeTrainer(tiny_gpt(n_layer=3, bias=False), data=batches(2, 8), config=cfg) as trainer:
        with pytest.raises(ConfigError, match="(?i)cpu memory"):
            await asyncio.wait_for(trainer.run(1), 120)
    assert not list(off.glob("*.bin"))



@pytest.mark.asyncio
@pytest.mark.parametrize(("schedule", "alpha"), [("vertical", 0.0), ("vertical", 0.25), ("vertical", 1.0),
                                                 ("horizontal", 0.0), ("horizontal", 1.0)])
async def test_planner_counts_the_ssd_operations_the_runtime_makes(tmp_path, schedule, alpha):
    """planner.model's ssd_ops per layer and iteration, summed over the schedule's phases, is
    the number of SSD reads and writes the runtime traces per kind when every kind has a tail
    on SSD (the planner's per-operation charges on a CPU device rest on this count)."""
    n_layer, m = 3, 2
    cfg = SnakeConfig(micro_batches=m, offload_dir=tmp_path, device="cpu", schedule=schedule, alpha=alpha,
                      placement=Placement(param=0.5, ckpt=0.0, opt=0.5, grad=0.0))
    async with SnakeTrainer(tiny_gpt(n_layer=n_layer, bias=False), data=batches(3, 2 * m), config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(2), 120)
        t0 = trainer.trace.now()
        await asyncio.wait_for(trainer.run(1), 120)
        traced = dict.fromkeys(KINDS, 0)
        for s in trainer.trace.spans:
            if s.start_s >= t0 and s.actor in ("ssd_read", "ssd_write"):
                traced[s.name.split()[0]] += 1
    shape = ModelShape(n_layers=n_layer, layer_params=1, ckpt_elems=1, resident_params=1, tokens_per_micro=1,
                       dtype_bytes=4, vocab_size=1)
    profile = MachineProfile(
        fwd_seconds=1.0, recompute_seconds=1.0, bwd_seconds=1.0, pre_post_seconds=1.0, h2d_bytes_per_s=1.0,
        d2h_bytes_per_s=1.0, ssd_read_bytes_per_s=1.0, ssd_write_bytes_per_s=1.0, adam_elems_per_s=1.0,
        cpu_memory_bytes=1.0, device_memory_bytes=1.0, shape=shape, device="cpu")
    phases = phases_for(profile, m, alpha, schedule)
    counted = {k: n_layer * sum(ph.count * ph.traffic.ssd_ops[i] for ph in phases) for i, k in enumerate(KINDS)}
    assert traced == counted


@pytest.mark.asyncio
@pytest.mark.parametrize(("schedule", "alpha", "placement", "dtype"), [
    ("vertical", 0.0, Placement(param=0.5, ckpt=0.5, opt=0.5), "float32"),
    ("vertical", 0.3, Placement.all_ssd(), "float32"),
    ("vertical", 1.0, Placement(param=0.3, ckpt=1.0, opt=0.2, grad=0.4), "float32"),
    ("vertical", 0.5, Placement(param=1.0, ckpt=0.25, opt=0.0, grad=0.0), "bfloat16"),
    ("horizontal", 0.3, Placement(param=0.5, ckpt=0.0, opt=0.5, grad=0.0), "float32"),
])
async def test_planner_predicts_the_ssd_bytes_the_runtime_moves(tmp_path, schedule, alpha, placement, dtype):
    """planner.model's SSD bytes per iteration, per kind, at a placement's shares (the grad
    share as the runtime keeps it, `shares`) are the bytes the runtime's traffic counters
    record for one iteration, up to the heads' rounding: what the LP trades is what moves."""
    from planner.model import shares
    from planner.profile import shape_of_parts
    from snake.adapters import describe

    n_layer, m = 4, 2
    model = tiny_gpt(n_layer=n_layer, bias=False)
    cfg = SnakeConfig(micro_batches=m, offload_dir=tmp_path, device="cpu", schedule=schedule, alpha=alpha,
                      placement=placement, dtype=dtype)
    async with SnakeTrainer(model, data=batches(3, 2 * m), config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(3), 120)  # the last one has the delayed steps of the one before
        traffic = trainer.traffic()
    moved = dict.fromkeys(KINDS, 0)
    for (src, dst, kind), nbytes in traffic.items():
        if "ssd" in (src, dst):
            moved[kind] += nbytes
    shape = shape_of_parts(describe(model), 2, 16, dtype)
    profile = MachineProfile(
        fwd_seconds=1.0, recompute_seconds=1.0, bwd_seconds=1.0, pre_post_seconds=1.0, h2d_bytes_per_s=1.0,
        d2h_bytes_per_s=1.0, ssd_read_bytes_per_s=1.0, ssd_write_bytes_per_s=1.0, adam_elems_per_s=1.0,
        cpu_memory_bytes=1.0, device_memory_bytes=1.0, shape=shape, device="cpu")
    x = shares(placement, shape, alpha, schedule)
    phases = phases_for(profile, m, alpha, schedule)
    predicted = {k: n_layer * sum(ph.count * (ph.traffic.ssd_read[i] + ph.traffic.ssd_write[i]) * (1 - x[i])
                                  for ph in phases) for i, k in enumerate(KINDS)}
    for k in KINDS:
        assert moved[k] == pytest.approx(predicted[k], rel=0.01, abs=64 * n_layer), k
    assert moved["grad"] > 0 or x[3] == 1.0
