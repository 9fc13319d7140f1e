"""AdamW on CPU with fp32 master weights, on split (CPU head, SSD tail) element ranges."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from snake.config import AdamW


def adamw_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    step: int | Sequence[int],
    opt: AdamW,
) -> None:
    """One AdamW step in place, with torch's fused CPU kernel: the math of
    `torch.optim.AdamW`. `step` is the step count (1-based): one for all the tensors, or one
    per tensor (a parameter that had no gradient in some iterations was not stepped then,
    and counts fewer). The step is element-wise, so any split of a tensor into pieces gives
    the same result as the whole, but for the last bit of a few elements: the kernel handles
    a piece's vector-width remainder apart, with another rounding (cutting 100k elements at
    3, 10 and 77,777 changed 3 of them by up to 1.9e-9 after 5 steps)."""
    counts = [step] * len(params) if isinstance(step, int) else list(step)
    assert len(counts) == len(params), "one step count per tensor"
    keep = [i for i, p in enumerate(params) if p.numel()]
    if not keep:
        return
    steps = [torch.tensor(float(counts[i])) for i in keep]
    torch._fused_adamw_(
        [params[i] for i in keep],
        [grads[i] for i in keep],
        [exp_avgs[i] for i in keep],
        [exp_avg_sqs[i] for i in keep],
        [],
        steps,
        lr=opt.lr,
        beta1=opt.betas[0],
        beta2=opt.betas[1],
        weight_decay=opt.weight_decay,
        eps=opt.eps,
        amsgrad=False,
        maximize=False,
    )
