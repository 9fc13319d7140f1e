"""`snake train`'s arguments: the parser, the argparse types, the checks of what was given
together (before anything is written) and the `SnakeConfig` they make."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snake.config import (
    MAX_SEED,
    RESIDENT_TIERS,
    SHARES,
    STORAGE_BACKENDS,
    AdamW,
    DynamicLossScale,
    Placement,
    SnakeConfig,
)
from snake.errors import ConfigError, SnakeError
from snake.lr import SCHEDULES as LR_SCHEDULES
from snake.lr import WarmupConstant
from snake.optim import biases_and_norms

if TYPE_CHECKING:
    from snake.train_source import Subject


HOLDOUT = 0.05  # the corpus' tail that `snake train` never trains on


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def _count(text: str) -> int:
    """An argparse type: an integer >= 0 (--save-every, --eval-batches)."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} must be an integer >= {least}")
    return value


def device_name(text: str) -> str:
    """An argparse type: 'cpu', 'cuda' or 'cuda:N', present on this machine."""
    from snake.device import resolve_device

    if re.fullmatch(r"cpu|cuda(:[0-9]+)?", text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not 'cpu', 'cuda' or 'cuda:N'")
    try:
        resolve_device(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 2**63 - 1]")
    return value


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train the built-in GPT on text shipped with Python (no download), or a "
                                     "Hugging Face model (--model hf:DIR)")
    p.add_argument("--steps", type=positive_int, default=60)
    p.add_argument("--model", type=_hf_dir, default=None, metavar="hf:DIR",
                   help="a local Hugging Face model directory (config.json, safetensors, tokenizer) to train instead "
                        "of the built-in GPT, on its tokenizer's ids of the text")
    p.add_argument("--stream", action="store_true",
                   help="with --model: leave the layers' weights in their files (snake.hf.stream_hf)")
    p.add_argument("--lora", type=positive_int, default=None, metavar="RANK",
                   help="with --model: train PEFT's LoRA adapters of this rank, the base frozen")
    p.add_argument("--lora-targets", type=_names, default=None, metavar="NAMES",
                   help="the modules --lora adapts, comma-separated (default: all-linear)")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="train on this UTF-8 text (default: the Python documentation shipped with Python)")
    p.add_argument("--layers", type=positive_int, default=None, help="the built-in GPT's layers (default 6)")
    p.add_argument("--embd", type=positive_int, default=None, help="the built-in GPT's width (default 192)")
    p.add_argument("--heads", type=positive_int, default=None, help="the built-in GPT's heads (default 6)")
    p.add_argument("--seq", type=positive_int, default=64)
    p.add_argument("--batch", type=positive_int, default=16, help="global batch (sequences)")
    p.add_argument("--micro-batches", type=positive_int, default=None, help="micro-batches per step (default 4)")
    p.add_argument("--placement", type=_placement, default=None,
                   help="CPU shares param,ckpt,opt[,grad] (rest on SSD; grad: the delayed gradients, default 1; "
                        "default 0.5,0.5,0.5)")
    p.add_argument("--plan", action="store_true",
                   help="let the planner pick --placement, --alpha and --micro-batches for this machine and "
                        "--batch (it profiles the machine first: seconds; cached in --offload-dir)")
    p.add_argument("--alpha", type=float, default=None,
                   help="delayed share of each optimizer step (default 0.25; 1.0 with a finite --max-grad-norm "
                        "or a dynamic --loss-scale)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-schedule", default="constant", choices=list(LR_SCHEDULES),
                   help="the rate after --warmup-steps: constant, or decaying to 0 at --decay-steps")
    p.add_argument("--warmup-steps", type=_count, default=0, metavar="N",
                   help="raise the rate linearly from 0 over the first N steps")
    p.add_argument("--no-decay-norms", action="store_true",
                   help="no weight decay for biases and norms' weights (snake.optim.biases_and_norms)")
    p.add_argument("--max-grad-norm", type=float, default=None, metavar="X",
                   help="clip the gradients to this global norm before each step (needs --alpha 1, its default "
                        "then); inf: report each step's norm without clipping")
    p.add_argument("--decay-steps", type=positive_int, default=None, metavar="N",
                   help="the step at which linear or cosine reaches 0 (default: this run's last step; "
                        "give the same N to a --resume run to continue one schedule)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--loss-scale", type=_loss_scale, default=None, metavar="dynamic|X",
                   help="float16's loss scale: dynamic (the default there: an overflowed step is skipped and the "
                        "scale backs off, as torch.amp.GradScaler; needs --alpha 1, its default then) or a "
                        "static number")
    p.add_argument("--schedule", default="vertical", choices=["vertical", "horizontal"])
    p.add_argument("--device", type=device_name, default=None, help="cpu, cuda or cuda:N (default: CUDA if present)")
    p.add_argument("--storage-backend", default="auto", choices=list(STORAGE_BACKENDS),
                   help="how the SSD tier's files are read and written (auto: the best this machine has)")
    p.add_argument("--resident-optimizer", default="cpu", choices=list(RESIDENT_TIERS),
                   help="where the embedding's and head's optimizer state lives")
    p.add_argument("--offload-dir", default=None,
                   help="SSD tier directory (default: a temporary one, on a disk where the system's is in memory)")
    p.add_argument("--out", default="snake-out")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--checkpoint", default=None, metavar="DIR", help="save a checkpoint here at the end")
    p.add_argument("--save-every", type=_count, default=0, metavar="N",
                   help="also save --checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from a checkpoint --checkpoint wrote (same model options, text, --seq and --batch; "
                        "--steps more steps)")
    p.add_argument("--eval-batches", type=_count, default=8, metavar="N",
                   help="validation loss before and after training on N batches of the held-out text (0: none)")


def _hf_dir(text: str) -> str:
    """--model: 'hf:DIR' (DIR checked when the run is set up, with its tokenizer)."""
    kind, _, rest = text.partition(":")
    if kind != "hf" or not rest:
        raise argparse.ArgumentTypeError(f"{text!r}: give hf:DIR, a local Hugging Face model directory (the built-in "
                                          "GPT is the default: leave --model out)")
    return rest


def _names(text: str) -> tuple[str, ...]:
    """--lora-targets: comma-separated module names."""
    names = tuple(n.strip() for n in text.split(","))
    if not all(names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r} must be module names separated by commas, each once")
    return names


def _loss_scale(text: str) -> float | str:
    """An argparse type: "dynamic" or a static scale > 0 (--loss-scale)."""
    if text == "dynamic":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'dynamic' nor a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number > 0, or 'dynamic'")
    return value


def _placement(text: str) -> Placement:
    try:
        shares = [float(x) for x in text.split(",")]
        if len(shares) not in (3, 4):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be three numbers param,ckpt,opt or four param,ckpt,opt,grad, e.g. 0.5,0.5,0.5"
        ) from None
    try:
        return Placement(**dict(zip(SHARES, shares, strict=False)))  # type: ignore[arg-type]
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _check_train_args(args: argparse.Namespace, subject: Subject) -> Subject:
    """What argparse cannot check one option at a time, before anything is built: a
    ConfigError naming the option. Returns `subject` with the built-in GPT where it trains
    that."""
    from snake.models import GPTConfig

    corpus_len, unit = len(subject.corpus), subject.unit
    gpt = subject.build is None
    if gpt:
        args.layers, args.embd, args.heads = args.layers or 6, args.embd or 192, args.heads or 6
        if args.embd % args.heads:
            raise ConfigError("--heads", args.heads, f"must divide --embd={args.embd}", "e.g. --embd 192 --heads 6")
    elif subject.block_size is not None and args.seq > subject.block_size:
        raise ConfigError("--seq", args.seq, f"is longer than the model's {subject.block_size} positions "
                          "(max_position_embeddings)", f"use --seq {subject.block_size} or less")
    if args.loss_scale is not None and args.dtype != "float16":
        raise ConfigError("--loss-scale", args.loss_scale, f"applies to --dtype float16 only, not {args.dtype}",
                          "drop --loss-scale, or add --dtype float16")
    if args.save_every and not args.checkpoint:
        raise ConfigError("--save-every", args.save_every, "needs --checkpoint DIR to save to", "add --checkpoint DIR")
    if args.plan:
        given = [f for f, v in (("--placement", args.placement), ("--alpha", args.alpha),
                                ("--micro-batches", args.micro_batches)) if v is not None]
        if given:
            raise ConfigError(given[0], getattr(args, given[0][2:].replace("-", "_")),
                              "is what --plan picks", f"leave {given[0]} out, or drop --plan")
    else:
        args.placement = args.placement or Placement(param=0.5, ckpt=0.5, opt=0.5)
        args.micro_batches = args.micro_batches or 4
    if args.micro_batches is not None and args.batch % args.micro_batches:
        raise ConfigError(
            "--batch", args.batch, f"is not divisible by --micro-batches={args.micro_batches}",
            "use a batch that is a multiple of the micro-batches",
        )
    longest = int(corpus_len * (1 - HOLDOUT)) - 2
    if args.seq > longest:
        raise ConfigError("--seq", args.seq, f"is longer than the training text allows ({longest} {unit})",
                          "use a shorter sequence" + (", or a longer --text" if args.text else ""))
    held = corpus_len - int(corpus_len * (1 - HOLDOUT)) - 1
    if args.eval_batches and args.seq > held:
        raise ConfigError("--seq", args.seq, f"is longer than the held-out text allows for validation ({held} {unit})",
                          "use a shorter sequence, or --eval-batches 0")
    most = max(1, (held - args.seq + 1) // args.batch)  # batches of windows that each start elsewhere
    if args.eval_batches > most:
        raise ConfigError("--eval-batches", args.eval_batches,
                          f"is more than the held-out text ({held} {unit}) holds in batches of --batch {args.batch} "
                          f"windows of --seq {args.seq} that each start at another {unit[:-1]} ({most})",
                          f"use --eval-batches {most} or fewer")
    if not gpt:
        return subject
    try:
        config = GPTConfig(n_layer=args.layers, n_head=args.heads, n_embd=args.embd, vocab_size=256, block_size=args.seq)
    except ValueError as e:  # GPTConfig's own checks
        raise SnakeError(f"--layers/--heads/--embd/--seq do not make a model: {e}") from None
    return subject.with_gpt(config)


def _lr_schedule(args: argparse.Namespace) -> Any:
    """--lr-schedule, --warmup-steps and --decay-steps as a snake.lr schedule (None: a
    constant rate). The decay ends at --decay-steps, or at this run's last step (counting
    a --resume checkpoint's steps)."""
    if args.lr_schedule == "constant":
        if args.decay_steps is not None:
            raise ConfigError("--decay-steps", args.decay_steps, "is where a decay ends, and --lr-schedule constant "
                              "has none", "add --lr-schedule linear or cosine, or leave --decay-steps out")
        return WarmupConstant(warmup_steps=args.warmup_steps) if args.warmup_steps else None
    total = args.decay_steps
    if total is None:
        done = (_checkpoint_step(args.resume) or 0) if args.resume else 0
        total = done + args.steps
    if args.warmup_steps > total:
        raise ConfigError("--warmup-steps", args.warmup_steps, f"must be <= the decay's {total} steps",
                          "use fewer warm-up steps or a larger --decay-steps")
    return LR_SCHEDULES[args.lr_schedule](total_steps=total, warmup_steps=args.warmup_steps)


def _snake_config(args: argparse.Namespace, offload_dir: str) -> SnakeConfig:
    dynamic = args.dtype == "float16" and args.loss_scale in (None, "dynamic")
    waits = dynamic or args.max_grad_norm not in (None, math.inf)  # every step needs the whole gradient
    return SnakeConfig(
        micro_batches=args.micro_batches, offload_dir=offload_dir, placement=args.placement,
        # --plan: the three None, which the trainer's first run plans
        alpha=None if args.plan else args.alpha if args.alpha is not None else 1.0 if waits else 0.25,
        loss_scale=DynamicLossScale() if dynamic else args.loss_scale or 1024.0,
        optimizer=AdamW(lr=args.lr, weight_decay=0.1, lr_schedule=_lr_schedule(args), max_grad_norm=args.max_grad_norm,
                        no_decay=biases_and_norms if args.no_decay_norms else None),
        dtype=args.dtype,
        device=args.device, schedule=args.schedule, seed=args.seed, storage_backend=args.storage_backend,
        resident_optimizer=args.resident_optimizer,
    )


def _output_dir(option: str, text: str) -> list[Path]:
    """Create the directory `text` (given as `option`) now, so the end of a run cannot fail
    on it. Returns the directories this made, deepest first (`_remove_if_empty` takes them
    back where the run is refused before it writes anything)."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(option, text, "is a file, not a directory", "pass a directory path")
    made = [d for d in (path, *path.absolute().parents) if not d.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _remove_if_empty(made)
        raise ConfigError(option, text, f"cannot be created ({e.strerror})", "pick a location you can write to") from None
    if not os.access(path, os.W_OK | os.X_OK):
        _remove_if_empty(made)
        raise ConfigError(option, text, "is not writable", "pick a directory you can write to")
    return made


def _remove_if_empty(made: list[Path]) -> None:
    """Remove the directories `_output_dir` made (deepest first) that are still empty."""
    for d in made:
        try:
            d.rmdir()
        except OSError:  # not empty (the run wrote there), or gone
            return


def _check_checkpoint_dir(text: str, offload_dir: str, out: str) -> None:
    """Refuse now a --checkpoint path that `trainer.save` would refuse after training (it only
    replaces a snake checkpoint or an empty directory, outside the offload directory), or
    could not write, or that is the --out directory or holds it. Leaves nothing behind."""
    from snake.checkpoint_files import holds
    from snake.manifest import MANIFEST

    path = Path(text).expanduser()
    fix = "pick a new or empty directory, or an earlier snake checkpoint to replace"
    try:
        path.exists()
    except OSError as e:  # a name past the file system's limit (ENAMETOOLONG), say
        raise ConfigError("--checkpoint", text, f"cannot be used ({e.strerror})", fix) from None
    for flag, other in (("--offload-dir", offload_dir), ("--out", out)):
        if holds(path, Path(other).expanduser()):
            raise ConfigError("--checkpoint", text, f"is or holds the {flag} directory {other!r}, which the run "
                              "writes into itself", "pick a checkpoint path outside it (one inside it is fine)")
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise ConfigError("--checkpoint", text, "exists and is not a directory", fix)
    if path.is_dir() and any(path.iterdir()) and not (path / MANIFEST).is_file():
        raise ConfigError("--checkpoint", text, f"is a directory with files but no {MANIFEST} (not a snake checkpoint)", fix)
    # save writes .NAME.tmp-<12 hex> next to the target, then renames it over the target: the
    # probe's name is one character longer
    _check_can_create("--checkpoint", text, path.absolute().parent, fix, probe_prefix=f".{path.name}.tmp-probe")


def _check_export_dir(text: str, option: str = "--hf", marker: str = "config.json", checkpoint: str | None = None) -> None:
    """Refuse now an export path (`option`) that export could not write into: one with
    files but no `marker` (what a directory of the kind it writes has), or one inside the
    `checkpoint` (the next save there replaces that directory whole, the export with it).
    Leaves nothing behind."""
    path = Path(text).expanduser()
    what = "Hugging Face model" if option == "--hf" else "PEFT adapter"
    fix = f"pass a new or empty directory you can write to, or a {what} directory to replace"
    if not text.strip():
        raise ConfigError(option, text, "is empty", fix)
    if checkpoint is not None:
        ck = Path(checkpoint).expanduser().absolute()
        if (ck / "manifest.json").is_file() and (path.absolute() == ck or ck in path.absolute().parents):
            raise ConfigError(option, text, f"is inside the checkpoint {checkpoint}, which the next save there "
                              "replaces whole (the export with it)", "export beside the checkpoint, not into it")
    if path.exists() and not path.is_dir():
        raise ConfigError(option, text, "exists and is not a directory", fix)
    # PEFT writes an adapter not named "default" into DIR/NAME
    ours = (path / marker).is_file() or (option == "--peft" and any((d / marker).is_file() for d in path.glob("*/")))
    if path.is_dir() and any(path.iterdir()) and not ours:
        # save_pretrained writes its config and *.safetensors over what is there
        raise ConfigError(option, text, f"is a directory with files but no {marker} (not a {what} "
                          "directory), which the export would write its files into", fix)
    _check_can_create(option, text, path.absolute(), fix, probe_prefix=".snake-export-probe-")


def _check_can_create(option: str, text: str, where: Path, fix: str, *, probe_prefix: str) -> None:
    """Refuse `text` (given as `option`) when a directory cannot be made in `where` or its
    nearest existing ancestor. os.access trusts the mode bits, which root passes where mkdir
    still fails (sysfs, a read-only mount): so one is made there (named `probe_prefix` and 8
    random characters) and removed at once."""
    existing = next(p for p in (where, *where.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(option, text, f"cannot be created: {existing} is a file", fix)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=probe_prefix, dir=existing))
    except OSError as e:
        raise ConfigError(option, text, f"cannot be created in {existing} ({e.strerror})", fix) from None


def _checkpoint_step(text: str) -> int | None:
    """The step of the checkpoint in `text` as it is on disk now (a save replaces it whole),
    or None where there is none."""
    from snake.manifest import MANIFEST

    try:
        return int(json.loads((Path(text).expanduser() / MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
