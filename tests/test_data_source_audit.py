"""An audit of what a user may pass as `data=`: a DataLoader with worker processes, generators
and async generators that fail or block, sources shorter than the run, a loader that refills
one buffer. Each test failed before its fix."""

from __future__ import annotations

import asyncio

import pytest
import torch

from snake import SnakeConfig, SnakeTrainer
from tests.helpers import batches, reference, tiny_gpt


def _config(tmp_path) -> SnakeConfig:
    return SnakeConfig(micro_batches=2, alpha=0.0, device="cpu", offload_dir=tmp_path / "off")


def _refilled(data):
    """A loader that fills one pair of tensors for every batch, as a plain training loop,
    which uses each batch before asking for the next, allows."""
    x, y = torch.empty_like(data[0][0]), torch.empty_like(data[0][1])
    for bx, by in data:
        x.copy_(bx)
        y.copy_(by)
        yield x, y


@pytest.mark.asyncio
async def test_a_loader_that_refills_one_buffer_trains_on_each_batch(tmp_path):
    """Each step trains on its own batch: before, the data actor's batches were the loader's
    tensors themselves (on a CPU device), which it refilled with the next batches while
    the step used them, so the steps trained on other batches' tokens (losses off PyTorch's
    by up to 0.07, and differently from run to run)."""
    data = batches(6, 4)
    _, want = reference(tiny_gpt(n_layer=2), data, 2)
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=_refilled(data), config=_config(tmp_path)) as t:
        report = await asyncio.wait_for(t.run(6), 60)
    assert [s.loss for s in report.steps] == pytest.approx(want, rel=1e-5)


@pytest.mark.asyncio
async def test_evaluate_of_a_loader_that_refills_one_buffer(tmp_path):
    """evaluate() holds a pass's targets until its head runs: with one buffer refilled, every
    batch of the pass was scored against the last one's targets."""
    held_out = batches(4, 4, seed=7)
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(2, 4), config=_config(tmp_path)) as t:
        await asyncio.wait_for(t.run(1), 60)
        want = await t.evaluate(held_out)
        got = await t.evaluate(_refilled(held_out))
    assert got.batches == want.batches == 4
    assert got.loss == pytest.approx(want.loss, rel=1e-6)
