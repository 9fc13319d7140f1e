"""PEFT's wrappers on a streamed model's layers: the stored names under them, and the
adapters PEFT made on the meta device, initialised as PEFT would have."""

from __future__ import annotations

import contextlib
import copy
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from snake.adapters import ModelParts, check_param_wrappers, has_peft_layers
from snake.errors import ModelError

# the path components PEFT puts between a wrapped module and its own parameters: a tuner
# layer's `base_layer` (LoRA, DoRA, IA3), `original_module` and the trained copies
# `modules_to_save.<adapter>` of `modules_to_save` (a copy starts as the original)
_PEFT_WRAPS = re.compile(r"(?<![^.])(?:base_layer|original_module|modules_to_save\.[^.]+)\.")


def _unwrapped_name(name: str) -> str:
    """A parameter's name in a layer PEFT wrapped -> its name in the layer as stored."""
    return _PEFT_WRAPS.sub("", name)


class _PeftNames(Mapping[str, torch.Tensor]):
    """One layer's stored weights (`_LayerSource`'s) by the names of the layer PEFT wrapped."""

    def __init__(self, read: Mapping[str, torch.Tensor]) -> None:
        self.read = read

    @staticmethod
    def of(weights: Callable[[int], Mapping[str, torch.Tensor]]) -> Callable[[int], Mapping[str, torch.Tensor]]:
        return lambda layer: _PeftNames(weights(layer))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read[_unwrapped_name(name)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and _unwrapped_name(name) in self.read

    def __iter__(self) -> Iterator[str]:
        return iter(self.read)

    def __len__(self) -> int:
        return len(self.read)


def _peft_inner(module: nn.Module) -> nn.Module | None:
    """The module a PEFT wrapper wraps (a tuner layer's base layer, `modules_to_save`'s
    original), None for a module PEFT did not wrap."""
    if not type(module).__module__.startswith("peft."):
        return None
    get_base = getattr(module, "get_base_layer", None)
    inner = get_base() if callable(get_base) else getattr(module, "original_module", None)
    return inner if isinstance(inner, nn.Module) and inner is not module else None


def _unwrap(block: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Put each module PEFT wrapped in `block` in its wrapper's place; returns (parent,
    name, wrapper) of each."""
    swaps = []
    for parent in list(block.modules()):
        for name, child in list(parent._modules.items()):
            inner = _peft_inner(child) if child is not None else None
            if child is not None and inner is not None:
                swaps.append((parent, name, child))
                parent._modules[name] = inner
    return swaps


@contextlib.contextmanager
def _peft_unwrapped(block: nn.Module) -> Iterator[None]:
    """`block` with each module PEFT wrapped in its place, unwrapped, until the end."""
    swaps = _unwrap(block)
    try:
        yield
    finally:
        for parent, name, child in reversed(swaps):
            parent._modules[name] = child


def _base_free(config: Any) -> bool:
    """Whether a PEFT config's initialisation of its adapters reads no base weight: LoRA's
    default (A as an nn.Linear, B zero), "gaussian" and none (False), without DoRA (whose
    magnitude is the base weight's norm); IA3's (ones)."""
    kind = type(config).__name__
    if kind == "LoraConfig":
        return not getattr(config, "use_dora", False) and config.init_lora_weights in (True, False, "gaussian")
    return kind == "IA3Config"


def _stored_names(block: nn.Module) -> set[str]:
    """The names of a layer's parameters and buffers as stored (PEFT's wrappers unwrapped)."""
    copy_ = copy.deepcopy(block)  # what is on the meta device allocates nothing
    _unwrap(copy_)
    return {n for n, _ in [*copy_.named_parameters(remove_duplicate=False), *copy_.named_buffers()]}


def _init_adapters(model: nn.Module, parts: ModelParts) -> int:
    assert parts.weights is not None
    configs = getattr(model, "peft_config", None)
    prefix = parts.blocks_prefix + "."
    outside = next((n for n, p in model.named_parameters() if p.is_meta and not n.startswith(prefix)), None)
    if outside is not None and has_peft_layers(model):
        raise ModelError(
            f"model: PEFT left {outside}, outside the layers, on the meta device (get_peft_model(..., "
            "low_cpu_mem_usage=True) makes the adapters without their values); snake initialises the "
            "adapters of a streamed model's layers only: call get_peft_model without low_cpu_mem_usage"
        )
    check_param_wrappers(parts)
    made: list[tuple[dict[str, Any], str, torch.Tensor]] = []  # put in once every layer's are made
    for i, block in enumerate(parts.blocks):
        if not any(t.is_meta for t in [*block.parameters(), *block.buffers()]):
            continue
        copy_ = copy.deepcopy(block)
        _unwrap(copy_)  # the layer as stored
        stored = {n for n, _ in [*copy_.named_parameters(remove_duplicate=False), *copy_.named_buffers()]}
        todo = [(n, t) for n, t in [*block.named_parameters(remove_duplicate=False), *block.named_buffers()]
                if t.is_meta and _unwrapped_name(n) not in stored]
        if not todo:
            continue
        if not isinstance(configs, dict) or not configs:
            raise ModelError(
                f"model: {parts.blocks_prefix}.{i}.{todo[0][0]} of a model from stream_hf is on the meta device "
                "and the files do not hold it, and the model has no PEFT config to initialise it with "
                "(peft_config); make the adapters with peft.get_peft_model"
            )
        made += _init_layer(parts, i, block, copy_, todo, configs)
    for where, attr, t in made:
        where[attr] = t
    return len(made)


def _init_layer(parts: ModelParts, layer: int, block: nn.Module, copy_: nn.Module,
                todo: list[tuple[str, torch.Tensor]], configs: dict[str, Any]
                ) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    """Layer `layer`'s adapters `todo` (parameters and buffers on the meta device), made by
    PEFT on `copy_`, a copy of `block` as stored (unwrapped), given the stored weights here:
    (the `_parameters` or `_buffers` of its module in `block`, attribute, tensor) of each."""
    from peft import inject_adapter_in_model

    from snake.adapters import layer_values

    read = not all(_base_free(c) for c in configs.values())
    # the copy's weights read from the files, or (where the initialisation does not read
    # them) allocated and left as they are
    named = [(n, p) for n, p in copy_.named_parameters(remove_duplicate=False) if p.is_meta]
    if read:
        values = layer_values(parts, layer, named)
    else:
        values = [torch.empty(p.shape, dtype=p.dtype) for _, p in named]
    mods = dict(copy_.named_modules())
    for (name, _), v in zip(named, values, strict=True):
        mod_name, _, attr = name.rpartition(".")
        mods[mod_name]._parameters[attr] = nn.Parameter(v, requires_grad=False)
    before = {n: v.clone() for (n, _), v in zip(named, values, strict=True)} if read else {}
    # PEFT finds its targets by their path in the model: the copy sits at the layer's path
    root: nn.Module = nn.Module()
    node = root
    *path, last = f"{parts.blocks_prefix}.{layer}".split(".")
    for step in path:
        node.add_module(step, nn.Module())
        node = node.get_submodule(step)
    node.add_module(last, copy_)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's own notes on a model it sees again
        for adapter, config in configs.items():
            if getattr(config, "trainable_token_indices", None) is not None:  # the embedding's, outside the layer
                config = copy.copy(config)
                config.trainable_token_indices = None
            try:
                inject_adapter_in_model(config, root, adapter_name=adapter)
            except (ValueError, TypeError, NotImplementedError) as e:
                raise ModelError(
                    f"model: PEFT could not make adapter {adapter!r} ({type(config).__name__}) of layer {layer} again "
                    f"to initialise it ({str(e).strip().splitlines()[0][:300]}); load the model with "
                    "snake.hf.load_hf(dir) before get_peft_model"
                ) from None
    made: dict[str, torch.Tensor] = {**dict(copy_.named_buffers()), **dict(copy_.named_parameters(remove_duplicate=False))}
    for name, v in before.items():
        now = made.get(_find_wrapped(made, name))
        if now is not None and not torch.equal(now.detach(), v):
            kinds = sorted({str(getattr(c, "init_lora_weights", type(c).__name__)) for c in configs.values()})
            raise ModelError(
                f"model: the adapters' initialisation ({', '.join(kinds)}) changes the base weight "
                f"{parts.blocks_prefix}.{layer}.{name}, which stream_hf keeps in its files as stored; initialise "
                "them so that the base stays (init_lora_weights=True, 'gaussian'), or load the model with "
                "snake.hf.load_hf(dir) before get_peft_model"
            )
    mods = dict(block.named_modules())
    out: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for name, t in todo:
        got = made.get(name)
        if got is None or got.is_meta or tuple(got.shape) != tuple(t.shape):
            raise ModelError(
                f"model: PEFT made no {parts.blocks_prefix}.{layer}.{name} of shape {tuple(t.shape)} when it made "
                "the layer's adapters again (its configs in model.peft_config differ from what made them); "
                "load the model with snake.hf.load_hf(dir) before get_peft_model"
            )
        mod_name, _, attr = name.rpartition(".")
        value = got.detach().to(t.dtype if t.is_floating_point() else got.dtype).clone()
        if isinstance(t, nn.Parameter):
            # trained where both say so: PEFT's move to the meta device re-made some as trained
            # (AdaLoRA's rank count), an adapter not active is not
            new = nn.Parameter(value, requires_grad=t.requires_grad and got.requires_grad)
            new.snake_read = True  # type: ignore[attr-defined]  # initialised by snake, not left by to_empty
            out.append((mods[mod_name]._parameters, attr, new))
        else:
            out.append((mods[mod_name]._buffers, attr, value))
    return out


def _find_wrapped(made: Mapping[str, Any], name: str) -> str:
    """The name in a layer PEFT wrapped of its stored parameter `name`."""
    return next((n for n in made if _unwrapped_name(n) == name and n != name), name)
