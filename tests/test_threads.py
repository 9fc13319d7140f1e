"""On a CPU device only the compute thread runs torch ops on several intra-op threads; every
other snake thread uses one, and nothing outside snake's threads changes."""

import threading

import pytest
import torch

from snake import Placement, SnakeConfig, SnakeTrainer
from tests.helpers import batches, tiny_gpt


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # so that "one" and "torch's count" differ on any machine
    yield 2
    torch.set_num_threads(before)


def _new_thread_count() -> int:
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
    t.start()
    t.join()
    return out[0]


@pytest.mark.asyncio
async def test_cpu_device_helper_threads_use_one_intraop_thread(tmp_path, two_threads):
    cfg = SnakeConfig(micro_batches=2, offload_dir=str(tmp_path), placement=Placement(param=0.5, ckpt=0.5, opt=0.5),
                      alpha=0.0, device="cpu", optimizer_workers=2)
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(3, 4), config=cfg) as trainer:
        await trainer.run(2)
        ex = trainer.engine.executors
        counts = {name: ex[name].submit(torch.get_num_threads).result() for name in ex}
    assert counts == {"compute": two_threads, "copy": 1, "io": 1, "optimizer": 1, "data": 1}
    # the caller's thread and threads made later keep torch's count
    assert torch.get_num_threads() == two_threads
    assert _new_thread_count() == two_threads
