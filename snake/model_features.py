"""PyTorch features of a user's model that snake's way of running it would change, refused
by name before anything is written: snake calls the model's parts (embedding, each layer
through its kind's shell, head), never the model's own forward, and runs each layer's
forward again for its backward (the recompute), with weights that are its fp32 masters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from snake.errors import ModelError

if TYPE_CHECKING:
    from snake.adapters import ModelParts

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hook_signature(block: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The hooks on a block and its submodules, by name (their functions' identities): layers
    with other hooks are kinds of their own (`layer_kinds`), each shell carrying its own."""
    out = []
    for name, m in block.named_modules():
        ids = tuple(id(h) for attr in _HOOKS for h in getattr(m, attr, {}).values())
        if ids:
            out.append((name, ids))
    return tuple(out)


def check_features(parts: ModelParts, blocks: Sequence[nn.Module]) -> None:
    """ModelError for a feature of the model that snake would run otherwise than PyTorch."""
    _check_distinct(blocks)
    _check_outer_hooks(parts)
    for name, m in parts.model.named_modules():
        _check_module(name, m)


def _check_distinct(blocks: Sequence[nn.Module]) -> None:
    seen: dict[int, int] = {}
    for i, b in enumerate(blocks):
        if id(b) in seen:
            raise ModelError(
                f"model: block {i} is block {seen[id(b)]} again (one module listed twice); each layer needs a "
                "module of its own: give it a copy (copy.deepcopy), or list the module once"
            )
        seen[id(b)] = i


def _check_outer_hooks(parts: ModelParts) -> None:
    """Hooks on the modules whose forward snake never calls: the model and the modules that
    hold the layers (it calls the embedding, the layers and the head, not their forward)."""
    prefix = parts.blocks_prefix.split(".")
    holders = {".".join(prefix[:k]) for k in range(len(prefix) + 1)}
    for name, m in parts.model.named_modules():
        if name not in holders:
            continue
        for attr in _HOOKS:
            for hook in getattr(m, attr, {}).values():
                where = f"{name!r}" if name else "the model itself"
                raise ModelError(
                    f"model: {where} has a {attr.strip('_').replace('_', ' ').removesuffix('s')} "
                    f"({getattr(hook, '__qualname__', type(hook).__name__)}), which would never run: snake calls "
                    "the model's embedding, layers and head, not the forward of the modules holding them; "
                    "register it on those parts (a layer's hooks run there, in every recompute too), or remove it"
                )


def _check_module(name: str, m: nn.Module) -> None:
    where = f"{name!r} ({type(m).__name__})"
    if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
        raise ModelError(
            f"model: {where} keeps running statistics, which its forward updates in training: snake runs a "
            "layer's forward again for its backward (and the embedding's), so they would be updated twice, and "
            "it keeps no per-layer copy of them; use track_running_stats=False, or a norm without them "
            "(LayerNorm, GroupNorm, RMSNorm)"
        )
    if isinstance(m, nn.Embedding | nn.EmbeddingBag):
        if m.sparse:
            raise ModelError(f"model: {where} has sparse=True: its gradients would be sparse, which AdamW does not "
                             "take (torch's refuses them too); use sparse=False")
        if m.max_norm is not None:
            raise ModelError(
                f"model: {where} has max_norm={m.max_norm}: its forward renormalizes the weight in place, which "
                "snake's weights (its fp32 masters, stepped by its own AdamW) would not follow; use "
                "max_norm=None (and renormalize out of place in the model's code where needed)"
            )
    for hook in getattr(m, "_forward_pre_hooks", {}).values():
        if _is_spectral(hook):
            raise _spectral_error(where)
    for p in _parametrizations(m):
        if _is_spectral(p):
            raise _spectral_error(where)


def _parametrizations(m: nn.Module) -> list[Any]:
    found = getattr(m, "parametrizations", None)
    if not isinstance(found, nn.ModuleDict):
        return []
    return [p for plist in found.values() for p in list(plist.children())]


def _is_spectral(obj: Any) -> bool:
    """torch's spectral norm: a parametrization (`parametrizations.spectral_norm`) or the
    older forward pre-hook (`utils.spectral_norm`), whose power iteration updates buffers
    (u, v) in each training forward."""
    return type(obj).__name__ in ("_SpectralNorm", "SpectralNorm") and type(obj).__module__.startswith("torch.nn")


def _spectral_error(where: str) -> ModelError:
    return ModelError(
        f"model: {where} has a spectral norm, whose power iteration updates its buffers (u, v) in each training "
        "forward: snake runs a layer's forward again for its backward, so they would be updated twice, and it "
        "keeps no per-layer copy of them; remove it, or compute the norm in the model's code without buffers"
    )


def requires_grad_flags(model: nn.Module) -> list[tuple[str, bool]]:
    """Each parameter's name and requires_grad: what the trainer was built to train."""
    return [(n, p.requires_grad) for n, p in model.named_parameters(remove_duplicate=False)]


def check_flags_unchanged(model: nn.Module, built: list[tuple[str, bool]]) -> None:
    """ModelError where a parameter's requires_grad changed since the trainer was built:
    what it trains (its masters, its optimizer state, its layers' layout) was fixed then."""
    now = requires_grad_flags(model)
    if now == built:
        return
    changed = next(((n, b) for (n, b), (_, a) in zip(now, built, strict=False) if a != b), None)
    what = (f"{changed[0]!r} has requires_grad={changed[1]} now, {not changed[1]} when the trainer was made"
            if changed else "its parameters changed since the trainer was made")
    raise ModelError(
        f"model: {what}; what a trainer trains is fixed when it is made: set requires_grad before, or save, "
        "make a new trainer of the model as it is now and load the checkpoint"
    )


def layer_output(y: object, x: torch.Tensor, layer: int) -> torch.Tensor:
    """A layer's output, which must be the next layer's input: a tensor of its input's shape
    (ModelError naming the fix for a block that returns a tuple or a dict). Not probed
    before the run: running a user's layer outside training may change what it keeps (a
    recurrent layer's cached state)."""
    if isinstance(y, torch.Tensor) and y.shape == x.shape:
        return y
    got = f"a tensor of shape {tuple(y.shape)}" if isinstance(y, torch.Tensor) else f"a {type(y).__name__}"
    raise ModelError(
        f"model: layer {layer} gave {got} for a hidden state of shape {tuple(x.shape)}; a layer must give the "
        "hidden state for the next one: give ModelParts a block_fn that takes it out (e.g. "
        "block_fn=lambda block, h: block(h)[0])"
    )


def reentrant_error(e: RuntimeError, layer: int) -> ModelError | None:
    """The ModelError for torch.utils.checkpoint(use_reentrant=True) in a layer, whose
    backward refuses torch.autograd.grad (snake takes each layer's so); None for another
    error."""
    text = str(e)
    if "checkpoint" not in text.lower() or ".grad()" not in text:
        return None
    return ModelError(
        f"model: layer {layer} uses torch.utils.checkpoint with use_reentrant=True, whose backward cannot be "
        "taken with torch.autograd.grad, as snake takes each layer's; use use_reentrant=False (snake recomputes "
        "each layer for its backward already)"
    )
