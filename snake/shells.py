"""A layer kind's shell: a copy of its first block whose parameters are placeholders, bound
to each layer's weights before every call, and what else differs per layer (scalar
attributes, buffers, parameters kept in float32, weights tied inside a block)."""

from __future__ import annotations

import copy

import torch
from torch import nn


def _shell(block: nn.Module) -> nn.Module:
    """A copy of `block` whose parameters are empty placeholders (a tied weight stays one
    placeholder): `bind` puts each layer's in before every call, so copying the block's
    own weights (one layer of memory per kind, on the device) would be waste."""
    memo: dict[int, object] = {
        id(p): nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad) for p in block.parameters()
    }
    return copy.deepcopy(block, memo)


def _mapping_of(named: list[tuple[str, nn.Parameter]], dtype: torch.dtype) -> torch.Tensor | None:
    """The flat mapping an earlier trainer's `map_frozen` pointed these parameters (a layer's
    streamed frozen ones, in order) at, or None: they are consecutive views of one storage
    of `dtype`, which they fill."""
    if not named or not all(getattr(p, "snake_mapped", False) and p.dtype == dtype for _, p in named):
        return None
    storage = named[0][1].untyped_storage()
    n = sum(p.numel() for _, p in named)
    esize = torch.empty((), dtype=dtype).element_size()
    if storage.nbytes() != n * esize:
        return None
    flat = torch.empty(0, dtype=dtype).set_(storage, 0, (n,), (1,))
    off = 0
    for _, p in named:
        if p.data_ptr() != flat.data_ptr() + off * esize or not p.is_contiguous():
            return None
        off += p.numel()
    return flat


def _share_frozen(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    """Point the model's frozen parameters at snake's CPU copy of them, `flat` (the same
    values), where they are CPU tensors of its dtype: the frozen weights of a LoRA-style
    fine-tune, most of the model, are then not held twice in CPU memory. Where they differ
    in dtype (a float32 model computed in bfloat16) the model keeps its own."""
    if not all(p.dtype == flat.dtype and p.device.type == "cpu" for p in params):
        return
    off = 0
    with torch.no_grad():
        for p in params:
            p.data = flat[off : off + p.numel()].view(p.shape)
            off += p.numel()


def _keep_fp32(shell: nn.Module, block: nn.Module, kept: frozenset[str], device: torch.device) -> None:
    """Put back in float32 what `block` keeps in float32 (`kept_fp32`) after the shell's
    conversion to the compute dtype: parameter placeholders (bound per layer) and buffers
    (as the block has them)."""
    params = [n for n, _ in shell.named_parameters() if n in kept]
    for where in _param_sites(shell, params):  # a weight tied inside the block: at every place
        placeholder = nn.Parameter(torch.empty(0, dtype=torch.float32, device=device))
        for module, attr in where:
            module._parameters[attr] = placeholder
    for name in kept.difference(params):
        owner, _, attr = name.rpartition(".")
        module = shell.get_submodule(owner)
        if attr in module._buffers:
            module._buffers[attr] = block.get_buffer(name).detach().to(device).clone()


_ABSENT = object()


_SCALARS = (bool, int, float, str, type(None))


# what every nn.Module keeps in its instance dict (hook tables, flags): never a layer's own
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _plain(value: object) -> bool:
    """A scalar, or a tuple / list of scalars: a value a layer can differ in and the shell
    can take (compared with ==)."""
    if isinstance(value, tuple | list):
        return all(isinstance(v, _SCALARS) for v in value)
    return isinstance(value, _SCALARS)


def _scalar_attrs(block: nn.Module) -> dict[tuple[str, str], object]:
    """(submodule name, attribute) -> value for the plain attributes of a block's modules
    (scalars and tuples / lists of them, `_private` ones too), nn.Module's own aside."""
    return {
        (name, attr): value
        for name, mod in block.named_modules()
        for attr, value in vars(mod).items()
        if attr not in _MODULE_INTERNALS and not attr.startswith("__") and _plain(value)
    }


def _layer_attrs(shell: nn.Module, blocks: list[nn.Module]) -> list[list[tuple[nn.Module, str, object]]]:
    """Per layer, what to set on the shell (a copy of block 0) to make it that layer beyond
    its parameters: each scalar attribute in which some layer differs from block 0 (a layer
    index, an attention window, whether it applies rotary embeddings), at this layer's
    value (_ABSENT: this layer's module has no such attribute). Empty where no layer
    differs, as in the built-in GPT."""
    per_layer = [_scalar_attrs(b) for b in blocks]
    keys = sorted({k for attrs in per_layer for k, v in attrs.items() if per_layer[0].get(k, _ABSENT) != v}
                  | {k for k in per_layer[0] if any(k not in attrs for attrs in per_layer)})
    if not keys:
        return []
    modules = dict(shell.named_modules())
    return [[(modules[name], attr, attrs.get((name, attr), _ABSENT)) for name, attr in keys if name in modules]
            for attrs in per_layer]


def _layer_buffers(
    shell: nn.Module, blocks: list[nn.Module], device: torch.device
) -> list[list[tuple[nn.Module, str, torch.Tensor]]]:
    """Per layer (of one kind), what to set on the kind's shell to give it the layer's own
    buffer values: each buffer whose values differ between the layers (a router's
    per-expert bias), as the layer's copy on the device in the shell's dtype. Empty lists
    where every layer has the same values (a rotary table, a causal mask)."""
    named = [dict(b.named_buffers()) for b in blocks]
    differ = [n for n, x in named[0].items() if any(not torch.equal(x, other[n]) for other in named[1:])]
    # every name of each buffer in the first block (one registered under two names, an
    # alias, is set at both: the shell's dtype conversion made two tensors of it)
    aliases: dict[int, list[str]] = {}
    for name, buf in blocks[0].named_buffers(remove_duplicate=False):
        aliases.setdefault(id(buf), []).append(name)
    modules = dict(shell.named_modules())
    own = dict(shell.named_buffers(remove_duplicate=False))
    out: list[list[tuple[nn.Module, str, torch.Tensor]]] = [[] for _ in blocks]
    for name in differ:
        sites = [(modules[n.rpartition(".")[0]], n.rpartition(".")[2]) for n in aliases[id(named[0][name])]]
        for i, bufs in enumerate(named):
            value = bufs[name].to(device=device, dtype=own[name].dtype).clone()
            out[i].extend((module, attr, value) for module, attr in sites)
    return out


def _param_sites(module: nn.Module, names: list[str]) -> list[list[tuple[nn.Module, str]]]:
    """For each parameter name of `module` (as `named_parameters` lists them), every
    (submodule, attribute) holding that parameter: a weight shared inside a block is bound
    at all its places."""
    sites: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for attr, p in sub._parameters.items():
            if p is not None:
                sites.setdefault(id(p), []).append((sub, attr))
    named = dict(module.named_parameters())
    return [sites[id(named[n])] for n in names]
