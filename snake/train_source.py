"""What `snake train` trains, and on what: the built-in GPT on the bytes of a text, or a
Hugging Face model (`--model hf:DIR`: loaded, or with `--stream` its layers' weights left
in their files; with `--lora RANK` PEFT's LoRA adapters in it) on its own tokenizer's ids
of the text. The text is the Python documentation that ships with Python (no download), or
`--text FILE`."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from snake.errors import ConfigError


@dataclass(frozen=True)
class Subject:
    """The token stream `snake train` cuts its windows from (`corpus`: 1-D int64, in units
    of `unit`: "bytes" or "tokens"), the model it trains (`build()`, called once the seed is
    set: a LoRA's adapters draw from it) and what report.json says of it (`record`)."""

    corpus: torch.Tensor
    unit: str
    build: Callable[[], nn.Module] | None  # None: the built-in GPT, which `snake train` sizes
    record: dict[str, Any]
    peft: bool = False
    block_size: int | None = None  # the model's longest sequence, where it has one

    def with_gpt(self, config: Any) -> Subject:
        """The built-in GPT of `config` as the model."""
        from snake.models import GPT

        return replace(self, build=lambda: GPT(config), record=asdict(config))


def text_of(path: str | None) -> str:
    """--text FILE's text (UTF-8), or the documentation that ships with Python."""
    if path is None:
        from snake.corpus import pydoc_text

        return pydoc_text()
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("--text", path, f"cannot be read as UTF-8 text ({type(e).__name__}: {e})",
                          "give a readable UTF-8 text file") from None
    if not text.strip():
        raise ConfigError("--text", path, "holds no text", "give a file with the text to train on")
    return text


def with_lora(model: nn.Module, rank: int, targets: tuple[str, ...]) -> nn.Module:
    """`model` with PEFT's LoRA adapters of `rank` in `targets` (("all-linear",): every
    linear layer but the head), as `get_peft_model` puts them: its base model, which snake
    trains (and whose `peft_config` a checkpoint records, for `snake export --peft`).
    ConfigError naming --lora / --lora-targets where PEFT cannot put them or snake cannot
    train them."""
    try:
        import peft
    except ImportError as e:
        raise ConfigError("--lora", rank, "needs PEFT, which is not installed", "pip install peft") from e
    config = peft.LoraConfig(r=rank, target_modules="all-linear" if targets == ("all-linear",) else list(targets))
    try:
        with warnings.catch_warnings():
            # PEFT reads a flag transformers 5 renamed; and says its own defaults' patterns
            # for other models' modules matched none here
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            warnings.filterwarnings("ignore", ".*did not match any targeted module", RuntimeWarning)
            # (GPT-2's Conv1D: PEFT sets the flag itself, as it says)
            warnings.filterwarnings("ignore", "fan_in_fan_out is set to False", UserWarning)
            base = peft.get_peft_model(model, config).get_base_model()
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError("--lora-targets", ",".join(targets), f"cannot take LoRA adapters: {e}",
                          "name linear modules of the model's layers, e.g. q_proj,v_proj, or all-linear") from None
    if any(type(m).__name__ == "ParamWrapper" for m in base.modules()):  # PEFT's target_parameters
        raise ConfigError("--lora-targets", ",".join(targets), "makes PEFT adapt this model's fused experts as "
                          "parameters (target_parameters), which snake does not train",
                          "name the modules, e.g. --lora-targets q_proj,k_proj,v_proj,o_proj")
    return base


def subject(args: argparse.Namespace) -> Subject:
    """The Subject of `snake train`'s arguments, checked before anything is built: a
    ConfigError naming the option."""
    hf = args.model is not None
    for flag, value in (("--stream", args.stream or None), ("--lora", args.lora)):
        if value is not None and not hf:
            raise ConfigError(flag, value, "applies to a Hugging Face model", "add --model hf:DIR")
    if args.lora_targets is not None and args.lora is None:
        raise ConfigError("--lora-targets", ",".join(args.lora_targets), "names the modules of a LoRA fine-tune",
                          "give --lora RANK with it, e.g. --lora 16")
    text = text_of(args.text)
    if not hf:
        from snake.corpus import text_bytes

        return Subject(text_bytes(text), "bytes", build=None, record={})
    for flag in ("layers", "embd", "heads"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--{flag}", getattr(args, flag), "shapes the built-in GPT, not a Hugging Face model "
                              "(its config.json does)", f"leave --{flag} out")
    return _hf_subject(args, text)


def _hf_subject(args: argparse.Namespace, text: str) -> Subject:
    from planner.cli import parse_model
    from snake.corpus import text_ids

    try:
        model = parse_model(f"hf:{args.model}")
    except argparse.ArgumentTypeError as e:
        raise ConfigError("--model", f"hf:{args.model}", str(e), "give a local Hugging Face model directory") from None
    path = Path(args.model).expanduser()
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers' and the tokenizer libraries' own kinds
        raise ConfigError("--model", f"hf:{args.model}", f"has no tokenizer transformers can load "
                          f"({type(e).__name__}: {' '.join(str(e).split())[:200]})",
                          "save the model's tokenizer into it: tokenizer.save_pretrained(DIR)") from None
    with warnings.catch_warnings():  # (a text longer than the model's positions: it is cut into windows)
        warnings.simplefilter("ignore")
        corpus = text_ids(tokenizer, text)
    config = model.config  # type: ignore[union-attr]
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    top = int(corpus.max()) if corpus.numel() else -1
    if top >= vocab:
        raise ConfigError("--model", f"hf:{args.model}", f"has a tokenizer whose ids reach {top}, beyond the "
                          f"model's vocab_size={vocab}", "give the model the tokenizer it was trained with")
    n = getattr(config, "max_position_embeddings", None)
    block = int(n) if isinstance(n, int) else None
    lora, targets = args.lora, tuple(args.lora_targets or ("all-linear",))
    if lora is not None:  # PEFT's adapters in the model built on the meta device: their targets checked now
        from snake.hf import load_hf

        with torch.device("meta"):
            with_lora(load_hf(config), lora, targets)

    # a full fine-tune's fp32 masters start from the stored weights: loaded in a compute
    # dtype they are stored wider than (fp32 weights, --dtype bfloat16) they would start
    # rounded, so they load in float32 (a float32 model computes in the compute dtype)
    stored = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)).removeprefix("torch.")
    load = args.dtype if lora is not None or stored == args.dtype else "float32"

    def build() -> nn.Module:
        from snake.hf import load_hf, stream_hf
        from snake.kernels import TORCH_DTYPES

        base = (stream_hf if args.stream else load_hf)(path, dtype=TORCH_DTYPES[load])
        return base if lora is None else with_lora(base, lora, targets)

    record = {"hf": str(path), "model_type": getattr(config, "model_type", None), "stream": bool(args.stream),
              "lora": None if lora is None else {"r": lora, "target_modules": list(targets)},
              "tokenizer": type(tokenizer).__name__, "text_tokens": int(corpus.numel())}
    return Subject(corpus, "tokens", build, record, peft=lora is not None, block_size=block)

