"""How the compute actor queues work on a CPU device: a job runs up to CPU_GROUP
consecutive micro-batches whose inputs are already in, and each is still traced alone."""

import asyncio
from collections import Counter
from dataclasses import dataclass

import pytest

from snake import Placement, SnakeConfig, SnakeTrainer
from snake.actors import compute
from snake.channels import Mailbox
from tests.helpers import batches, tiny_gpt

N, M = 4, 8


@dataclass
class _Msg:
    key: tuple


@pytest.mark.asyncio
async def test_mailbox_ready_keeps_messages():
    box = Mailbox("m", 4)
    await box.put(_Msg(("a", 1)))
    await box.put(_Msg(("b", 1)))
    assert box.ready(("a", 1))
    assert not box.ready(("a", 1), ("c", 1))
    assert box.ready(("b", 1), ("a", 1))  # nothing was taken out by asking
    assert (await box.take(("b", 1))).key == ("b", 1)
    assert not box.ready(("b", 1))
    assert (await box.take(("a", 1))).key == ("a", 1)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_cpu_device_groups_micro_batches_into_jobs(tmp_path, monkeypatch, schedule):
    sizes: list[int] = []
    start = compute.Compute._start

    async def spy(self, parts):  # type: ignore[no-untyped-def]
        sizes.append(len(parts))
        return await start(self, parts)

    monkeypatch.setattr(compute.Compute, "_start", spy)
    cfg = SnakeConfig(device="cpu", micro_batches=M, offload_dir=tmp_path, placement=Placement.all_cpu(),
                      alpha=0.0, schedule=schedule)
    async with SnakeTrainer(tiny_gpt(n_layer=N, bias=False), data=batches(2, 2 * M), config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(2), timeout=120)
        spans = Counter(s.name.split()[0] for s in trainer.trace.spans if s.actor == "compute")
    # every micro-batch of every layer, forward and backward, is one span
    assert spans["fwd"] == spans["bwd"] == 2 * N * M
    assert sum(sizes) == 4 * N * M
    if schedule == "vertical":
        # layer 0's forward needs no input from the inbox: its jobs are always full
        assert max(sizes) == compute.CPU_GROUP
        assert len(sizes) <= 4 * N * M // 2
    else:
        # horizontal stages hold one micro-batch each
        assert set(sizes) == {1}
