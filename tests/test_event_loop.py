"""Training never blocks the event loop: in debug mode asyncio logs every callback that
runs longer than `slow_callback_duration`; none may appear while snake trains."""

import asyncio
import logging

import pytest

from snake import Placement, SnakeConfig, SnakeTrainer
from tests.helpers import batches, tiny_gpt


@pytest.mark.asyncio
async def test_no_slow_callbacks_while_training(tmp_path, caplog):
    loop = asyncio.get_running_loop()
    assert loop.get_debug()
    loop.slow_callback_duration = 0.05
    cfg = SnakeConfig(micro_batches=3, offload_dir=tmp_path, placement=Placement(param=0.5, ckpt=0.5, opt=0.5),
                      alpha=0.3, device="cpu")
    with caplog.at_level(logging.WARNING, logger="asyncio"):
        async with SnakeTrainer(tiny_gpt(n_layer=4, n_embd=128), data=batches(6, 6), config=cfg) as trainer:
            await asyncio.wait_for(trainer.run(3), 60)  # warm-up: setup allocates on threads too
            caplog.clear()
            await asyncio.wait_for(trainer.run(3), 60)
    slow = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert not slow, slow
