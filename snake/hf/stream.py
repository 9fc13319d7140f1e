"""`stream_hf`: a local Hugging Face checkpoint whose layers' weights stay in their safetensors
files (mapped) until snake copies them into its tiers, one layer at a time."""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from snake.adapters import ModelParts, layer_kinds
from snake.errors import ModelError
from snake.hf.families import supported
from snake.hf.files import _gone, _read, _safetensors_keys, _Stored, _stored_shapes, check_unchanged
from snake.hf.load import _parameters_on_meta, _text_tensors, causal_lm_class, text_part
from snake.hf.parts import _describe_hf
from snake.hf.peft_layers import _peft_unwrapped

log = logging.getLogger("snake")


def stream_hf(
    path: str | os.PathLike[str], *, dtype: torch.dtype | str = "auto", attn_implementation: str | None = None
) -> nn.Module:
    """The causal LM in a local directory (config.json and *.safetensors), as `load_hf`
    loads it, but with its layers' parameters left in their files (on the meta device)
    until snake copies them into its tiers, one layer at a time: the process never holds
    the model's layer weights beside snake's own copy of them, so a model whose weights do
    not fit in CPU memory trains with its parameters and optimizer states placed on SSD. The
    embedding, head, final norm and buffers are read at once; frozen parameters (and those
    kept in float32) when a trainer is made from the model. Give the model to `SnakeTrainer`
    as any other; it cannot run a forward of its own (`export_hf` fills it).

    dtype: the parameters' dtype ("auto": the config's, else the stored weights', as
    `from_pretrained` takes it). attn_implementation: as `load_hf` (default "sdpa", or
    "eager" for a model without SDPA). Weights stored under other names or shapes than the
    model's (the experts of a mixture of experts stored one by one, which transformers 5
    fuses; older names) go through transformers' own conversion, one layer at a time.
    The directory must stay as it is while the model is in use (snake reads the layers from
    it when a trainer builds its tiers, and the frozen weights it leaves there whenever it
    needs them): a file replaced or rewritten since is refused by name at its next read, and
    `export_hf` into it is refused. The files are read as `from_pretrained` reads them:
    `model.safetensors`, else the shards its index names. Needs transformers 5."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    if int(transformers.__version__.split(".")[0]) < 5:
        raise ModelError(
            f"stream_hf: needs transformers 5 or later (its loader's layer-by-layer conversion); this is "
            f"{transformers.__version__}: upgrade it, or load the whole model with snake.hf.load_hf(dir)"
        )
    directory = Path(path)
    where = _safetensors_keys(directory)
    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelError(
            f"stream_hf: cannot read {str(directory / 'config.json')!r} as a transformers config "
            f"({str(e).strip().splitlines()[0][:300]}); it must name a model_type transformers knows"
        ) from None
    chosen = _load_dtype(dtype, config, where)
    text = text_part(config)
    if text is not None:  # an image-text checkpoint: its language model, the tensors renamed
        where = _text_tensors(where, directory)
        config = text
    cls = causal_lm_class(config)
    impls = [attn_implementation] if attn_implementation is not None else ["sdpa", "eager"]
    for impl in impls:
        try:
            with _parameters_on_meta():
                if cls is AutoModelForCausalLM:
                    model = cls.from_config(config, attn_implementation=impl, dtype=chosen)
                else:
                    model = cls._from_config(config, attn_implementation=impl, dtype=chosen)
            break
        except (ValueError, ImportError) as e:
            if attn_implementation is not None:
                raise ModelError(f"stream_hf: attn_implementation={impl!r}: {e}") from None
            if impl == impls[-1] or "scaled_dot_product_attention" not in str(e):
                raise
    model.eval()  # as from_pretrained returns it
    _generation_config(model, directory)
    parts = _describe_hf(model)
    if parts is None:
        raise ModelError(f"stream_hf: snake does not know how the layers of {type(model).__name__} compose; it recognises {supported()}")
    source = _LayerSource(model, parts, where, chosen, directory)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    prefix = parts.blocks_prefix + "."
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta and not n.startswith(prefix)]
    if missing:
        raise ModelError(
            f"stream_hf: {str(directory)!r} has no {missing[0]!r} ({len(missing)} tensors outside the layers "
            "missing); load it with snake.hf.load_hf(dir), which initialises what a checkpoint leaves out"
        )
    source.check()
    model.snake_layer_weights = source  # describe_hf gives it to the ModelParts
    return model


_FLOATS = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


_STORED = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def _load_dtype(dtype: torch.dtype | str, config: Any, where: Mapping[str, _Stored]) -> torch.dtype:
    """The dtype `stream_hf` builds in: `dtype`, or for "auto" the config's, else that of the
    first floating-point tensor stored (as `from_pretrained(dtype="auto")`)."""
    from safetensors import safe_open

    chosen: Any = dtype
    if chosen == "auto":
        chosen = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if chosen is None:
            for at in where.values():
                with safe_open(str(at.file), framework="pt") as f:
                    chosen = _STORED.get(f.get_slice(at.key).get_dtype())
                if chosen is not None:
                    break
            chosen = chosen or torch.float32
    if isinstance(chosen, str):
        chosen = getattr(torch, chosen, None)
    if chosen not in _FLOATS:
        raise ModelError(
            f"stream_hf: dtype {dtype!r} is not one snake trains in; pass torch.float32, torch.bfloat16, "
            'torch.float16 or "auto"'
        )
    return chosen


class _LayerSource:
    """`ModelParts.weights` for `stream_hf`: a layer's parameters from the files. Where the
    files use the model's names they are read by name (memory-mapped by safetensors, copied
    out one tensor at a time, cast to the model's dtype); otherwise transformers' own
    conversion (`convert_and_load_state_dict_in_model`, as `from_pretrained` runs it) loads
    the layer's stored tensors into the model, snake takes the layer's parameters and puts
    the model's meta ones back. Made by `stream_hf`, which it loads everything outside the
    layers, and the layers' buffers, into."""

    def __init__(self, model: Any, parts: ModelParts, where: Mapping[str, _Stored], dtype: torch.dtype,
                 directory: Path) -> None:
        self.model, self.where, self.directory = model, where, directory
        self.prefix = parts.blocks_prefix + "."
        self.n_layers = len(parts.blocks)
        self.lock = threading.Lock()  # one conversion at a time: it sets the model's parameters
        state = model.state_dict(keep_vars=True)
        # a checkpoint may leave out the base model's prefix (the Hub's GPT-2: "h.0.", OPT:
        # "decoder.layers.0."), as from_pretrained accepts
        base = str(getattr(model, "base_model_prefix", "") or "")
        heads = [self.prefix] + ([self.prefix[len(base) + 1:]] if base and self.prefix.startswith(base + ".") else [])
        layer_key = re.compile("^(?:" + "|".join(re.escape(h) for h in heads) + r")(\d+)\.")
        self.stored: list[dict[str, str]] = [{} for _ in range(self.n_layers)]  # per layer: name in layer -> key
        outside = []
        for key in where:
            m = layer_key.match(key)
            if m and int(m.group(1)) < self.n_layers:
                self.stored[int(m.group(1))][key[m.end():]] = key
            else:
                outside.append(key)
        self.lazy = {k: t for k, t in state.items() if k.startswith(self.prefix) and isinstance(t, nn.Parameter)}
        # the dtype each layer parameter is loaded in, as load_hf would load it: a cast of the
        # model afterwards (`.float()`) then casts what was loaded (`layer_values`), as it
        # would cast load_hf's weights
        self.dtypes = {k: t.dtype for k, t in self.lazy.items()}
        self.direct = all(k in where for k in self.lazy) and all(n in where for n, _ in model.named_parameters()
                                                                   if not n.startswith(self.prefix))
        self.load: Callable[[list[str]], Any] | None = None
        if self.direct:
            self._check_shapes({k: t for k, t in state.items() if k in where})
            eager = {k: _read(where[k], t.dtype if t.is_floating_point() else None, own=True)
                     for k, t in state.items() if k not in self.lazy and k in where}
            model.load_state_dict(eager, strict=False, assign=True)
            return
        self.load = _converter(model, dtype, where)
        self.load(outside)
        _own_memory(model, self.prefix)
        for i in range(self.n_layers):  # the layers' stored buffers: by name, or converted with the layer
            head = f"{self.prefix}{i}."
            buffers = [k for k, t in state.items() if k.startswith(head) and not isinstance(t, nn.Parameter)]
            if not buffers:
                continue
            if all(k[len(head):] in self.stored[i] for k in buffers):
                model.load_state_dict({k: _read(where[self.stored[i][k[len(head):]]],
                                                state[k].dtype if state[k].is_floating_point() else None, own=True)
                                       for k in buffers}, strict=False, assign=True)
            else:
                self._converted(i)
                _own_memory(block_of(model, head), "")

    def __call__(self, layer: int) -> Mapping[str, torch.Tensor]:
        if self.direct:
            return _LayerReader(self, f"{self.prefix}{layer}.")
        return self._converted(layer)

    def _check_shapes(self, state: Mapping[str, torch.Tensor]) -> None:
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for k in state:
            by_file.setdefault(self.where[k].file, []).append(k)
        for file, keys in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for k in keys:
                    stored = tuple(f.get_slice(self.where[k].key).get_shape())
                    if stored != tuple(state[k].shape):
                        raise ModelError(
                            f"stream_hf: the checkpoint's {k!r} has shape {stored}, the model its config.json "
                            f"describes {tuple(state[k].shape)}: the directory's config.json does not match its weights"
                        )

    def _converted(self, layer: int) -> dict[str, torch.Tensor]:
        assert self.load is not None
        block = self.model.get_submodule(f"{self.prefix}{layer}")
        with self.lock:
            sites = [(mod, attr, p) for mod in block.modules() for attr, p in mod._parameters.items() if p is not None]
            head = f"{self.prefix}{layer}."
            try:
                # transformers loads by the model's own names: PEFT's wrappers out of the way
                with _peft_unwrapped(block):
                    self.load(list(self.stored[layer].values()))
                    return {n: p.detach().to(self.dtypes.get(head + n, p.dtype))
                            for n, p in block.named_parameters() if not p.is_meta}
            finally:
                for mod, attr, p in sites:
                    mod._parameters[attr] = p

    def check(self) -> None:
        """ModelError unless every layer's parameters can be read: each one's names (and
        shapes) where read by name; where converted, a layer of each kind is converted now
        and every other layer must store what the first of its kind does."""
        blocks = [self.model.get_submodule(f"{self.prefix}{i}") for i in range(self.n_layers)]
        if self.direct:
            return  # every name was found, every shape checked
        kinds, firsts = layer_kinds(blocks)
        for i in range(self.n_layers):
            if not self.stored[i]:
                raise ModelError(
                    f"stream_hf: the checkpoint has no layer {i} ({self.prefix}{i}.*): config.json gives "
                    f"{self.n_layers} layers; make its layer count (num_hidden_layers) match the weights"
                )
        for first in firsts:
            read = self._converted(first)
            for name, p in blocks[first].named_parameters():
                if p.is_meta and name not in read:
                    raise ModelError(
                        f"stream_hf: the checkpoint has no {self.prefix}{first}.{name} (nor anything "
                        "transformers converts into it); load it with snake.hf.load_hf(dir) to see what it holds"
                    )
        shapes = _stored_shapes(self.where)
        for i, kind in enumerate(kinds):
            first = firsts[kind]
            mine, want = set(self.stored[i]), set(self.stored[first])
            if mine != want:
                name = min((want - mine) or (mine - want))
                raise ModelError(
                    f"stream_hf: the checkpoint's layer {i} stores other tensors than layer {first} "
                    f"(its kind's first): {self.prefix}{i}.{name} is in one of them only; load it with snake.hf.load_hf(dir) "
                    "to see what it holds"
                )
            for name in sorted(mine):
                here, there = shapes[self.stored[i][name]], shapes[self.stored[first][name]]
                if here != there:
                    raise ModelError(
                        f"stream_hf: the checkpoint's {self.stored[i][name]!r} has shape {here}, layer {first}'s "
                        f"{there} ({str(self.where[self.stored[i][name]].file)!r}); layers of one kind store one shape: "
                        "the file is damaged or from another model"
                    )


class _LayerReader(Mapping[str, torch.Tensor]):
    """One layer's parameters read by name, each when asked for."""

    def __init__(self, source: _LayerSource, head: str) -> None:
        self.source, self.head = source, head

    def __getitem__(self, name: str) -> torch.Tensor:
        key = self.head + name
        if key not in self.source.lazy:
            raise KeyError(name)
        return _read(self.source.where[key], self.source.dtypes[key])

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.head + name in self.source.lazy

    def __iter__(self) -> Iterator[str]:
        return (k[len(self.head):] for k in self.source.lazy if k.startswith(self.head))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _converter(model: Any, dtype: torch.dtype, where: Mapping[str, _Stored]) -> Callable[[list[str]], Any]:
    """keys -> load those stored tensors into `model` through transformers' conversion of
    its weights (renames, fused experts), as `from_pretrained` does; ModelError for shapes
    that do not match or a conversion that fails."""
    from safetensors import SafetensorError, safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import logging as hf_logging

    plan = getattr(model, "_get_dtype_plan", None)
    mapping: Any = get_model_conversion_mapping(model, None, None)
    config = LoadStateDictConfig(dtype=dtype, dtype_plan=plan(dtype) if callable(plan) else {}, weight_mapping=mapping)

    def load(keys: list[str]) -> None:
        files = {}
        for at in {where[k].file: where[k] for k in keys}.values():
            file = at.file
            try:
                check_unchanged(at)
                files[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as e:
                raise _gone(file, e) from None
        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # one bar per layer read would flood a training log
        try:
            info, _ = convert_and_load_state_dict_in_model(
                model=model, state_dict={k: files[where[k].file].get_slice(where[k].key) for k in keys},
                load_config=config,
            )
        finally:
            if bar:
                hf_logging.enable_progress_bar()
            for f in files.values():
                f.__exit__(None, None, None)
        if info.mismatched_keys:
            key, stored, want = sorted(info.mismatched_keys)[0]
            raise ModelError(
                f"stream_hf: the checkpoint's {key!r} has shape {tuple(stored)}, the model its config.json "
                f"describes {tuple(want)}: the directory's config.json does not match its weights"
            )
        if info.conversion_errors or info.error_msgs:
            key, what = next(iter(info.conversion_errors.items()), None) or ("", info.error_msgs[0])
            what = str(what).strip().splitlines()[-1][:300]
            raise ModelError(
                f"stream_hf: transformers could not convert the stored weights{' of ' + repr(key) if key else ''} "
                f"({what}); the files are damaged or from another model: load it with snake.hf.load_hf(dir)"
            )

    return load


def _own_memory(model: nn.Module, prefix: str) -> None:
    """Give the model's loaded tensors outside `prefix` (the layers') memory of their own:
    what transformers' conversion loaded may be a view of the file's mapping (a file
    truncated in place: a SIGBUS at the next touch)."""
    with torch.no_grad():
        for module_name, module in model.named_modules():
            here = f"{module_name}." if module_name else ""
            if prefix and here.startswith(prefix):
                continue
            for p in module._parameters.values():
                if p is not None and not p.is_meta:
                    p.data = p.data.clone()
            for name, b in module._buffers.items():
                if b is not None and not b.is_meta:
                    module._buffers[name] = b.clone()


def block_of(model: nn.Module, head: str) -> nn.Module:
    """The module named by `head` ("model.layers.3.")."""
    return model.get_submodule(head.rstrip("."))


def _generation_config(model: Any, directory: Path) -> None:
    """The directory's generation_config.json, as from_pretrained reads it (sampling,
    lengths, special tokens: what export_hf saves beside the weights), where it has one."""
    if not (directory / "generation_config.json").is_file():
        return
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as e:
        log.warning("stream_hf: %s's generation_config.json was not read (%s); the config's is used",
                    directory, type(e).__name__)
