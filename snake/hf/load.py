"""`load_hf`: a Hugging Face causal LM from a config or a local directory (the language model
of an image-text checkpoint alone), with the class transformers gives its config."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from snake.errors import ModelError
from snake.hf.families import _LLAMA_FAMILY, _MAMBA, _OLD, supported
from snake.hf.files import _safetensors_keys, _Stored

log = logging.getLogger("snake")


def load_hf(path_or_config: Any, **kwargs: Any) -> nn.Module:
    """A causal LM from a `transformers` config object (fresh weights, `from_config`) or a
    local directory with a config and safetensors weights (`from_pretrained`, no network).
    `kwargs` go to transformers (e.g. `attn_implementation`, `dtype`); the attention
    implementation defaults to "sdpa", or "eager" for a model without SDPA (Gemma 2)."""
    if "attn_implementation" not in kwargs:
        try:
            return _load_hf(path_or_config, attn_implementation="sdpa", **kwargs)
        except ValueError as e:
            if "scaled_dot_product_attention" not in str(e):
                raise
        return _load_hf(path_or_config, attn_implementation="eager", **kwargs)
    return _load_hf(path_or_config, **kwargs)


# image-text checkpoints whose language model is one of snake's families but which
# AutoModelForCausalLM loads whole, vision tower and all (Gemma 3, Gemma 4): `load_hf` and
# `stream_hf` load their text part as that family's causal LM, its tensors renamed so
# (transformers 5 stores the language model under `model.language_model.`, 4.x under
# `language_model.model.`); the other towers' tensors stay in the files
_TEXT_PART = {
    r"^model\.language_model\.": "model.",
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
}


_TEXT_NAMES = "model.language_model.* (or transformers 4's language_model.model.*)"


def _causal_name(config: Any) -> str | None:
    """The name of AutoModelForCausalLM's class for `config`, None where it has none."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if config is None or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return None
    cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return getattr(cls, "__name__", None)


def text_part(config: Any) -> Any | None:
    """The text config of an image-text model's `config` whose language model snake trains
    but whose own causal LM class (AutoModelForCausalLM's) it does not, else None."""
    known = {"GPT2LMHeadModel", *_LLAMA_FAMILY, *_MAMBA, *_OLD}
    if config is None or _causal_name(config) in known:
        return None
    text = getattr(config, "text_config", None)
    if text is None or text is config or _causal_name(text) not in known:
        return None
    text = copy.deepcopy(text)
    # the whole model ties its head to the embedding as its own config says, whatever the
    # text config's says: so does its text part
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", text.tie_word_embeddings))
    return text


def text_part_hint(model: nn.Module) -> str | None:
    """What to do with an image-text model whose language model snake trains, None for any
    other model."""
    text = text_part(getattr(model, "config", None))
    if text is None:
        return None
    return (
        f"model: {type(model).__name__} is an image-text model; snake trains its language model "
        f"({_causal_name(text)}): load the checkpoint's directory with snake.hf.load_hf(dir) or "
        "snake.hf.stream_hf(dir), which give that part alone (the other towers stay in the files)"
    )


def _other_towers(keys: Iterable[str]) -> list[str]:
    """The modules of an image-text checkpoint's stored tensors outside its language model
    (`_TEXT_PART`): each key's first component past a leading `model.` (vision_tower,
    multi_modal_projector, ...)."""
    out = set()
    for key in keys:
        if key.startswith("lm_head.") or any(re.match(pattern, key) for pattern in _TEXT_PART):
            continue
        parts = key.split(".")
        out.add(parts[1] if parts[0] == "model" and len(parts) > 1 else parts[0])
    return sorted(out)


def _text_tensors(where: Mapping[str, _Stored], directory: Path) -> dict[str, _Stored]:
    """An image-text checkpoint's language-model tensors under the text model's names
    (`_TEXT_PART`); its other towers' are left out."""
    out: dict[str, _Stored] = {}
    for key, at in where.items():
        for pattern, to in _TEXT_PART.items():
            name, n = re.subn(pattern, to, key)
            if n:
                out[name] = at
                break
        else:
            if key.startswith("lm_head."):
                out[key] = at
    if not any(name.startswith("model.") for name in out):
        raise ModelError(
            f"stream_hf: {str(directory)!r} is an image-text checkpoint whose config names a language model, "
            f"but its weights hold none under {_TEXT_NAMES}; save the model again with transformers"
        )
    return out


def causal_lm_class(config: Any) -> Any:
    """The causal LM class for a transformers config: AutoModelForCausalLM's, or for a
    family transformers does not register there (Mistral 4) the class of snake's families
    its config names (`architectures`, or the config class's stem + "ForCausalLM")."""
    import transformers
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM
    stem = type(config).__name__.removesuffix("Config")
    for name in [*(getattr(config, "architectures", None) or []), f"{stem}ForCausalLM"]:
        if name in _LLAMA_FAMILY and hasattr(transformers, name):
            return getattr(transformers, name)
    raise ModelError(
        f"load_hf: transformers has no causal LM for {type(config).__name__} (model_type "
        f"{getattr(config, 'model_type', None)!r}); snake recognises {supported()}"
    )


def _load_hf(path_or_config: Any, **kwargs: Any) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    if isinstance(path_or_config, PretrainedConfig):
        path_or_config = text_part(path_or_config) or path_or_config  # an image-text model: its text part
        cls = causal_lm_class(path_or_config)
        if cls is AutoModelForCausalLM:
            return AutoModelForCausalLM.from_config(path_or_config, **kwargs)
        return cls._from_config(path_or_config, **kwargs)
    if isinstance(path_or_config, str | os.PathLike):
        path = Path(path_or_config)
        if not path.is_dir():
            raise ModelError(
                f"load_hf: {str(path)!r} is not a directory; pass a local directory with "
                "config.json and *.safetensors weights, or a transformers config object"
            )
        kwargs.setdefault("use_safetensors", True)
        kwargs.setdefault("local_files_only", True)
        files = path / kwargs.get("subfolder", "")
        if kwargs["use_safetensors"] and (files / "config.json").is_file() and not any(files.glob("*.safetensors")):
            raise ModelError(
                f"load_hf: {str(files)!r} has a config.json but no *.safetensors weights; for a model "
                f"with fresh weights from that config pass the config: "
                f"load_hf(transformers.AutoConfig.from_pretrained({str(files)!r}))"
            )
        config = AutoConfig.from_pretrained(str(path), local_files_only=kwargs["local_files_only"],
                                            subfolder=kwargs.get("subfolder", ""))
        text = text_part(config)
        if text is not None:  # an image-text checkpoint: its language model, the tensors renamed
            cls = causal_lm_class(text)
            if cls is AutoModelForCausalLM:  # the class it stands for, to subclass
                from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

                cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(text)]
            try:
                towers = _other_towers(_safetensors_keys(files))
            except ModelError:  # a damaged directory: from_pretrained says what is wrong
                towers = []
            # the other towers' tensors are left in the files: not reported one per line as
            # unexpected (hundreds of lines for a vision tower), but in one line here
            quiet: Any = type(cls.__name__, (cls,), {
                "__module__": cls.__module__,
                "_keys_to_ignore_on_load_unexpected": [rf"(^|\.)({'|'.join(map(re.escape, towers))})\."],
            }) if towers else cls
            model, info = quiet.from_pretrained(str(path), **{"key_mapping": _TEXT_PART, **kwargs, "config": text},
                                                output_loading_info=True)
            model.__class__ = cls  # the family's own class, as from_pretrained of it gives
            if towers:
                log.info("load_hf: the language model of %s; the tensors of its %s stay in the files",
                         path, ", ".join(towers))
            if info["missing_keys"]:  # stored under names `_TEXT_PART` does not know: fresh weights instead
                raise ModelError(
                    f"load_hf: {str(path)!r} is an image-text checkpoint; snake loads its language model, but "
                    f"found no {min(info['missing_keys'])!r} ({len(info['missing_keys'])} tensors missing) stored "
                    f"as {_TEXT_NAMES}; save the model again with transformers"
                )
            _freeze_as_built(model, cls, text)
            return model
        cls = causal_lm_class(config)
        model = cls.from_pretrained(str(path), **kwargs)
        _freeze_as_built(model, cls, config)
        return model
    raise ModelError(
        f"load_hf: expected a transformers PretrainedConfig or a directory path, got "
        f"{type(path_or_config).__name__}"
    )


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """While a model is built: each parameter goes to the meta device as it is registered
    (after its module made it, before the module initialises it), buffers stay as built
    (the rotary tables computed in the modules' __init__). Patches
    `nn.Module.register_parameter`, as accelerate's `init_empty_weights` does, for this
    thread alone: modules other threads build meanwhile keep their parameters."""
    with _META_BUILD:  # one build at a time: each puts back what it found
        register = nn.Module.register_parameter
        builder = threading.get_ident()

        def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            register(module, name, param)
            if param is not None and not param.is_meta and threading.get_ident() == builder:
                module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

        nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            nn.Module.register_parameter = register  # type: ignore[method-assign]


_META_BUILD = threading.Lock()


def _freeze_as_built(model: nn.Module, cls: Any, config: Any) -> None:
    """`from_pretrained` returns every parameter trainable, also those the model's class
    builds frozen (requires_grad=False: Ernie 4.5 MoE's and AFMoE's routing statistics),
    which `from_config` keeps frozen: freeze them as the class builds them (read off a copy
    on the meta device), so snake leaves them as plain PyTorch training would."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        built = cls.from_config(config) if cls is AutoModelForCausalLM else cls._from_config(config)
    frozen = [n for n, p in built.named_parameters() if not p.requires_grad]
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
