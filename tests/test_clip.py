"""Clipping by the global gradient norm (`AdamW(max_grad_norm=...)`, snake.clip): the weights
of torch.nn.utils.clip_grad_norm_ + torch AdamW for both schedules and several placements,
the resident state on SSD, bf16, missed steps and resuming; the norm each step reports is
the one clip_grad_norm_ returns; faults while steps wait for the norm fail quickly."""

import asyncio
import dataclasses
import json
import math
import time

import pytest
import torch

from snake import (
    ActorFailed,
    AdamW,
    ConfigError,
    DynamicLossScale,
    Placement,
    SnakeConfig,
    SnakeTrainer,
)
from snake.faults import ActorFaults
from tests.helpers import (
    assert_close_state,
    batches,
    reference,
    straight_and_resumed,
    tiny_gpt,
    train,
)
from tests.test_fault_injection import _bin_fds, _snake_threads

MIXED = Placement(param=0.5, ckpt=0.3, opt=0.6)
CLIPS = 0.3  # the tiny GPT's gradient norms here are about 2: every step is clipped


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,placement,micro,workers", [
    ("vertical", MIXED, 2, 2),
    ("vertical", Placement.all_ssd(), 3, 2),
    ("vertical", Placement.all_cpu(), 1, 2),
    ("vertical", Placement.all_ssd(), 3, 1),  # one worker: a step waiting for the norm before a layer's keep
    ("horizontal", MIXED, 2, 2),
    ("horizontal", Placement.all_ssd(), 3, 1),
])
async def test_matches_clip_grad_norm_and_reports_its_norm(tmp_path, schedule, placement, micro, workers):
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(3, 2 * micro)
    norms: list[float] = []
    want, want_losses = reference(model, data, micro, max_norm=CLIPS, norms=norms)
    got, report, _ = await train(model, data, 3, micro_batches=micro, offload_dir=tmp_path, placement=placement,
                                 alpha=1.0, schedule=schedule, optimizer_workers=workers, io_threads=workers,
                                 optimizer=AdamW(max_grad_norm=CLIPS))
    assert_close_state(got, want)
    assert [s.loss for s in report.steps] == pytest.approx(want_losses, abs=1e-5)
    assert min(norms) > 3 * CLIPS  # clipped, every step
    assert [s.grad_norm for s in report.steps] == pytest.approx(norms, rel=1e-6)


@pytest.mark.asyncio
async def test_clipping_changes_the_weights_and_a_large_bound_changes_nothing(tmp_path):
    """The checks above can fail: unclipped weights differ; and a bound no norm reaches
    gives, bitwise, the weights of the same run without clipping (a coefficient of 1)."""
    model = tiny_gpt(n_layer=2, bias=False)
    data = batches(3, 4)
    kw = dict(micro_batches=2, placement=MIXED, alpha=1.0)
    plain, report, _ = await train(model, data, 3, offload_dir=tmp_path / "a", **kw)
    loose, loose_report, _ = await train(model, data, 3, offload_dir=tmp_path / "b", optimizer=AdamW(max_grad_norm=1e3),
                                         **kw)
    clipped, _, _ = await train(model, data, 3, offload_dir=tmp_path / "c", optimizer=AdamW(max_grad_norm=CLIPS), **kw)
    for k in plain:
        assert torch.equal(loose[k], plain[k]), k
    assert [s.grad_norm for s in report.steps] == [None] * 3
    assert all(s.grad_norm > 1 for s in loose_report.steps)
    with pytest.raises(AssertionError):
        assert_close_state(clipped, plain)


@pytest.mark.asyncio
async def test_parameters_without_a_gradient_are_left_and_the_rest_clipped(tmp_path):
    from tests.test_parity import _routed_batches, _routed_parts, _RoutedLM

    torch.manual_seed(0)
    model = _RoutedLM()
    data = _routed_batches()
    want, _ = reference(model, data, 2, max_norm=CLIPS)
    got, _, _ = await train(_routed_parts(model), data, 5, micro_batches=2, offload_dir=tmp_path, placement=MIXED,
                            alpha=1.0, optimizer=AdamW(max_grad_norm=CLIPS))
    assert_close_state(got, want)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_runs_and_checkpoints_in_between_go_on_bitwise(tmp_path, schedule):
    """The last iteration's steps wait for its coefficient into the next run, or a save (an
    evaluate) applies them with it: 2 steps, save, load into a new trainer and 2 more, and 1
    step, evaluate, 3 more in one trainer, give the weights of 4 straight."""
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(4, 4)
    kw = dict(micro_batches=2, placement=MIXED, alpha=1.0, schedule=schedule, optimizer=AdamW(max_grad_norm=CLIPS))
    straight, resumed, _, manifest = await straight_and_resumed(tmp_path, model, data, 2, 2, **kw)
    async with SnakeTrainer(model, data=data, config=SnakeConfig(offload_dir=tmp_path / "b", device="cpu", **kw)) as t:
        await t.run(1)
        await t.evaluate(data[:1])  # applies the pending steps with their coefficient, as state_dict does
        await t.run(3)
        twice = await t.state_dict()
    for k in straight:
        assert torch.equal(twice[k], straight[k]), k
        assert torch.equal(resumed[k], straight[k]), k
    assert_close_state(straight, reference(model, data, 2, max_norm=CLIPS)[0])
    assert manifest["config"]["optimizer"]["max_grad_norm"] == CLIPS


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha", [("vertical", 0.0), ("vertical", 0.3), ("horizontal", 0.3)])
async def test_an_infinite_bound_measures_the_norm_at_any_alpha_and_changes_nothing(tmp_path, schedule, alpha):
    """max_grad_norm=math.inf: each step reports the norm clip_grad_norm_ returns, at the
    alpha given (no clipping, so nothing waits for it), and the weights are bitwise those of
    the same run without it."""
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(3, 4)
    norms: list[float] = []
    reference(model, data, 2, max_norm=math.inf, norms=norms)
    kw = dict(micro_batches=2, placement=MIXED, alpha=alpha, schedule=schedule)
    plain, _, _ = await train(model, data, 3, offload_dir=tmp_path / "a", **kw)
    got, report, _ = await train(model, data, 3, offload_dir=tmp_path / "b", optimizer=AdamW(max_grad_norm=math.inf),
                                 **kw)
    assert [s.grad_norm for s in report.steps] == pytest.approx(norms, rel=1e-6)
    for k in plain:
        assert torch.equal(got[k], plain[k]), k


@pytest.mark.asyncio
async def test_an_infinite_bound_is_written_as_strict_json(tmp_path):
    def no_constant(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path / "off", placement=MIXED, device="cpu",
                      optimizer=AdamW(max_grad_norm=math.inf))
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(1, 4), config=cfg) as t:
        await t.run(1)
        await t.save(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text(), parse_constant=no_constant)
    assert manifest["config"]["optimizer"]["max_grad_norm"] == "inf"


@pytest.mark.asyncio
async def test_the_planner_picks_alpha_1_for_clipping(tmp_path):
    model = tiny_gpt(n_layer=2, bias=False)
    data = batches(2, 4)
    cfg = SnakeConfig(micro_batches=2, placement=MIXED, alpha=None, offload_dir=tmp_path, device="cpu",
                      optimizer=AdamW(max_grad_norm=CLIPS))
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        await asyncio.wait_for(t.run(2), 120)
        assert t.config.alpha == 1.0
        got = await t.state_dict()
    assert_close_state(got, reference(model, data, 2, max_norm=CLIPS)[0])


@pytest.mark.parametrize("make,field", [
    (lambda d: SnakeConfig(offload_dir=d, alpha=0.3, optimizer=AdamW(max_grad_norm=1.0)), "alpha=0.3 must be 1.0"),
    (lambda d: SnakeConfig(offload_dir=d, optimizer=AdamW(max_grad_norm=1.0)), "alpha=0.0 must be 1.0"),
    (lambda d: AdamW(max_grad_norm=0.0), "optimizer.max_grad_norm=0.0"),
    (lambda d: AdamW(max_grad_norm=-1), "optimizer.max_grad_norm=-1"),
    (lambda d: AdamW(max_grad_norm=math.nan), "optimizer.max_grad_norm=nan"),
    (lambda d: AdamW(max_grad_norm=True), "optimizer.max_grad_norm=True"),
])
def test_bad_settings_are_refused_naming_the_field(tmp_path, make, field):
    with pytest.raises(ConfigError) as err:
        make(tmp_path)
    assert str(err.value).startswith(field), str(err.value)


@pytest.mark.asyncio
@pytest.mark.parametrize("actor,nth", [("d2h", 4), ("compute", 9), ("optimizer[0]", 5), ("optimizer[1]", 5)])
async def test_a_fault_while_steps_wait_for_the_norm_fails_quickly(tmp_path, actor, nth):
    """An actor failing while others wait for the iteration's norm (the compute actor for
    the layers', the delayed steps for the coefficient): run() raises ActorFailed naming it
    within seconds, and nothing is left behind."""
    model = tiny_gpt(n_layer=3, bias=False)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=MIXED, alpha=1.0, device="cpu",
                      stall_timeout_s=1.0, optimizer=AdamW(max_grad_norm=CLIPS))
    before = len(_snake_threads())
    async with SnakeTrainer(model, data=batches(8, 4), config=cfg) as t:
        await t.run(1)
        t.engine.fault_hook = ActorFaults(fail={actor: nth})
        t0 = time.monotonic()
        with pytest.raises(ActorFailed) as err:
            await asyncio.wait_for(t.run(4), 30)
        assert time.monotonic() - t0 < 5
    assert err.value.actor == actor and "injected fault" in str(err.value)
    assert len(_snake_threads()) <= before and not _bin_fds()


@pytest.mark.asyncio
@pytest.mark.parametrize("waits,why", [
    (dict(optimizer=AdamW(max_grad_norm=1.0)), "clipping"),
    (dict(dtype="float16", loss_scale=DynamicLossScale()), "a dynamic loss_scale"),
])
async def test_a_placement_that_cannot_hold_the_gradients_names_clipping(tmp_path, waits, why):
    """Over the memory budget, the error says how much of the need is the gradients that
    clipping (or a dynamic loss scale) holds (vertical keeps each layer's fp32 gradient until
    its step at alpha = 1), and nothing starts."""
    from planner.profile import shape_of_parts
    from snake.adapters import describe
    from snake.memory import fmt_size, placement_bytes

    model = tiny_gpt(n_layer=8, n_embd=256)
    in_memory = Placement(param=0.0, ckpt=0.0, opt=0.0, grad=1.0)  # all on SSD but the waiting gradients
    cfg = SnakeConfig(micro_batches=2, placement=in_memory, alpha=1.0, offload_dir=tmp_path, device="cpu", **waits)
    need = {g: placement_bytes(shape_of_parts(describe(model), 2, 16, cfg.dtype),
                               n_micro=2, alpha=1.0, schedule="vertical", workers=2, param=0.0, ckpt=0.0, opt=0.0,
                               grad=g, device_type="cpu") for g in (0.0, 1.0)}
    cfg = dataclasses.replace(cfg, cpu_memory_bytes=int(sum(need.values()) / 2))
    async with SnakeTrainer(model, data=batches(2, 4), config=cfg) as t:
        with pytest.raises(ConfigError, match=why + r" \(optimizer.max_grad_norm\) holds|" + why + " holds") as err:
            await t.run(1)
        assert t.engine is None
    held = 4 * sum(p.numel() for p in model.blocks.parameters())  # every layer's gradient, fp32
    assert f"fp32 gradient until its step, {fmt_size(held)} of the need" in str(err.value)
    assert "a smaller placement.grad (now 1) puts more of them on SSD" in str(err.value)
    # the fix it names: the same budget holds them on SSD
    cfg = dataclasses.replace(cfg, placement=Placement.all_ssd(), offload_dir=tmp_path / "b")
    async with SnakeTrainer(model, data=batches(2, 4), config=cfg) as t:
        await asyncio.wait_for(t.run(1), 120)
