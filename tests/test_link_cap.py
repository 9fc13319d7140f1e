"""`device_link_bytes_per_s`: an emulated host<->device link. It costs time for every byte a
GPU would move (also where a CPU device moves none), changes no number, and the planner
models it as link time, not CPU work."""

import dataclasses
import time

import pytest
import torch

from planner.model import phases_for
from snake import Placement, SnakeConfig, SnakeTrainer
from tests.helpers import batches, tiny_gpt
from tests.planner.conftest import GiB, synthetic_profile


async def _train(tmp_path, name: str, link: float | None) -> tuple[float, dict, dict]:
    cfg = SnakeConfig(micro_batches=2, offload_dir=str(tmp_path / name), placement=Placement.all_cpu(),
                      alpha=0.0, device="cpu", device_link_bytes_per_s=link)
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(3, 4), config=cfg) as trainer:
        await trainer.run(1)  # warm-up
        t0 = time.perf_counter()
        await trainer.run(2)
        seconds = time.perf_counter() - t0
        traffic = dict(trainer.engine.traffic.last())
        state = await trainer.state_dict()
        waits = [sp for sp in trainer.trace.spans if sp.actor.startswith("link ")]
    if link is not None:  # the trace shows where the link made the run wait
        assert {sp.actor for sp in waits} >= {"link cpu->gpu"}
        assert sum(sp.end_s - sp.start_s for sp in waits) > 0.5
    else:
        assert not waits
    return seconds, traffic, state


@pytest.mark.asyncio
async def test_capped_link_takes_bytes_over_cap_and_changes_no_number(tmp_path):
    free_s, free_traffic, free_state = await _train(tmp_path, "free", None)
    link_bytes = sum(n for (src, dst, _), n in free_traffic.items() if {src, dst} == {"cpu", "gpu"})
    h2d = sum(n for (src, dst, _), n in free_traffic.items() if (src, dst) == ("cpu", "gpu"))
    assert h2d > 0 and link_bytes > h2d
    cap = h2d / 0.4  # each iteration's host->device bytes take 0.4 s over the link
    capped_s, capped_traffic, capped_state = await _train(tmp_path, "capped", cap)
    assert capped_traffic == free_traffic
    # 2 iterations; the bucket's burst (1/20 s of the rate) lets a little through at once
    assert capped_s >= 2 * 0.4 * 0.8, (capped_s, free_s)
    assert capped_s > free_s
    for k in free_state:
        assert torch.equal(free_state[k], capped_state[k]), k


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["cpu-device", "gpu-device"])
def test_planner_counts_a_capped_link_as_link_time_not_cpu_work(device):
    base = synthetic_profile(cpu_memory_bytes=512 * GiB, device=device)
    capped = dataclasses.replace(base, device_link_bytes_per_s=base.h2d_bytes_per_s / 10)
    for ph_free, ph_cap in zip(phases_for(base, 4, 0.0, "horizontal"), phases_for(capped, 4, 0.0, "horizontal"),
                               strict=True):
        free = {b.name.split("_")[0]: b.seconds for b in ph_free.bounds}
        cap = {b.name.split("_")[0]: b.seconds for b in ph_cap.bounds}
        assert cap["h2d"] == pytest.approx(10 * free["h2d"])
        assert cap["d2h"] == pytest.approx(free["d2h"] * base.d2h_bytes_per_s / capped.device_link_bytes_per_s)
        assert cap.get("host") == free.get("host")  # the memcpy's CPU work is what was measured


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_every_byte_counted_between_host_and_device_is_charged_to_the_link(tmp_path, schedule):
    """Also the activations a CPU device's compute thread writes into CPU memory itself
    (Engine.inline_store, no d2h copy): d2h charges the link for them before they count as
    stored, as it does for the bytes it copies."""
    cfg = SnakeConfig(micro_batches=3, offload_dir=str(tmp_path), placement=Placement.all_cpu(), alpha=0.0,
                      device="cpu", schedule=schedule, device_link_bytes_per_s=1e12)
    async with SnakeTrainer(tiny_gpt(n_layer=3), data=batches(2, 6), config=cfg) as trainer:
        await trainer.run(1)
        engine = trainer.engine
        assert engine is not None and engine.inline_store("ckpt", 1, 0) is not None
        charged = {"cpu->gpu": 0, "gpu->cpu": 0}
        wait = engine.link_wait

        async def counting(link: str, nbytes: int) -> None:
            charged[link] += nbytes
            await wait(link, nbytes)

        engine.link_wait = counting  # type: ignore[method-assign]
        await trainer.run(1)
        traffic = dict(engine.traffic.last())
        d2h_copies = [s for s in trainer.trace.spans if s.actor == "d2h" and s.name.startswith(("ckpt", "act_grad"))]
    assert not d2h_copies
    counted = {f"{a}->{b}": sum(n for (src, dst, _), n in traffic.items() if (src, dst) == (a, b))
               for a, b in (("cpu", "gpu"), ("gpu", "cpu"))}
    assert counted["gpu->cpu"] > 0 and any(k == "ckpt" for (_, dst, k) in traffic if dst == "cpu")
    assert charged == counted
