"""Audit of feature interactions the per-feature parity tests check one at a time:
clipping, learning-rate schedules, parameters without weight decay, frozen layers, float16's
dynamic loss scale, delayed steps (alpha), placements on SSD, the resident state on SSD,
several micro-batches, both schedules, and runs split by run() / evaluate() / save() /
load() / state_dict() in between. Each case is compared with plain PyTorch (gradient
accumulation + torch.optim.AdamW, clip_grad_norm_, LambdaLR, GradScaler) within the
tolerance the per-feature tests use, and a split run with the uninterrupted one bitwise."""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
import torch

from snake import AdamW, DynamicLossScale, Placement, SnakeConfig, SnakeTrainer
from snake.lr import WarmupCosine
from tests.helpers import (
    STEEP,
    KindsLM,
    assert_close_state,
    batches,
    kinds_parts,
    mixed_reference,
    norms_and_position_table,
    reference,
    steep,
    tiny_gpt,
    train,
)

MIXED = Placement(param=0.5, ckpt=0.3, opt=0.6)
SSD_GRADS = Placement(param=0.5, ckpt=0.3, opt=0.6, grad=0.0)  # delayed gradients on SSD
CLIP = 0.3  # below every norm of these models: every step is clipped
WD = 0.5  # a weight decayed or not differs by far more than the tolerance
COS = WarmupCosine(total_steps=6, warmup_steps=2, min_ratio=0.1)


def cos(i: int) -> float:
    return COS(i)


LONG = (*STEEP, 0.7, 1.2)  # STEEP for runs of more than 5 steps (LambdaLR asks for index 6)


def steep8(i: int) -> float:
    return LONG[i]


def frozen_gpt(layers=(1,), n_layer: int = 3, **kw) -> torch.nn.Module:
    model = tiny_gpt(n_layer=n_layer, bias=False, **kw)
    for i in layers:
        for p in model.blocks[i].parameters():
            p.requires_grad_(False)
    return model


def assert_bitwise(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"differ bitwise: {bad[:6]} (max abs diff {max((got[k] - want[k]).abs().max().item() for k in bad)})"


def cfg(tmp_path, name: str, **kw) -> SnakeConfig:
    return SnakeConfig(offload_dir=tmp_path / name, device="cpu", **kw)


async def script(model, data, config: SnakeConfig, ops, held_out=None):
    """Run `ops` on one trainer: ints are run(n) steps, "eval" evaluates `held_out`, "state"
    takes a state_dict in between, ("save", dir) saves, ("data", batches) runs on other data.
    Returns (final state, the losses of every step, the reports' steps)."""
    steps = []
    async with SnakeTrainer(model, data=data, config=config) as t:
        for op in ops:
            if isinstance(op, int):
                report = await asyncio.wait_for(t.run(op), 120)
                steps += report.steps
            elif op == "eval":
                await asyncio.wait_for(t.evaluate(held_out), 120)
            elif op == "state":
                await t.state_dict()
            elif op[0] == "save":
                await t.save(op[1])
            elif op[0] == "data":
                report = await asyncio.wait_for(t.run(op[2], data=op[1]), 120)
                steps += report.steps
        state = await t.state_dict()
    return state, steps


async def resumed(model, data, tmp_path, cuts: list[int], **kw):
    """Train `cuts[0]` steps, save, load into a new trainer, `cuts[1]` more, save, ... ;
    return the final state and every step's report."""
    steps = []
    ckpt = None
    for j, n in enumerate(cuts):
        async with SnakeTrainer(copy.deepcopy(model), data=data, config=cfg(tmp_path, f"r{j}", **kw)) as t:
            if ckpt is not None:
                await t.load(ckpt)
            report = await asyncio.wait_for(t.run(n), 120)
            steps += report.steps
            ckpt = tmp_path / f"ckpt{j}"
            await t.save(ckpt)
            state = await t.state_dict()
    return state, steps


# --- clipping x schedules x placements x options against PyTorch --------------------------

@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,placement,resident,micro", [
    ("vertical", Placement.all_ssd(), "ssd", 3),
    ("horizontal", MIXED, "cpu", 2),
])
async def test_clip_lr_schedule_no_decay_on_ssd(tmp_path, schedule, placement, resident, micro):
    """Clipping (alpha 1) with a steep LambdaLR schedule and two weight-decay groups, the
    state (and the resident state) on SSD: torch's clip_grad_norm_ + AdamW + LambdaLR."""
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(5, 2 * micro)
    norms: list[float] = []
    want, want_losses = reference(model, data, micro, max_norm=CLIP, norms=norms, lr_lambda=steep, wd=WD,
                                  no_decay=norms_and_position_table)
    got, report, _ = await train(model, data, 5, micro_batches=micro, offload_dir=tmp_path, placement=placement,
                                 alpha=1.0, schedule=schedule, resident_optimizer=resident,
                                 optimizer=AdamW(max_grad_norm=CLIP, lr_schedule=steep, weight_decay=WD,
                                                 no_decay=norms_and_position_table))
    assert_close_state(got, want)
    assert [s.loss for s in report.steps] == pytest.approx(want_losses, abs=1e-5)
    assert [s.grad_norm for s in report.steps] == pytest.approx(norms, rel=1e-5)
    assert [s.lr for s in report.steps] == [1e-3 * f for f in STEEP[:5]]


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_frozen_layers_with_clip_no_decay_and_lr_schedule(tmp_path, schedule):
    """Frozen middle layer + the position table frozen + clipping + no_decay + a schedule."""
    model = frozen_gpt((1,))
    model.wpe.weight.requires_grad_(False)
    data = batches(4, 6)
    norms: list[float] = []
    want, _ = reference(model, data, 3, max_norm=CLIP, norms=norms, lr_lambda=steep, wd=WD,
                        no_decay=norms_and_position_table)
    got, report, _ = await train(model, data, 4, micro_batches=3, offload_dir=tmp_path, placement=MIXED, alpha=1.0,
                                 schedule=schedule,
                                 optimizer=AdamW(max_grad_norm=CLIP, lr_schedule=steep, weight_decay=WD,
                                                 no_decay=norms_and_position_table))
    assert_close_state(got, want)
    assert [s.grad_norm for s in report.steps] == pytest.approx(norms, rel=1e-5)
    for k, v in model.state_dict().items():
        if k.startswith("blocks.1.") or k == "wpe.weight":
            assert torch.equal(got[k], v), k


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha", [("vertical", 0.3)])
async def test_frozen_layers_with_no_decay_and_lr_schedule_at_alpha(tmp_path, schedule, alpha):
    model = frozen_gpt((0, 2), n_layer=4)
    data = batches(4, 6)
    want, _ = reference(model, data, 3, lr_lambda=steep, wd=WD, no_decay=norms_and_position_table)
    got, _, _ = await train(model, data, 4, micro_batches=3, offload_dir=tmp_path, placement=Placement.all_ssd(),
                            alpha=alpha, schedule=schedule,
                            optimizer=AdamW(lr_schedule=steep, weight_decay=WD, no_decay=norms_and_position_table))
    assert_close_state(got, want)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha,opt", [
    ("vertical", 0.3, "lr+nodecay"), ("horizontal", 1.0, "clip+lr+nodecay"),
])
async def test_missed_steps_with_options(tmp_path, schedule, alpha, opt):
    """Parameters without a gradient in some iterations (AdamW leaves them and counts its
    own steps) together with a schedule, no_decay groups and clipping."""
    from tests.test_parity import _routed_batches, _routed_parts, _RoutedLM

    torch.manual_seed(0)
    model = _RoutedLM()
    data = _routed_batches()
    nd = lambda n, p: p.dim() < 2  # noqa: E731
    clip = CLIP if "clip" in opt else None
    want, _ = reference(model, data, 2, lr_lambda=steep, wd=WD, no_decay=nd, max_norm=clip)
    got, _, _ = await train(_routed_parts(copy.deepcopy(model)), data, 5, micro_batches=2, offload_dir=tmp_path,
                            placement=Placement.all_ssd(), alpha=alpha, schedule=schedule,
                            optimizer=AdamW(lr_schedule=steep, weight_decay=WD, no_decay=nd, max_grad_norm=clip))
    assert_close_state(got, want)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha", [("vertical", 0.3), ("horizontal", 1.0)])
async def test_layers_of_several_kinds_with_every_option(tmp_path, schedule, alpha):
    model = KindsLM()
    data = batches(4, 4)
    nd = lambda n, p: p.dim() < 2  # noqa: E731
    clip = CLIP if alpha == 1.0 else None
    want, _ = reference(model, data, 2, lr_lambda=steep, wd=WD, no_decay=nd, max_norm=clip)
    got, _, _ = await train(kinds_parts(copy.deepcopy(model)), data, 4, micro_batches=2, offload_dir=tmp_path,
                            placement=Placement.all_ssd(), alpha=alpha, schedule=schedule, resident_optimizer="ssd",
                            optimizer=AdamW(lr_schedule=steep, weight_decay=WD, no_decay=nd, max_grad_norm=clip))
    assert_close_state(got, want)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha", [("vertical", 0.3)])
async def test_infinite_bound_with_lr_and_no_decay_changes_nothing(tmp_path, schedule, alpha):
    """max_grad_norm=inf only measures: bitwise the same run without it, with a schedule
    and two groups at a delay ratio that is not 1."""
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(3, 4)
    norms: list[float] = []
    reference(model, data, 2, max_norm=math.inf, norms=norms)
    kw = dict(micro_batches=2, placement=MIXED, alpha=alpha, schedule=schedule)
    opt = dict(lr_schedule=steep, weight_decay=WD, no_decay=norms_and_position_table)
    plain, _, _ = await train(model, data, 3, offload_dir=tmp_path / "a", optimizer=AdamW(**opt), **kw)
    got, report, _ = await train(model, data, 3, offload_dir=tmp_path / "b",
                                 optimizer=AdamW(max_grad_norm=math.inf, **opt), **kw)
    assert_bitwise(got, plain)
    assert report.steps[0].grad_norm == pytest.approx(norms[0], rel=1e-5)


# --- float16's dynamic loss scale combined --------------------------------------------------

def _fp16():
    from tests.test_loss_scale import OVERFLOWS, fp16_gpt, grad_scaler
    return OVERFLOWS, fp16_gpt, grad_scaler


def assert_masters(got: dict, want: dict, rtol: float = 0.0) -> None:
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=rtol, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,placement,resident", [
    ("vertical", Placement.all_ssd(), "ssd"),
    ("horizontal", SSD_GRADS, "cpu"),
])
async def test_dynamic_scale_with_clip_lr_schedule_and_no_decay(tmp_path, schedule, placement, resident):
    """float16, a scale that overflows (skipped steps), clipping of the unscaled gradients,
    a schedule that still counts skipped iterations, two groups: GradScaler + clip +
    LambdaLR's weights, skips and scales."""
    overflows, fp16_gpt, grad_scaler = _fp16()
    model = fp16_gpt(n_layer=3)
    data = batches(6, 4)
    scales: list[tuple[float, bool]] = []
    want = mixed_reference(model, data, 2, scaler=grad_scaler(overflows), scales=scales, fused=True,
                           max_norm=CLIP, lr_lambda=steep8, wd=WD, no_decay=norms_and_position_table)
    assert any(s for _, s in scales) and not all(s for _, s in scales)
    got, report, _ = await train(model, data, 6, micro_batches=2, offload_dir=tmp_path, placement=placement, alpha=1.0,
                                 schedule=schedule, dtype="float16", loss_scale=overflows, resident_optimizer=resident,
                                 optimizer=AdamW(max_grad_norm=CLIP, lr_schedule=steep8, weight_decay=WD,
                                                 no_decay=norms_and_position_table))
    assert [(s.loss_scale, s.skipped) for s in report.steps] == scales
    assert [s.lr for s in report.steps] == [1e-3 * f for f in STEEP]
    assert_masters(got, want, rtol=1e-5)


@pytest.mark.asyncio
async def test_dynamic_scale_with_frozen_layer_and_lr(tmp_path):
    """float16 dynamic scale + a frozen middle layer + a schedule, vertical, all on SSD."""
    overflows, fp16_gpt, grad_scaler = _fp16()
    model = fp16_gpt(n_layer=3)
    for p in model.blocks[1].parameters():
        p.requires_grad_(False)
    data = batches(6, 4)
    scales: list[tuple[float, bool]] = []
    want = mixed_reference(model, data, 2, scaler=grad_scaler(overflows), scales=scales, fused=True, lr_lambda=steep8)
    got, report, _ = await train(model, data, 6, micro_batches=2, offload_dir=tmp_path, placement=Placement.all_ssd(),
                                 alpha=1.0, dtype="float16", loss_scale=overflows,
                                 optimizer=AdamW(lr_schedule=steep8))
    assert [(s.loss_scale, s.skipped) for s in report.steps] == scales
    assert_masters(got, want)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_dynamic_scale_clip_lr_split_runs_eval_and_resume_bitwise(tmp_path, schedule):
    """The float16 dynamic scale with clipping and a schedule: run(1) run(2) eval run(3) in
    one trainer, and 2 + 2 + 2 steps through two checkpoints, give run(6)'s weights
    bitwise (the skipped and taken steps pending at each cut)."""
    overflows, fp16_gpt, _ = _fp16()
    model = fp16_gpt(n_layer=2)
    data = batches(6, 4)
    kw = dict(micro_batches=2, placement=MIXED, alpha=1.0, schedule=schedule, dtype="float16", loss_scale=overflows,
              optimizer=AdamW(max_grad_norm=CLIP, lr_schedule=steep, weight_decay=WD,
                              no_decay=norms_and_position_table))
    straight, s_steps = await script(copy.deepcopy(model), data, cfg(tmp_path, "a", **kw), [6])
    split, p_steps = await script(copy.deepcopy(model), data, cfg(tmp_path, "b", **kw), [1, 2, "eval", 3],
                                  held_out=batches(1, 2, seed=7))
    res, r_steps = await resumed(model, data, tmp_path, [2, 2, 2], **kw)
    want = [(s.loss_scale, s.skipped) for s in s_steps]
    assert [(s.loss_scale, s.skipped) for s in p_steps] == want
    assert [(s.loss_scale, s.skipped) for s in r_steps] == want
    assert_bitwise(split, straight)
    assert_bitwise(res, straight)


@pytest.mark.asyncio
async def test_static_fp16_scale_with_alpha_lr_and_no_decay(tmp_path):
    """float16 at a fixed loss scale (the default 1024, which never overflows here) at alpha
    0.3 with a schedule and two groups: GradScaler at 1024 that never grows nor skips."""
    _, fp16_gpt, _ = _fp16()
    model = fp16_gpt(n_layer=3)
    data = batches(4, 4)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**6)
    scales: list[tuple[float, bool]] = []
    want = mixed_reference(model, data, 2, scaler=scaler, scales=scales, fused=True, lr_lambda=steep, wd=WD,
                           no_decay=norms_and_position_table)
    assert not any(s for _, s in scales)
    got, _, _ = await train(model, data, 4, micro_batches=2, offload_dir=tmp_path, placement=MIXED, alpha=0.3,
                            dtype="float16", loss_scale=1024.0,
                            optimizer=AdamW(lr_schedule=steep, weight_decay=WD, no_decay=norms_and_position_table))
    assert_masters(got, want)


# --- bf16 with options combined ------------------------------------------------------------

@pytest.mark.asyncio
@pytest.mark.parametrize("alpha,clip", [(0.3, None), (1.0, CLIP)])
async def test_bf16_with_frozen_layer_lr_no_decay_and_clip(tmp_path, alpha, clip):
    """A bf16 model with fp32 gates (held on the device) and its first layer frozen, a
    schedule, two groups, and clipping at alpha 1: plain mixed precision's masters."""
    from tests.test_parity import _gated_model, _gated_parts

    model = _gated_model()
    model.layers[0].experts.requires_grad_(False)
    data = batches(4, 4)
    nd = lambda n, p: p.dim() < 2  # noqa: E731
    want = mixed_reference(model, data, 2, lr_lambda=steep, wd=WD, no_decay=nd, max_norm=clip)
    got, _, _ = await train(_gated_parts(model), data, 4, micro_batches=2, offload_dir=tmp_path,
                            placement=Placement(param=0.5, ckpt=0.3, opt=0.6, grad=0.3), alpha=alpha, dtype="bfloat16",
                            optimizer=AdamW(lr_schedule=steep, weight_decay=WD, no_decay=nd, max_grad_norm=clip))
    assert_close_state({k: got[k] for k in want}, want, rtol=1e-5 if clip else 0, atol=1e-6)


# --- runs split by run() / evaluate() / save() / state_dict() ----------------------------

SPLITS = [
    ("vertical", 0.3, MIXED, dict(lr_schedule=cos, weight_decay=WD, no_decay=norms_and_position_table)),
    ("horizontal", 0.3, Placement.all_ssd(), dict(lr_schedule=cos, weight_decay=WD)),
    ("vertical", 1.0, SSD_GRADS, dict(lr_schedule=cos, max_grad_norm=CLIP, weight_decay=WD,
                                      no_decay=norms_and_position_table)),
    ("horizontal", 1.0, MIXED, dict(lr_schedule=cos, max_grad_norm=CLIP)),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha,placement,opt", [SPLITS[0], SPLITS[3]])
async def test_runs_of_1_2_3_with_eval_and_state_dict_between_are_run_6(tmp_path, schedule, alpha, placement, opt):
    """run(1), evaluate, run(2), state_dict, run(3) == run(6) bitwise, with dropout (whose
    generator the evaluation must not advance), a warm-up + cosine schedule, and PyTorch's
    weights without dropout (checked on a dropout-free model)."""
    data = batches(6, 6)
    kw = dict(micro_batches=3, placement=placement, alpha=alpha, schedule=schedule, optimizer=AdamW(**opt))
    held = batches(2, 3, seed=9)
    straight, s_steps = await script(tiny_gpt(n_layer=3, bias=False, dropout=0.1), data, cfg(tmp_path, "a", **kw), [6])
    split, p_steps = await script(tiny_gpt(n_layer=3, bias=False, dropout=0.1), data, cfg(tmp_path, "b", **kw),
                                  [1, "eval", 2, "state", 3], held_out=held)
    assert [s.loss for s in p_steps] == [s.loss for s in s_steps]
    assert [s.lr for s in p_steps] == [1e-3 * cos(i) for i in range(6)]
    assert_bitwise(split, straight)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha,placement,opt", [SPLITS[1], SPLITS[2]])
async def test_resumed_twice_with_dropout_is_one_run(tmp_path, schedule, alpha, placement, opt):
    """1 + 3 + 2 steps through two checkpoints (mid warm-up, mid cosine) == 6 straight,
    bitwise, with dropout, clipping or delayed steps pending at each save."""
    data = batches(6, 6)
    kw = dict(micro_batches=3, placement=placement, alpha=alpha, schedule=schedule, optimizer=AdamW(**opt))
    model = tiny_gpt(n_layer=3, bias=False, dropout=0.1)
    straight, s_steps = await script(copy.deepcopy(model), data, cfg(tmp_path, "a", **kw), [6])
    res, r_steps = await resumed(model, data, tmp_path, [1, 3, 2], **kw)
    assert [s.loss for s in r_steps] == [s.loss for s in s_steps]
    assert_bitwise(res, straight)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha,placement,opt", [SPLITS[0], SPLITS[3]])
async def test_save_mid_run_then_go_on_in_the_same_trainer(tmp_path, schedule, alpha, placement, opt):
    """run(2), save, run(2), save, run(2) in one trainer == run(6) (the save applies the
    pending delayed steps; the run after it must go on as without it)."""
    data = batches(6, 4)
    kw = dict(micro_batches=2, placement=placement, alpha=alpha, schedule=schedule, optimizer=AdamW(**opt))
    model = tiny_gpt(n_layer=3, bias=False)
    straight, _ = await script(copy.deepcopy(model), data, cfg(tmp_path, "a", **kw), [6])
    saved, _ = await script(copy.deepcopy(model), data, cfg(tmp_path, "b", **kw),
                            [2, ("save", tmp_path / "c1"), 2, ("save", tmp_path / "c2"), 2])
    assert_bitwise(saved, straight)
    # and the first checkpoint, loaded, goes on to the same weights
    res_data = data
    async with SnakeTrainer(copy.deepcopy(model), data=res_data, config=cfg(tmp_path, "d", **kw)) as t:
        await t.load(tmp_path / "c1")
        await t.run(4)
        got = await t.state_dict()
    assert_bitwise(got, straight)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha,opt", [
    ("vertical", 0.3, dict(lr_schedule=steep, weight_decay=WD, no_decay=norms_and_position_table)),
    ("horizontal", 1.0, dict(lr_schedule=steep, max_grad_norm=CLIP)),
])
async def test_run_on_other_data_between_runs_matches_pytorch(tmp_path, schedule, alpha, opt):
    """run(2) on A, run(data=B) for 3 more: the schedule's step count goes on across the
    data change; PyTorch's weights over A[:2] + B."""
    a, b = batches(4, 4, seed=1), batches(3, 4, seed=2)
    model = tiny_gpt(n_layer=3, bias=False)
    ref_kw = dict(lr_lambda=steep, wd=opt.get("weight_decay", 0.01), no_decay=opt.get("no_decay"),
                  max_norm=opt.get("max_grad_norm"))
    want, _ = reference(model, a[:2] + b, 2, **ref_kw)
    kw = dict(micro_batches=2, placement=MIXED, alpha=alpha, schedule=schedule, optimizer=AdamW(**opt))
    got, steps = await script(copy.deepcopy(model), a, cfg(tmp_path, "a", **kw), [2, ("data", b, 3)])
    assert [s.lr for s in steps] == [1e-3 * f for f in STEEP[:5]]
    assert_close_state(got, want)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical"])
async def test_resume_with_frozen_no_decay_clip_and_lr_matches_pytorch(tmp_path, schedule):
    """Frozen layer + no_decay + clipping + cosine, resumed at 2 and 4 of 6: PyTorch's
    weights (and bitwise the straight run's)."""
    model = frozen_gpt((1,))
    data = batches(6, 6)
    opt = AdamW(lr_schedule=cos, max_grad_norm=CLIP, weight_decay=WD, no_decay=norms_and_position_table)
    kw = dict(micro_batches=3, placement=Placement.all_ssd(), alpha=1.0, schedule=schedule, optimizer=opt,
              resident_optimizer="ssd")
    want, _ = reference(model, data, 3, lr_lambda=cos, max_norm=CLIP, wd=WD, no_decay=norms_and_position_table)
    res, steps = await resumed(model, data, tmp_path, [2, 2, 2], **kw)
    assert_close_state(res, want)
    straight, _ = await script(copy.deepcopy(model), data, cfg(tmp_path, "s", **kw), [6])
    assert_bitwise(res, straight)


@pytest.mark.asyncio
async def test_missed_steps_resume_with_clip_lr_and_no_decay(tmp_path):
    """The routed model's missed steps across a checkpoint, with clipping, a schedule and
    two groups: PyTorch's weights."""
    from tests.test_parity import _routed_batches, _routed_parts, _RoutedLM

    torch.manual_seed(0)
    model = _RoutedLM()
    data = _routed_batches()
    nd = lambda n, p: p.dim() < 2  # noqa: E731
    want, _ = reference(model, data, 2, lr_lambda=steep, wd=WD, no_decay=nd, max_norm=CLIP)
    kw = dict(micro_batches=2, placement=SSD_GRADS, alpha=1.0,
              optimizer=AdamW(lr_schedule=steep, weight_decay=WD, no_decay=nd, max_grad_norm=CLIP))
    state = None
    for j, n in enumerate((2, 3)):
        async with SnakeTrainer(_routed_parts(copy.deepcopy(model)), data=data, config=cfg(tmp_path, f"r{j}", **kw)) as t:
            if j:
                await t.load(tmp_path / "ckpt")
            await asyncio.wait_for(t.run(n), 120)
            if not j:
                await t.save(tmp_path / "ckpt")
            state = await t.state_dict()
    assert_close_state(state, want)


@pytest.mark.asyncio
async def test_one_worker_one_io_thread_everything_on_ssd_with_all_options(tmp_path):
    """One optimizer worker and one I/O thread, everything on SSD (delayed gradients and
    the resident state too), clipping + cosine + no_decay, micro-batches 4, vertical."""
    model = tiny_gpt(n_layer=4, bias=False, n_embd=32)
    data = batches(4, 8)
    want, _ = reference(model, data, 4, lr_lambda=cos, max_norm=CLIP, wd=WD, no_decay=norms_and_position_table)
    got, _, _ = await train(model, data, 4, micro_batches=4, offload_dir=tmp_path, placement=Placement.all_ssd(),
                            alpha=1.0, optimizer_workers=1, io_threads=1, resident_optimizer="ssd",
                            optimizer=AdamW(lr_schedule=cos, max_grad_norm=CLIP, weight_decay=WD,
                                            no_decay=norms_and_position_table))
    assert_close_state(got, want)


# --- checkpoints across placements, frozen=False, overwriting ------------------------------

@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha,first,second", [
    ("vertical", 0.3, dict(placement=MIXED, resident_optimizer="cpu"),
     dict(placement=Placement.all_ssd(), resident_optimizer="ssd")),
    ("vertical", 1.0, dict(placement=Placement.all_cpu(), resident_optimizer="cpu"),
     dict(placement=SSD_GRADS, resident_optimizer="ssd")),
])
async def test_a_checkpoint_loads_into_another_placement(tmp_path, schedule, alpha, first, second):
    """A checkpoint saved with one placement (and resident tier) resumes in another: the
    weights are PyTorch's (placement moves only a last bit, README), with clipping or a
    delayed share, a schedule, two groups and non-default betas / eps."""
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(5, 4)
    clip = CLIP if alpha == 1.0 else None
    want, _ = reference(model, data, 2, lr_lambda=cos, wd=WD, no_decay=norms_and_position_table, max_norm=clip,
                        betas=(0.8, 0.95), eps=1e-6)
    opt = AdamW(lr_schedule=cos, weight_decay=WD, no_decay=norms_and_position_table, max_grad_norm=clip,
                betas=(0.8, 0.95), eps=1e-6)
    kw = dict(micro_batches=2, alpha=alpha, schedule=schedule, optimizer=opt)
    async with SnakeTrainer(copy.deepcopy(model), data=data, config=cfg(tmp_path, "a", **kw, **first)) as t:
        await asyncio.wait_for(t.run(2), 120)
        await t.save(tmp_path / "ckpt")
    async with SnakeTrainer(copy.deepcopy(model), data=data, config=cfg(tmp_path, "b", **kw, **second)) as t:
        await t.load(tmp_path / "ckpt")
        await asyncio.wait_for(t.run(3), 120)
        got = await t.state_dict()
    assert_close_state(got, want)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha", [("horizontal", 1.0)])
async def test_frozen_layers_saved_without_frozen_weights_resume(tmp_path, schedule, alpha):
    """save(dir, frozen=False) of a model with frozen layers (their weights left out), loaded
    into a new trainer of the same model, goes on as one run: bitwise run(4)."""
    model = frozen_gpt((0, 2), n_layer=3)
    data = batches(4, 4)
    clip = CLIP if alpha == 1.0 else None
    kw = dict(micro_batches=2, placement=MIXED, alpha=alpha, schedule=schedule,
              optimizer=AdamW(lr_schedule=cos, max_grad_norm=clip, weight_decay=WD, no_decay=norms_and_position_table))
    straight, _ = await script(copy.deepcopy(model), data, cfg(tmp_path, "s", **kw), [4])
    async with SnakeTrainer(copy.deepcopy(model), data=data, config=cfg(tmp_path, "a", **kw)) as t:
        await asyncio.wait_for(t.run(2), 120)
        await t.save(tmp_path / "ckpt", frozen=False)
    async with SnakeTrainer(copy.deepcopy(model), data=data, config=cfg(tmp_path, "b", **kw)) as t:
        await t.load(tmp_path / "ckpt")
        await asyncio.wait_for(t.run(2), 120)
        got = await t.state_dict()
    assert_bitwise(got, straight)


@pytest.mark.asyncio
async def test_saving_twice_into_one_directory_keeps_the_latest(tmp_path):
    """save at step 1 and again into the same directory at step 3 (with clipping's steps
    pending at each): loading it and running 2 more == run(5)."""
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(5, 4)
    kw = dict(micro_batches=2, placement=SSD_GRADS, alpha=1.0,
              optimizer=AdamW(lr_schedule=steep, max_grad_norm=CLIP))
    straight, _ = await script(copy.deepcopy(model), data, cfg(tmp_path, "s", **kw), [5])
    await script(copy.deepcopy(model), data, cfg(tmp_path, "a", **kw),
                 [1, ("save", tmp_path / "ckpt"), 2, ("save", tmp_path / "ckpt")])
    async with SnakeTrainer(copy.deepcopy(model), data=data, config=cfg(tmp_path, "b", **kw)) as t:
        await t.load(tmp_path / "ckpt")
        report = await asyncio.wait_for(t.run(2), 120)
        got = await t.state_dict()
    assert [s.lr for s in report.steps] == [1e-3 * f for f in STEEP[3:5]]
    assert_bitwise(got, straight)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical"])
async def test_ignored_targets_with_clip_and_lr(tmp_path, schedule):
    """Targets of -100 (a micro-batch with none kept) + clipping + a schedule: the big
    batch's mean, clip_grad_norm_ and LambdaLR."""
    from tests.test_parity import _ignoring

    model = tiny_gpt(n_layer=3, bias=False)
    data = _ignoring(batches(4, 6))
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, steep)
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        kept = int((y != -100).sum())
        for xc, yc in zip(x.chunk(3), y.chunk(3), strict=True):
            logits = m(xc)
            (torch.nn.functional.cross_entropy(logits.reshape(-1, 96), yc.reshape(-1), reduction="sum") / kept).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
        opt.step()
        sched.step()
    got, _, _ = await train(model, data, 4, micro_batches=3, offload_dir=tmp_path, placement=MIXED, alpha=1.0,
                            schedule=schedule, optimizer=AdamW(lr_schedule=steep, max_grad_norm=CLIP))
    assert_close_state(got, m.state_dict())


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,micro", [("vertical", 5), ("horizontal", 1)])
async def test_odd_micro_batch_counts_with_clip_grads_on_ssd_and_resume(tmp_path, schedule, micro):
    """One micro-batch, or an odd five (vertical's alternating order), with clipping and the
    delayed gradients on SSD: PyTorch's weights, and a 2 + 2 resume bitwise the straight run."""
    model = tiny_gpt(n_layer=3, bias=False, n_embd=32)
    data = batches(4, micro)
    want, _ = reference(model, data, micro, lr_lambda=steep, max_norm=CLIP)
    kw = dict(micro_batches=micro, placement=Placement.all_ssd(), alpha=1.0, schedule=schedule,
              optimizer=AdamW(lr_schedule=steep, max_grad_norm=CLIP))
    straight, _ = await script(copy.deepcopy(model), data, cfg(tmp_path, "s", **kw), [4])
    assert_close_state(straight, want)
    res, _ = await resumed(model, data, tmp_path, [2, 2], **kw)
    assert_bitwise(res, straight)


@pytest.mark.asyncio
async def test_trained_only_state_dict_between_runs_with_frozen_layers(tmp_path):
    """state_dict(trained_only=True) between runs (it applies the pending steps too) with
    frozen layers and a delayed share: the run after goes on as without it."""
    model = frozen_gpt((1,), n_layer=3)
    data = batches(4, 4)
    kw = dict(micro_batches=2, placement=MIXED, alpha=0.3,
              optimizer=AdamW(lr_schedule=steep, weight_decay=WD, no_decay=norms_and_position_table))
    straight, _ = await script(copy.deepcopy(model), data, cfg(tmp_path, "s", **kw), [4])
    async with SnakeTrainer(copy.deepcopy(model), data=data, config=cfg(tmp_path, "a", **kw)) as t:
        await asyncio.wait_for(t.run(2), 120)
        part = await t.state_dict(trained_only=True)
        await asyncio.wait_for(t.run(2), 120)
        got = await t.state_dict()
    assert not any(k.startswith("blocks.1.") for k in part)
    assert_bitwise(got, straight)


# --- runs that end early: stop() and data that runs out ------------------------------------

@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha,placement", [
    ("vertical", 1.0, SSD_GRADS), ("horizontal", 0.3, Placement.all_ssd()),
])
async def test_stopped_run_then_the_rest_is_one_run(tmp_path, schedule, alpha, placement):
    """run(6) stopped from on_step after its second step (it ends within a step or so),
    then run(the rest), with clipping or a delayed share and a schedule: run(6) bitwise,
    the rates each step's own."""
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(6, 4)
    clip = CLIP if alpha == 1.0 else None
    kw = dict(micro_batches=2, placement=placement, alpha=alpha, schedule=schedule,
              optimizer=AdamW(lr_schedule=steep8, max_grad_norm=clip, weight_decay=WD,
                              no_decay=norms_and_position_table))
    straight, s_steps = await script(copy.deepcopy(model), data, cfg(tmp_path, "s", **kw), [6])
    async with SnakeTrainer(copy.deepcopy(model), data=data, config=cfg(tmp_path, "a", **kw)) as t:
        def on_step(report):
            if report.step == 1:
                t.stop()
        first = await asyncio.wait_for(t.run(6, on_step=on_step), 120)
        assert first.stopped and 2 <= len(first.steps) < 6
        rest = await asyncio.wait_for(t.run(6 - len(first.steps)), 120)
        got = await t.state_dict()
    steps = first.steps + rest.steps
    assert [s.lr for s in steps] == [s.lr for s in s_steps]
    assert [s.loss for s in steps] == [s.loss for s in s_steps]
    assert_bitwise(got, straight)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical"])
async def test_data_running_out_mid_run_then_more_data_is_one_run(tmp_path, schedule):
    """run(5) on a generator of 3 batches (DataExhausted after 3 steps, clipping's steps of
    the third pending), then run(2, data=the other 2): run(5) over all 5 bitwise."""
    from snake import DataExhausted

    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(5, 4)
    kw = dict(micro_batches=2, placement=SSD_GRADS, alpha=1.0, schedule=schedule,
              optimizer=AdamW(lr_schedule=steep, max_grad_norm=CLIP))
    straight, s_steps = await script(copy.deepcopy(model), data, cfg(tmp_path, "s", **kw), [5])
    async with SnakeTrainer(copy.deepcopy(model), data=(b for b in data[:3]), config=cfg(tmp_path, "a", **kw)) as t:
        with pytest.raises(DataExhausted) as err:
            await asyncio.wait_for(t.run(5), 120)
        assert len(err.value.report.steps) == 3
        rest = await asyncio.wait_for(t.run(2, data=data[3:]), 120)
        got = await t.state_dict()
    assert [s.lr for s in rest.steps] == [s.lr for s in s_steps[3:]]
    assert_bitwise(got, straight)


# --- what may come between load() and the first run ----------------------------------------

@pytest.mark.asyncio
@pytest.mark.parametrize("between", [("eval", "save", "state")])
async def test_calls_between_load_and_run_change_nothing(tmp_path, between):
    """load(), then evaluate / state_dict / save (and that save loaded again), then run:
    the weights of the run straight through, bitwise (clipping at alpha 1, the delayed
    gradients on SSD, dropout, a schedule)."""
    model = tiny_gpt(n_layer=3, bias=False, dropout=0.1)
    data = batches(5, 4)
    kw = dict(micro_batches=2, placement=SSD_GRADS, alpha=1.0,
              optimizer=AdamW(lr_schedule=steep, max_grad_norm=CLIP, weight_decay=WD,
                              no_decay=norms_and_position_table))
    straight, s_steps = await script(copy.deepcopy(model), data, cfg(tmp_path, "s", **kw), [5])
    await script(copy.deepcopy(model), data, cfg(tmp_path, "a", **kw), [2, ("save", tmp_path / "c1")])
    ckpt = tmp_path / "c1"
    async with SnakeTrainer(copy.deepcopy(model), data=data, config=cfg(tmp_path, "b", **kw)) as t:
        await t.load(ckpt)
        for op in between:
            if op == "eval":
                await t.evaluate(batches(1, 2, seed=7))
            elif op == "state":
                await t.state_dict()
            else:
                await t.save(tmp_path / "c2")
                ckpt = tmp_path / "c2"
        report = await asyncio.wait_for(t.run(3), 120)
        got = await t.state_dict()
    assert [s.loss for s in report.steps] == [s.loss for s in s_steps[2:]]
    assert_bitwise(got, straight)
    if "save" in between:  # the checkpoint saved right after the load resumes too
        async with SnakeTrainer(copy.deepcopy(model), data=data, config=cfg(tmp_path, "c", **kw)) as t:
            await t.load(ckpt)
            await asyncio.wait_for(t.run(3), 120)
            again = await t.state_dict()
        assert_bitwise(again, straight)


@pytest.mark.asyncio
async def test_evaluate_before_the_first_run_then_runs(tmp_path):
    """evaluate() on a new trainer (it sets the trainer up), then run: as without it, with
    dropout, clipping and a schedule."""
    model = tiny_gpt(n_layer=3, bias=False, dropout=0.1)
    data = batches(4, 4)
    kw = dict(micro_batches=2, placement=MIXED, alpha=1.0, schedule="horizontal",
              optimizer=AdamW(lr_schedule=steep, max_grad_norm=CLIP))
    straight, _ = await script(copy.deepcopy(model), data, cfg(tmp_path, "s", **kw), [4])
    got, _ = await script(copy.deepcopy(model), data, cfg(tmp_path, "a", **kw), ["eval", 2, "eval", 2],
                          held_out=batches(2, 3, seed=8))
    assert_bitwise(got, straight)


# --- parameters held on the device with pre/post's, with options by name ------------------

def _no_decay_by_name(name: str, p: torch.Tensor) -> bool:
    """Decided by the name alone (a filter that mixes parameters up shows): the adapters'
    B and the routers' gates take no decay."""
    return "lora_B" in name or name.endswith("gate.weight")


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("alpha,clip", [(1.0, 0.05)])
async def test_held_fp32_adapters_with_named_no_decay_lr_and_clip(tmp_path, alpha, clip):
    """PEFT's fp32 LoRA adapters of a bf16 Llama (held with pre/post's) with a filter by
    name, a schedule and clipping: plain mixed precision's masters (fused AdamW)."""
    pytest.importorskip("peft")
    from tests.test_hf import VOCAB
    from tests.test_peft import lora

    model = lora(dtype=torch.bfloat16)
    base = model.get_base_model()
    data = batches(3, 4, seq=16, vocab=VOCAB)
    want = mixed_reference(base, data, 2, fused=True, max_norm=clip, lr_lambda=steep, wd=WD,
                           no_decay=_no_decay_by_name)
    got, _, _ = await train(model, data, 3, micro_batches=2, offload_dir=tmp_path, alpha=alpha, dtype="bfloat16",
                            placement=Placement(param=0.5, ckpt=0.5, opt=0.5),
                            optimizer=AdamW(lr_schedule=steep, max_grad_norm=clip, weight_decay=WD,
                                            no_decay=_no_decay_by_name))
    assert_masters({k: got[k] for k in want}, want, rtol=1e-5 if clip else 0.0)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha,clip", [("horizontal", 1.0, CLIP)])
async def test_held_fp32_gates_with_named_no_decay(tmp_path, schedule, alpha, clip):
    """A bf16 model's fp32 router gates (held with pre/post's) without decay by name, the
    experts with it, a schedule and clipping: plain mixed precision's masters."""
    from tests.test_parity import _gated_model, _gated_parts

    model = _gated_model()
    data = batches(4, 4)
    want = mixed_reference(model, data, 2, lr_lambda=steep, wd=WD, no_decay=_no_decay_by_name, max_norm=clip)
    got, _, _ = await train(_gated_parts(model), data, 4, micro_batches=2, offload_dir=tmp_path, schedule=schedule,
                            placement=Placement.all_ssd(), alpha=alpha, dtype="bfloat16", resident_optimizer="ssd",
                            optimizer=AdamW(lr_schedule=steep, weight_decay=WD, no_decay=_no_decay_by_name,
                                            max_grad_norm=clip))
    assert_close_state({k: got[k] for k in want}, want, rtol=1e-5 if clip else 0, atol=1e-6)


# --- more knobs -----------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_static_fp16_scale_with_clip_at_alpha_1_horizontal(tmp_path):
    """float16 at a fixed scale with clipping (alpha 1), horizontal, all on SSD: GradScaler
    at 1024 (never growing, never skipping) + unscale + clip_grad_norm_."""
    _, fp16_gpt, _ = _fp16()
    model = fp16_gpt(n_layer=3)
    data = batches(4, 4)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**6)
    scales: list[tuple[float, bool]] = []
    want = mixed_reference(model, data, 2, scaler=scaler, scales=scales, fused=True, lr_lambda=steep, max_norm=CLIP)
    assert not any(s for _, s in scales)
    got, _, _ = await train(model, data, 4, micro_batches=2, offload_dir=tmp_path, placement=Placement.all_ssd(),
                            alpha=1.0, schedule="horizontal", dtype="float16", loss_scale=1024.0,
                            optimizer=AdamW(lr_schedule=steep, max_grad_norm=CLIP))
    assert_masters(got, want, rtol=1e-5)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical"])
async def test_dynamic_scale_on_layers_of_several_kinds(tmp_path, schedule):
    """float16's dynamic scale on layers of three kinds and sizes (each kind's delayed
    gradient room its own), on SSD, with a schedule and two groups: GradScaler's."""
    overflows, _, grad_scaler = _fp16()
    model = KindsLM().to(torch.float16)
    data = batches(6, 4)
    nd = lambda n, p: p.dim() < 2  # noqa: E731
    scales: list[tuple[float, bool]] = []
    want = mixed_reference(model, data, 2, scaler=grad_scaler(overflows), scales=scales, fused=True,
                           lr_lambda=steep8, wd=WD, no_decay=nd)
    assert any(s for _, s in scales) and not all(s for _, s in scales), scales
    got, report, _ = await train(kinds_parts(model), data, 6, micro_batches=2, offload_dir=tmp_path,
                                 placement=Placement.all_ssd(), alpha=1.0, schedule=schedule, dtype="float16",
                                 loss_scale=overflows,
                                 optimizer=AdamW(lr_schedule=steep8, weight_decay=WD, no_decay=nd))
    assert [(s.loss_scale, s.skipped) for s in report.steps] == scales
    assert_masters(got, want)


@pytest.mark.asyncio
async def test_three_workers_buffered_io_five_layers_with_clip(tmp_path):
    """Three optimizer workers over five layers, buffered I/O, everything on SSD, clipping,
    a schedule and two groups; then a resume, bitwise."""
    model = tiny_gpt(n_layer=5, bias=False, n_embd=32)
    data = batches(4, 6)
    want, _ = reference(model, data, 3, lr_lambda=steep, max_norm=CLIP, wd=WD, no_decay=norms_and_position_table)
    kw = dict(micro_batches=3, placement=Placement.all_ssd(), alpha=1.0, optimizer_workers=3, io_threads=4,
              storage_backend="buffered", resident_optimizer="ssd",
              optimizer=AdamW(lr_schedule=steep, max_grad_norm=CLIP, weight_decay=WD,
                              no_decay=norms_and_position_table))
    straight, _ = await script(copy.deepcopy(model), data, cfg(tmp_path, "s", **kw), [4])
    assert_close_state(straight, want)
    res, _ = await resumed(model, data, tmp_path, [3, 1], **kw)
    assert_bitwise(res, straight)


@pytest.mark.asyncio
async def test_a_load_then_run_without_steps_trains_the_rest_of_the_data(tmp_path):
    """load() after 2 of 5 batches, then run() without steps: the 3 left, at their own
    rates, run(5)'s weights bitwise (a delayed share, cosine)."""
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(5, 4)
    kw = dict(micro_batches=2, placement=MIXED, alpha=0.3,
              optimizer=AdamW(lr_schedule=cos, weight_decay=WD, no_decay=norms_and_position_table))
    straight, s_steps = await script(copy.deepcopy(model), data, cfg(tmp_path, "s", **kw), [5])
    await script(copy.deepcopy(model), data, cfg(tmp_path, "a", **kw), [2, ("save", tmp_path / "c")])
    async with SnakeTrainer(copy.deepcopy(model), data=data, config=cfg(tmp_path, "b", **kw)) as t:
        await t.load(tmp_path / "c")
        report = await asyncio.wait_for(t.run(), 120)
        got = await t.state_dict()
    assert [s.lr for s in report.steps] == [s.lr for s in s_steps[2:]]
    assert_bitwise(got, straight)


@pytest.mark.asyncio
async def test_the_planner_with_a_dynamic_scale_and_a_load_takes_the_checkpoints_choices(tmp_path):
    """alpha / micro_batches / placement left to the planner with float16's dynamic scale
    and clipping: it picks alpha 1; a trainer loading the checkpoint with them None takes
    the checkpoint's and goes on as one run."""
    overflows, fp16_gpt, _ = _fp16()
    model = fp16_gpt(n_layer=2)
    data = batches(4, 4)
    opt = AdamW(lr_schedule=steep, max_grad_norm=CLIP)
    fixed = dict(micro_batches=2, placement=MIXED, alpha=1.0, dtype="float16", loss_scale=overflows, optimizer=opt)
    straight, _ = await script(copy.deepcopy(model), data, cfg(tmp_path, "s", **fixed), [4])
    planned = dict(fixed, alpha=None)
    async with SnakeTrainer(copy.deepcopy(model), data=data, config=cfg(tmp_path, "a", **planned)) as t:
        await asyncio.wait_for(t.run(2), 120)
        assert t.config.alpha == 1.0
        await t.save(tmp_path / "c")
    async with SnakeTrainer(copy.deepcopy(model), data=data, config=cfg(tmp_path, "b", **planned)) as t:
        await t.load(tmp_path / "c")
        await asyncio.wait_for(t.run(2), 120)
        got = await t.state_dict()
    assert_bitwise(got, straight)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_dynamic_scale_skips_with_missed_steps(tmp_path, schedule):
    """float16's dynamic scale on the routed model: iterations skipped for an overflow
    coincide with ones where experts (and a head parameter) get no gradient, and a taken
    step follows; each parameter's own AdamW step count (torch's) after both kinds of miss,
    with a schedule that counts every iteration; then a resume across them, bitwise."""
    from tests.test_parity import _routed_batches, _routed_parts, _RoutedLM

    torch.manual_seed(0)
    model = _RoutedLM().to(torch.float16)
    data = _routed_batches()
    dyn = DynamicLossScale(init_scale=2.0**18, growth_interval=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=dyn.init_scale, growth_interval=1)
    scales: list[tuple[float, bool]] = []
    want = mixed_reference(model, data, 2, scaler=scaler, scales=scales, fused=True, lr_lambda=steep)
    assert [s for _, s in scales] == [True, True, False, True, False]
    kw = dict(micro_batches=2, placement=Placement.all_ssd(), alpha=1.0, schedule=schedule, dtype="float16",
              loss_scale=dyn, optimizer=AdamW(lr_schedule=steep))
    got, report, _ = await train(_routed_parts(copy.deepcopy(model)), data, 5, offload_dir=tmp_path / "s",
                                 **kw)
    assert [(s.loss_scale, s.skipped) for s in report.steps] == scales
    assert_masters(got, want)
    state = None
    for j, n in enumerate((2, 3)):
        async with SnakeTrainer(_routed_parts(copy.deepcopy(model)), data=data, config=cfg(tmp_path, f"r{j}", **kw)) as t:
            if j:
                await t.load(tmp_path / "ckpt")
            await asyncio.wait_for(t.run(n), 120)
            if not j:
                await t.save(tmp_path / "ckpt")
            state = await t.state_dict()
    assert_bitwise(state, got)


@pytest.mark.asyncio
@pytest.mark.parametrize("alpha", [0.99999])
async def test_alpha_rounding_a_part_to_nothing_with_groups_and_schedule(tmp_path, alpha):
    """A delay ratio that leaves one part of a layer nearly empty, cut across parameters of
    both weight-decay groups, with a schedule: torch's weights."""
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(4, 4)
    want, _ = reference(model, data, 2, lr_lambda=steep, wd=WD, no_decay=norms_and_position_table)
    got, _, _ = await train(model, data, 4, micro_batches=2, offload_dir=tmp_path, placement=MIXED, alpha=alpha,
                            schedule="vertical",
                            optimizer=AdamW(lr_schedule=steep, weight_decay=WD, no_decay=norms_and_position_table))
    assert_close_state(got, want)


@pytest.mark.asyncio
async def test_evaluate_mid_run_with_clip_and_grads_on_ssd_is_pytorchs_eval(tmp_path):
    """evaluate() between runs with clipping's steps pending and the delayed gradients on
    SSD, in passes of two batches: PyTorch's eval loss of the weights state_dict() gives
    after it; the run after goes on as without it (bitwise)."""
    from tests.test_evaluate import torch_eval_loss

    model = tiny_gpt(n_layer=3, bias=False, dropout=0.1)
    data = batches(4, 4)
    held = batches(3, 3, seed=11)
    kw = dict(micro_batches=2, placement=SSD_GRADS, alpha=1.0,
              optimizer=AdamW(lr_schedule=steep, max_grad_norm=CLIP, weight_decay=WD,
                              no_decay=norms_and_position_table))
    straight, _ = await script(copy.deepcopy(model), data, cfg(tmp_path, "s", **kw), [4])
    async with SnakeTrainer(copy.deepcopy(model), data=data, config=cfg(tmp_path, "a", **kw)) as t:
        await asyncio.wait_for(t.run(2), 120)
        report = await t.evaluate(held, batches_per_pass=2)
        mid = await t.state_dict()
        await asyncio.wait_for(t.run(2), 120)
        got = await t.state_dict()
    want, count = torch_eval_loss(model, mid, held)
    assert report.tokens == count and report.passes == 2
    assert report.loss == pytest.approx(want, rel=1e-6)
    assert_bitwise(got, straight)


@pytest.mark.asyncio
async def test_the_users_model_keeps_its_weights_and_trains_again_the_same(tmp_path):
    """Two trainers one after the other on the same model object (no copy), with clipping,
    the resident state on SSD, a schedule and an evaluate: the model keeps its weights
    and modes, and the second trainer trains bitwise as the first."""
    model = tiny_gpt(n_layer=3, bias=False, dropout=0.1)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = batches(3, 4)
    kw = dict(micro_batches=2, placement=Placement.all_ssd(), alpha=1.0, resident_optimizer="ssd",
              optimizer=AdamW(lr_schedule=steep, max_grad_norm=CLIP))
    first, _ = await script(model, data, cfg(tmp_path, "a", **kw), [2, "eval", 1], held_out=batches(1, 2, seed=4))
    assert_bitwise(model.state_dict(), before)
    assert not model.training
    second, _ = await script(model, data, cfg(tmp_path, "b", **kw), [3])
    assert_bitwise(second, first)
    assert_bitwise(model.state_dict(), before)


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
async def test_epochs_of_a_stateful_loader_resumed_mid_epoch_with_clip_and_cosine(tmp_path):
    """snake.Epochs over a shuffling StatefulDataLoader (3 batches an epoch, 2 epochs),
    clipping and a cosine schedule over the 6 steps, resumed after 4 (mid second epoch)
    and after 1: the straight run's weights and losses, bitwise."""
    pytest.importorskip("torchdata")
    from torch.utils.data import TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    from snake import Epochs

    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 96, (12, 17), generator=g)
    ds = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    def data():
        return Epochs(StatefulDataLoader(ds, batch_size=4, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(0)), 2)

    model = tiny_gpt(n_layer=3, bias=False)
    kw = dict(micro_batches=2, placement=MIXED, alpha=1.0, optimizer=AdamW(lr_schedule=cos, max_grad_norm=CLIP))
    straight, s_steps = await script(copy.deepcopy(model), data(), cfg(tmp_path, "s", **kw), [6])
    steps, ckpt = [], None
    for j, n in enumerate((1, 3, 2)):
        async with SnakeTrainer(copy.deepcopy(model), data=data(), config=cfg(tmp_path, f"r{j}", **kw)) as t:
            if ckpt is not None:
                await t.load(ckpt)
            steps += (await asyncio.wait_for(t.run(n), 120)).steps
            ckpt = tmp_path / f"c{j}"
            await t.save(ckpt)
            got = await t.state_dict()
    assert [s.loss for s in steps] == [s.loss for s in s_steps]
    assert_bitwise(got, straight)
