"""How snake sees a model: resident `pre` (embeddings) and `post` (final norm, head),
and N uniform `blocks` (hidden -> hidden) that stream through the device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from snake.errors import ModelError

PreFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]
PostFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]
BlockFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _call_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x)


@dataclass(frozen=True, eq=False)
class ModelParts:
    """An explicit description of a model, for any `nn.Module`.

    model: owns every parameter. blocks: the uniform layers, in order, all submodules of
    `model` under `blocks_prefix` (state_dict keys `f"{blocks_prefix}.{i}.{name}"`).
    pre(model, idx) -> hidden; post(model, hidden) -> logits; block_fn(block, hidden) ->
    hidden (default: `block(hidden)`). Parameters outside the blocks are resident;
    tied weights must be there."""

    model: nn.Module
    blocks: Sequence[nn.Module]
    blocks_prefix: str
    pre: PreFn
    post: PostFn
    block_fn: BlockFn = _call_block


def describe(model: nn.Module | ModelParts) -> ModelParts:
    """Recognise a model (built-in GPT; Hugging Face adapters live in snake.hf) or accept
    an explicit ModelParts. Raises ModelError with what to do otherwise."""
    from snake.models.gpt import GPT

    if isinstance(model, ModelParts):
        parts = model
    elif isinstance(model, GPT):
        parts = ModelParts(
            model=model,
            blocks=list(model.blocks),
            blocks_prefix="blocks",
            pre=_gpt_pre,
            post=_gpt_post,
        )
    else:
        hf = _try_hf(model)
        if hf is None:
            raise ModelError(
                f"model: cannot find uniform transformer blocks in {type(model).__name__}; "
                "pass snake.ModelParts(model, blocks=..., blocks_prefix=..., pre=..., post=...) "
                "describing its embedding (pre), its layers (blocks) and its head (post)"
            )
        parts = hf
    check_parts(parts)
    return parts


def _gpt_pre(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return model.embed(idx)  # type: ignore[operator]


def _gpt_post(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return model.head(h)  # type: ignore[operator]


def _try_hf(model: nn.Module) -> ModelParts | None:
    try:
        from snake.hf import describe_hf
    except ImportError:
        return None
    return describe_hf(model)


def check_parts(parts: ModelParts) -> None:
    if not isinstance(parts.model, nn.Module):
        raise ModelError(f"model: expected a torch.nn.Module, got {type(parts.model).__name__}")
    blocks = list(parts.blocks)
    if not blocks:
        raise ModelError("model: no blocks found; a model needs at least one block to stream")
    sig0 = _signature(blocks[0])
    if not sig0:
        raise ModelError("model: blocks have no parameters; nothing to offload")
    for i, b in enumerate(blocks[1:], start=1):
        if type(b) is not type(blocks[0]) or _signature(b) != sig0:
            raise ModelError(
                f"model: block {i} ({type(b).__name__}) differs from block 0 in its parameters; "
                "snake streams uniform blocks: describe non-uniform layers as pre/post"
            )
    names = dict(parts.model.named_modules())
    for i, b in enumerate(blocks):
        if names.get(f"{parts.blocks_prefix}.{i}") is not b:
            raise ModelError(
                f"model: block {i} is not the submodule '{parts.blocks_prefix}.{i}'; "
                "set blocks_prefix so that blocks are model.<prefix>.<i>"
            )


def _signature(block: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((n, tuple(p.shape)) for n, p in block.named_parameters())


def block_param_names(parts: ModelParts) -> list[tuple[str, torch.Size]]:
    return [(n, p.shape) for n, p in parts.blocks[0].named_parameters()]


def resident_named_params(parts: ModelParts) -> list[tuple[str, nn.Parameter]]:
    """Parameters outside the blocks (deduplicated: tied weights appear once)."""
    prefix = parts.blocks_prefix + "."
    return [(n, p) for n, p in parts.model.named_parameters() if not n.startswith(prefix)]
