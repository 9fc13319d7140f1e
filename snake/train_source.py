"""What `snake train` trains, and on what: the built-in GPT on the bytes of a text, or a
Hugging Face model (`--model hf:DIR`: loaded, or with `--stream` its layers' weights left
in their files; with `--lora RANK` PEFT's LoRA adapters in it) on its own tokenizer's ids
of the text. The text is the Python documentation that ships with Python (no download), or
`--text FILE`."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from snake.errors import MISSING, ConfigError


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
    text: dict[str, Any] | None = None  # what the corpus is (`text_record`): a --resume keeps it
    # the modules a --lora run adapts, by their last name (q_proj), sorted: a --resume keeps them
    lora_modules: tuple[str, ...] = ()

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


def text_record(path: str | None, text: str, corpus: torch.Tensor) -> dict[str, Any]:
    """What a run's corpus is, as a --resume checks it: its text (`--text` FILE as given,
    or the documentation of this Python) by its characters and their sha256 (UTF-8), and
    the ids cut into windows by their count and sha256 (another tokenizer's ids differ)."""
    ids = corpus.to(torch.long).contiguous()
    python = platform.python_version()  # its documentation differs from release to release (3.11.2, 3.11.7)
    return {
        "text": str(Path(path).expanduser().absolute()) if path is not None else f"the Python {python} documentation",
        "given": path is not None,
        "chars": len(text),
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "ids": int(ids.numel()),
        "ids_sha256": hashlib.sha256(ids.numpy().data if ids.numel() else b"").hexdigest(),
    }


def lora_modules(model: nn.Module) -> tuple[str, ...]:
    """The last names of the modules that hold a LoRA adapter in `model` (sorted, each once)."""
    return tuple(sorted({n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters()
                         if ".lora_A." in n}))


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

        corpus = text_bytes(text)
        return Subject(corpus, "bytes", build=None, record={}, text=text_record(args.text, text, corpus))
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
    adapted: tuple[str, ...] = ()
    if lora is not None:  # PEFT's adapters in the model built on the meta device: their targets checked now
        from snake.hf import load_hf

        with torch.device("meta"):
            adapted = lora_modules(with_lora(load_hf(config), lora, targets))

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
    return Subject(corpus, "tokens", build, record, peft=lora is not None, block_size=block,
                   text=text_record(args.text, text, corpus), lora_modules=adapted)



# -- --resume: what a checkpoint must match, checked before anything is built or written --
TRAIN_RECORD = "snake-train.json"  # beside a checkpoint's manifest: the text and windows `snake train` cut


def train_record(args: argparse.Namespace, subject: Subject) -> dict[str, Any]:
    """What `snake train` writes beside each checkpoint it saves (`TRAIN_RECORD`): its text
    (`text_record`) and its windows' --seq and --batch, which the checkpoint's place in the
    data (`consumed_batches`) counts in."""
    return {"text": subject.text, "seq": args.seq, "batch": args.batch}


def write_train_record(directory: str, record: dict[str, Any]) -> None:
    """Blocking: `record` into `directory`'s TRAIN_RECORD (a new file renamed over the old)."""
    target = Path(directory).expanduser() / TRAIN_RECORD
    tmp = target.with_name(f".{TRAIN_RECORD}.tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, target)


def resume_manifest(text: str) -> dict[str, Any]:
    """The manifest of the --resume checkpoint `text`, after checking what can be checked
    without reading its files: that it is there (or where an interrupted save left it), that
    it reads, and that each file it lists is there with its size (load() checks their sha256)."""
    from snake.manifest import MANIFEST

    path = Path(text).expanduser()
    fix = "pass a directory that --checkpoint wrote"
    if not (path / MANIFEST).is_file():
        own = re.compile(rf"\.{re.escape(path.name)}\.old-[0-9a-f]+")  # (a name may hold glob characters)
        aside = sorted((p for p in path.parent.iterdir() if own.fullmatch(p.name) and p.is_dir()),
                       key=lambda p: p.stat().st_mtime) if not path.exists() and path.parent.is_dir() else []
        if aside:  # snake.checkpoint renames the old checkpoint aside until the new one is in place
            raise ConfigError("--resume", text, f"is not there: a save into it was interrupted and left the "
                              f"previous checkpoint at {aside[-1]}", f"rename that to {path.name}")
        raise ConfigError("--resume", text, f"is not a snake checkpoint (no {MANIFEST} in it)", fix)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        assert isinstance(manifest["config"], dict) and isinstance(manifest["model"], dict)
        listed = [(str(name), int(info["bytes"])) for name, info in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, AssertionError) as e:
        raise ConfigError("--resume", text, f"has a {MANIFEST} that does not read as a snake checkpoint's "
                          f"({type(e).__name__}: {e})", fix) from None
    for name, size in listed:
        f = path / name
        have = f.stat().st_size if f.is_file() else None
        if have != size:
            rule = "is missing" if have is None else f"has {have} bytes where the manifest says {size}"
            raise ConfigError("--resume", text, f"is incomplete or damaged: its {name} {rule}",
                              "resume from a whole checkpoint (a save leaves the previous one whole until "
                              "the new one is)")
    return manifest


def resume_defaults(args: argparse.Namespace, manifest: dict[str, Any]) -> None:
    """--alpha and --micro-batches left out of a --resume run are the checkpoint's (the
    defaults, or what --plan picked), as the trainer's None takes them."""
    saved = manifest["config"]
    if args.plan:
        return  # the trainer fills its None from the checkpoint (snake.manifest.fill_config)
    if args.alpha is None and isinstance(saved.get("alpha"), int | float) and not isinstance(saved["alpha"], bool):
        args.alpha = float(saved["alpha"])
    mb = saved.get("micro_batches")
    if args.micro_batches is None and isinstance(mb, int) and not isinstance(mb, bool) and mb >= 1:
        args.micro_batches = mb
    # a float16 run's static --loss-scale, left out: the checkpoint's (not the dynamic default)
    scale = saved.get("loss_scale")
    if (args.loss_scale is None and args.dtype == "float16" == saved.get("dtype") and isinstance(scale, int | float)
            and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0):
        args.loss_scale = float(scale)


def check_resume_options(args: argparse.Namespace, manifest: dict[str, Any]) -> None:
    """ConfigError naming the option where one given (--dtype, --schedule, --seed, --alpha,
    --micro-batches) is not the --resume checkpoint's: checked before the run's config is
    made, so that what the checkpoint filled in (its alpha) is not refused first beside
    another dtype."""
    _check_fields({name: getattr(args, name, None) for name in _match_fields()}, manifest)


def _match_fields() -> tuple[str, ...]:
    from snake.manifest import MATCH_FIELDS

    return MATCH_FIELDS


def _check_fields(mine: dict[str, Any], manifest: dict[str, Any]) -> None:
    for name, value in mine.items():
        theirs = manifest["config"].get(name)
        if value is not None and theirs is not None and value != theirs:
            option = "--" + name.replace("_", "-")
            raise ConfigError(option, value, f"does not match the --resume checkpoint's {theirs!r}",
                              f"give {option} {theirs}, as the checkpoint was saved with")


def check_resume(args: argparse.Namespace, subject: Subject, config: Any, manifest: dict[str, Any]) -> str | None:
    """ConfigError naming the option where this run is not the one the --resume checkpoint
    goes on: another model (the built-in GPT's shape, a Hugging Face model's config), LoRA
    rank or targets, config fields a resume keeps (`snake.manifest.MATCH_FIELDS`), text
    or windows. load() checks the model and fields too, but once the model is built and
    naming a tensor. Returns a note for the user where something could not be checked."""
    _check_resume_model(args, manifest.get("model_config") or {})
    _check_fields({name: getattr(config, name) for name in _match_fields()}, manifest)
    _check_resume_lora(args, subject, manifest)
    if not _check_resume_data(args, subject):
        return (f"--resume {args.resume} holds no {TRAIN_RECORD} (it was not saved by snake train, or by one "
                "before it wrote one): its text and windows are not checked")
    return None


def _check_resume_model(args: argparse.Namespace, saved: dict[str, Any]) -> None:
    kind = saved.get("kind")
    if kind == "snake.gpt":
        shape = {"--layers": "n_layer", "--embd": "n_embd", "--heads": "n_head", "--seq": "block_size"}
        theirs = " ".join(f"{flag} {saved.get(key)}" for flag, key in shape.items())
        if args.model is not None:
            raise ConfigError("--model", f"hf:{args.model}", "is not the model of the --resume checkpoint, the "
                              "built-in GPT", f"leave --model out and give its shape: {theirs}")
        for flag, key in shape.items():
            mine = getattr(args, "seq" if flag == "--seq" else flag[2:])
            if saved.get(key) is not None and mine != saved[key]:
                raise ConfigError(flag, mine, f"does not match the --resume checkpoint's GPT ({theirs})",
                                  f"give {flag} {saved[key]}")
    elif isinstance(kind, str) and kind.startswith("transformers"):
        source = saved.get("_name_or_path") or "DIR"
        what = f"a Hugging Face {saved.get('model_type') or 'model'} (from {source})"
        if args.model is None:
            raise ConfigError("--model", MISSING, f"is left out, but the --resume checkpoint is of {what}",
                              f"give --model hf:{source}")
        from transformers import AutoConfig

        try:
            mine = AutoConfig.from_pretrained(str(Path(args.model).expanduser()), local_files_only=True).to_dict()
        except Exception:  # noqa: BLE001 - the subject read it already; load() says what differs
            return
        for key in ("model_type", *_SHAPE_KEYS):
            if key in mine and key in saved and mine[key] != saved[key]:
                raise ConfigError("--model", f"hf:{args.model}", f"has {key}={mine[key]!r}, but the --resume "
                                  f"checkpoint is of {what} with {key}={saved[key]!r}", f"give --model hf:{source}")


# a Hugging Face config's entries that shape its parameters (those of the model's kind)
_SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "vocab_size", "n_layer", "n_embd", "n_head", "n_inner")


def _check_resume_lora(args: argparse.Namespace, subject: Subject, manifest: dict[str, Any]) -> None:
    """--lora's rank (or none) and --lora-targets: the checkpoint's PEFT config's rank, and
    the modules its trained parameters hold adapters in (`lora_modules`' names)."""
    peft = manifest.get("peft")
    configs = (peft.get("configs") if isinstance(peft, dict) else None) or {}
    rank = next((c.get("r") for c in configs.values() if isinstance(c, dict)), None)
    model = manifest["model"]
    names = [n for spec in (model.get("block_params") or [], *(model.get("kind_params") or []),
                            model.get("resident_params") or []) for n, _ in spec]
    theirs = tuple(sorted({n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n in names if ".lora_A." in n}))
    targets = ",".join(theirs) if theirs else None
    if rank != args.lora:
        saved = f"a LoRA of rank {rank}" if rank is not None else "a fine-tune without LoRA adapters"
        raise ConfigError("--lora", args.lora, f"does not match the --resume checkpoint, {saved}",
                          (f"give --lora {rank}" + (f" --lora-targets {targets}" if targets else ""))
                          if rank is not None else "leave --lora out and --lora-targets")
    if args.lora is not None and theirs and subject.lora_modules != theirs:
        given = ",".join(args.lora_targets or ("all-linear",))
        raise ConfigError("--lora-targets", given, f"adapts {','.join(subject.lora_modules)}, but the --resume "
                          f"checkpoint's adapters are in {targets}", f"give --lora-targets {targets}")


def _check_resume_data(args: argparse.Namespace, subject: Subject) -> bool:
    """The text and the windows the checkpoint's place in the data counts in, from the
    TRAIN_RECORD `snake train` wrote beside it. False where there is none (a checkpoint of
    SnakeTrainer.save): nothing to check."""
    path = Path(args.resume).expanduser() / TRAIN_RECORD
    try:
        saved = json.loads(path.read_text())
        text = saved["text"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    for flag, key in (("--seq", "seq"), ("--batch", "batch")):
        if saved.get(key) is not None and getattr(args, key) != saved[key]:
            raise ConfigError(flag, getattr(args, key), f"does not match the --resume checkpoint's {saved[key]}: its "
                              f"place in the data counts batches of its --batch windows of --seq {subject.unit}",
                              f"give {flag} {saved[key]}, or start a new run (without --resume)")
    mine = subject.text or {}
    if not isinstance(text, dict) or mine.get("ids_sha256") == text.get("ids_sha256"):
        return True
    if mine.get("sha256") != text.get("sha256"):
        theirs = (f"{text.get('text')} ({text.get('chars')} characters, sha256 {str(text.get('sha256'))[:12]}...), "
                  "whose place in it the resumed run goes on from")
        if text.get("given"):
            go_on = f"give --text {text['text']}"
        else:  # the documentation of another Python, where --text is left out
            go_on = "leave --text out" if args.text is not None else "resume it with that Python"
        new = "start a new run on it, without --resume" + (
            f" (from the trained weights: snake export {args.resume} --hf DIR, then --model hf:DIR)"
            if args.model is not None and args.lora is None else "")
        rule = (f"is not the text the --resume checkpoint trained on, {theirs}" if args.text is not None
                else f"is left out, and {mine.get('text')} is not the text the --resume checkpoint trained on, "
                f"{theirs}")
        raise ConfigError("--text", args.text if args.text is not None else MISSING, rule,
                          f"{go_on} to go on; to train on this text, {new}")
    raise ConfigError("--model", f"hf:{args.model}", "has a tokenizer that gives other ids of the text than the "
                      "--resume checkpoint's run did", "give the model directory (and tokenizer) it trained")
