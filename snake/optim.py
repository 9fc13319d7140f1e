"""AdamW on CPU with fp32 master weights, on split (CPU head, SSD tail) element ranges."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from snake.adapters import ModelParts, flat_named, resident_named_params
from snake.config import AdamW
from snake.errors import ConfigError


def adamw_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    step: int | Sequence[int],
    opt: AdamW,
    lr: float,
    decay: Sequence[bool] | None = None,
) -> None:
    """One AdamW step in place, with torch's fused CPU kernel: the math of
    `torch.optim.AdamW`. `step` is the step count (1-based): one for all the tensors, or one
    per tensor (a parameter that had no gradient in some iterations was not stepped then,
    and counts fewer). `lr`: this iteration's rate (`opt.lr_at` of the iteration's step count:
    a parameter that missed steps still takes the schedule's rate of the iteration).
    `decay`: per tensor, whether it takes weight decay (`decay_flags`); None: every one. The step is element-wise, so any split of a tensor into pieces gives
    the same result as the whole, but for the last bit of a few elements: the kernel handles
    a piece's vector-width remainder apart, with another rounding (cutting 100k elements at
    3, 10 and 77,777 changed 3 of them by up to 1.9e-9 after 5 steps)."""
    counts = [step] * len(params) if isinstance(step, int) else list(step)
    assert len(counts) == len(params), "one step count per tensor"
    assert decay is None or len(decay) == len(params), "one decay flag per tensor"
    flags = [True] * len(params) if decay is None else decay
    for decays in (True, False):  # the weight-decay group, then the one without (`AdamW.no_decay`)
        keep = [i for i, p in enumerate(params) if p.numel() and flags[i] == decays]
        if not keep:
            continue
        torch._fused_adamw_(
            [params[i] for i in keep],
            [grads[i] for i in keep],
            [exp_avgs[i] for i in keep],
            [exp_avg_sqs[i] for i in keep],
            [],
            [torch.tensor(float(counts[i])) for i in keep],
            lr=lr,
            beta1=opt.betas[0],
            beta2=opt.betas[1],
            weight_decay=opt.weight_decay if decays else 0.0,
            eps=opt.eps,
            amsgrad=False,
            maximize=False,
        )


def biases_and_norms(name: str, param: torch.Tensor) -> bool:
    """`AdamW(no_decay=biases_and_norms)`: no weight decay for parameters of fewer than two
    dimensions (biases, the weights of LayerNorm and RMSNorm), weight decay for the matrices
    and embeddings: nanoGPT's and most LLM recipes' two groups."""
    return param.dim() < 2


def decay_flags(parts: ModelParts, opt: AdamW) -> tuple[list[list[bool] | None], list[bool]]:
    """Which trained parameters take weight decay under `opt.no_decay`: per layer, one flag
    per parameter of its flat state (`flat_named`), None where every one does; and one per
    resident parameter (`resident_named_params`). A no_decay that raises or does not give a
    bool is a ConfigError naming it and the parameter."""
    blocks, prefix = parts.blocks, parts.blocks_prefix
    res = resident_named_params(parts)
    if opt.no_decay is None:
        return [None] * len(blocks), [True] * len(res)

    def decays(name: str, p: torch.Tensor) -> bool:
        assert opt.no_decay is not None
        try:
            off = opt.no_decay(name, p)
        except Exception as exc:
            raise ConfigError("optimizer.no_decay", _name(opt.no_decay), f"raised {type(exc).__name__}: {exc} for {name!r}",
                              "it is called with each trained parameter's name and the parameter") from exc
        if not isinstance(off, bool):
            raise ConfigError("optimizer.no_decay", _name(opt.no_decay), f"gave {off!r} for {name!r}",
                              "it must return True (no weight decay) or False")
        return not off

    layers: list[list[bool] | None] = []
    for i, block in enumerate(blocks):
        flags = [decays(f"{prefix}.{i}.{n}", p) for n, p in flat_named(block)]
        layers.append(None if all(flags) else flags)
    return layers, [decays(n, p) for n, p in res]


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", type(fn).__qualname__)
