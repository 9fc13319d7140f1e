"""Learning-rate schedules (`AdamW(lr_schedule=...)`, `snake.lr`): the weights of plain
PyTorch with `torch.optim.lr_scheduler.LambdaLR` for every schedule, placement and delay
ratio (a delayed share steps with its own iteration's rate), transformers' factors, the
rate in each step's report, resuming, and bad schedules refused before a run changes
anything."""

import asyncio
import math

import pytest
import torch

from snake import AdamW, ConfigError, Placement, SnakeConfig, SnakeTrainer
from snake.lr import WarmupConstant, WarmupCosine, WarmupLinear, describe
from tests.helpers import (
    STEEP,
    assert_close_state,
    batches,
    reference,
    schedule_alpha_placement,
    steep,
    straight_and_resumed,
    tiny_gpt,
    train,
)

MIXED = Placement(param=0.5, ckpt=0.3, opt=0.6)
@pytest.mark.parametrize("warmup", [0, 1, 4])
@pytest.mark.parametrize("total", [1, 7, 20])
def test_factors_are_transformers_own_within_the_schedule(warmup, total):
    from transformers.optimization import (
        _get_constant_schedule_with_warmup_lr_lambda,
        _get_cosine_schedule_with_warmup_lr_lambda,
        _get_linear_schedule_with_warmup_lr_lambda,
    )

    if warmup > total:
        return
    for i in range(total + 1):
        want = _get_cosine_schedule_with_warmup_lr_lambda(i, num_warmup_steps=warmup, num_training_steps=total,
                                                          num_cycles=0.5)
        assert WarmupCosine(total_steps=total, warmup_steps=warmup)(i) == want, i
        want = _get_cosine_schedule_with_warmup_lr_lambda(i, num_warmup_steps=warmup, num_training_steps=total,
                                                          num_cycles=0.5, min_lr_rate=0.1)
        assert WarmupCosine(total_steps=total, warmup_steps=warmup, min_ratio=0.1)(i) == want, i
        want = _get_linear_schedule_with_warmup_lr_lambda(i, num_warmup_steps=warmup, num_training_steps=total)
        assert WarmupLinear(total_steps=total, warmup_steps=warmup)(i) == want, i
        assert WarmupConstant(warmup_steps=warmup)(i) == _get_constant_schedule_with_warmup_lr_lambda(
            i, num_warmup_steps=warmup)


def test_after_total_steps_the_factor_stays_at_its_end():
    """transformers' cosine rises again after num_training_steps; ours stays at min_ratio."""
    cos = WarmupCosine(total_steps=10, warmup_steps=2, min_ratio=0.05)
    lin = WarmupLinear(total_steps=10, warmup_steps=2, min_ratio=0.05)
    assert [cos(i) for i in (10, 11, 15, 1000)] == pytest.approx([0.05] * 4, abs=1e-15)
    assert [lin(i) for i in (10, 11, 15, 1000)] == pytest.approx([0.05] * 4, abs=1e-15)
    assert WarmupLinear(total_steps=10)(30) == 0.0
    # the linear decay with a floor: half-way down at the middle
    assert lin(6) == pytest.approx(0.05 + 0.95 * 0.5)
    assert cos(1) == 0.5 and cos(2) == 1.0  # the warm-up from 0


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha,placement", schedule_alpha_placement())
async def test_matches_plain_pytorch_with_lambda_lr(tmp_path, schedule, alpha, placement):
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(5, 4)
    want, want_losses = reference(model, data, 2, lr_lambda=steep)
    got, report, _ = await train(model, data, 5, micro_batches=2, offload_dir=tmp_path, placement=placement,
                                 alpha=alpha, schedule=schedule, optimizer=AdamW(lr_schedule=steep))
    assert_close_state(got, want)
    assert [s.loss for s in report.steps] == pytest.approx(want_losses, abs=1e-5)
    assert [s.lr for s in report.steps] == [1e-3 * f for f in STEEP[:5]]


@pytest.mark.asyncio
async def test_the_schedule_changes_the_weights(tmp_path):
    """The check above would pass a trainer that ignored the schedule only if the schedule
    did nothing: it does."""
    model = tiny_gpt(n_layer=2, bias=False)
    data = batches(3, 4)
    constant, _ = reference(model, data, 2)
    got, _, _ = await train(model, data, 3, micro_batches=2, offload_dir=tmp_path, alpha=0.3,
                            optimizer=AdamW(lr_schedule=steep))
    with pytest.raises(AssertionError):
        assert_close_state(got, constant)


@pytest.mark.asyncio
async def test_resuming_goes_on_with_the_schedule_bitwise(tmp_path):
    """The rate follows the step count, which a checkpoint keeps: 2 steps, save, load into a
    new trainer and 3 more give the weights of 5 straight (the delayed share pending at the
    save stepped with the rate of its own iteration)."""
    model = tiny_gpt(n_layer=3, bias=False)
    cos = WarmupCosine(total_steps=5, warmup_steps=2)
    straight, resumed, report, manifest = await straight_and_resumed(
        tmp_path, model, batches(5, 4), 2, 3, micro_batches=2, placement=MIXED, alpha=0.3,
        optimizer=AdamW(lr=2e-3, lr_schedule=cos))
    assert [s.lr for s in report.steps] == [2e-3 * cos(i) for i in (2, 3, 4)]
    for k in straight:
        assert torch.equal(resumed[k], straight[k]), k
    assert manifest["config"]["optimizer"]["lr_schedule"] == {
        "kind": "cosine", "total_steps": 5, "warmup_steps": 2, "min_ratio": 0.0}


def test_describe_names_every_schedule():
    assert describe(None) is None
    assert describe(WarmupConstant(warmup_steps=3)) == {"kind": "constant", "warmup_steps": 3}
    assert describe(WarmupLinear(total_steps=9)) == {"kind": "linear", "total_steps": 9, "warmup_steps": 0,
                                                     "min_ratio": 0.0}
    assert describe(steep) == {"kind": "callable", "name": "steep"}


@pytest.mark.parametrize("make,field", [
    (lambda: AdamW(lr_schedule=0.5), "optimizer.lr_schedule"),
    (lambda: WarmupCosine(total_steps=0), "lr_schedule.total_steps"),
    (lambda: WarmupCosine(total_steps=5, warmup_steps=6), "lr_schedule.warmup_steps"),
    (lambda: WarmupLinear(total_steps=5, min_ratio=1.5), "lr_schedule.min_ratio"),
    (lambda: WarmupLinear(total_steps=5, min_ratio=math.nan), "lr_schedule.min_ratio"),
    (lambda: WarmupConstant(warmup_steps=-1), "lr_schedule.warmup_steps"),
    (lambda: WarmupConstant(warmup_steps=2.5), "lr_schedule.warmup_steps"),
])
def test_bad_schedules_are_refused_naming_the_field(make, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        make()


@pytest.mark.asyncio
@pytest.mark.parametrize("bad,match", [
    (lambda i: [1.0, 1.0, math.nan][i], "gives the rate nan at step index 2"),
    (lambda i: 1.0 - i, "gives the rate -0.001 at step index 2"),
    (lambda i: [1.0, 1.0][i], "raised IndexError: list index out of range at step index 2"),
    (lambda i: "fast", "raised TypeError"),
])
async def test_a_schedule_that_fails_within_a_run_is_refused_before_it(tmp_path, bad, match):
    """Every step's rate of a run is computed before it starts: a schedule that breaks at
    its third step refuses run(3) with nothing changed, and the trainer goes on."""
    model = tiny_gpt(n_layer=2, bias=False)
    data = batches(6, 4)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=MIXED, alpha=0.3, device="cpu",
                      optimizer=AdamW(lr_schedule=bad))
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        with pytest.raises(ConfigError, match="optimizer.lr_schedule") as err:
            await asyncio.wait_for(t.run(3), 60)
        assert match in str(err.value)
        assert t.engine is None  # nothing was set up
        if "TypeError" in match:  # fails at the first step already
            return
        report = await asyncio.wait_for(t.run(2), 60)  # its first two steps are fine
        with pytest.raises(ConfigError, match="at step index 2"):
            await t.run(1)
        got = await t.state_dict()
    assert len(report.steps) == 2
    want, _ = reference(model, data[:2], 2, lr_lambda=lambda i: bad(i) if i < 2 else 0.0)
    assert_close_state(got, want)
