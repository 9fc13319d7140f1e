"""Numerical edges against plain PyTorch on a deep copy of the same model (same batches, same
micro-batch split): AdamW's hyperparameters at their limits (weights and the Adam moments a
checkpoint holds), losses and gradients that are not finite in float32 and bfloat16 at
several delay ratios (and what save, load and evaluate do after them), clipping bounds at
their edges, gradients exactly zero, learning-rate schedules at and past their ends, and
float16 loss scales at the ends of float32's range.

The references use torch's fused AdamW (`torch.optim.AdamW(fused=True)`), the kernel snake
steps with (README: torch's default differs from it in the last bit)."""

from __future__ import annotations

import asyncio
import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from snake import (
    AdamW,
    ConfigError,
    DynamicLossScale,
    ModelParts,
    Placement,
    SnakeConfig,
    SnakeTrainer,
)
from snake.lr import WarmupCosine, WarmupLinear
from tests.helpers import StackLM, _Dense, as_param_strides, batches, mixed_reference, tiny_gpt

MIXED = Placement(param=0.5, ckpt=0.5, opt=0.5)
POISON = 5  # the token whose embedding row is +inf in the poisoned models


def gpt(dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The tiny GPT with its head untied (a tied weight's two gradients are summed in another
    order by snake, README) and no biases."""
    model = tiny_gpt(n_layer=2, n_embd=32, bias=False)
    model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
    return model if dtype is None else model.to(dtype)


def poisoned_gpt(dtype: torch.dtype | None = None) -> torch.nn.Module:
    """`gpt()` whose embedding of token POISON is +inf: a batch that holds it has a NaN loss."""
    model = gpt()
    with torch.no_grad():
        model.wte.weight[POISON] = math.inf
    return model if dtype is None else model.to(dtype)


def poisoned_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three batches of 4 rows (2 micro-batches of 2): no POISON token but one, in batch 1's
    last row (its second micro-batch). Step 0 is finite; step 1's loss is NaN and its
    gradients NaN in every layer, but finite for the embedding rows of tokens seen only in
    the other rows."""
    out = []
    for i, (x, y) in enumerate(batches(3, 4)):
        x, y = x.clone(), y.clone()
        x[x == POISON] = POISON + 1
        y[y == POISON] = POISON + 1
        if i == 1:
            x[3, 10] = POISON
        out.append((x, y))
    return out


def torch_adamw(model, data, micro: int, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, wd=0.01, max_norm=None,
                lr_lambda=None):
    """Plain PyTorch: gradient accumulation over the micro-batches (loss / M), optionally
    clip_grad_norm_, torch.optim.AdamW (fused), LambdaLR stepped after each step. Returns
    (state_dict, {"exp_avg/<name>": ..., "exp_avg_sq/<name>": ...}, losses, norms, lrs)."""
    m = copy.deepcopy(model)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd, fused=True)
    sched = None if lr_lambda is None else torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    losses, norms, lrs = [], [], []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xc, yc in zip(x.chunk(micro), y.chunk(micro), strict=True):
            logits = m(xc)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), yc.reshape(-1)) / micro
            loss.backward()
            total += loss.item()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)))
        as_param_strides(m.parameters())
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(total)
    names = {p: n for n, p in m.named_parameters()}
    moments = {}
    for p, s in opt.state.items():
        moments[f"exp_avg/{names[p]}"] = s["exp_avg"].clone()
        moments[f"exp_avg_sq/{names[p]}"] = s["exp_avg_sq"].clone()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, moments, losses, norms, lrs


def checkpoint_moments(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({k: v for k, v in load_file(f).items() if k.startswith("exp_avg")})
    return out


def assert_same_numbers(got: dict, want: dict, *, rtol: float = 1e-5, atol: float = 1e-6, what: str = "") -> None:
    """got is want: NaN and +-inf at the same elements, the finite ones close."""
    for k in want:
        assert k in got, f"{what}{k} missing"
        a, b = got[k].float(), want[k].float()
        assert a.shape == b.shape, f"{what}{k}: shape {tuple(a.shape)} against {tuple(b.shape)}"
        assert torch.equal(a.isnan(), b.isnan()), (
            f"{what}{k}: NaN at {int(a.isnan().sum())} elements, PyTorch at {int(b.isnan().sum())}")
        assert torch.equal(a.isinf(), b.isinf()) and torch.equal(a[a.isinf()], b[b.isinf()]), (
            f"{what}{k}: infinities differ from PyTorch's")
        fin = a.isfinite()
        torch.testing.assert_close(a[fin], b[fin], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{what}{k}: {m}")


def same_float(a: float | None, b: float | None, rel: float = 1e-5) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= rel * max(1.0, abs(b))


def cfg(tmp_path, name: str, **kw) -> SnakeConfig:
    kw.setdefault("micro_batches", 2)
    kw.setdefault("placement", MIXED)
    return SnakeConfig(offload_dir=tmp_path / name, device="cpu", **kw)


# --------------------------------------------------------------------------------------------
# AdamW's hyperparameters at their edges: weights and Adam moments against torch's


EDGES = {
    # lr 0: nothing changes (weight decay times lr is 0), the moments still move; every number
    # an int, as snake accepts them (torch wants float betas: its reference gets floats)
    "ints: lr=0 betas=(0,0) eps=1 wd=1": dict(lr=0, betas=(0, 0), eps=1, wd=1),
    "lr*weight_decay=1": dict(lr=1e-2, wd=100.0),
    "betas=(0,0)": dict(betas=(0.0, 0.0)),
    "betas=(0.999,0.9999)": dict(betas=(0.999, 0.9999)),
    "eps=1e-16": dict(eps=1e-16),
    "eps=1": dict(eps=1.0),
    # below float32's range: torch's own kernels compute 0 / 0 for the embedding rows that got a
    # zero gradient (NaN there, the same elements in both)
    "eps=1e-300": dict(eps=1e-300),
}
EDGE_RUNS = [("vertical", 0.0), ("horizontal", 0.5), ("vertical", 0.5)]


@pytest.mark.asyncio
@pytest.mark.parametrize("edge", sorted(EDGES))
async def test_adamw_hyperparameter_edges_match_torch_weights_and_moments(tmp_path, edge):
    h = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "wd": 0.01, **EDGES[edge]}
    schedule, alpha = EDGE_RUNS[sorted(EDGES).index(edge) % len(EDGE_RUNS)]
    model = gpt()
    data = batches(3, 4)
    want, want_moments, want_losses, _, _ = torch_adamw(
        model, data, 2, lr=float(h["lr"]), betas=tuple(float(b) for b in h["betas"]), eps=float(h["eps"]),
        wd=float(h["wd"]))
    opt = AdamW(lr=h["lr"], betas=h["betas"], eps=h["eps"], weight_decay=h["wd"])
    async with SnakeTrainer(model, data=data, config=cfg(tmp_path, "off", schedule=schedule, alpha=alpha,
                                                          optimizer=opt)) as t:
        report = await asyncio.wait_for(t.run(3), 60)
        got = await t.state_dict()
        await t.save(tmp_path / "ckpt")
    # betas (0, 0) step each element by lr * g / (|g| + eps): where |g| is near eps the order
    # the micro-batches' gradients are summed in shows (2.6e-6 at one element here)
    atol = 1e-5 if h["betas"] == (0.0, 0.0) else 1e-6
    assert_same_numbers(got, want, atol=atol, what=f"{edge} ({schedule}, alpha {alpha}) weights: ")
    assert_same_numbers(checkpoint_moments(tmp_path / "ckpt"), want_moments, what=f"{edge} moments: ")
    assert all(same_float(s.loss, w) for s, w in zip(report.steps, want_losses, strict=True))
    if h["lr"] == 0:
        for k, v in model.state_dict().items():
            assert torch.equal(got[k], v), f"{k} changed at lr=0"


@pytest.mark.asyncio
@pytest.mark.parametrize("edge", ["betas=(0,0)"])
async def test_adamw_hyperparameter_edges_in_bf16_are_plain_mixed_precision(tmp_path, edge):
    h = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "wd": 0.01, **EDGES[edge]}
    model = gpt(torch.bfloat16)
    data = batches(3, 4)
    want = mixed_reference(model, data, 2, lr=h["lr"], betas=h["betas"], eps=h["eps"], wd=h["wd"], fused=True)
    opt = AdamW(lr=h["lr"], betas=h["betas"], eps=h["eps"], weight_decay=h["wd"])
    async with SnakeTrainer(model, data=data, config=cfg(tmp_path, "off", alpha=0.5, dtype="bfloat16",
                                                          optimizer=opt)) as t:
        await asyncio.wait_for(t.run(3), 60)
        got = await t.state_dict()
    atol = 1e-5 if h["betas"] == (0.0, 0.0) else 1e-6
    assert_same_numbers({k: got[k] for k in want}, want, rtol=0, atol=atol, what=f"bf16 {edge}: ")


@pytest.mark.parametrize("option", ["amsgrad", "maximize", "fused", "capturable"])
def test_adamw_options_snake_does_not_have_are_refused_when_made(option):
    """snake.AdamW steps torch's AdamW without amsgrad or maximize: asking for one must fail
    at once, naming it, not train with the option ignored."""
    with pytest.raises(TypeError, match=option):
        AdamW(**{option: True})


# --------------------------------------------------------------------------------------------
# losses and gradients that are not finite in float32 and bfloat16: README promises no check
# (that is float16 at a static scale alone), so the weights are PyTorch's, NaN where its are


NAN_RUNS = [
    ("float32", "vertical", 0.0, None),
    ("float32", "horizontal", 0.5, None),
    ("bfloat16", "horizontal", 1.0, 1.0),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("dtype,schedule,alpha,clip", NAN_RUNS)
async def test_a_nan_loss_puts_torchs_nans_into_the_weights_and_a_checkpoint_keeps_them(
        tmp_path, dtype, schedule, alpha, clip):
    """Step 1's loss is NaN: every layer's weights go NaN, the embedding rows of tokens only
    in the other rows stay finite (the delayed share of step 1 too), the norm is NaN as
    clip_grad_norm_'s; evaluate gives NaN, a save and load keep the NaNs bit for bit, and a
    run after the load goes on as PyTorch's third step."""
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else None
    model = poisoned_gpt(torch_dtype)
    data = poisoned_data()
    if torch_dtype is None:
        want2, _, want_losses, _, _ = torch_adamw(model, data[:2], 2, max_norm=clip)
        want3, _, _, _, _ = torch_adamw(model, data, 2, max_norm=clip)
    else:
        want2 = mixed_reference(model, data[:2], 2, max_norm=clip, fused=True)
        want3 = mixed_reference(model, data, 2, max_norm=clip, fused=True)
        want_losses = None
    assert any(bool(v.isnan().any()) for v in want2.values())
    if clip is None:  # (clipping's NaN coefficient makes every gradient NaN)
        assert not all(bool(v.isnan().all()) for v in want2.values()), "the reference must leave some finite"
    config = dict(schedule=schedule, alpha=alpha, dtype=dtype, optimizer=AdamW(max_grad_norm=clip))
    async with SnakeTrainer(model, data=data, config=cfg(tmp_path, "a", **config)) as t:
        report = await asyncio.wait_for(t.run(2), 60)
        val = await t.evaluate(data[:1])
        got = await t.state_dict()
        await t.save(tmp_path / "ckpt")
    assert_same_numbers({k: got[k] for k in want2}, want2, what="after the NaN step: ")
    assert math.isfinite(report.steps[0].loss) and math.isnan(report.steps[1].loss)
    assert math.isnan(val.loss), f"evaluate() of NaN weights gave {val.loss}"
    if want_losses is not None:
        assert all(same_float(s.loss, w) for s, w in zip(report.steps, want_losses, strict=True))
    if clip is not None:  # clip_grad_norm_ returns NaN for the NaN step
        assert math.isfinite(report.steps[0].grad_norm) and math.isnan(report.steps[1].grad_norm)
    async with SnakeTrainer(model, data=data, config=cfg(tmp_path, "b", **config)) as t:
        await t.load(tmp_path / "ckpt")
        loaded = await t.state_dict()
        assert_same_numbers(loaded, got, rtol=0, atol=0, what="loaded: ")
        report = await asyncio.wait_for(t.run(1), 60)
        resumed = await t.state_dict()
    assert math.isnan(report.steps[0].loss)
    assert_same_numbers({k: resumed[k] for k in want3}, want3, what="resumed step: ")


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical"])
async def test_an_infinite_bound_with_a_nan_gradient_is_the_run_without_it(tmp_path, schedule):
    """README: max_grad_norm=math.inf only measures the norm and gives the weights of the same
    run without it, bitwise. On purpose not torch's clip_grad_norm_(params, inf), whose
    coefficient inf / (nan + 1e-6) is NaN and makes every gradient NaN (the finite embedding
    rows too). The norm reported is the NaN clip_grad_norm_ returns."""
    model = poisoned_gpt()
    data = poisoned_data()
    want, _, _, _, _ = torch_adamw(model, data[:2], 2)
    clipped, _, _, torch_norms, _ = torch_adamw(model, data[:2], 2, max_norm=math.inf)
    assert sum(int(v.isnan().sum()) for v in clipped.values()) > sum(int(v.isnan().sum()) for v in want.values())
    runs = {}
    for name, bound in (("plain", None), ("measured", math.inf)):
        c = cfg(tmp_path, name, schedule=schedule, alpha=0.5, optimizer=AdamW(max_grad_norm=bound))
        async with SnakeTrainer(model, data=data, config=c) as t:
            report = await asyncio.wait_for(t.run(2), 60)
            runs[name] = (await t.state_dict(), report)
    (plain, _), (measured, report) = runs["plain"], runs["measured"]
    for k in plain:
        assert torch.equal(plain[k].isnan(), measured[k].isnan()) and torch.equal(
            plain[k].nan_to_num(), measured[k].nan_to_num()), f"{k}: max_grad_norm=inf changed the weights"
    assert_same_numbers(measured, want, what="max_grad_norm=inf: ")
    assert all(same_float(s.grad_norm, w) for s, w in zip(report.steps, torch_norms, strict=True)), (
        [s.grad_norm for s in report.steps], torch_norms)


class _MaskedLM(StackLM):
    """A head whose logit of token 7 is -inf (a frozen mask buffer): a target 7 makes the loss
    +inf, while every gradient stays finite (softmax 0 there, minus the one-hot)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(lambda: _Dense(16, torch.nn.GELU()), n=2)
        mask = torch.zeros(96)
        mask[7] = -math.inf
        self.register_buffer("mask", mask)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) + self.mask


@pytest.mark.asyncio
@pytest.mark.parametrize("alpha,clip", [(0.5, None), (1.0, 1.0)])
async def test_an_infinite_loss_with_finite_gradients_trains_as_torch(tmp_path, alpha, clip):
    model = _MaskedLM()
    data = []
    for i, (x, y) in enumerate(batches(3, 4)):
        y = y.clone()
        y[y == 7] = 8
        if i == 1:
            y[2, 3] = 7
        data.append((x, y))
    want, _, want_losses, want_norms, _ = torch_adamw(model, data, 2, max_norm=clip)
    assert want_losses[1] == math.inf and all(math.isfinite(v.abs().sum()) for k, v in want.items() if k != "mask")
    parts = ModelParts(model=model, blocks=list(model.layers), blocks_prefix="layers",
                       pre=lambda m, i: m.embed(i), post=lambda m, h: m.head(h) + m.mask)
    async with SnakeTrainer(parts, data=data, config=cfg(tmp_path, "off", alpha=alpha,
                                                          optimizer=AdamW(max_grad_norm=clip))) as t:
        report = await asyncio.wait_for(t.run(3), 60)
        got = await t.state_dict()
        val = await t.evaluate(data[1:2])
    assert_same_numbers(got, want)
    assert all(same_float(s.loss, w) for s, w in zip(report.steps, want_losses, strict=True)), (
        [s.loss for s in report.steps], want_losses)
    if clip is not None:
        assert all(same_float(s.grad_norm, w) for s, w in zip(report.steps, want_norms, strict=True))
    assert val.loss == math.inf


# --------------------------------------------------------------------------------------------
# clipping bounds at their edges (alpha 1, as README requires), and gradients exactly zero


@pytest.mark.asyncio
@pytest.mark.parametrize("bound,schedule", [("1e-6", "vertical"), ("the first norm", "horizontal"),
                                            ("1e-45", "vertical")])
async def test_clipping_bounds_at_the_edges_match_clip_grad_norm(tmp_path, bound, schedule):
    model = gpt()
    data = batches(3, 4)
    if bound == "the first norm":
        _, _, _, first, _ = torch_adamw(model, data[:1], 2, max_norm=math.inf)
        max_norm = first[0]
    else:
        max_norm = float(bound)
    want, want_moments, _, want_norms, _ = torch_adamw(model, data, 2, max_norm=max_norm)
    async with SnakeTrainer(model, data=data, config=cfg(tmp_path, "off", schedule=schedule, alpha=1.0,
                                                          optimizer=AdamW(max_grad_norm=max_norm))) as t:
        report = await asyncio.wait_for(t.run(3), 60)
        got = await t.state_dict()
        await t.save(tmp_path / "ckpt")
    assert_same_numbers(got, want, what=f"max_grad_norm={max_norm}: ")
    assert_same_numbers(checkpoint_moments(tmp_path / "ckpt"), want_moments, rtol=1e-4, atol=1e-12,
                        what=f"max_grad_norm={max_norm} moments: ")
    assert [s.grad_norm for s in report.steps] == pytest.approx(want_norms, rel=1e-5)


def _zero_gradient_model() -> torch.nn.Module:
    """gpt() with everything frozen but layer 0's MLP, whose output projection starts at
    zero: its input projection gets a gradient of exact zeros (not None) in step 0, and a
    real one once the output projection has moved."""
    model = gpt()
    for p in model.parameters():
        p.requires_grad_(False)
    mlp = model.blocks[0].mlp
    with torch.no_grad():
        mlp.c_proj.weight.zero_()
    mlp.c_fc.weight.requires_grad_(True)
    mlp.c_proj.weight.requires_grad_(True)
    return model


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha,clip", [("horizontal", 0.5, None), ("vertical", 1.0, 1e-3)])
async def test_a_gradient_of_exact_zeros_is_a_step_not_a_missed_one(tmp_path, schedule, alpha, clip):
    """torch.optim.AdamW steps a parameter whose .grad is all zeros (its step count, weight
    decay and moments move); README's missed steps are for a gradient that is None. Step 1's
    bias correction tells the two apart."""
    model = _zero_gradient_model()
    data = batches(3, 4)
    want, want_moments, _, want_norms, _ = torch_adamw(model, data, 2, max_norm=clip)
    async with SnakeTrainer(model, data=data, config=cfg(tmp_path, "off", schedule=schedule, alpha=alpha,
                                                          optimizer=AdamW(max_grad_norm=clip))) as t:
        report = await asyncio.wait_for(t.run(3), 60)
        got = await t.state_dict()
        await t.save(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert not manifest["missed_steps"], f"a gradient of zeros counted as a missed step: {manifest['missed_steps']}"
    assert_same_numbers(got, want)
    assert_same_numbers(checkpoint_moments(tmp_path / "ckpt"), want_moments, atol=1e-10)
    if clip is not None:
        assert [s.grad_norm for s in report.steps] == pytest.approx(want_norms, rel=1e-5)


@pytest.mark.asyncio
async def test_a_norm_of_exactly_zero_clips_nothing_and_only_decays(tmp_path):
    """Every trained gradient zero (layer 0's MLP input projection behind a frozen zero output
    projection): the norm is 0, the coefficient min(1, bound / 1e-6) is 1, and AdamW only
    decays the weights, as torch's."""
    model = _zero_gradient_model()
    model.blocks[0].mlp.c_proj.weight.requires_grad_(False)
    data = batches(2, 4)
    want, _, _, want_norms, _ = torch_adamw(model, data, 2, max_norm=1e-3)
    assert want_norms == [0.0, 0.0]
    async with SnakeTrainer(model, data=data, config=cfg(tmp_path, "off", alpha=1.0,
                                                          optimizer=AdamW(max_grad_norm=1e-3))) as t:
        report = await asyncio.wait_for(t.run(2), 60)
        got = await t.state_dict()
    assert [s.grad_norm for s in report.steps] == want_norms
    assert_same_numbers(got, want, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# learning-rate schedules at their edges and past their ends


SCHEDULES = {
    "WarmupCosine(total_steps=1)": WarmupCosine(total_steps=1),
    "WarmupLinear(total_steps=1, warmup_steps=1)": WarmupLinear(total_steps=1, warmup_steps=1),
    "a callable giving -0.0": lambda i: -0.0,
    "a callable giving int 1, 0, 2": lambda i: [1, 0, 2, 0][i],  # (LambdaLR calls it at 3 too)
}


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(SCHEDULES))
async def test_schedules_at_and_past_their_ends_are_lambda_lrs(tmp_path, name):
    schedule = SCHEDULES[name]
    model = gpt()
    data = batches(3, 4)
    want, _, _, _, want_lrs = torch_adamw(model, data, 2, lr_lambda=schedule)
    async with SnakeTrainer(model, data=data, config=cfg(tmp_path, "off", alpha=0.5,
                                                          optimizer=AdamW(lr_schedule=schedule))) as t:
        report = await asyncio.wait_for(t.run(3), 60)
        got = await t.state_dict()
    assert [s.lr for s in report.steps] == want_lrs
    assert_same_numbers(got, want)
    if all(r == 0 for r in want_lrs):
        for k, v in model.state_dict().items():
            assert torch.equal(got[k], v), f"{k} changed at rate 0"


# --------------------------------------------------------------------------------------------
# float16 loss scales at the ends of float32's range


def fp16_gpt(nan: bool = False) -> torch.nn.Module:
    model = gpt()
    if nan:  # every batch's loss NaN: every iteration overflows
        with torch.no_grad():
            model.ln_f.weight[0] = math.nan
    return model.half()


def grad_scaler(c: DynamicLossScale) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=c.init_scale, growth_factor=c.growth_factor,
                                backoff_factor=c.backoff_factor, growth_interval=c.growth_interval)


@pytest.mark.asyncio
@pytest.mark.parametrize("scale", ["dynamic 2**-20, growing", "static 2**-126"])
async def test_tiny_loss_scales_underflow_as_grad_scalers(tmp_path, scale):
    """A scale so small that float16's gradients underflow to zero (the norm 0): the weights,
    scales and skips of GradScaler (a static scale: one that never grows)."""
    kind, _, rest = scale.partition(" ")
    value = 2.0 ** float(rest.split(",")[0].split("**")[1])
    if kind == "dynamic":
        loss_scale: float | DynamicLossScale = DynamicLossScale(init_scale=value, growth_interval=1)
        ref, alpha = loss_scale, 1.0
    else:
        loss_scale, ref, alpha = value, DynamicLossScale(init_scale=value, growth_interval=10**6), 0.5
    model = fp16_gpt()
    data = batches(3, 4)
    scales: list[tuple[float, bool]] = []
    want = mixed_reference(model, data, 2, scaler=grad_scaler(ref), scales=scales, fused=True)
    async with SnakeTrainer(model, data=data, config=cfg(tmp_path, "off", alpha=alpha, dtype="float16",
                                                          loss_scale=loss_scale)) as t:
        report = await asyncio.wait_for(t.run(3), 60)
        got = await t.state_dict()
    assert [(s.loss_scale, s.skipped) for s in report.steps] == scales
    assert_same_numbers({k: got[k] for k in want}, want, rtol=0, atol=1e-6)


@pytest.mark.asyncio
async def test_a_dynamic_scale_backed_off_below_float32s_range_skips_as_grad_scaler(tmp_path):
    """Every iteration overflows (a NaN weight); a backoff factor of 2**-80 (in (0, 1), as
    DynamicLossScale asks) takes the scale 2**16 -> 2**-64 -> 2**-144, a float32 subnormal
    whose reciprocal float32 cannot hold, then 0. GradScaler multiplies by that reciprocal
    (inf), finds the overflow and skips the step again, leaving the weights as they are;
    snake must skip too (or refuse the factor up front), not crash its compute actor."""
    loss_scale = DynamicLossScale(backoff_factor=2.0**-80)
    model = fp16_gpt(nan=True)
    data = batches(4, 4)
    scales: list[tuple[float, bool]] = []
    want = mixed_reference(model, data, 2, scaler=grad_scaler(loss_scale), scales=scales, fused=True)
    assert [s for s, _ in scales] == [2.0**16, 2.0**-64, 2.0**-144, 0.0]
    async with SnakeTrainer(model, data=data, config=cfg(tmp_path, "off", alpha=1.0, dtype="float16",
                                                          loss_scale=loss_scale)) as t:
        try:
            report = await asyncio.wait_for(t.run(4), 60)
        except Exception as exc:
            raise AssertionError(
                f"a dynamic scale that backs off to a float32 subnormal (then 0) crashed the run: {exc!r} "
                "(snake/kernels.py computes 1.0 / scale in Python and hands it to add_/mul as alpha, which "
                "float32 cannot hold, then divides by 0; GradScaler's inf reciprocal only skips the step)"
            ) from exc
        got = await t.state_dict()
        await t.save(tmp_path / "ck")  # its scale, backed off to 0, is a checkpoint's as any
    async with SnakeTrainer(fp16_gpt(nan=True), data=data, config=cfg(tmp_path, "off2", alpha=1.0, dtype="float16",
                                                                       loss_scale=loss_scale)) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), 60)
        assert t.engine is not None and t.engine.kernels.scale == 0.0
    assert [s.loss_scale for s in report.steps] == [s for s, _ in scales]
    assert all(s.skipped for s in report.steps)
    for k, v in want.items():
        assert torch.equal(got[k].isnan(), v.isnan()) and torch.equal(got[k].nan_to_num(), v.nan_to_num()), k


@pytest.mark.parametrize("init_scale", [1e-46, 1e-40, 1e39])
def test_a_dynamic_init_scale_float32_cannot_hold_is_refused_or_runs_as_grad_scaler(tmp_path, init_scale):
    """float32 holds 1e-46 as 0, 1e-40 as a subnormal (reciprocal past its range) and 1e39 as
    inf. The static loss_scale is refused below float32's smallest normal number, "below,
    float32 cannot hold it" (snake.config); DynamicLossScale's init_scale is only checked to be
    a finite number > 0. Expected: a ConfigError naming loss_scale.init_scale, or training as
    GradScaler does (which refuses 1e39 itself, at its first scale())."""
    try:
        loss_scale = DynamicLossScale(init_scale=init_scale)
    except ConfigError as exc:
        assert "loss_scale.init_scale" in str(exc)
        return
    model = fp16_gpt()
    data = batches(3, 4)
    scales: list[tuple[float, bool]] = []
    try:
        want = mixed_reference(model, data, 2, scaler=grad_scaler(loss_scale), scales=scales, fused=True)
    except RuntimeError as exc:
        want, torch_says = None, str(exc)

    async def run():
        async with SnakeTrainer(model, data=data, config=cfg(tmp_path, "off", alpha=1.0, dtype="float16",
                                                              loss_scale=loss_scale)) as t:
            report = await asyncio.wait_for(t.run(3), 60)
            return report, await t.state_dict()

    try:
        report, got = asyncio.run(run())
    except Exception as exc:
        raise AssertionError(
            f"DynamicLossScale(init_scale={init_scale}) was accepted, then the run failed: {exc!r}; "
            "expected a ConfigError naming loss_scale.init_scale before any state (as a static loss_scale "
            "float32 cannot hold is refused, snake/config.py DynamicLossScale.__post_init__), or GradScaler's "
            "skips") from exc
    assert want is not None, (
        f"DynamicLossScale(init_scale={init_scale}) was accepted and trained with the scales "
        f"{[s.loss_scale for s in report.steps]} (skipped {[s.skipped for s in report.steps]}): float32 holds it "
        f"as inf, every step is skipped for ever; GradScaler refuses it ({torch_says}); expected a ConfigError "
        "naming loss_scale.init_scale")
    assert [s.loss_scale for s in report.steps] == [s for s, _ in scales]
    assert_same_numbers({k: got[k] for k in want}, want, rtol=0, atol=1e-6)


@pytest.mark.asyncio
async def test_a_checkpoint_of_an_accepted_dynamic_scale_loads(tmp_path):
    """DynamicLossScale(init_scale=1e39) is accepted; float32 holds it as inf (snake.scaler._f32),
    the manifest records that scale, and a load then refuses snake's own checkpoint as
    damaged ("loss_scale.scale=inf, which must be a finite number > 0"). Expected: refused
    when made (a ConfigError naming loss_scale.init_scale), or a checkpoint that loads."""
    try:
        loss_scale = DynamicLossScale(init_scale=1e39)
    except ConfigError as exc:
        assert "loss_scale.init_scale" in str(exc)
        return
    model = fp16_gpt()
    data = batches(2, 4)
    kw = dict(alpha=1.0, dtype="float16", loss_scale=loss_scale)
    async with SnakeTrainer(model, data=data, config=cfg(tmp_path, "a", **kw)) as t:
        await asyncio.wait_for(t.run(1), 60)
        await t.save(tmp_path / "ckpt")
    async with SnakeTrainer(model, data=data, config=cfg(tmp_path, "b", **kw)) as t:
        try:
            await t.load(tmp_path / "ckpt")
        except Exception as exc:
            raise AssertionError(
                f"DynamicLossScale(init_scale=1e39) was accepted and trained, and its own checkpoint does not "
                f"load: {exc}") from exc
