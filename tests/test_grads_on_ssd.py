"""placement.grad: the delayed gradients (vertical, alpha > 0; every layer's whole gradient
with clipping or a dynamic loss scale) partly or wholly on SSD, between the layer's
backward and its delayed step in the next iteration. What the stale delayed parameters'
memory holds stays there whatever the share. Where a gradient waits does not change a bit
of it: the weights equal those of the same run with every gradient in CPU memory (and
plain PyTorch's); the bytes written and read are the SSD parts; the memory model charges
what the runtime allocates; the planner puts gradients on SSD when memory is short."""

import asyncio
import dataclasses

import pytest
import torch

from snake import AdamW, DynamicLossScale, Placement, SnakeConfig, SnakeTrainer
from snake.io import align_up
from snake.memory import ModelShape, host_memory
from tests.helpers import assert_close_state, batches, reference, tiny_gpt

CLIPS = 0.3

CASES = {
    # everything on SSD, the delayed share of an fp32 model
    "fp32-all-ssd": dict(placement=Placement(param=0.0, ckpt=0.5, opt=0.0, grad=0.0), alpha=0.3),
    # clipping (alpha = 1): some gradients in the stale params, some in memory, the rest on SSD
    "clip-part": dict(placement=Placement(param=0.5, ckpt=1.0, opt=0.5, grad=0.6), alpha=1.0,
                      optimizer=AdamW(max_grad_norm=CLIPS)),
    # bf16 params all in CPU memory: half of each gradient fits in them, the other half on SSD
    "bf16-half": dict(placement=Placement(param=1.0, ckpt=1.0, opt=0.5, grad=0.0), alpha=0.5, dtype="bfloat16"),
    # fp16 with a dynamic loss scale, one optimizer worker (the staging pools at their least)
    "fp16-dynamic": dict(placement=Placement(param=0.3, ckpt=1.0, opt=1.0, grad=0.2), alpha=1.0, dtype="float16",
                         loss_scale=DynamicLossScale(init_scale=2.0**24, growth_interval=2), optimizer_workers=1),
}


async def _run(tmp_path, model, data, kw):
    """1 step and 1 more (layer 0's waiting gradient kept in between), state_dict (applies
    the pending delayed steps, reading the SSD parts), 2 more."""
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, device="cpu", schedule="vertical", **kw)
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        await asyncio.wait_for(t.run(1), 120)
        await asyncio.wait_for(t.run(1), 120)
        traffic = t.traffic()
        e = t.engine
        # layer 0's delayed step follows its now-step: its SSD part waits in a staging buffer
        tails = sum(e.stores["grad"].tail_bytes(u) for u in e.stores["grad"].units.values() if u.key[0] != 0)
        assert e.plans.grad_stays(0) and not any(e.plans.grad_stays(layer) for layer in range(1, e.N))
        stays = e.stores["grad"].tail_bytes(e.stores["grad"].unit((0, 1)))
        cpu = e.stores["grad"].cpu_bytes()
        await t.state_dict()
        report = await asyncio.wait_for(t.run(2), 120)
        return await t.state_dict(), report, traffic, tails, cpu, stays


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(CASES))
async def test_gradients_on_ssd_give_the_weights_of_gradients_in_memory(tmp_path, case):
    kw = CASES[case]
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(4, 4)
    got, report, traffic, tails, cpu, stays = await _run(tmp_path / "ssd", model, data, kw)
    in_memory = {**kw, "placement": dataclasses.replace(kw["placement"], grad=1.0)}
    want, want_report, want_traffic, want_tails, want_cpu, _ = await _run(tmp_path / "cpu", model, data, in_memory)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert [s.loss for s in report.steps] == [s.loss for s in want_report.steps]
    assert [s.skipped for s in report.steps] == [s.skipped for s in want_report.steps]
    # the SSD parts were written after each backward and read for each delayed step
    assert tails > 0 and want_tails == 0
    assert traffic[("cpu", "ssd", "grad")] == tails == traffic[("ssd", "cpu", "grad")]
    assert ("cpu", "ssd", "grad") not in want_traffic
    assert cpu + tails + stays == want_cpu  # the same gradient elements outside the stale params, split
    if case == "fp32-all-ssd":
        assert_close_state(got, reference(model, data, 2)[0])


@pytest.mark.asyncio
async def test_checkpoints_resume_bitwise_with_gradients_on_ssd(tmp_path):
    """A save applies the pending delayed steps (their gradients read back from SSD); the
    resumed run goes on as the straight one, clipped, with gradients on SSD."""
    from tests.helpers import straight_and_resumed

    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(4, 4)
    kw = dict(micro_batches=2, placement=Placement(param=0.0, ckpt=1.0, opt=0.5, grad=0.0), alpha=1.0,
              optimizer=AdamW(max_grad_norm=CLIPS))
    straight, resumed, _, manifest = await straight_and_resumed(tmp_path, model, data, 2, 2, **kw)
    for k in straight:
        assert torch.equal(resumed[k], straight[k]), k
    assert_close_state(straight, reference(model, data, 2, max_norm=CLIPS)[0])
    assert manifest["config"]["placement"]["grad"] == 0.0


@pytest.mark.asyncio
@pytest.mark.parametrize(("param", "grad", "dtype"), [(0.0, 0.0, "float32"), (0.5, 0.3, "float32"),
                                                      (1.0, 0.25, "bfloat16"), (0.0, 0.7, "bfloat16")])
async def test_the_memory_model_charges_what_the_gradients_take(tmp_path, param, grad, dtype):
    """The host bytes the delayed gradients take (their CPU heads and the staging buffers of
    their SSD parts, beyond the stale params' memory) are what host_memory charges at the
    grad share, to a few pages."""
    model = tiny_gpt(n_layer=3, n_embd=128, bias=False)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=Placement(param=param, ckpt=1.0, opt=0.5,
                                                                                 grad=grad),
                      alpha=1.0, schedule="vertical", device="cpu", dtype=dtype)
    async with SnakeTrainer(model, data=batches(2, 4), config=cfg) as trainer:
        await trainer.run(1)
        e = trainer.engine
        st = e.stores["grad"]
        buffers = sum(len(e.pools[n]._all) for n in ("grad_in", "grad_out") if e.pools.get(n) is not None)
        taken = st.cpu_bytes() + buffers * (align_up(st.max_tail_bytes) if st.max_tail_bytes else 0)
        db = torch.empty((), dtype=e.dtype).element_size()
        shape = ModelShape(n_layers=e.N, layer_params=e.P, ckpt_elems=e.ckpt_elems, resident_params=0,
                           tokens_per_micro=1, dtype_bytes=db, vocab_size=0)
        x = (param, 1.0, 0.5, grad)
        # with two workers the optimizer-state pools are the same at alpha 0 and 1
        modelled = (host_memory(shape, n_micro=2, alpha=1.0, schedule="vertical", workers=2).at(*x)
                    - host_memory(shape, n_micro=2, alpha=0.0, schedule="vertical", workers=2).at(*x))
        # a few elements per layer: the heads' rounding and 4-byte alignment; a page per buffer
        assert modelled == pytest.approx(taken, abs=64 * e.N + 4096 * buffers)
        assert (st.max_tail_bytes > 0) == (grad < 1 and (param < 1 or db < 4))


def test_snake_train_takes_a_grad_share(tmp_path):
    """`--placement param,ckpt,opt,grad`: clipping with the waiting gradients on SSD; the
    report's config records the share."""
    import json

    from snake import cli
    from tests.test_cli_mistakes import SMALL

    out = tmp_path / "out"
    assert cli.main(["train", *SMALL, "--steps", "2", "--max-grad-norm", "0.5", "--placement", "0,0.5,0.5,0",
                     "--out", str(out), "--offload-dir", str(tmp_path / "off")]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["placement"] == {"param": 0.0, "ckpt": 0.5, "opt": 0.5, "grad": 0.0}
    assert report["config"]["alpha"] == 1.0


@pytest.mark.asyncio
async def test_the_planner_puts_waiting_gradients_on_ssd_under_a_tight_budget(tmp_path):
    """Clipping with the planner choosing the placement (alpha and placement None) under a
    memory budget that cannot hold every layer's fp32 gradient beside the least of the rest:
    it plans part of them on SSD, the run keeps to the plan, and the weights are torch's."""
    from planner.profile import shape_of_parts
    from snake.adapters import describe
    from snake.memory import off_budget_bytes

    model = tiny_gpt(n_layer=24, bias=False)  # enough layers that their gradients outweigh the staging buffers
    data = batches(3, 4)
    shape = shape_of_parts(describe(model), 2, 16, "float32")
    mem = host_memory(shape, n_micro=2, alpha=1.0, schedule="vertical", workers=2)
    # the planner also solves the exact model of every checkpoint in CPU memory
    exact = host_memory(shape, n_micro=2, alpha=1.0, schedule="vertical", workers=2, ckpt_in_cpu=True)
    least = mem.smallest()
    least_in_memory = min(mem.smallest({"grad": 1.0}), exact.smallest({"grad": 1.0, "ckpt": 1.0}))
    assert least_in_memory > least
    budget = int(off_budget_bytes(shape, n_micro=2, device_type="cpu") + (least + least_in_memory) / 2)
    cfg = SnakeConfig(micro_batches=2, placement=None, alpha=None, offload_dir=tmp_path, device="cpu",
                      cpu_memory_bytes=budget, resident_optimizer="cpu", optimizer=AdamW(max_grad_norm=CLIPS))
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        await asyncio.wait_for(t.run(3), 120)
        assert t.config.alpha == 1.0
        assert t.config.placement.grad < 1.0
        assert t.engine.stores["grad"].file_bytes > 0
        got = await t.state_dict()
    assert_close_state(got, reference(model, data, 2, max_norm=CLIPS)[0])


@pytest.mark.asyncio
async def test_the_disk_check_counts_the_gradients_ssd_tier(tmp_path, monkeypatch):
    """Before any file is made, the free-space check adds the waiting gradients' SSD part:
    a disk with exactly the room the other kinds take refuses grad=0 and takes grad=1."""
    from collections import namedtuple

    import snake.engine
    from snake import ConfigError

    kw = dict(micro_batches=2, alpha=1.0, device="cpu", optimizer=AdamW(max_grad_norm=CLIPS))
    model = tiny_gpt(n_layer=3, bias=False)
    in_memory = Placement(param=0.0, ckpt=0.0, opt=0.0, grad=1.0)
    async with SnakeTrainer(model, data=batches(1, 4), config=SnakeConfig(offload_dir=tmp_path / "a",
                                                                          placement=in_memory, **kw)) as t:
        await t.run(1)
        room = t.engine.offload_bytes()
        grads = sum(t.engine.layer_parts[layer][1] * 4 for layer in range(t.engine.N))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(snake.engine.shutil, "disk_usage", lambda p: usage(2**40, 2**40 - room, room))
    for placement, fits in ((Placement.all_ssd(), False), (in_memory, True)):
        off = tmp_path / f"b{fits}"
        async with SnakeTrainer(model, data=batches(1, 4), config=SnakeConfig(offload_dir=off, placement=placement,
                                                                              **kw)) as t:
            if fits:
                await asyncio.wait_for(t.run(1), 60)
            else:
                with pytest.raises(ConfigError, match=r"offload_dir.*free but the SSD tier needs") as err:
                    await asyncio.wait_for(t.run(1), 60)
                assert not list(off.glob("*.bin"))
                assert grads > 0 and "placement shares" in str(err.value)


@pytest.mark.asyncio
async def test_a_state_dict_cancelled_during_its_flush_returns_the_kept_buffer(tmp_path, monkeypatch):
    """A cancelled state_dict waits for the flush it started; the flush applied the steps
    layer 0's kept gradient waited for, so its staging buffer goes back to the pool. With
    one worker that pool has one buffer: kept, the next run would wait for it forever."""
    import threading

    import snake.trainer

    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(3, 4)
    kw = dict(micro_batches=2, placement=Placement.all_ssd(), alpha=1.0, device="cpu", optimizer_workers=1,
              io_threads=1, stall_timeout_s=20, optimizer=AdamW(max_grad_norm=CLIPS))
    async with SnakeTrainer(model, data=data, config=SnakeConfig(offload_dir=tmp_path / "a", **kw)) as t:
        await asyncio.wait_for(t.run(3), 120)
        want = await t.state_dict()
    real = snake.trainer.flush_delayed
    loop, started = asyncio.get_running_loop(), asyncio.Event()

    def slow_flush(e):
        loop.call_soon_threadsafe(started.set)
        threading.Event().wait(0.3)
        real(e)

    monkeypatch.setattr(snake.trainer, "flush_delayed", slow_flush)
    async with SnakeTrainer(model, data=data, config=SnakeConfig(offload_dir=tmp_path / "b", **kw)) as t:
        await asyncio.wait_for(t.run(1), 120)
        assert 0 in t.engine.held_grads
        task = asyncio.create_task(t.state_dict())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not t.engine.held_grads
        await asyncio.wait_for(t.run(2), 120)
        got = await t.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k
