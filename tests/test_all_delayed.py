"""alpha = 1: every element of every layer is stepped in the delayed step (no now-step
elements), so every step can wait for the whole iteration's gradient. Training is still
plain PyTorch, resumes bit-exactly, and the planner and memory model take it."""

import asyncio
import itertools

import pytest

from planner.solve import Plan, predict, solve
from snake import Placement, SnakeConfig, SnakeTrainer
from snake.engine import _split_parts
from snake.memory import placement_bytes
from tests.helpers import (
    KindsLM,
    assert_close_state,
    batches,
    kinds_parts,
    reference,
    tiny_gpt,
    train,
)
from tests.planner.conftest import synthetic_profile
from tests.test_checkpoint import resumed_as_straight

PL = {"cpu": Placement.all_cpu(), "ssd": Placement.all_ssd(), "mixed": Placement(param=0.5, ckpt=0.3, opt=0.6)}


@pytest.mark.asyncio
@pytest.mark.parametrize("micro,schedule,placement", list(itertools.product([1, 3], ["vertical", "horizontal"], PL)))
async def test_matches_plain_pytorch_with_every_step_delayed(tmp_path, micro, schedule, placement):
    model = tiny_gpt(n_layer=4, bias=False)
    data = batches(3, 2 * micro)
    want, _ = reference(model, data, micro)
    cfg = SnakeConfig(device="cpu", micro_batches=micro, offload_dir=tmp_path, placement=PL[placement], alpha=1.0,
                      schedule=schedule)
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(3), 120)
        e = trainer.engine
        assert e is not None
        # no now part: no unit of it, and no AdamW at the end of a layer's backward
        assert all(n_now == 0 for n_now, _ in e.layer_parts)
        assert not any(e.stores[kind].units.get((layer, 0)) for kind in ("param", "opt") for layer in range(e.N))
        assert not [s for s in trainer.trace.spans if s.name.startswith("adamw") and s.name.endswith("now")]
        got = await trainer.state_dict()
    assert_close_state(got, want)


def test_alpha_1_delays_every_element_of_every_layer():
    """Even of a one-element layer (which no alpha < 1 splits); an alpha just below 1
    still leaves each layer a now element."""
    assert _split_parts([100, 1000], 1.0) == [(0, 100), (0, 1000)]
    assert _split_parts([1, 1000], 1.0) == [(0, 1), (0, 1000)]
    assert _split_parts([100, 1000], 0.99999) == [(1, 99), (1, 999)]


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_layers_of_several_kinds(tmp_path, schedule):
    model = KindsLM()
    data = batches(3, 4)
    want, _ = reference(model, data, 2)
    got, _, _ = await train(kinds_parts(model), data, 3, offload_dir=tmp_path / "off", micro_batches=2,
                            placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=1.0, schedule=schedule)
    assert_close_state(got, want)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_resume_is_bitwise_identical_at_alpha_1(tmp_path, schedule):
    """As tests/test_checkpoint.py's resume test: saving flushes the pending delayed steps
    (here every element's), and the resumed run is bitwise the uninterrupted one."""

    async def body():
        consumed = await resumed_as_straight(tmp_path, batches(4, 4), tmp_path / "ckpt", schedule=schedule, alpha=1.0)
        assert consumed == 4

    await asyncio.wait_for(body(), 240)


@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
def test_planner_and_memory_model_take_alpha_1(schedule):
    p = synthetic_profile()
    kw = dict(n_micro=4, schedule=schedule, workers=2)
    plan = solve(p, alpha=1.0, **kw)
    assert isinstance(plan, Plan) and plan.alpha == 1.0
    assert predict(p, 4, plan.placement, 1.0, schedule) == pytest.approx(plan.predicted_iteration_seconds)
    at = dict(param=0.5, ckpt=0.5, opt=0.5, device_type="cuda")
    # vertical: the whole fp32 gradient of every layer waits for its delayed step
    extra = p.shape.n_layers * p.shape.layer_params * (4 - 0.5 * p.shape.dtype_bytes) / 2
    more = placement_bytes(p.shape, alpha=1.0, **kw, **at) - placement_bytes(p.shape, alpha=0.5, **kw, **at)
    assert more == pytest.approx(extra if schedule == "vertical" else 0.0)


@pytest.mark.asyncio
async def test_the_trainer_plans_a_placement_at_alpha_1(tmp_path):
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(2, 4)
    cfg = SnakeConfig(micro_batches=2, placement=None, alpha=1.0, offload_dir=tmp_path, device="cpu")
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(2), 120)
        assert trainer.config.alpha == 1.0 and trainer.config.placement is not None
        got = await trainer.state_dict()
    assert_close_state(got, reference(model, data, 2)[0])
