"""Faults injected deterministically (snake.faults): each makes run() raise one
ActorFailed within 5 s naming the actor and the cause, leaves no thread or file behind,
and the last checkpoint stays loadable; faults the backend must absorb (short transfers,
latency spikes) change nothing in the result."""

import asyncio
import os
import threading
import time

import pytest

from snake import ActorFailed, Placement, SnakeConfig, SnakeTrainer
from snake.errors import StallError, StorageError
from snake.faults import ActorFaults, StorageFaults, inject_storage
from tests.helpers import assert_close_state, batches, reference, tiny_gpt

ACTORS = ["data", "compute", "h2d", "d2h", "ssd_read", "ssd_write", "optimizer[0]", "optimizer[1]"]


def _cfg(path, **kw):
    # every kind partly on SSD, the waiting gradients too (beyond the stale params' 0.3)
    base = dict(micro_batches=2, offload_dir=path, placement=Placement(param=0.3, ckpt=0.3, opt=0.3, grad=0.0),
                alpha=0.3, device="cpu", stall_timeout_s=1.0)
    base.update(kw)
    return SnakeConfig(**base)


def _snake_threads():
    return [t for t in threading.enumerate() if t.name.startswith("snake-")]


def _bin_fds():
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").endswith(".bin"):
                out.append(fd)
        except OSError:
            pass
    return out


async def _fails(tmp_path, setup, actor, cause, match=None):
    """Run a step, save a checkpoint, break something, and check how the next run fails."""
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(8, 4)
    async with SnakeTrainer(model, data=data, config=_cfg(tmp_path / "off")) as trainer:
        await trainer.run(1)
        await trainer.save(tmp_path / "ckpt")
        setup(trainer)
        t0 = time.monotonic()
        with pytest.raises(ActorFailed) as e:
            await asyncio.wait_for(trainer.run(4), 30)
        assert time.monotonic() - t0 < 5
    assert e.value.actor == actor, e.value
    assert isinstance(e.value.__cause__, cause), repr(e.value.__cause__)
    if match:
        assert match in str(e.value)
    assert not _snake_threads() and not _bin_fds()
    # the last checkpoint is intact and loads
    async with SnakeTrainer(tiny_gpt(n_layer=3, bias=False, seed=7), data=data, config=_cfg(tmp_path / "off2")) as t2:
        await t2.load(tmp_path / "ckpt")
        await asyncio.wait_for(t2.run(1), 30)
    return e.value


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "kind,faults,actor,match",
    [
        ("opt", StorageFaults(seed=1, read_error=1.0), "ssd_read", "Input/output error"),
        ("param", StorageFaults(seed=2, read_error=0.5), "ssd_read", "Input/output error"),
        ("ckpt", StorageFaults(seed=3, write_error=1.0), "ssd_write", "Input/output error"),
        ("opt", StorageFaults(seed=4, no_space=1.0), "ssd_write", "disk is full"),
        ("param", StorageFaults(seed=5, flip=1.0), "ssd_read", "checksum mismatch"),
        ("grad", StorageFaults(seed=6, no_space=1.0), "ssd_write", "disk is full"),
        ("grad", StorageFaults(seed=7, read_error=1.0), "ssd_read", "Input/output error"),
    ],
)
async def test_storage_faults_fail_cleanly(tmp_path, kind, faults, actor, match):
    def setup(trainer):
        inject_storage(trainer.engine.stores[kind].file, faults)

    err = await _fails(tmp_path, setup, actor, StorageError, match)
    assert f"{kind}.bin" in str(err.__cause__)


@pytest.mark.asyncio
@pytest.mark.parametrize("actor", ACTORS)
async def test_exception_in_each_actor(tmp_path, actor):
    def setup(trainer):
        trainer.engine.fault_hook = ActorFaults(fail={actor: 3})

    await _fails(tmp_path, setup, actor, RuntimeError, "injected fault")


@pytest.mark.asyncio
@pytest.mark.parametrize("actor", ACTORS)
async def test_stall_in_each_actor_is_detected(tmp_path, actor):
    def setup(trainer):
        trainer.engine.fault_hook = ActorFaults(stall={actor: 3})

    err = await _fails(tmp_path, setup, actor, StallError, "no actor finished any work")
    assert actor in str(err.__cause__)


@pytest.mark.asyncio
async def test_random_actor_fault_is_deterministic_by_seed():
    a = ActorFaults.random(42, ACTORS)
    assert a.fail == ActorFaults.random(42, ACTORS).fail
    assert len({tuple(ActorFaults.random(s, ACTORS).fail.items()) for s in range(10)}) > 1


@pytest.mark.asyncio
async def test_short_transfers_and_latency_spikes_change_nothing(tmp_path):
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(3, 4)
    want, _ = reference(model, data, 2)
    cfg = _cfg(tmp_path, stall_timeout_s=30.0)
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        await trainer.run(1)
        for i, kind in enumerate(("param", "opt", "ckpt")):
            inject_storage(trainer.engine.stores[kind].file, StorageFaults(seed=i, short=0.5, spike=0.2, spike_s=0.01))
        await asyncio.wait_for(trainer.run(2), 60)
        got = await trainer.state_dict()
    assert_close_state(got, want)
