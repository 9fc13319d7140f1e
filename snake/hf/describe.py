"""`describe_hf` and `init_adapters`: the public entry points that turn a Hugging Face model
(loaded, or streamed from its files, with PEFT's adapters or without) into `ModelParts`."""

from __future__ import annotations

import dataclasses

from torch import nn

from snake.adapters import ModelParts, has_peft_layers
from snake.errors import ModelError
from snake.hf.parts import _describe_hf
from snake.hf.peft_layers import _init_adapters, _PeftNames, _stored_names, _unwrapped_name


def describe_hf(model: nn.Module) -> ModelParts | None:
    """ModelParts for a supported Hugging Face causal LM, None for any other module.

    Raises ModelError for a supported class whose configuration snake cannot stream
    (layers that differ by their index, an unsupported attention implementation). A model
    from `stream_hf` gets its layers' weights from their files (`ModelParts.weights`)."""
    parts = _describe_hf(model)
    weights = getattr(model, "snake_layer_weights", None)
    if parts is None or weights is None:
        return parts
    if has_peft_layers(model):
        # PEFT wrapped some of the layers' modules (`q_proj` is now `q_proj.base_layer`): the
        # files hold them by their own names; the adapters it made beside them are on the
        # meta device with the layers, uninitialised, until snake initialises them
        weights = _PeftNames.of(weights)
        parts = dataclasses.replace(parts, weights=weights)
        _init_adapters(model, parts)
    # a layer parameter is on the meta device, or real because snake read it from the files
    # (frozen ones) or PEFT made it (an adapter the files do not hold: one added after the
    # first, which PEFT initialises itself): one made real otherwise (model.to_empty) would
    # train on whatever it holds
    for i, block in enumerate(parts.blocks):
        stored: set[str] | None = None  # taken where needed: a copy of the layer
        for name, p in block.named_parameters():
            if p.is_meta or getattr(p, "snake_read", False):
                continue
            if stored is None and has_peft_layers(block):
                stored = _stored_names(block)
            if stored is not None and _unwrapped_name(name) not in stored:
                continue
            raise ModelError(
                f"model: {parts.blocks_prefix}.{i}.{name} of a model from stream_hf is no longer on the "
                "meta device, and snake did not read it (model.to_empty(...) leaves memory as it finds "
                "it): load the model again; a streamed model stays where stream_hf put it (.to(dtype) "
                "is fine, .to(device) is not)"
            )
    return dataclasses.replace(parts, weights=weights)


def init_adapters(model: nn.Module) -> int:
    """Initialise the adapters PEFT put into the layers of a model from `stream_hf` (a
    `PeftModel` or its base model) with PEFT's own initialisation, one layer at a time.

    `get_peft_model` makes a layer's adapters beside its weights, which `stream_hf` leaves
    in their files on the meta device, so the adapters are left there too, uninitialised.
    Here each layer's adapters are made again by PEFT (`inject_adapter_in_model`, the
    model's PEFT configs) on a copy of the layer whose weights are read from the files
    where the initialisation reads them (DoRA's magnitude), else left unread; they
    are put into the model's layer in the dtype PEFT gave them, and the layer's weights stay
    in their files. Layer by layer in order, the adapters draw from torch's random
    generator as `get_peft_model` draws for a model in memory: seeded alike just before,
    they are the same, where the config adapts modules of the layers only (adapters of the
    embedding, outside the layers, are drawn by `get_peft_model` before the layers'; the
    head's after). PEFT's adapter buffers (OFT's) are made too. An initialisation that
    changes the base weights (PiSSA, OLoRA, LoftQ, CorDA) is refused: the files keep the
    weights as they were. Adapters outside the layers are made by `get_peft_model` itself
    (not with `low_cpu_mem_usage=True`, which is refused).

    `SnakeTrainer` calls it for a model whose adapters are not yet initialised; call it
    yourself to choose when they draw, or to keep it off an event loop where it reads the
    base weights (DoRA: `await asyncio.to_thread(init_adapters, model)`). Returns the number
    of adapter tensors initialised (0 where there are none left to initialise)."""
    from snake.adapters import peft_base

    base = peft_base(model) or model
    parts = _describe_hf(base)
    weights = getattr(base, "snake_layer_weights", None)
    if parts is None or weights is None:
        raise ModelError(
            f"init_adapters: {type(base).__name__} is not a model from snake.hf.stream_hf; PEFT initialises "
            "the adapters of a model in memory itself (get_peft_model)"
        )
    return _init_adapters(base, dataclasses.replace(parts, weights=_PeftNames.of(weights)))
