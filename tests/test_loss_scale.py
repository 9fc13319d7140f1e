"""float16's dynamic loss scale (`SnakeConfig(loss_scale=DynamicLossScale(...))`, snake.scaler):
the weights, skipped steps and scales of plain PyTorch with torch.amp.GradScaler for both
schedules, several placements and the resident state on SSD; every step skipped leaves
the weights as they were; a checkpoint carries the scale; the scale's update is torch's."""

import asyncio
import random

import pytest
import torch

from snake import ConfigError, DynamicLossScale, Placement, SnakeConfig, SnakeTrainer
from snake.scaler import LossScaler
from tests.helpers import batches, mixed_reference, straight_and_resumed, tiny_gpt, train

MIXED = Placement(param=0.5, ckpt=0.3, opt=0.6)
# here the scaled gradients overflow float16 from a scale of 2**20 on: three skipped steps,
# two taken, growth (interval 2) into a fourth skipped one, and so on
OVERFLOWS = DynamicLossScale(init_scale=2.0**22, growth_interval=2)


def fp16_gpt(n_layer: int = 2) -> torch.nn.Module:
    """The tiny GPT in float16 with its head untied: autograd sums a tied weight's two
    gradients in float16, snake in fp32 (README), which would hide what is tested here."""
    model = tiny_gpt(n_layer=n_layer, bias=False)
    model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
    return model.to(torch.float16)


def grad_scaler(cfg: DynamicLossScale) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=cfg.init_scale, growth_factor=cfg.growth_factor,
                                backoff_factor=cfg.backoff_factor, growth_interval=cfg.growth_interval)


def assert_masters(got: dict, want: dict) -> None:
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,placement,workers,resident", [
    ("vertical", MIXED, 2, "cpu"),
    ("vertical", Placement.all_ssd(), 1, "ssd"),
    ("horizontal", MIXED, 2, "cpu"),
])
async def test_matches_grad_scaler_and_skips_the_same_steps(tmp_path, schedule, placement, workers, resident):
    model = fp16_gpt()
    data = batches(6, 4)
    scales: list[tuple[float, bool]] = []
    want = mixed_reference(model, data, 2, scaler=grad_scaler(OVERFLOWS), scales=scales, fused=True)
    # the run takes and skips steps, and its last one is skipped: state_dict() applies it
    assert any(s for _, s in scales) and not all(s for _, s in scales) and scales[-1][1]
    got, report, _ = await train(model, data, 6, micro_batches=2, offload_dir=tmp_path, placement=placement,
                                 alpha=1.0, schedule=schedule, dtype="float16", loss_scale=OVERFLOWS,
                                 optimizer_workers=workers, io_threads=workers, resident_optimizer=resident)
    assert [(s.loss_scale, s.skipped) for s in report.steps] == scales
    assert all((s.grad_norm != s.grad_norm or s.grad_norm == float("inf")) == s.skipped for s in report.steps)
    assert_masters(got, want)


@pytest.mark.asyncio
@pytest.mark.parametrize("alpha,placement", [(0.0, Placement(param=1.0, ckpt=1.0, opt=1.0)), (0.5, MIXED), (1.0, MIXED)])
async def test_a_static_scale_that_overflows_fails_the_run_before_any_step(tmp_path, monkeypatch, alpha, placement):
    """At a static scale an overflowed gradient would go into the weights as inf or nan
    (plain PyTorch with a fixed scale takes that step). snake checks each step's gradient
    first and fails the run naming the fix: at alpha 0 a layer's step during the backward
    finds it, at alpha 1 the resident step at the iteration's end or, where the embedding's
    and head's gradients came out finite, the next iteration's delayed step of a layer; the
    message names the iteration the gradient is of. AdamW never saw a
    gradient that is not finite (a spy on its calls)."""
    import snake.actors.optimizer
    import snake.resident
    from snake import ActorFailed, GradientOverflow

    stepped: list[bool] = []  # per AdamW call: were all its gradients finite

    def spy(real):
        def step(params, grads, *a, **k):
            stepped.append(all(bool(g.isfinite().all()) for g in grads))
            return real(params, grads, *a, **k)
        return step

    for module in (snake.actors.optimizer, snake.resident):
        monkeypatch.setattr(module, "adamw_step", spy(module.adamw_step))
    model = fp16_gpt()
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=placement, alpha=alpha, device="cpu",
                      dtype="float16", loss_scale=OVERFLOWS.init_scale)
    trainer = SnakeTrainer(model, data=batches(3, 4), config=cfg)
    try:
        with pytest.raises(ActorFailed) as err:
            await asyncio.wait_for(trainer.run(3), timeout=120)
        cause = err.value.__cause__
        assert isinstance(cause, GradientOverflow)
        assert "loss_scale=4194304" in str(cause) and "DynamicLossScale()" in str(cause) and "iteration 0" in str(cause)
        assert all(stepped)
    finally:
        await trainer.close()


@pytest.mark.asyncio
async def test_skipping_changes_the_weights_as_torch_does(tmp_path, monkeypatch):
    """The checks above can fail: with the overflowed steps taken (a static scale, its
    overflow check turned off here) the weights are not finite; with GradScaler's skips
    they are the model's own, bitwise."""
    from snake.kernels import Kernels

    model = fp16_gpt()
    data = batches(3, 4)
    kw = dict(micro_batches=2, placement=MIXED, alpha=1.0, dtype="float16")
    dynamic, report, _ = await train(model, data, 3, offload_dir=tmp_path / "b", loss_scale=OVERFLOWS, **kw)
    assert [s.skipped for s in report.steps] == [True, True, True]
    assert all(torch.equal(dynamic[k], v.float()) for k, v in model.state_dict().items())
    monkeypatch.setattr(Kernels, "check_finite", lambda *a, **k: None)
    static, _, _ = await train(model, data, 3, offload_dir=tmp_path / "a", loss_scale=OVERFLOWS.init_scale, **kw)
    assert not all(bool(v.isfinite().all()) for v in static.values())
@pytest.mark.asyncio
async def test_a_checkpoint_carries_the_scale_and_resumes_bitwise(tmp_path):
    model = fp16_gpt()
    data = batches(6, 4)
    scales: list[tuple[float, bool]] = []
    mixed_reference(model, data, 2, scaler=grad_scaler(OVERFLOWS), scales=scales, fused=True)
    straight, resumed, report, manifest = await straight_and_resumed(
        tmp_path, model, data, 3, 3, micro_batches=2, placement=MIXED, alpha=1.0, dtype="float16",
        loss_scale=OVERFLOWS)
    assert manifest["loss_scale"] == {"scale": 2.0**19, "growth_tracker": 0}
    assert manifest["config"]["loss_scale"]["init_scale"] == 2.0**22
    assert all(c >= 3 for c in manifest["missed_steps"].values())  # three steps skipped, every parameter
    assert [(s.loss_scale, s.skipped) for s in report.steps] == scales[3:]
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_the_scale_is_updated_as_torch_updates_it():
    """LossScaler.update against torch's own kernel (what GradScaler.update runs), with
    factors that are not powers of two, growth past float32's range, and a long run."""
    rng = random.Random(0)
    for cfg in (DynamicLossScale(), DynamicLossScale(init_scale=3.3, growth_factor=1.7, backoff_factor=0.3,
                                                     growth_interval=3),
                DynamicLossScale(init_scale=2.0**126, growth_factor=3.0, growth_interval=1)):
        ours = LossScaler(cfg)
        scale = torch.full((), cfg.init_scale, dtype=torch.float32)
        tracker = torch.zeros((), dtype=torch.int32)
        for _ in range(300):
            found = rng.random() < 0.3 if cfg.growth_interval > 1 else False
            torch._amp_update_scale_(scale, tracker, torch.full((), float(found)), cfg.growth_factor,
                                     cfg.backoff_factor, cfg.growth_interval)
            ours.update(found)
            assert (ours.scale, ours.growth_tracker) == (scale.item(), tracker.item())


@pytest.mark.parametrize("make,says", [
    (lambda d: DynamicLossScale(init_scale=0.0), "loss_scale.init_scale=0.0 must be a number float32 holds"),
    (lambda d: DynamicLossScale(init_scale=float("inf")), "loss_scale.init_scale=inf"),
    (lambda d: DynamicLossScale(growth_factor=1.0), "loss_scale.growth_factor=1.0 must be a finite number > 1"),
    (lambda d: DynamicLossScale(backoff_factor=1.0), "loss_scale.backoff_factor=1.0 must be in (0, 1)"),
    (lambda d: DynamicLossScale(growth_interval=0), "loss_scale.growth_interval=0 must be an integer >= 1"),
    (lambda d: DynamicLossScale(growth_interval=True), "loss_scale.growth_interval=True"),
    (lambda d: SnakeConfig(offload_dir=d, dtype="float16", loss_scale=DynamicLossScale()), "alpha=0.0 must be 1.0"),
    (lambda d: SnakeConfig(offload_dir=d, dtype="float16", alpha=0.5, loss_scale=DynamicLossScale()),
     "alpha=0.5 must be 1.0 (or None) with a dynamic loss_scale"),
    (lambda d: SnakeConfig(offload_dir=d, dtype="bfloat16", alpha=1.0, loss_scale=DynamicLossScale()),
     "loss_scale='DynamicLossScale(...)' is for float16 only"),
    (lambda d: SnakeConfig(offload_dir=d, dtype="float16", loss_scale="dynamic"), "loss_scale='dynamic' must be"),
])
def test_bad_settings_are_refused_naming_the_field(tmp_path, make, says):
    with pytest.raises(ConfigError) as err:
        make(tmp_path)
    assert str(err.value).startswith(says), str(err.value)


@pytest.mark.asyncio
async def test_evaluate_between_runs_applies_a_skipped_step_as_skipped(tmp_path):
    """evaluate() applies the pending delayed steps first (as save and state_dict do): an
    overflowed iteration's must stay skipped, and the next run go on as without it."""
    model = fp16_gpt()
    data = batches(6, 4)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path / "a", device="cpu", placement=MIXED, alpha=1.0,
                      dtype="float16", loss_scale=OVERFLOWS)
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        await asyncio.wait_for(t.run(3), 120)
        await t.evaluate(batches(1, 2, seed=5))
        await asyncio.wait_for(t.run(3), 120)
        got = await t.state_dict()
    plain, _, _ = await train(model, data, 6, micro_batches=2, offload_dir=tmp_path / "b", placement=MIXED,
                              alpha=1.0, dtype="float16", loss_scale=OVERFLOWS)
    assert all(torch.equal(got[k], plain[k]) for k in plain)
