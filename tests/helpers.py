"""Shared test helpers: a tiny GPT, deterministic data, and the plain PyTorch reference."""

from __future__ import annotations

import copy
import warnings

import torch

from snake.adapters import ModelParts
from snake.models import GPT, GPTConfig


def tiny_gpt(n_layer: int = 4, n_embd: int = 64, dropout: float = 0.0, seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=n_embd, vocab_size=96, block_size=32, dropout=dropout, **kw))


def batches(n: int, batch: int, seq: int = 16, vocab: int = 96, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def reference(model: torch.nn.Module, data, micro: int, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, wd=0.01,
              device: str = "cpu", lr_lambda=None, no_decay=None, max_norm=None, norms=None):
    """Plain PyTorch: gradient accumulation over micro-batches (loss / M) + torch AdamW, on
    `device` (the returned state dict is on the CPU); `lr_lambda`: a LambdaLR schedule,
    stepped after each optimizer step; `no_decay(name, p)`: True puts a parameter in a second
    group, without weight decay; `max_norm`: clip_grad_norm_ before each step, appending the
    norm it returns to `norms`."""
    m = copy.deepcopy(model).to(device)
    m.train()
    data = [(x.to(device), y.to(device)) for x, y in data]
    opt = torch.optim.AdamW(param_groups(m.named_parameters(), no_decay, wd), lr=lr, betas=betas, eps=eps,
                            weight_decay=wd)
    sched = None if lr_lambda is None else torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xc, yc in zip(x.chunk(micro), y.chunk(micro), strict=True):
            logits = m(xc)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), yc.reshape(-1)) / micro
            loss.backward()
            loss = loss.detach()
            total += loss.item()
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
            if norms is not None:
                norms.append(float(norm))
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(total)
    return {k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()}, losses


async def train(model, data, steps: int, **config):
    """Run snake for `steps` and return (state_dict, run report, traffic of the last step)."""
    import asyncio

    from snake import SnakeConfig, SnakeTrainer

    cfg = SnakeConfig(device="cpu", **config)
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        report = await asyncio.wait_for(trainer.run(steps), timeout=120)
        state = await trainer.state_dict()
        traffic = trainer.traffic()
    return state, report, traffic


def as_param_strides(params) -> None:
    """Give each `.grad` its parameter's strides. torch's fused CPU AdamW (the kernel snake
    steps with; `fused=True` in the references) reads a gradient as if it were laid out as
    its parameter: in torch 2.13 a gradient with other strides (a bmm's, through a
    transposed weight: Inkling's shared experts) stepped every element with another's
    gradient. snake's gradients are flat, laid out as its masters."""
    for p in params:
        if p.grad is not None and p.grad.stride() != p.stride():
            p.grad = torch.empty_like(p).copy_(p.grad)


def param_groups(named, no_decay, wd: float) -> list[dict]:
    """torch.optim's parameter groups: one, or with `no_decay` those it is True for apart,
    with weight_decay 0."""
    named = list(named)
    if no_decay is None:
        return [{"params": [p for _, p in named]}]
    return [{"params": [p for n, p in named if not no_decay(n, p)], "weight_decay": wd},
            {"params": [p for n, p in named if no_decay(n, p)], "weight_decay": 0.0}]


def mixed_reference(model: torch.nn.Module, data, micro: int, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, wd=0.01,
                    lr_lambda=None, no_decay=None, max_norm=None, scaler=None, scales=None, fused=None,
                    device: str = "cpu"):
    """Plain PyTorch mixed precision: the model computes in its own dtypes (bfloat16, with
    whatever it keeps in float32), fp32 master weights, gradients summed over micro-batches in
    fp32, torch AdamW on the masters, the masters cast back into the model after each step.
    `scaler`: a torch.amp.GradScaler (float16) that scales each loss, unscales the summed
    gradients (before clipping), steps and updates, appending (the scale the step used,
    whether it skipped the step) to `scales`. `fused=True`: torch's fused AdamW, the kernel
    snake steps with (its last bit differs from the default's, which can move a bf16 or fp16
    weight across a rounding boundary). Runs on `device`; returns the masters (on the CPU) by
    parameter name."""
    m = copy.deepcopy(model).to(device)
    m.train()
    data = [(x.to(device), y.to(device)) for x, y in data]
    named = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    masters = [p.detach().float().clone() for p in params]
    opt = torch.optim.AdamW(param_groups([(n, master) for (n, _), master in zip(named, masters, strict=True)],
                                         no_decay, wd), lr=lr, betas=betas, eps=eps, weight_decay=wd, fused=fused)
    sched = None if lr_lambda is None else torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    for x, y in data:
        acc: list[torch.Tensor | None] = [None] * len(params)
        for xc, yc in zip(x.chunk(micro), y.chunk(micro), strict=True):
            logits = m(xc)
            logits = getattr(logits, "logits", logits)
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), yc.reshape(-1)) / micro
            grads = torch.autograd.grad(loss if scaler is None else scaler.scale(loss), params, allow_unused=True)
            for i, g in enumerate(grads):
                if g is not None:
                    acc[i] = g.float() if acc[i] is None else acc[i] + g.float()
        for master, g in zip(masters, acc, strict=True):
            master.grad = g
        if fused:
            as_param_strides(masters)
        if scaler is not None:
            scaler.unscale_(opt)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(masters, max_norm)
        if scaler is None:
            opt.step()
        else:
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if scales is not None:
                scales.append((before, scaler.get_scale() < before))
        if sched is not None:
            with warnings.catch_warnings():  # after a step GradScaler skipped, as intended
                warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)` before")
                sched.step()
        with torch.no_grad():
            for p, master in zip(params, masters, strict=True):
                p.copy_(master)
    return {n: master.to("cpu", copy=True) for (n, _), master in zip(named, masters, strict=True)}


def assert_close_state(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-6, exact: dict | None = None) -> None:
    """got equals PyTorch's want within rtol / atol. With `exact` (the same training in
    float64): an element outside that may differ only by being nearer the exact value than
    PyTorch's own fp32 result (the two sum the micro-batches' gradients in different orders,
    and AdamW's division by sqrt(v) magnifies the rounding where a gradient is near zero)."""
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].shape == want[k].shape, k
        if exact is None:
            torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
            continue
        off = ~torch.isclose(got[k], want[k], rtol=rtol, atol=atol)
        ours = (got[k].double() - exact[k])[off].abs()
        theirs = (want[k].double() - exact[k])[off].abs()
        assert bool((ours <= theirs).all()), (k, int(off.sum()), ours.max().item(), theirs.max().item())


def assert_tracks_updates(got: dict, want: dict, init: dict, *, overall: float = 0.12, each: float = 0.3) -> None:
    """Low-precision training `got` follows fp32 training `want` from the same `init`: the
    error in the weights' updates, relative to the updates themselves, is below `overall`
    (all weights as one vector) and below `each` for every tensor that moved. A bound on the
    weights alone cannot fail in a few steps: they move by ~lr per step, so a trainer that
    never updated anything passed the old 5e-3 bound. Measured on a CPU: bfloat16 0.048
    overall and 0.12 at worst (a LayerNorm weight), float16 0.015 and 0.035; a trainer that
    does not update reads 1.0 everywhere."""
    assert got.keys() == want.keys()
    num = den = 0.0
    for k in want:
        moved = (want[k].float() - init[k].float()).norm().item()
        err = (got[k].float() - want[k].float()).norm().item()
        num, den = num + err**2, den + moved**2
        if moved > 0:
            assert err / moved < each, f"{k}: update off by {err / moved:.3f} of itself"
    assert den > 0 and (num / den) ** 0.5 < overall, f"updates off by {(num / den) ** 0.5:.3f} of themselves"


class _Dense(torch.nn.Module):
    def __init__(self, d: int, act: torch.nn.Module) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, 2 * d)
        self.act = act
        self.down = torch.nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(self.act(self.up(h)))


class _Experts(torch.nn.Module):
    """A dense mixture of three experts: the largest kind of layer."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.router = torch.nn.Linear(d, 3, bias=False)
        self.experts = torch.nn.ModuleList(_Dense(d, torch.nn.GELU()) for _ in range(3))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w = torch.softmax(self.router(h), dim=-1)
        return sum(w[..., e : e + 1] * (self.experts[e](h) - h) for e in range(3)) + h


class StackLM(torch.nn.Module):
    """An embedding, `n` blocks made by `block()`, a head: a test model around a block."""

    def __init__(self, block, n: int = 3, d: int = 16, vocab: int = 96) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(block() for _ in range(n))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class KindsLM(StackLM):
    """Layers of three kinds, the first of them not the largest: dense with SiLU (layers 0
    and 4), mixtures of experts (1 and 3), dense with ReLU (2: the same parameters as
    layer 0, another activation)."""

    def __init__(self, d: int = 16, vocab: int = 96) -> None:
        torch.nn.Module.__init__(self)
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList([
            _Dense(d, torch.nn.SiLU()), _Experts(d), _Dense(d, torch.nn.ReLU()), _Experts(d), _Dense(d, torch.nn.SiLU()),
        ])
        self.head = torch.nn.Linear(d, vocab)


def kinds_parts(model: torch.nn.Module) -> ModelParts:
    """ModelParts of a model with `embed`, `layers` and `head` (KindsLM, StackLM)."""
    return ModelParts(model=model, blocks=list(model.layers), blocks_prefix="layers",
                      pre=lambda m, i: m.embed(i), post=lambda m, h: m.head(h))


# factors far apart from step to step: a share stepped with another iteration's rate is off
# by about lr per element, a thousand times the tests' tolerance
STEEP = (1.0, 0.1, 2.0, 0.0, 0.5, 1.5)


def steep(i: int) -> float:
    return STEEP[i]


def norms_and_position_table(name: str, p: torch.Tensor) -> bool:
    """A no_decay for the tiny GPT: 1-D parameters (inside layers and resident) and the
    position table (resident)."""
    return p.dim() < 2 or name == "wpe.weight"


def optimizer_options():
    """Each optimizer option against plain PyTorch: (snake's AdamW arguments, the
    reference's arguments, alpha). A weight decay of 0.5: a weight decayed or not differs by
    far more than the tolerance; clipping at 0.3, below every norm of the tests' models."""
    from snake import AdamW

    return {
        "lr_schedule": (AdamW(lr_schedule=steep), dict(lr_lambda=steep), 0.3),
        "no_decay": (AdamW(weight_decay=0.5, no_decay=norms_and_position_table),
                     dict(wd=0.5, no_decay=norms_and_position_table), 0.3),
        "max_grad_norm": (AdamW(max_grad_norm=0.3), dict(max_norm=0.3), 1.0),
    }


def schedule_alpha_placement():
    """The cases the optimizer options' parity tests run: both schedules, a delayed share or
    none, the state mixed, on SSD or in memory."""
    from snake import Placement

    mixed = Placement(param=0.5, ckpt=0.3, opt=0.6)
    return [("vertical", 0.0, mixed), ("vertical", 0.3, mixed), ("vertical", 0.3, Placement.all_ssd()),
            ("horizontal", 0.3, mixed), ("horizontal", 0.0, Placement.all_cpu())]


async def straight_and_resumed(tmp_path, model, data, first: int, second: int, **config):
    """`first + second` steps in one trainer, and `first` steps, save, load into a new
    trainer and `second` more (config as SnakeConfig takes it, on the CPU device). Returns
    (straight state, resumed state, the resumed run's report, the checkpoint's manifest)."""
    import json

    from snake import SnakeConfig, SnakeTrainer

    def cfg(d):
        return SnakeConfig(offload_dir=tmp_path / d, device="cpu", **config)

    async with SnakeTrainer(model, data=data, config=cfg("straight")) as t:
        await t.run(first + second)
        straight = await t.state_dict()
    async with SnakeTrainer(model, data=data, config=cfg("first")) as t:
        await t.run(first)
        await t.save(tmp_path / "ckpt")
    async with SnakeTrainer(model, data=data, config=cfg("second")) as t:
        await t.load(tmp_path / "ckpt")
        report = await t.run(second)
        resumed = await t.state_dict()
    return straight, resumed, report, json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
