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


def _omp_workers() -> set[int]:
    """OS threads of this process that Python did not start (OpenMP workers, mostly)."""
    import os

    python_ids = {t.native_id for t in threading.enumerate()}
    return {int(t) for t in os.listdir("/proc/self/task")} - python_ids


def test_event_loop_thread_runs_no_parallel_torch_op(tmp_path, two_threads):
    """Training, state_dict, save and load. A parallel torch op on the event loop's thread would give it an OpenMP team that lives as
    long as the thread; on a CPU device that team makes the compute kernels' OpenMP workers
    stop spinning and every kernel slower. The loop runs on a fresh thread here, so the team
    would be new and still alive after the trainer closed its own threads."""
    import asyncio
    import time

    before = _omp_workers()
    leftover: list[set[int]] = []

    async def train() -> None:
        # 8 x 32 x 256 floats per micro-batch: the embedding is large enough to run in parallel
        cfg = SnakeConfig(micro_batches=2, offload_dir=str(tmp_path), placement=Placement.all_cpu(),
                          alpha=0.0, device="cpu")
        data = batches(3, 16, seq=32)
        async with SnakeTrainer(tiny_gpt(n_layer=2, n_embd=256), data=data, config=cfg) as t:
            await t.state_dict()  # before the first run and after it
            await t.run(2)
            await t.state_dict()
            await t.save(tmp_path / "ck")
        again = SnakeConfig(micro_batches=2, offload_dir=str(tmp_path / "again"), placement=Placement.all_cpu(),
                            alpha=0.0, device="cpu")
        async with SnakeTrainer(tiny_gpt(n_layer=2, n_embd=256), data=data, config=again) as t:
            await t.load(tmp_path / "ck")
            await t.run(1)

    def loop_then_look() -> None:
        asyncio.run(train())
        deadline = time.monotonic() + 5  # still on the loop's thread: its team would be alive
        while _omp_workers() - before and time.monotonic() < deadline:
            time.sleep(0.05)  # the compute thread's workers leave with it
        leftover.append(_omp_workers() - before)

    loop_thread = threading.Thread(target=loop_then_look)
    loop_thread.start()
    loop_thread.join()
    assert leftover == [set()]


def _os_names() -> dict[int, str]:
    import os

    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
        except FileNotFoundError:  # the thread exited meanwhile
            pass
    return out


@pytest.mark.asyncio
async def test_snake_threads_carry_their_names_in_the_os(tmp_path):
    """top -H, py-spy and perf show OS thread names: each snake thread has its own."""
    cfg = SnakeConfig(micro_batches=2, offload_dir=str(tmp_path), placement=Placement(param=0.5, ckpt=0.5, opt=0.5),
                      alpha=0.0, device="cpu", optimizer_workers=2)
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(3, 4), config=cfg) as trainer:
        await trainer.run(1)
        ex = trainer.engine.executors
        seen = {name: ex[name].submit(threading.get_native_id).result() for name in ex}
        names = _os_names()
    assert {k: names[tid] for k, tid in seen.items()} == {
        "compute": "snake-compute_0", "copy": "snake-copy_0", "io": names[seen["io"]], "optimizer": names[seen["optimizer"]],
        "data": "snake-data_0",
    }
    assert names[seen["io"]].startswith("snake-io_")
    assert names[seen["optimizer"]] == "snake-optimizer"  # "snake-optimizer_N" cut to 15 bytes
    assert names[threading.get_native_id()] != "snake-compute_0"  # the caller's thread keeps its name
