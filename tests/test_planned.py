"""Leaving micro_batches, placement and alpha to the planner: the trainer profiles, plans,
and trains with the plan (still exactly plain PyTorch); a model that cannot fit fails
before training, naming the short resource."""

import asyncio

import pytest

from snake import ConfigError, SnakeConfig, SnakeTrainer
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
