"""`SnakeTrainer.state_dict()`'s assembly, on a helper thread: the trained parameters' fp32
masters from the stores (CPU memory, SSD) one layer at a time, with the model's keys; the
frozen parameters and buffers as the trainer computes with them; before the first run the
model's own values (a streamed model's frozen weights read from its files)."""

from __future__ import annotations

import threading

import torch
from torch import nn

from snake.adapters import ModelParts, flat_named, frozen_values, layer_specs, layer_values
from snake.buffers import HostBuffer
from snake.engine import Engine
from snake.errors import Stopped


def initial_state_dict(parts: ModelParts, stop: threading.Event, trained_only: bool) -> dict[str, torch.Tensor]:
    """Before the first run: the model's own values (the masters it starts from), a
    streamed model's frozen layer weights read from its files."""
    sd = parts.model.state_dict()
    if trained_only:
        sd = {k: v for k, v in sd.items() if k in _trained_keys(parts.model)}
    prefix = parts.blocks_prefix + "."
    for i, block in enumerate(parts.blocks):  # layers on the meta device: read
        _check_stop(stop)
        named = [(n, p) for n, p in flat_named(block) if p.is_meta]
        for (n, _), v in zip(named, layer_values(parts, i, named), strict=True):
            sd[f"{prefix}{i}.{n}"] = v
    for name, v in ({} if trained_only else frozen_values(parts)).items():
        if sd.get(name) is not None and sd[name].is_meta:
            sd[name] = v
    out = {}
    trained = _trained_keys(parts.model)
    for k, v in sd.items():
        _check_stop(stop)
        out[k] = v.detach().float().clone() if k in trained and v.is_floating_point() else _as_given(v)
    return out

def assemble_state_dict(parts: ModelParts, e: Engine, scratch: HostBuffer | None, stop: threading.Event,
                        trained_only: bool) -> dict[str, torch.Tensor]:
    """Each tensor copied once from the stores into its own: beside the result it holds
    one layer's master weights at a time (a state_dict of every layer's first held
    twice the model's fp32 state), their SSD tails read through `scratch`."""
    model = parts.model
    resident = e.kernels.resident.index()
    held: tuple[int, torch.Tensor] | None = None  # the layer whose masters the keys read
    canonical: dict[int, str] = {}
    alias: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        alias[name] = canonical.setdefault(id(p), name)
    offsets = []  # per layer: name -> (first element in the layer's flat state, shape)
    for block, spec in zip(parts.blocks, layer_specs(parts), strict=True):
        here, off = {}, 0
        for name, shape in spec:
            here[name] = (off, shape)
            off += shape.numel()
        # a weight tied inside the block: every name it has reads the one state
        first: dict[int, str] = {}
        for name, p in block.named_parameters(remove_duplicate=False):
            owner = first.setdefault(id(p), name)
            if owner in here:
                here[name] = here[owner]
        offsets.append(here)
    prefix = parts.blocks_prefix + "."
    out: dict[str, torch.Tensor] = {}
    frozen_read: tuple[int, dict[str, torch.Tensor]] | None = None  # a layer's, read from the files
    keep = _trained_keys(model) if trained_only else None
    for key, value in model.state_dict().items():
        _check_stop(stop)
        if keep is not None and key not in keep:
            continue
        if alias.get(key) in resident:  # pre/post's, and the blocks' kept in float32
            out[key] = e.kernels.resident.master_of(resident[alias[key]])
            continue
        if key.startswith(prefix):
            i_str, _, pname = key[len(prefix) :].partition(".")
            i = int(i_str)
            if pname in offsets[i]:
                if held is None or held[0] != i:
                    held = None  # the layer before goes first
                    held = (i, e.layer_master(i, scratch))
                o, shape = offsets[i][pname]
                out[key] = held[1][o : o + shape.numel()].view(shape).clone()
                continue
        if value.is_meta and key.startswith(prefix):  # frozen, left in a streamed model's files
            i_str, _, pname = key[len(prefix) :].partition(".")
            if frozen_read is None or frozen_read[0] != int(i_str):
                frozen_read = None
                frozen_read = (int(i_str), _meta_values(parts, int(i_str)))
            value = frozen_read[1][pname]
        # buffers and frozen parameters, as the trainer computes with them
        computed = e.kernels.outer_as_computed(alias.get(key, key), value, "state_dict() gives that value")
        out[key] = _as_given(value if computed is None else computed)
    return out

def _check_stop(stop: threading.Event) -> None:
    if stop.is_set():
        raise Stopped("state_dict cancelled part-way")

def _as_given(t: torch.Tensor) -> torch.Tensor:
    """A buffer's or frozen parameter's copy for `state_dict()`: in float32 where it is a
    narrower float (as the trained parameters' fp32 masters are), else in its own dtype (a
    float64 or integer buffer exactly as it is)."""
    t = t.detach()
    if t.is_floating_point() and t.element_size() < 4:
        return t.float()
    return t.clone()

def _trained_keys(model: nn.Module) -> set[str]:
    """The names (every one of a tied weight) of the model's trained parameters."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}

def _meta_values(parts: ModelParts, layer: int) -> dict[str, torch.Tensor]:
    """Layer `layer`'s parameters on the meta device (frozen ones a streamed model left in
    its files), read, by their names in the block."""
    named = [(n, p) for n, p in parts.blocks[layer].named_parameters(remove_duplicate=False) if p.is_meta]
    return {n: v for (n, _), v in zip(named, layer_values(parts, layer, named), strict=True)}
