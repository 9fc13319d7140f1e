"""The `snake` command: `snake train` (an embedded default run), `snake plan`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from snake.clip import json_float
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
from snake.errors import ActorFailed, ConfigError, DataError, SnakeError
from snake.lr import SCHEDULES as LR_SCHEDULES
from snake.lr import WarmupConstant, describe
from snake.offload_dir import scratch_parent
from snake.optim import biases_and_norms

if TYPE_CHECKING:
    from snake.trace import Tracer
    from snake.train_source import Subject
    from snake.trainer import SnakeTrainer

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


def _check_export_dir(text: str, option: str = "--hf", marker: str = "config.json") -> None:
    """Refuse now an export path (`option`) that export could not write into: one with
    files but no `marker` (what a directory of the kind it writes has). Leaves nothing behind."""
    path = Path(text).expanduser()
    what = "Hugging Face model" if option == "--hf" else "PEFT adapter"
    fix = f"pass a new or empty directory you can write to, or a {what} directory to replace"
    if not text.strip():
        raise ConfigError(option, text, "is empty", fix)
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


class _Interrupted(Exception):
    """SIGINT or SIGTERM stopped `snake train`: its run stopped after the steps in flight
    (their checkpoint saved, where --checkpoint is given), or was cancelled (a second
    signal, or one while it set up, evaluated or saved) and the trainer closed."""

    def __init__(self, signum: int, steps: int, saved: tuple[str, int] | None = None) -> None:
        kept = (f"; the checkpoint in {saved[0]} holds step {saved[1]} (--resume {saved[0]} to go on)"
                if saved else "")
        super().__init__(f"interrupted ({signal.Signals(signum).name}) after {steps} steps{kept}")
        self.signum = signum


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Signals:
    """SIGINT and SIGTERM while `snake train` runs. The first asks the run in progress to
    stop after the steps in flight (`graceful`, where one is set and says it will: the run
    then ends as it would, keeping what it trained); else, or at a second signal, the task
    is cancelled, once: a later signal is ignored, so the trainer's cleanup is not cut
    short. `caught`: the signals caught."""

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.caught: list[int] = []
        self.graceful: Callable[[], bool] | None = None
        self._task = task
        self._cancelled = False

    def on_signal(self, signum: int) -> None:
        self.caught.append(signum)
        if len(self.caught) == 1 and self.graceful is not None and self.graceful():
            print(f"\nsnake train: {signal.Signals(signum).name}: stopping after the steps in flight "
                  f"(again to stop at once)", file=sys.stderr)
            return
        if not self._cancelled:
            self._cancelled = True
            self._task.cancel()


@contextlib.contextmanager
def _signals_cancel_this_task() -> Iterator[_Signals]:
    """While inside, SIGINT and SIGTERM go to a `_Signals` of the running task (yielded).
    The handlers before are put back at the end (off the main thread, or where the loop has
    no signal handlers, the signals keep them throughout)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    signals = _Signals(task)
    before: dict[signal.Signals, Any] = {}
    try:
        for signum in _STOP_SIGNALS:
            handler = signal.getsignal(signum)
            try:
                loop.add_signal_handler(signum, signals.on_signal, signum)
            except (NotImplementedError, RuntimeError, ValueError):
                continue
            before[signum] = handler
        yield signals
    finally:
        for signum, handler in before.items():
            loop.remove_signal_handler(signum)
            if handler is not None:  # None: set outside Python; the removal leaves the default
                signal.signal(signum, handler)


class _StoppedBySignal(Exception):
    """The run stopped after the steps in flight, as a signal asked (`_Signals.graceful`)."""


async def _train(args: argparse.Namespace, subject: Subject, config: SnakeConfig, resumed: dict | None) -> int:
    """The run; _Interrupted when SIGINT or SIGTERM stopped it. `resumed`: the --resume
    checkpoint and its step, for report.json."""
    steps: list[dict] = []
    with _signals_cancel_this_task() as signals:
        caught = signals.caught
        try:
            return await _train_run(args, subject, config, steps, resumed, signals)
        except _StoppedBySignal:
            pass
        except asyncio.CancelledError:
            if not caught:
                raise
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()  # the cancellation was ours and ends here
        held = _checkpoint_step(args.checkpoint) if args.checkpoint else None
        raise _Interrupted(caught[0], len(steps), (args.checkpoint, held) if held is not None else None) from None


def _checkpoint_step(text: str) -> int | None:
    """The step of the checkpoint in `text` as it is on disk now (a save replaces it whole),
    or None where there is none."""
    from snake.manifest import MANIFEST

    try:
        return int(json.loads((Path(text).expanduser() / MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _config_json(value: Any) -> Any:
    """`asdict(config)` as JSON values: tuples as lists, paths as strings."""
    if isinstance(value, dict):
        return {k: _config_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_config_json(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def _config_dict(config: SnakeConfig) -> dict[str, Any]:
    """The config as JSON values, its optimizer's callables named (`snake.lr.describe`)."""
    out = _config_json(asdict(config))
    out["optimizer"]["lr_schedule"] = describe(config.optimizer.lr_schedule)
    out["optimizer"]["no_decay"] = describe(config.optimizer.no_decay)
    out["optimizer"]["max_grad_norm"] = json_float(config.optimizer.max_grad_norm)
    return out


async def _train_run(args: argparse.Namespace, subject: Subject, config: SnakeConfig, steps: list[dict],
                     resumed: dict | None, signals: _Signals) -> int:
    """Train, appending each step's numbers to `steps`, and write the run's files."""
    from snake.corpus import holdout_windows, random_windows
    from snake.timeline import plot_timeline
    from snake.train_source import train_record
    from snake.trainer import SnakeTrainer

    corpus = subject.corpus
    torch.manual_seed(args.seed)  # the model's fresh weights (a LoRA's adapters) draw from it
    assert subject.build is not None
    model = subject.build()
    params = sum(p.numel() for p in model.parameters())
    learned = sum(p.numel() for p in model.parameters() if p.requires_grad)
    count = f"{_millions(params)} parameters" + (f", {_millions(learned)} trained" if learned < params else "")
    print("model:", json.dumps(subject.record), f"({count})")
    print("config:", json.dumps(_config_dict(config)))
    data = random_windows(corpus, batch=args.batch, seq=args.seq, seed=args.seed, holdout=HOLDOUT)
    held = (holdout_windows(corpus, batch=args.batch, seq=args.seq, batches=args.eval_batches, holdout=HOLDOUT)
            if args.eval_batches else [])
    val: dict[str, float] = {}
    out = Path(args.out)
    async with SnakeTrainer(model, data=data, config=config) as trainer:
        try:
            wall, trained = await _train_steps(trainer, args, config, held, val, steps, train_record(args, subject),
                                               signals)
        except BaseException as exc:  # failed or interrupted: its trace tells what it was doing
            _save_trace_of_stopped_run(trainer.trace, out, steps, exc)
            raise
        trainer.trace.save(out / "trace.json")
        spans = list(trainer.trace.spans)
        # the timeline's window: the last steps, not the evaluation after them
        plot_timeline([s for s in spans if s.start_s < trained], out / "timeline.png", window_s=_window(steps),
                      dropped=trainer.trace.recorded - len(spans))
        report_json = {
            "model": subject.record,
            "text": subject.text,  # what a --resume of its checkpoint must train on (snake.train_source)
            "resumed_from": resumed,  # the --resume checkpoint and its step, or null
            "config": _config_dict(trainer.config),  # what --plan picked too
            "steps": steps,
            "wall_seconds": wall,  # of the runs, their setup included
            "tokens_per_s": sum(s["tokens"] for s in steps) / wall,
            "data_wait_s": sum(s["data_wait_s"] for s in steps),  # steps waiting for their batch
            "traffic_last_step": {"/".join(k): v for k, v in trainer.traffic().items()},
            "trace_summary": trainer.trace.summary(),
            # on --eval-batches batches of the held-out text, before and after training
            "val_loss": {k: json_float(v) for k, v in val.items()},
        }
        (out / "report.json").write_text(json.dumps(report_json, indent=2, allow_nan=False))
        if args.checkpoint:
            await _save(trainer, args.checkpoint, train_record(args, subject))
            print(f"checkpoint: {args.checkpoint} (snake export {args.checkpoint} "
                  f"{'--peft' if subject.peft else '--hf'} DIR)")
    held_out = f"; held-out loss {val['before']:.4f} -> {val['after']:.4f}" if val else ""
    print(f"loss {float(steps[0]['loss']):.4f} -> {float(steps[-1]['loss']):.4f} in {wall:.1f} s{held_out}; "
          f"wrote trace.json, report.json, timeline.png to {out}")
    return 0


def _millions(n: int) -> str:
    """A parameter count in millions, with the digits a small one needs (a LoRA's 8 K: 0.008 M)."""
    return f"{n / 1e6:.2f} M" if n >= 10**5 or n == 0 else f"{n / 1e6:.2g} M"


async def _save(trainer: SnakeTrainer, directory: str, record: dict[str, Any]) -> None:
    """trainer.save, then the run's text and windows beside the checkpoint (`record`, what a
    --resume of it checks: snake.train_source.TRAIN_RECORD)."""
    from snake.train_source import write_train_record

    await trainer.save(directory)
    await asyncio.to_thread(write_train_record, directory, record)


async def _train_steps(
    trainer: SnakeTrainer, args: argparse.Namespace, config: SnakeConfig, held: list, val: dict[str, float],
    steps: list[dict], record: dict[str, Any], signals: _Signals,
) -> tuple[float, float]:
    """The trainer's work in `snake train`: resume, evaluate, train --steps steps (with the
    progress bar, a checkpoint every --save-every), evaluate. Returns the runs' wall seconds
    and the trace's clock at the end of training (before the evaluation after it). `record`:
    what each checkpoint's TRAIN_RECORD says. A signal while a run trains (once it is set
    up) stops it after the steps in flight: what they trained goes to --checkpoint, and
    _StoppedBySignal is raised."""
    if args.resume:  # its step, weights, optimizer state, RNG and place in the data
        await trainer.load(args.resume)
    if held:
        val["before"] = (await trainer.evaluate(held)).loss
    bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True)
    links: dict[str, str] = {}
    skipped = [0]  # steps a dynamic loss scale skipped (an overflow)

    def on_step(s) -> None:  # type: ignore[no-untyped-def]
        # a step's seconds: its wall time, the wait for its batch (data_wait_s) included
        steps.append({"step": s.step, "loss": json_float(s.loss), "seconds": s.seconds,
                      "data_wait_s": s.data_wait_s, "tokens": s.tokens, "lr": s.lr,
                      "grad_norm": json_float(s.grad_norm), "loss_scale": json_float(s.loss_scale),
                      "skipped": s.skipped})
        if len(steps) % 10 == 1:  # bandwidth per tier link, from the trace
            for link, v in trainer.trace.summary()["links"].items():
                links[link] = f"{v['avg_bytes_per_s'] / 2**20:.0f}MiB/s"
        info = {"loss": f"{s.loss:.4f}", "tok/s": f"{s.tokens / s.seconds:.0f}", **links}
        if s.data_wait_s > 0.05 * s.seconds:  # input-bound: the step waited for its batch
            info["data wait"] = f"{s.data_wait_s / s.seconds:.0%}"
        if config.optimizer.lr_schedule is not None:
            info["lr"] = f"{s.lr:.2e}"
        if s.grad_norm is not None:
            info["gnorm"] = f"{s.grad_norm:.3f}"
        if s.loss_scale is not None:
            info["scale"] = f"{s.loss_scale:g}"
            skipped[0] += s.skipped
            if skipped[0]:
                info["skipped"] = str(skipped[0])
        bar.set_postfix(info, refresh=False)
        bar.update(1)

    wall, done = 0.0, 0
    try:
        while done < args.steps:  # in pieces of --save-every steps, a checkpoint after each but the last
            n = min(args.save_every or args.steps, args.steps - done)
            t0 = time.perf_counter()
            signals.graceful = lambda: trainer.engine is not None and trainer.stop()
            try:
                report = await trainer.run(n, on_step=on_step)
            except DataError as e:
                if e.report is not None and args.checkpoint:  # stopped cleanly: what it trained is kept
                    await _save(trainer, args.checkpoint, record)
                    print(f"\nsnake train: the data stopped the run after {done + len(e.report.steps)} steps; saved "
                          f"them to {args.checkpoint}", file=sys.stderr)
                raise
            finally:
                signals.graceful = None  # a signal while it saves or evaluates cancels that
            wall += time.perf_counter() - t0
            done += len(report.steps)
            if report.stopped or signals.caught:
                if args.checkpoint:  # what the steps in flight trained is kept
                    await _save(trainer, args.checkpoint, record)
                raise _StoppedBySignal()
            if done < args.steps:
                await _save(trainer, args.checkpoint, record)
    finally:
        bar.close()
    trained = trainer.trace.now()
    if held:
        val["after"] = (await trainer.evaluate(held)).loss
    return wall, trained


def _save_trace_of_stopped_run(trace: Tracer, out: Path, steps: list[dict], exc: BaseException) -> None:
    """Write trace.json and timeline.png of a run that failed or was interrupted, and say so
    on stderr. A failure here is said in one line; the caller re-raises the run's error."""
    from snake.timeline import plot_timeline

    how = "interrupted" if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | _StoppedBySignal) else "failed"
    spans = list(trace.spans)
    if not spans:
        return  # it stopped before anything was traced
    wrote = []
    try:
        trace.save(out / "trace.json")
        wrote.append("trace.json")
        plot_timeline(spans, out / "timeline.png", window_s=_window(steps), dropped=trace.recorded - len(spans))
        wrote.append("timeline.png")
    except Exception as e:  # said, not raised: the run's own error is the one to raise
        print(f"snake train: could not save the {how} run's {'timeline.png' if wrote else 'trace.json'} to "
              f"{out}: {type(e).__name__}: {e}", file=sys.stderr)
    if wrote:
        print(f"snake train: the run {'was interrupted' if how == 'interrupted' else how} after {len(steps)} "
              f"steps; wrote its {' and '.join(wrote)} to {out}", file=sys.stderr)


def _window(steps: list[dict]) -> float | None:
    """Show about the last three steps in the timeline, where it is readable."""
    if len(steps) < 4:
        return None
    return sum(s["seconds"] for s in steps[-3:]) * 1.1


def _seconds(text: str) -> float:
    """A positive number of seconds (--last)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be more than 0 seconds")
    return value


def _image_path(out: str) -> str | None:
    """Why `out` cannot take the timeline PNG (None: it can)."""
    path = Path(out).expanduser()
    if path.suffix.lower() != ".png":
        return "must name a .png file"
    if path.is_dir():
        return "is a directory; name a .png file in it"
    if not path.parent.is_dir():
        return f"is in {path.parent}, which is not a directory; create it first"
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return f"is in {path.parent}, which is not writable"
    return None


def _trace(argv: list[str]) -> int:
    from snake.timeline import plot_timeline
    from snake.trace import load_trace, summarize

    p = argparse.ArgumentParser(prog="snake trace")
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("summarize", help="per-actor utilization and per-link bandwidth")
    s.add_argument("trace")
    s.add_argument("--json", action="store_true")
    pl = sub.add_parser("plot", help="per-actor timeline (Gantt chart) as PNG")
    pl.add_argument("trace")
    pl.add_argument("-o", "--out", default="timeline.png")
    pl.add_argument("--last", type=_seconds, default=None, help="only the last SECONDS of the trace")
    args = p.parse_args(argv)
    if args.what == "plot" and (why := _image_path(args.out)) is not None:
        print(f"snake trace: -o {args.out!r} {why}", file=sys.stderr)
        return 2
    try:
        spans, records = load_trace(args.trace)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        print(f"snake trace: cannot read {args.trace}: {e}", file=sys.stderr)
        return 2
    try:
        if args.what == "plot":
            if not spans:
                print(f"snake trace: {args.trace} has no spans to plot", file=sys.stderr)
                return 2
            totals = records.get("totals") or {}
            dropped = int(totals.get("spans_recorded", 0)) - int(totals.get("spans_kept", 0))
            plot_timeline(spans, args.out, window_s=args.last, dropped=dropped)
            print(f"wrote {args.out}")
            return 0
        _print_summary(summarize(spans, **records), as_json=args.json)
        sys.stdout.flush()  # here, so a closed pipe is caught below and not at exit
    except BrokenPipeError:  # `snake trace summarize t.json | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _print_summary(summary: dict, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    print(f"traced wall time: {summary['wall_s']:.3f} s")
    spans = summary.get("spans", {})
    if spans.get("dropped"):
        print(f"spans: {spans['recorded']} recorded, the newest {spans['kept']} kept in the file "
              "(the numbers below cover all of them)")
    print(f"{'actor':<16}{'busy s':>10}{'busy %':>9}")
    for actor, v in summary["actors"].items():
        print(f"{actor:<16}{v['busy_s']:>10.3f}{100 * v['busy_fraction']:>8.1f}%")
    loop = summary.get("event_loop")
    if loop is not None:
        print(f"event loop CPU: {loop['cpu_s']:.3f} s in {loop['run_wall_s']:.3f} s of run() "
              f"({100 * loop['cpu_fraction']:.1f}% of one core)")
    if "threads" in summary:
        print(f"{'threads (over run())':<24}{'CPU s':>9}{'cores':>7}{'run-queue wait':>16}")
        for group, v in summary["threads"].items():
            print(f"{group:<24}{v['cpu_s']:>9.3f}{v['cpu_fraction']:>7.2f}{100 * v['runqueue_fraction']:>15.1f}%")
    print(f"{'link':<12}{'MiB moved':>10}{'MiB copied':>12}{'MiB/s copying':>15}{'MiB/s avg':>11}")
    for link, v in summary["links"].items():
        print(
            f"{link:<12}{v['bytes'] / 2**20:>10.1f}{v.get('copied_bytes', v['bytes']) / 2**20:>12.1f}"
            f"{v['busy_bytes_per_s'] / 2**20:>15.1f}{v['avg_bytes_per_s'] / 2**20:>11.1f}"
        )
    print("(moved: what the schedule sends over the link; copied: what took a copy, which a CPU "
          "device skips for data already in CPU memory)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="snake", description="train LLMs bigger than GPU memory")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _train_parser(sub)
    sub.add_parser("plan", help="profile this machine and plan placement, alpha and micro-batches", add_help=False)
    ex = sub.add_parser("export", help="write a checkpoint as a Hugging Face model (from_pretrained), or a PEFT "
                                       "model's checkpoint as its adapters (PeftModel.from_pretrained)")
    ex.add_argument("checkpoint")
    to = ex.add_mutually_exclusive_group(required=True)
    to.add_argument("--hf", metavar="DIR", help="output directory of the whole model")
    to.add_argument("--peft", metavar="DIR", help="output directory of a PEFT model's adapters (adapter_config.json "
                                                  "and adapter_model.safetensors)")
    sub.add_parser("trace", help="summarize or plot a trace.json", add_help=False)
    if argv and argv[0] == "trace":
        return _trace(argv[1:])
    if argv and argv[0] == "plan":
        from planner.cli import plan_main

        return plan_main(argv[1:])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.cmd == "export":
        from snake.export import export_checkpoint_hf, export_checkpoint_peft

        try:
            if args.peft is not None:
                _check_export_dir(args.peft, "--peft", "adapter_config.json")  # before the checkpoint is read
                out = export_checkpoint_peft(args.checkpoint, args.peft)
            else:
                _check_export_dir(args.hf, "--hf", "config.json")
                out = export_checkpoint_hf(args.checkpoint, args.hf)
        except SnakeError as e:
            print(f"snake export: {e}", file=sys.stderr)
            return 2
        how = "peft's PeftModel.from_pretrained(base_model, DIR)" if args.peft is not None else \
            "transformers' from_pretrained"
        print(f"wrote {out} (load it with {how})")
        return 0
    if args.cmd == "train":
        try:
            return _train_main(args)
        except SnakeError as e:
            if isinstance(e, ActorFailed | DataError) and e.__cause__ is not None \
                    and not isinstance(e.__cause__, SnakeError):
                raise  # an actor or the data hit a bug, not a bad argument: the traceback is what a report needs
            print(f"snake train: {e}", file=sys.stderr)
            return 2
    return 2


def _train_main(args: argparse.Namespace) -> int:
    # until the event loop takes SIGINT and SIGTERM over (_signals_cancel_this_task), they
    # raise here, so a temporary offload directory made meanwhile is removed on the way out
    before = {signum: signal.getsignal(signum) for signum in _STOP_SIGNALS}
    try:
        for signum in _STOP_SIGNALS:
            signal.signal(signum, _interrupt_setup)
    except ValueError:  # off the main thread: the signals keep their handlers
        before = {}
    try:
        return _train_setup_and_run(args)
    except _Interrupted as e:  # the temporary offload directory is gone by now; a given one stays
        print(f"snake train: {e}", file=sys.stderr)
        return 128 + e.signum
    finally:
        for signum, handler in before.items():
            if handler is not None:
                signal.signal(signum, handler)


def _interrupt_setup(signum: int, frame: Any) -> None:
    raise _Interrupted(signum, 0)


def _train_setup_and_run(args: argparse.Namespace) -> int:
    from snake.train_source import (
        check_resume,
        check_resume_options,
        resume_defaults,
        resume_manifest,
        subject,
    )

    trains = subject(args)
    manifest = resume_manifest(args.resume) if args.resume else None
    if manifest is not None:
        resume_defaults(args, manifest)
        check_resume_options(args, manifest)
    chosen = _check_train_args(args, trains)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run  # type: ignore[assignment]
    with contextlib.ExitStack() as stack:
        offload_dir = args.offload_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="snake-offload-", dir=scratch_parent()))
        config = _snake_config(args, offload_dir)
        # the run writes these at its end: refuse a bad path now, not after training
        if args.checkpoint:
            _check_checkpoint_dir(args.checkpoint, str(offload_dir), args.out)
        if manifest is not None and (note := check_resume(args, chosen, config, manifest)) is not None:
            print(f"snake train: {note}", file=sys.stderr)
        made = _output_dir("--out", args.out)
        resumed = None if manifest is None else {"checkpoint": args.resume, "step": manifest["step"]}
        try:
            return runner(_train(args, chosen, config, resumed))
        finally:  # refused before it wrote anything (a bad offload_dir, found by the trainer): none left
            _remove_if_empty(made)


if __name__ == "__main__":
    sys.exit(main())
