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
async def test_skipping_changes_the_weights_as_torch_does(tmp_path):
    """The check above can fail: with the overflowed steps taken (a static scale; their
    gradients are not finite) the weights are not finite; with GradScaler's weights they are."""
    model = fp16_gpt()
    data = batches(3, 4)
    kw = dict(micro_batches=2, placement=MIXED, alpha=1.0, dtype="float16")
    static, _, _ = await train(model, data, 3, offload_dir=tmp_path / "a", loss_scale=OVERFLOWS.init_scale, **kw)
    assert not all(bool(v.isfinite().all()) for v in static.values())
    dynamic, report, _ = await train(model, data, 3, offload_dir=tmp_path / "b", loss_scale=OVERFLOWS, **kw)
    assert [s.skipped for s in report.steps] == [True, True, True]
    # every step skipped: the weights as the model had them, bitwise
    assert all(torch.equal(dynamic[k], v.float()) for k, v in model.state_dict().items())


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
    (lambda d: DynamicLossScale(init_scale=0.0), "loss_scale.init_scale=0.0 must be a finite number > 0"),
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
