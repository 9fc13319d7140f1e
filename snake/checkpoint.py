"""Checkpoints: `await trainer.save(directory)` and `await trainer.load(directory)`.

A checkpoint is a directory of safetensors files and one JSON manifest (no pickle):

  manifest.json            format and version, `step` (optimizer steps applied = the next
                           iteration), `consumed_batches` (global batches taken from the
                           data), the config fields a resume must match, the model's
                           parameter names and shapes, `missed_steps` (the parameters left
                           in some steps for want of a gradient or by a dynamic loss
                           scale's overflow, and how many), `loss_scale` (a dynamic loss
                           scale's state: scale and growth_tracker; absent without one),
                           `frozen_stored` (whether the files hold the frozen parameters;
                           absent in older checkpoints, which do), and the size and sha256
                           of each file
  layer-00000.safetensors  one per block: `master/<name>`, `exp_avg/<name>`,
                           `exp_avg_sq/<name>` (fp32) for each of the block's parameters,
                           named as in `model.state_dict()`, and `frozen/<name>` for each
                           of the block's frozen parameters (requires_grad=False: never
                           stepped; a load checks the model's against their digests, which
                           the manifest holds: not stored by `save(frozen=False)`, nor by
                           default for a PEFT model, whose base is the user's; before round
                           37 in resident.safetensors)
  resident.safetensors     the same for the resident (pre/post) parameters (tied weights once),
                           and `frozen/<name>` for the other frozen parameters,
                           and `buffer/<name>` for every buffer in `model.state_dict()` (a
                           layer's own scale or routing bias: `snake export` rebuilds the
                           model from its config, which does not hold them; a load leaves
                           the model's as they are)
  rng.safetensors          torch's global RNG state(s) as uint8 tensors
  data.safetensors         the tensors of the data's state (a stateful source's: one with
                           `state_dict()` and `load_state_dict()`, torchdata's
                           StatefulDataLoader): the state after the last batch trained on,
                           whose tree is the manifest's `data_state` (`snake.data_state`); a
                           load with such data hands it to `load_state_dict` instead of
                           reading and dropping the batches trained before. Absent (and no
                           `data_state`) where the data has no state.

The manifest's `batch` records the shapes and dtypes of the trainer's batches (inputs and
targets): a load whose data has no batch after the checkpoint's (a run trained to its
data's end) sizes the trainer from it, to evaluate or go on with `run(data=...)`; absent in
checkpoints before round 42 and in one saved before the first run.

Every parameter has had `step` AdamW steps, less its `missed_steps` (iterations in which it
got no gradient, which torch.optim.AdamW skips too): delayed optimizer work (alpha > 0) is
flushed before saving, so a resumed run gives the weights of an uninterrupted one. The
compute-dtype parameters are not stored: `load` derives them from the masters. Dropout
masks derive from (config.seed, iteration, layer, micro-batch), so the step counter and the
seed fix them.

Saving is atomic: the files are written into a temporary sibling directory and fsynced,
then renamed over the target (an existing checkpoint there is renamed aside first and
removed only after the rename), so a crash leaves the previous checkpoint in place. Writes
and reads go one layer at a time, without a copy of the layer's state: safetensors writes
the optimizer state in CPU memory from the store itself, and what lies on SSD passes through
the optimizer's staging buffers (idle between runs); a load maps one layer file and copies
each parameter into its units.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
import stat
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file as st_save_file

from snake.adapters import (
    ModelParts,
    flat_named,
    has_peft_layers,
    iter_frozen,
    layer_kinds,
    layer_specs,
    layer_values,
    resident_named_params,
)
from snake.batch_spec import spec_error, stand_in_batch
from snake.blocking import name_native_thread, run_blocking
from snake.buffers import HostBuffer, alloc_host
from snake.clip import json_float
from snake.config import DynamicLossScale, Placement, SnakeConfig
from snake.data_state import Snapshot, check_tree
from snake.device import synchronize
from snake.errors import ConfigError, DataError, DataExhausted, SnakeError, Stopped, StorageError
from snake.lr import describe
from snake.memory import fmt_size

if TYPE_CHECKING:
    from snake.engine import Engine
    from snake.trainer import SnakeTrainer

log = logging.getLogger("snake")

FORMAT = "snake-checkpoint"
# 2: `missed_steps` (round 25). A version 1 checkpoint has none (its snake stepped every
# parameter every step) and reads as before; a snake that reads only version 1 refuses a
# version 2 one rather than lose its parameters' step counts
VERSION = 2
READS = (1, 2)
MANIFEST = "manifest.json"
RESIDENT = "resident.safetensors"
DATA = "data.safetensors"
RNG = "rng.safetensors"
COMPS = ("master", "exp_avg", "exp_avg_sq")
# config fields a resume must match (None on either side: not checked)
MATCH_FIELDS = ("dtype", "schedule", "alpha", "micro_batches", "seed")
FIX = (
    "a checkpoint resumes only with the model shape and the config "
    f"({', '.join(MATCH_FIELDS)}) it was saved with"
)

R = TypeVar("R")

_rename = os.rename  # the one call that publishes a checkpoint (tests fake it)


def _resolve(directory: str | os.PathLike[str]) -> Path:
    if not isinstance(directory, str | os.PathLike):
        raise ConfigError("directory", directory, "must be a path (a str or an os.PathLike such as pathlib.Path)")
    return Path(os.path.abspath(Path(directory).expanduser()))


def holds(outer: str | os.PathLike[str], inner: str | os.PathLike[str]) -> bool:
    """Whether `outer` is `inner` or one of its ancestors (their real paths: links
    followed)."""
    o, i = Path(os.path.realpath(outer)), Path(os.path.realpath(inner))
    return o == i or o in i.parents


def layer_file(layer: int) -> str:
    return f"layer-{layer:05d}.safetensors"


# -- public entry points (SnakeTrainer.save / .load call these) -------------------------
async def save_checkpoint(trainer: SnakeTrainer, directory: str | os.PathLike[str], *,
                          frozen: bool | None = None) -> Path:
    """Write the trainer's full training state to `directory` (atomically, replacing a
    checkpoint already there). Works before the first run too (step 0, zero moments).
    `frozen`: store the frozen parameters (default: unless the model is a PEFT model)."""
    trainer._check_usable()
    trainer._check_idle("save")
    if frozen is not None and not isinstance(frozen, bool):
        raise ConfigError("save(frozen=...)", frozen, "must be True, False or None (the default: stored unless the "
                          "model is a PEFT model)")
    store = not has_peft_layers(trainer.parts.model) if frozen is None else frozen
    target = _resolve(directory)
    if holds(target, trainer.offload_dir):  # the checkpoint's rename would take the live tier away
        raise SnakeError(
            f"save: {target} is or holds the trainer's offload_dir {trainer.offload_dir}, whose SSD tier files are "
            "the training's live state: pick a checkpoint path outside it (one inside it is fine)"
        )
    _check_save_target(target)  # before the delayed steps are flushed: a bad path changes nothing
    _check_save_space(trainer, target, store)
    data = _data_state(trainer)
    trainer._begin()
    try:
        e = trainer.engine
        if e is not None:
            await trainer._flush("save")
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "step": e.next_t if e is not None else 0,
            "consumed_batches": trainer.source.consumed,
            "config": config_record(trainer.config),
            # off the event loop: the frozen parameters' digests read them whole
            "model": await _blocking(e, lambda: model_spec(trainer.parts, trainer_digests(trainer))),
            "model_config": model_config(trainer.parts),
            "peft": peft_record(trainer.parts),
            "missed_steps": missed_steps(e) if e is not None else {},
            "frozen_stored": store,
        }
        if e is not None and e.scaler is not None:
            manifest["loss_scale"] = e.scaler.state()
        if data is not None:
            manifest["data_state"] = data.tree
        if trainer._batch_spec is not None:
            manifest["batch"] = trainer._batch_spec
        rng = rng_state()
        stop = threading.Event()  # a cancelled save stops at its next file and removes what it wrote
        with _borrowed(e, "opt", every=True) as bufs:
            await _blocking(e, functools.partial(_save_blocking, e, trainer.parts, manifest, rng, target, bufs, stop,
                                                 data.tensors if data is not None else None),
                            on_cancel=stop.set)
    finally:
        trainer._end()
    return target


async def load_checkpoint(
    trainer: SnakeTrainer, directory: str | os.PathLike[str], *, skip_data: bool = True
) -> None:
    """Restore a checkpoint into a new trainer, before its first run(). Validates the
    manifest against the trainer (ConfigError naming the field), skips the global batches
    the checkpoint consumed (unless skip_data=False: then the data must already start
    after them), builds the engine and overwrites its state."""
    trainer._check_usable()
    if trainer.engine is not None or trainer._running or trainer.source.consumed:
        raise SnakeError(
            "load: a checkpoint can only be loaded into a new trainer, before its first run() "
            "(this one has already run or loaded one); make a new SnakeTrainer and call "
            "load() before run()"
        )
    if not isinstance(skip_data, bool):
        raise ConfigError("load(skip_data=...)", skip_data, "must be True or False")
    target = _resolve(directory)
    trainer._begin()
    try:
        manifest = await _blocking(None, functools.partial(read_manifest, target))
        await _blocking(None, lambda: check_compatible(manifest, trainer.config, trainer.parts,
                                                        trainer_digests(trainer)))
        consumed, left = int(manifest["consumed_batches"]), trainer.source.left()
        restores = skip_data and trainer.source.stateful and "data_state" in manifest
        if skip_data and not restores and left is not None and left < consumed:  # a list: known before it is read
            raise _short_data(consumed, f"data holds {left}")
        # checked before the point of no return below, as the rest of the manifest is
        snap = await _blocking(None, functools.partial(_read_data_state, target, manifest)) if restores else None
        trainer.config = fill_config(trainer.config, manifest)
        # where the data has no batch after the checkpoint's (a run trained to its end), the
        # engine is sized from the batch shapes the checkpoint records
        trainer._stand_in = None
        if "batch" in manifest:
            why = spec_error(manifest["batch"], trainer.config.micro_batches)
            if why is not None:
                raise SnakeError(f"load: {target / MANIFEST} has batch={manifest['batch']!r}, which {why}: the "
                                 "manifest is damaged")
            trainer._stand_in = stand_in_batch(manifest["batch"])
        # from here on the trainer's data and engine change: a failure leaves it unusable
        try:
            await _restore(trainer, target, manifest, skip_data, snap)
        except BaseException as exc:
            trainer._broken = f"load({str(target)!r}) failed: {type(exc).__name__}: {exc}"
            await trainer._shutdown()
            raise
    finally:
        trainer._end()


async def _restore(
    trainer: SnakeTrainer, target: Path, manifest: dict[str, Any], skip_data: bool, snap: Snapshot | None
) -> None:
    """`snap`: the checkpoint's data state, handed to the (stateful) data; else the batches
    it consumed are skipped by reading them (where skip_data)."""
    consumed = int(manifest["consumed_batches"])
    if snap is not None or (skip_data and consumed):
        ex = ThreadPoolExecutor(1, thread_name_prefix="snake-data", initializer=name_native_thread)
        try:
            if snap is not None:
                await trainer.source.restore(snap, consumed, ex)
            else:
                try:
                    for _ in range(consumed):
                        await trainer.source.next(ex)
                except DataError as exc:
                    raise _short_data(consumed, f"data ran out after {trainer.source.consumed}") from exc
        finally:
            # joined unless a cancellation left the user's next() running there (it may block
            # for long, and the load does not wait for it, as run() does not): that thread
            # ends when it returns
            ex.shutdown(wait=not trainer.source.fetching(), cancel_futures=True)
    if not skip_data:  # the data starts after the checkpoint's batches: its own state is not that position
        trainer.source.skipped = consumed
    trainer.source.consumed = consumed
    try:
        await trainer._setup()
    except DataExhausted as exc:  # only without the manifest's `batch` (a checkpoint before round 42)
        raise DataExhausted(
            f"load: the data has no batch after the checkpoint's {consumed}, and the checkpoint records no batch "
            "shapes to size the trainer from (it was saved before its trainer's first run, or by a snake before "
            "round 42): give data with a batch after them, or load(dir, skip_data=False) with the data to go on with"
        ) from exc
    trainer._stand_in = None
    check_resolved(trainer.config, manifest)
    e = trainer.engine
    assert e is not None
    stop = threading.Event()  # a cancelled load stops at its next layer (the trainer closes either way)
    with _borrowed(e, "opt") as obuf, _borrowed(e, "param_in") as pbuf:
        rng = await run_blocking(e.executors["io"], apply_checkpoint, e, trainer.parts, target, manifest,
                                 obuf[0] if obuf else None, pbuf[0] if pbuf else None, stop, on_cancel=stop.set)
    set_rng_state(rng)


def _data_state(trainer: SnakeTrainer) -> Snapshot | None:
    """The state a save stores of the trainer's data (after the last batch it trained on;
    None where the data has none). Where a stateful source's is not known there (its
    state_dict() failed at that batch), a warning: the checkpoint's load reads and drops
    the batches instead, as for data without state."""
    source = trainer.source
    if not source.stateful:
        return None
    snap = source.state()
    if source.state_lost():
        log.warning("save: the data's state after its %d batches trained on is not known (its state_dict() failed "
                    "there): a load of this checkpoint reads and drops those batches instead of restoring the "
                    "state", source.consumed)
    return snap


def _read_data_state(target: Path, manifest: dict[str, Any]) -> Snapshot:
    """Blocking: the data state a checkpoint holds (the manifest's tree, the tensors of
    data.safetensors), checked."""
    tensors: dict[str, torch.Tensor] = {}
    if DATA in manifest["files"]:
        try:
            tensors = st_load_file(str(target / DATA))
        except (SafetensorError, OSError) as exc:
            raise SnakeError(f"load: {target / DATA} is not a valid safetensors file: {exc}") from exc
    why = check_tree(manifest["data_state"], set(tensors))
    if why is not None:
        raise SnakeError(why)
    return Snapshot(manifest["data_state"], tensors)


def _short_data(consumed: int, have: str) -> DataError:
    return DataError(
        f"load: the checkpoint has consumed {consumed} global batches but {have}; pass the data the "
        "checkpoint was trained on (from its start), or load(..., skip_data=False) with data that starts "
        "after them"
    )


@contextlib.contextmanager
def _borrowed(e: Engine | None, pool: str, *, every: bool = False) -> Iterator[list[HostBuffer]]:
    """The engine's staging buffers for `pool`'s tails (one, or every free one), lent to a
    save or load: no run is in flight then, so all are free, and the state passes through
    them rather than through memory of its own. Empty when the store has no tails (or no
    engine)."""
    p = e.pools[pool] if e is not None else None
    bufs: list[HostBuffer] = []
    while p is not None and (every or not bufs):
        buf = p.try_acquire()
        if buf is None:
            break
        bufs.append(buf)
    try:
        yield bufs
    finally:
        for buf in bufs:
            assert p is not None
            p.release(buf)


async def _blocking(e: Engine | None, fn: Callable[[], R], on_cancel: Callable[[], None] | None = None) -> R:
    if e is not None:
        return await run_blocking(e.executors["io"], fn, on_cancel=on_cancel)
    with ThreadPoolExecutor(1, thread_name_prefix="snake-checkpoint", initializer=name_native_thread) as ex:
        return await run_blocking(ex, fn, on_cancel=on_cancel)


# -- manifest ---------------------------------------------------------------------------
def config_record(cfg: SnakeConfig) -> dict[str, Any]:
    p, o = cfg.placement, cfg.optimizer
    return {
        "dtype": cfg.dtype,
        "schedule": cfg.schedule,
        "alpha": cfg.alpha,
        "micro_batches": cfg.micro_batches,
        "seed": cfg.seed,
        # informational: not checked on load (placement changes results only in the last
        # bit of a few elements, snake.optim.adamw_step; a new optimizer setting is the
        # user's choice)
        "placement": None if p is None else {"param": p.param, "ckpt": p.ckpt, "opt": p.opt, "grad": p.grad},
        "resident_optimizer": cfg.resident_optimizer,  # informational, as placement (bitwise either way)
        "optimizer": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
                      "lr_schedule": describe(o.lr_schedule), "no_decay": describe(o.no_decay),
                      "max_grad_norm": json_float(o.max_grad_norm)},
        # informational: a resume may change it (a dynamic scale goes on from the state saved)
        "loss_scale": (dataclasses.asdict(cfg.loss_scale) if isinstance(cfg.loss_scale, DynamicLossScale)
                       else cfg.loss_scale),
    }


def model_config(parts: ModelParts) -> dict[str, Any] | None:
    """What `snake export` needs to rebuild the model: the built-in GPT's config, or a
    transformers model's config dict; None for other models."""
    from snake.models.gpt import GPT

    model = parts.model
    if isinstance(model, GPT):
        return {"kind": "snake.gpt", **dataclasses.asdict(model.config)}
    cfg = getattr(model, "config", None)
    to_dict = getattr(cfg, "to_dict", None)
    if callable(to_dict):
        # a PEFT model's layers hold adapters its config does not build (`snake export` refuses)
        return {"kind": "transformers+peft" if has_peft_layers(model) else "transformers", **to_dict()}
    return None


def peft_record(parts: ModelParts) -> dict[str, Any] | None:
    """What `snake export` needs to make a PEFT model's adapters again: its PEFT configs by
    adapter name as JSON (PEFT's `to_dict`, its sets as sorted lists) and the adapters that
    were active; None for a model without PEFT's adapters, or with a config JSON cannot
    hold (logged)."""
    model = parts.model
    configs = getattr(model, "peft_config", None)
    if not has_peft_layers(model) or not isinstance(configs, dict):
        return None
    lists = (getattr(m, "active_adapters", None) for m in model.modules() if type(m).__module__.startswith("peft."))
    active = next(([str(a) for a in names] for names in lists if isinstance(names, list)), [])

    def plain(value: Any) -> Any:
        if isinstance(value, (set, frozenset)):
            return sorted(value, key=str)
        if isinstance(value, enum.Enum):
            return value.value
        raise TypeError(f"{type(value).__name__} is not JSON")

    try:
        record = {str(name): json.loads(json.dumps(cfg.to_dict(), default=plain)) for name, cfg in configs.items()}
    except (TypeError, ValueError, AttributeError) as e:
        log.warning("save: the model's PEFT config is not recorded (%s); snake export cannot make its adapters "
                    "from this checkpoint", e)
        return None
    return {"configs": record, "active": active}


def model_spec(parts: ModelParts, digests: dict[str, str] | None = None) -> dict[str, Any]:
    """The model record of a manifest; `digests`: the frozen parameters' (`frozen_digests`),
    taken here where not given."""
    digests = frozen_digests(parts) if digests is None else digests
    return {
        "blocks_prefix": parts.blocks_prefix,
        "n_layer": len(parts.blocks),
        # the first kind's parameters (every layer's, where the layers are of one kind); with
        # several kinds, each layer's kind and each kind's parameters
        "block_params": [[n, list(s)] for n, s in layer_specs(parts)[0]],
        **_kinds_spec(parts),
        "resident_params": [[n, list(p.shape)] for n, p in resident_named_params(parts)],
        **({"frozen_params": dict(sorted(digests.items()))} if digests else {}),
    }


def frozen_digests(parts: ModelParts) -> dict[str, str]:
    """The frozen parameters' digests (sha256 of their bytes), so that a load checks that
    the model it is given holds the same (the checkpoint need not store them); read a
    layer at a time where a streamed model has them on the meta device."""
    return {n: _digest(p) for n, p in iter_frozen(parts)}


def trainer_digests(trainer: SnakeTrainer) -> dict[str, str]:
    """Blocking: `frozen_digests` of the trainer's model, taken at its first save or load and
    kept (`SnakeTrainer._frozen_digests`): the frozen parameters do not change while it
    trains, and every save read the whole frozen base for them (a LoRA of a large model: its
    size at sha256's ~1.5 GB/s, and from the disk where not cached). One save or load of a
    trainer at a time."""
    if trainer._frozen_digests is None:
        trainer._frozen_digests = frozen_digests(trainer.parts)
    return trainer._frozen_digests


def _digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes, read where they are (no copy of a CPU tensor)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().data if flat.numel() else b"").hexdigest()


def _kinds_spec(parts: ModelParts) -> dict[str, Any]:
    kinds, firsts = layer_kinds(parts.blocks)
    if len(firsts) == 1:
        return {}
    specs = layer_specs(parts)
    return {"layer_kinds": kinds, "kind_params": [[[n, list(s)] for n, s in specs[f]] for f in firsts]}


def _layer_spec(spec: dict[str, Any], layer: int) -> list[list[Any]]:
    """Layer `layer`'s [name, shape] list from a model spec (a manifest's or model_spec's)."""
    if "layer_kinds" in spec:
        return spec["kind_params"][spec["layer_kinds"][layer]]
    return spec["block_params"]


def read_manifest(target: Path, what: str = "load") -> dict[str, Any]:
    """Blocking: the manifest of the checkpoint at `target`, after checking that it is one,
    that its values have their types and ranges, and that every file it lists is there with
    its recorded size and sha256. `what`: the operation its errors name."""
    if not target.is_dir():
        hint = ""
        aside = _siblings(target, "old")
        if aside:
            hint = f"; an interrupted save left the previous checkpoint at {aside[-1]}: rename it to {target.name}"
        raise SnakeError(f"{what}: no checkpoint directory at {target}{hint}")
    path = target / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise SnakeError(f"{what}: {target} has no {MANIFEST}: not a snake checkpoint") from None
    except (OSError, ValueError) as exc:
        raise SnakeError(f"{what}: cannot read {path}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SnakeError(f"{what}: {path} is not a snake checkpoint manifest (format != {FORMAT!r})")
    if manifest.get("version") not in READS:
        raise SnakeError(
            f"{what}: {target} has checkpoint format version {manifest.get('version')!r}; "
            f"this snake reads versions {', '.join(map(str, READS))}"
        )
    for key in ("step", "consumed_batches", "config", "model", "files"):
        if key not in manifest:
            raise SnakeError(f"{what}: {path} lacks {key!r}: the manifest is damaged")

    def damaged(field: str, value: object, rule: str) -> SnakeError:
        return SnakeError(f"{what}: {path} has {field}={value!r}, which {rule}: the manifest is damaged")

    for key in ("step", "consumed_batches"):
        v = manifest[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise damaged(key, v, "must be an integer >= 0")
    for key in ("config", "model", "files"):
        if not isinstance(manifest[key], dict):
            raise damaged(key, type(manifest[key]).__name__, "must be a mapping")
    n_layer = manifest["model"].get("n_layer")
    if not isinstance(n_layer, int) or isinstance(n_layer, bool) or n_layer < 1:
        raise damaged("model.n_layer", n_layer, "must be an integer >= 1")
    _check_model_record(manifest["model"], n_layer, damaged)
    _check_missed_steps(manifest, n_layer, damaged)
    _check_loss_scale(manifest, damaged)
    if not isinstance(manifest.get("frozen_stored", True), bool):
        raise damaged("frozen_stored", manifest["frozen_stored"], "must be true or false")
    if "batch" in manifest and (why := spec_error(manifest["batch"])) is not None:
        raise damaged("batch", manifest["batch"], why)
    files: dict[str, Any] = manifest["files"]
    for name, info in files.items():
        if not (isinstance(info, dict) and isinstance(info.get("bytes"), int) and isinstance(info.get("sha256"), str)):
            raise damaged(f"files[{name!r}]", info, "must record 'bytes' and 'sha256'")
    for name in [layer_file(i) for i in range(n_layer)] + [RESIDENT, RNG]:
        if name not in files:
            raise SnakeError(f"{what}: {path} does not list {name}: the manifest is damaged")
    for name, info in files.items():
        f = target / name
        if not f.is_file():
            raise SnakeError(f"{what}: {f} is missing: the checkpoint is incomplete")
        if f.stat().st_size != info["bytes"]:
            raise SnakeError(f"{what}: {f} has {f.stat().st_size} bytes, the manifest says {info['bytes']}: it is damaged")
        with open(f, "rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        if digest != info["sha256"]:
            raise SnakeError(f"{what}: {f} does not match its sha256 in the manifest: it is damaged")
    return manifest


def missed_steps(e: Engine) -> dict[str, int]:
    """The trained parameters that were left in some steps (no gradient in the iteration, as
    torch.optim.AdamW leaves them), with how many, by state_dict name."""
    k = e.kernels
    out: dict[str, int] = {}
    for layer, missed in enumerate(k.layer_skips):
        names = k.kind_names[k.kinds[layer]]
        for i, count in sorted(missed.items()):
            out[f"{k.parts.blocks_prefix}.{layer}.{names[i]}"] = count
    for name, count in zip(k.res_names, k.res_skips, strict=True):
        if count:
            out[name[len("model."):]] = count
    return out


def _check_missed_steps(manifest: dict[str, Any], n_layer: int, damaged: Callable[[str, object, str], SnakeError]) -> None:
    """`missed_steps` (absent in a checkpoint where no parameter missed one) names trained
    parameters of the manifest's own model record, each with 1..step steps missed."""
    missed = manifest.get("missed_steps", {})
    if not isinstance(missed, dict):
        raise damaged("missed_steps", type(missed).__name__, "must be a mapping")
    model, step = manifest["model"], manifest["step"]
    prefix = model.get("blocks_prefix")
    known = {str(n) for n, _ in model["resident_params"]}
    known |= {f"{prefix}.{i}.{n}" for i in range(n_layer) for n, _ in _layer_spec(model, i)}
    for name, count in missed.items():
        if name not in known:
            raise damaged(f"missed_steps[{name!r}]", count, "must name a trained parameter of the checkpoint's model")
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= step:
            raise damaged(f"missed_steps[{name!r}]", count, f"must be an integer in [1, step={step}]")


def _check_loss_scale(manifest: dict[str, Any], damaged: Callable[[str, object, str], SnakeError]) -> None:
    """`loss_scale` (a dynamic loss scale's state; absent without one): a finite scale > 0
    and a growth tracker >= 0."""
    state = manifest.get("loss_scale")
    if state is None:
        return
    if not isinstance(state, dict):
        raise damaged("loss_scale", type(state).__name__, "must be a mapping")
    scale, tracker = state.get("scale"), state.get("growth_tracker")
    if not isinstance(scale, int | float) or isinstance(scale, bool) or not (math.isfinite(scale) and scale > 0):
        raise damaged("loss_scale.scale", scale, "must be a finite number > 0")
    if not isinstance(tracker, int) or isinstance(tracker, bool) or tracker < 0:
        raise damaged("loss_scale.growth_tracker", tracker, "must be an integer >= 0")


def _set_missed_steps(e: Engine, missed: dict[str, int]) -> None:
    k = e.kernels
    res = {name[len("model."):]: i for i, name in enumerate(k.res_names)}
    k.res_skips = [missed.get(name, 0) for name in res]
    for layer in range(e.N):
        head = f"{k.parts.blocks_prefix}.{layer}."
        k.layer_skips[layer] = {
            i: missed[head + n] for i, n in enumerate(k.kind_names[k.kinds[layer]]) if head + n in missed
        }
    k.res_got = [False] * len(k.res_got)
    e.delayed_skips.clear()


def _check_model_record(model: dict[str, Any], n_layer: int, damaged: Callable[[str, object, str], SnakeError]) -> None:
    """The parameter lists, layer kinds and frozen digests a manifest's model record holds
    have their types and ranges (`check_compatible` indexes them)."""

    def spec_list(field: str, value: object) -> None:
        ok = isinstance(value, list) and all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
            and isinstance(e[1], list) and all(isinstance(d, int) and not isinstance(d, bool) for d in e[1])
            for e in value
        )
        if not ok:
            raise damaged(field, value, "must be a list of [name, shape] pairs")

    for key in ("block_params", "resident_params"):
        spec_list(f"model.{key}", model.get(key))
    if "layer_kinds" in model or "kind_params" in model:
        specs = model.get("kind_params")
        if not isinstance(specs, list) or not specs:
            raise damaged("model.kind_params", specs, "must be a non-empty list of parameter lists")
        for k, spec in enumerate(specs):
            spec_list(f"model.kind_params[{k}]", spec)
        kinds = model.get("layer_kinds")
        if not (isinstance(kinds, list) and len(kinds) == n_layer and all(
                isinstance(k, int) and not isinstance(k, bool) and 0 <= k < len(specs) for k in kinds)):
            raise damaged("model.layer_kinds", kinds, f"must list {n_layer} kinds in [0, {len(specs)})")
    frozen = model.get("frozen_params", {})
    if not (isinstance(frozen, dict) and all(isinstance(v, str) for v in frozen.values())):
        raise damaged("model.frozen_params", frozen, "must map names to sha256 digests")


def check_compatible(manifest: dict[str, Any], config: SnakeConfig, parts: ModelParts,
                     digests: dict[str, str] | None = None) -> None:
    """ConfigError naming the first field where the trainer differs from the checkpoint;
    `digests`: as `model_spec`."""
    want, have = manifest["model"], model_spec(parts, digests)
    if have["n_layer"] != want["n_layer"]:
        raise ConfigError("model.n_layer", have["n_layer"], f"does not match the checkpoint's {want['n_layer']}", FIX)
    mine_frozen, theirs_frozen = have.get("frozen_params", {}), want.get("frozen_params", {})
    for n in sorted(mine_frozen.keys() | theirs_frozen.keys()):
        if n not in theirs_frozen:
            raise ConfigError(f"model.{n}", None, "is frozen (requires_grad=False) but trained in the checkpoint", FIX)
        if n not in mine_frozen:
            raise ConfigError(f"model.{n}", None, "is trained but frozen in the checkpoint", FIX)
        if mine_frozen[n] != theirs_frozen[n]:
            raise ConfigError(
                f"model.{n}", None,
                "is frozen and differs from the frozen values the checkpoint was trained with (frozen "
                "parameters are not stored: they come from the model)", FIX,
            )
    moved = _held_now(have, want, parts.blocks_prefix)

    def their_layer(i: int) -> list[Any]:  # layer i's streamed parameters in the checkpoint, less the moved
        return [[n, s] for n, s in _layer_spec(want, i) if f"{parts.blocks_prefix}.{i}.{n}" not in moved]

    groups = [(_layer_spec(have, i), their_layer(i), f"{parts.blocks_prefix}.{i}.") for i in range(have["n_layer"])]
    if "layer_kinds" not in have and "layer_kinds" not in want:  # one kind: one message for all
        groups = groups[:1]
        groups[0] = (groups[0][0], groups[0][1], f"{parts.blocks_prefix}.*.")
    groups.append((have["resident_params"], want["resident_params"] + [[n, s] for n, s in have["resident_params"]
                                                                       if n in moved], ""))
    for mine_list, theirs_list, label in groups:
        mine = {n: s for n, s in mine_list}
        theirs = {n: s for n, s in theirs_list}
        for n, s in mine.items():
            if n not in theirs:
                raise ConfigError(f"model.{label}{n}", tuple(s), "is not in the checkpoint", FIX)
            if theirs[n] != s:
                raise ConfigError(
                    f"model.{label}{n}", tuple(s), f"has a shape that does not match the checkpoint's {tuple(theirs[n])}", FIX
                )
        for n, s in theirs.items():
            if n not in mine:
                raise ConfigError(f"model.{label}{n}", None, f"is in the checkpoint (shape {tuple(s)}) but not in the model", FIX)
    _check_fields(config, manifest)


def _held_now(have: dict[str, Any], want: dict[str, Any], prefix: str) -> set[str]:
    """The trained parameters a checkpoint of an earlier snake streamed with their layer
    that this one holds with pre/post's (`kept_fp32` since round 36: PEFT's float32 adapters
    of a bfloat16 model, a router's float32 gate): their state is in the checkpoint's layer
    file, under the name the resident state's reader takes (`apply_checkpoint`). Full
    names, each of the same shape in both."""
    theirs_resident = {n for n, _ in want["resident_params"]}
    moved = set()
    for name, shape in have["resident_params"]:
        layer, dot, rest = name[len(prefix) + 1:].partition(".") if name.startswith(prefix + ".") else ("", "", "")
        if name in theirs_resident or not dot or not layer.isdigit() or int(layer) >= want["n_layer"]:
            continue
        if [rest, shape] in _layer_spec(want, int(layer)) and rest not in {n for n, _ in _layer_spec(have, int(layer))}:
            moved.add(name)
    return moved


def _check_fields(config: SnakeConfig, manifest: dict[str, Any]) -> None:
    saved = manifest["config"]
    for name in MATCH_FIELDS:
        mine, theirs = getattr(config, name), saved.get(name)
        if mine is not None and theirs is not None and mine != theirs:
            raise ConfigError(name, mine, f"does not match the checkpoint's {theirs!r}", FIX)


def check_resolved(config: SnakeConfig, manifest: dict[str, Any]) -> None:
    """After setup: fields the planner chose must match the checkpoint as well."""
    _check_fields(config, manifest)


def fill_config(config: SnakeConfig, manifest: dict[str, Any]) -> SnakeConfig:
    """The trainer's config with its planner-chosen (None) micro_batches, alpha,
    placement and resident_optimizer taken from the checkpoint, where it recorded them; but with a memory budget
    (cpu_memory_bytes) the planner places under it, as for a new run (the checkpoint's
    placement may not fit this machine; placement changes results only in the last bit of
    a few elements)."""
    saved = manifest["config"]
    changes: dict[str, Any] = {}
    for name in ("micro_batches", "alpha"):
        if getattr(config, name) is None and saved.get(name) is not None:
            changes[name] = saved[name]
    if config.placement is None and config.cpu_memory_bytes is None and saved.get("placement") is not None:
        if not isinstance(saved["placement"], dict):
            raise SnakeError(f"load: the checkpoint's manifest records placement={saved['placement']!r}, not a "
                             "mapping of shares: it is damaged; give placement in the trainer's config")
        try:
            changes["placement"] = Placement(**saved["placement"])
        except (ConfigError, TypeError) as e:
            raise SnakeError(f"load: the checkpoint's manifest records a placement the config refuses ({e}): it is "
                             "damaged; give placement in the trainer's config") from None
    if config.resident_optimizer is None and config.cpu_memory_bytes is None and saved.get("resident_optimizer"):
        changes["resident_optimizer"] = saved["resident_optimizer"]
    try:
        return dataclasses.replace(config, **changes) if changes else config
    except (ConfigError, TypeError) as e:  # SnakeConfig's checks, of what the manifest says
        raise SnakeError(f"load: the checkpoint's manifest records a value the config refuses ({e}): it is "
                         "damaged; give micro_batches, alpha, placement and resident_optimizer in the trainer's "
                         "config") from None


# -- RNG --------------------------------------------------------------------------------
def rng_state() -> dict[str, torch.Tensor]:
    out = {"torch/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch/cuda/{i}"] = s
    return out


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch/cpu"])
    cuda = [state[k] for k in sorted(state) if k.startswith("torch/cuda/")]
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)


# -- saving -----------------------------------------------------------------------------
def _save_blocking(
    e: Engine | None, parts: ModelParts, manifest: dict[str, Any], rng: dict[str, torch.Tensor], target: Path,
    bufs: list[HostBuffer] | None = None, stop: threading.Event | None = None,
    data: dict[str, torch.Tensor] | None = None,
) -> None:
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    _check_replaceable(target)
    _clean_stale(target)
    tmp = parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir(mode=0o755)
    try:
        if target.is_dir():  # the checkpoint replaces it: keep the permissions the user gave it
            os.chmod(tmp, stat.S_IMODE(target.stat().st_mode))
        files: dict[str, Any] = {}
        meta = {"format": FORMAT}
        if e is not None:
            read_layer = _engine_layers(e, parts, bufs or [])
        else:
            read_model = _model_layer(parts)
            read_layer = lambda layer: layer_tensors(parts, layer, read_model(layer))  # noqa: E731
        def check_stop() -> None:
            if stop is not None and stop.is_set():
                raise Stopped(f"save to {target} cancelled; nothing was published")

        frozen = manifest["frozen_stored"]
        for layer in range(len(parts.blocks)):
            check_stop()
            # a layer's frozen parameters beside its state: read (where a streamed model left
            # them in its files) a layer at a time
            tensors = {**read_layer(layer), **(layer_frozen(parts, layer) if frozen else {})}
            files[layer_file(layer)] = _write_tensors(tmp / layer_file(layer), tensors, meta)
            del tensors
        check_stop()
        files[RESIDENT] = _write_tensors(tmp / RESIDENT, resident_tensors(e, parts, frozen), meta)
        check_stop()
        files[RNG] = _write_tensors(tmp / RNG, {k: v.contiguous() for k, v in rng.items()}, meta)
        if data is not None:  # the data's state (its tree is the manifest's)
            files[DATA] = _write_tensors(tmp / DATA, data, meta)
        manifest = {**manifest, "files": files}
        _write_file(tmp / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
        _fsync_dir(tmp)
        check_stop()  # the last point at which a cancellation keeps the old checkpoint
        _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _engine_layers(e: Engine, parts: ModelParts, bufs: list[HostBuffer]) -> Callable[[int], dict[str, torch.Tensor]]:
    """A reader of one layer's master, m and v by parameter name, from the optimizer store.
    A parameter that lies in one unit's CPU head is a view of it (no copy: the state in
    CPU memory is written from where it is). What has a part on SSD is copied into `bufs`
    (the optimizer's idle staging buffers: the first takes the tails as read, the others
    the copies) and, for what does not fit there, into a mapping of the save's own."""
    store = e.stores["opt"]
    specs = layer_specs(parts)
    buf = bufs[0] if bufs else (alloc_host(store.max_tail_bytes, pin=False) if store.max_tail_bytes else None)
    # beyond the borrowed buffers: one mapping reused layer to layer (torch.empty per
    # parameter left glibc's arenas holding each layer's copies: +30-60 MiB per layer)
    own: list[HostBuffer] = []

    def place(sizes: list[int]) -> list[torch.Tensor]:
        """fp32 tensors of `sizes` elements in the spare buffers, first fit, else own memory."""
        spare = bufs[1:]
        used = [0] * len(spare)
        where: list[tuple[HostBuffer | None, int]] = []
        extra = 0
        for n in sizes:
            i = next((i for i, b in enumerate(spare) if used[i] + 4 * n <= b.nbytes), None)
            if i is None:
                where.append((None, extra))
                extra += 4 * n
            else:
                where.append((spare[i], used[i]))
                used[i] += 4 * n
        if extra and (not own or own[0].nbytes < extra):
            own[:] = [alloc_host(extra, pin=False)]
        return [
            (hb if hb is not None else own[0]).data[at : at + 4 * n].view(torch.float32)
            for (hb, at), n in zip(where, sizes, strict=True)
        ]

    def read(layer: int) -> dict[str, torch.Tensor]:
        prefix = f"{parts.blocks_prefix}.{layer}."
        units = []  # (first element in the layer, unit)
        off = 0
        for part, n in enumerate(e.layer_parts[layer]):
            if n:
                units.append((off, store.unit((layer, part))))
                off += n
        out: dict[str, torch.Tensor] = {}
        copied: list[tuple[str, torch.Size, int, int]] = []  # parameters not in one head
        a = 0
        for name, shape in specs[layer]:
            b = a + shape.numel()
            home = next(((s0, u) for s0, u in units if s0 <= a and b <= s0 + u.k), None)
            if home is None:
                copied.append((name, shape, a, b))
            else:
                s0, u = home
                for c, comp in enumerate(COMPS):
                    out[f"{comp}/{prefix}{name}"] = store.head(u)[c, a - s0 : b - s0].view(shape)
            a = b
        room = iter(place([b - a for _, _, a, b in copied for _ in COMPS]))
        for name, shape, _, _ in copied:
            for comp in COMPS:
                out[f"{comp}/{prefix}{name}"] = next(room).view(shape)
        for s0, u in units:
            mine = [(name, a, b) for name, _, a, b in copied if a < s0 + u.n and b > s0]
            if not mine:
                continue
            head = store.head(u)
            tail = None
            if u.tail_n:
                assert buf is not None
                store.read_tail(u, buf)
                tail = store.tail(u, buf)
            for name, a, b in mine:
                for c, comp in enumerate(COMPS):
                    dst = out[f"{comp}/{prefix}{name}"].view(-1)
                    lo, hi = max(a, s0), min(b, s0 + u.k)  # the part in the head
                    if lo < hi:
                        dst[lo - a : hi - a] = head[c, lo - s0 : hi - s0]
                    lo, hi = max(a, s0 + u.k), min(b, s0 + u.n)  # the part on SSD
                    if lo < hi:
                        assert tail is not None
                        dst[lo - a : hi - a] = tail[c, lo - s0 - u.k : hi - s0 - u.k]
        return out

    return read


def _model_layer(parts: ModelParts) -> Callable[[int], torch.Tensor]:
    def read(layer: int) -> torch.Tensor:
        params = layer_values(parts, layer, flat_named(parts.blocks[layer]))
        out = torch.zeros(3, sum(p.numel() for p in params), dtype=torch.float32)
        if params:  # a layer that trains nothing (frozen, or its adapters held in fp32) has no state
            torch.cat([p.reshape(-1).to("cpu", torch.float32) for p in params], out=out[0])
        return out

    return read


def layer_tensors(parts: ModelParts, layer: int, stacked: torch.Tensor) -> dict[str, torch.Tensor]:
    """One layer's tensors as views of its (3, P) state: no copy (safetensors takes
    non-overlapping views of one storage)."""
    prefix = f"{parts.blocks_prefix}.{layer}."
    out: dict[str, torch.Tensor] = {}
    for c, comp in enumerate(COMPS):
        off = 0
        for name, shape in layer_specs(parts)[layer]:
            n = shape.numel()
            out[f"{comp}/{prefix}{name}"] = stacked[c, off : off + n].view(shape)
            off += n
    return out


def resident_tensors(e: Engine | None, parts: ModelParts, frozen: bool = True) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    # the state on SSD: read into a mapping of a scratch file, not into the process's memory
    snap = None
    if e is not None and e.kernels.res_store is not None:
        snap = e.kernels.resident_snapshot(e.offload_dir)
    for i, (name, p) in enumerate(resident_named_params(parts)):
        if snap is not None:
            comps = snap[i]
        elif e is not None:
            comps = e.kernels.resident_components(i)
        else:
            master = p.detach().to("cpu", torch.float32)
            comps = (master, torch.zeros_like(master), torch.zeros_like(master))
        for comp, t in zip(COMPS, comps, strict=True):
            out[f"{comp}/{name}"] = t.view(p.shape)  # each its own tensor: no copy needed
    # frozen parameters outside the layers, as they are, where stored (a load checks the
    # model's against their digests; `snake export` takes them from here)
    prefix = parts.blocks_prefix + "."
    for name, p in parts.model.named_parameters():
        if frozen and not p.requires_grad and not name.startswith(prefix):
            out[f"frozen/{name}"] = p.detach().to("cpu").contiguous()
    for name, t in state_buffers(parts.model).items():
        out[f"buffer/{name}"] = t.detach().to("cpu").contiguous()
    return out


def layer_frozen(parts: ModelParts, layer: int) -> dict[str, torch.Tensor]:
    """Layer `layer`'s frozen parameters as a checkpoint stores them (`frozen/<name>`, by
    `named_parameters`' names: a weight tied elsewhere before it is stored there), as they
    are or, on the meta device, read through `parts.weights`."""
    head = f"{parts.blocks_prefix}.{layer}."
    names = {n[len(head):] for n, p in parts.model.named_parameters() if not p.requires_grad and n.startswith(head)}
    named = [(n, p) for n, p in parts.blocks[layer].named_parameters() if n in names]
    values = layer_values(parts, layer, named)
    return {f"frozen/{head}{n}": v.to("cpu").contiguous() for (n, _), v in zip(named, values, strict=True)}


def state_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers `model.state_dict()` holds (persistent), by its names."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {n: t for n, t in model.state_dict(keep_vars=True).items() if n not in params and not t.is_meta}


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> dict[str, Any]:
    """safetensors writes straight from the tensors (no bytes object of the file in
    memory); then fsync, and the digest from the file as written."""
    try:
        st_save_file(tensors, path, metadata=meta)
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
    except (SafetensorError, OSError) as exc:
        raise _write_failed(path, exc) from exc
    return {"bytes": path.stat().st_size, "sha256": digest}


def _write_failed(path: Path, exc: BaseException) -> StorageError:
    """A failed checkpoint write (a full disk, a quota, an I/O error), named: safetensors
    reports one as a SafetensorError with the OS error in its text."""
    code = getattr(exc, "errno", None)
    if not isinstance(code, int):
        found = re.search(r"os error (\d+)", str(exc))
        code = int(found.group(1)) if found else errno.EIO
    return StorageError(
        code,
        f"save: writing {path.name} of the checkpoint failed ({exc}); the target and any checkpoint "
        f"there are unchanged. Free space in {path.parent.parent} or save somewhere else",
    )


def _write_file(path: Path, data: bytes) -> dict[str, Any]:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _write_failed(path, exc) from exc
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _siblings(target: Path, kind: str) -> list[Path]:
    """`target`'s own temporary ("tmp") or set-aside ("old") directories, oldest first: the
    exact name and hex digits, so that another checkpoint's (a name with glob characters,
    "ck*", or one that starts like this one's, "ck.tmp-x") never matches."""
    if not target.parent.is_dir():
        return []
    own = re.compile(rf"\.{re.escape(target.name)}\.{kind}-[0-9a-f]+")
    found = [p for p in target.parent.iterdir() if own.fullmatch(p.name)]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def _check_save_target(target: Path) -> None:
    """A path save() can write: replaceable (`_check_replaceable`), and its nearest existing
    ancestor a directory (else mkdir fails with a bare FileExistsError or NotADirectoryError
    after the delayed steps were flushed)."""
    _check_replaceable(target)
    for p in target.parents:
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                raise SnakeError(
                    f"save: {p} is not a directory, so {target} cannot be created under it; "
                    "pick a checkpoint path under a directory"
                )
            return


def checkpoint_bytes(parts: ModelParts, frozen: bool = True) -> int:
    """The tensor bytes of a checkpoint of `parts` (its files hold these plus small headers):
    master, m and v in fp32 of every trained parameter, and (`frozen`) the frozen ones as
    they are."""
    trained = sum(s.numel() for spec in layer_specs(parts) for _, s in spec)
    trained += sum(p.numel() for _, p in resident_named_params(parts))
    held = sum(p.numel() * p.element_size() for _, p in parts.model.named_parameters() if not p.requires_grad)
    return 3 * 4 * trained + (held if frozen else 0)


def _check_save_space(trainer: SnakeTrainer, target: Path, frozen: bool) -> None:
    """Before the delayed steps are flushed: refuse a save that cannot fit. The new
    checkpoint is written whole before it replaces one already at `target` (that one still
    takes its space); a leftover temporary directory of an earlier save is removed first. With
    the resident optimizer state on SSD the save also reads it into a scratch file in the
    offload_dir (`Kernels.resident_snapshot`), on the same disk or another. Only what
    certainly does not fit is refused: the bytes counted are the tensors', not the headers'."""
    disk = next(p for p in (target, *target.parents) if p.exists())
    # per file system (st_dev): where, and what the save writes there
    needs: dict[int, tuple[Path, list[tuple[str, int]]]] = {
        disk.stat().st_dev: (disk, [("the checkpoint", checkpoint_bytes(trainer.parts, frozen))])}
    e = trainer.engine
    if e is not None and e.kernels.res_store is not None:
        scratch = 3 * 4 * sum(s.numel() for s in e.kernels.res_shapes)
        try:
            offload = e.offload_dir.stat()
        except FileNotFoundError:  # removed while the trainer ran (its open files live on)
            raise StorageError(
                errno.ENOENT,
                f"save: the offload_dir {e.offload_dir} is gone (removed while the trainer ran: a temporary-files "
                "cleaner?), and the save needs it for a scratch copy of the resident optimizer state on SSD; "
                "nothing was changed: create the directory again and save again",
            ) from None
        here = needs.setdefault(offload.st_dev, (e.offload_dir, []))
        here[1].append(("a scratch copy of the resident optimizer state on SSD, in the offload_dir", scratch))
    for dev, (path, what) in needs.items():
        free = shutil.disk_usage(path).free
        if dev == disk.stat().st_dev:  # an earlier save's leftovers go first
            free += sum(_tree_bytes(p) for p in _siblings(target, "tmp"))
        need = sum(n for _, n in what)
        if need > free:
            raise StorageError(
                errno.ENOSPC,
                f"save: {path} has {fmt_size(free)} free but the save needs at least {fmt_size(need)} there ("
                + " and ".join(f"{w}, {fmt_size(n)}" for w, n in what)
                + "); nothing was changed (the delayed steps were not applied): free space there"
                + (", or save to a disk with room" if dev == disk.stat().st_dev else ""),
            )


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _check_replaceable(target: Path) -> None:
    """Refuse to replace anything but a snake checkpoint (or an empty directory)."""
    if not (target.exists() or target.is_symlink()):
        return
    if target.is_symlink() or not target.is_dir():
        raise SnakeError(f"save: {target} exists and is not a directory; pick another checkpoint path")
    entries = list(target.iterdir())
    if entries and not (target / MANIFEST).is_file():
        raise SnakeError(
            f"save: {target} exists and is not a snake checkpoint (no {MANIFEST}); "
            "refusing to replace it: pick an empty or new directory"
        )


def _clean_stale(target: Path) -> None:
    """Leftovers of a save that crashed: temporary directories go; a previous checkpoint
    renamed aside goes back in place if the target is missing, else it goes."""
    for tmp in _siblings(target, "tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
    aside = _siblings(target, "old")
    if aside and not target.exists():
        _rename(aside.pop(), target)
    for old in aside:
        shutil.rmtree(old, ignore_errors=True)


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished `tmp` over `target`, keeping the old checkpoint until then."""
    aside = None
    if target.exists():
        aside = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
        _rename(target, aside)
    try:
        _rename(tmp, target)
    except BaseException:
        if aside is not None:
            _rename(aside, target)
        raise
    _fsync_dir(target.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


# -- loading ----------------------------------------------------------------------------
class _TensorFile:
    """A safetensors file read one tensor at a time (the library maps the file; a tensor
    is copied out when taken), so a layer's load holds one copy of its state, not three."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._f = safe_open(str(path), framework="pt")
        except SafetensorError as exc:
            raise SnakeError(f"load: {path} is not a valid safetensors file: {exc}") from exc
        self._keys = set(self._f.keys())

    def __enter__(self) -> _TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.__exit__(None, None, None)
        del self._f

    def keys(self) -> set[str]:
        return self._keys

    def take_range(self, key: str, shape: torch.Size, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of the flattened fp32 tensor `key` of `shape`, reading only the
        rows (first dimension) that hold them."""
        if key not in self._keys:
            raise SnakeError(f"load: {self.path} lacks tensor {key!r}: the checkpoint is damaged")
        sl = self._f.get_slice(key)
        got = torch.Size(sl.get_shape())
        if sl.get_dtype() != "F32" or got != shape:
            raise SnakeError(f"load: {self.path}: tensor {key!r} is {sl.get_dtype()} {tuple(got)}, expected "
                             f"torch.float32 {tuple(shape)}")
        if not shape:  # a scalar
            return self.take(key, shape)[None][a:b]
        row = shape.numel() // shape[0] if shape[0] else 1
        r0, r1 = a // row, -(-b // row)
        return sl[r0:r1].reshape(-1)[a - r0 * row : b - r0 * row]

    def take(self, key: str, shape: torch.Size | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if key not in self._keys:
            raise SnakeError(f"load: {self.path} lacks tensor {key!r}: the checkpoint is damaged")
        t: torch.Tensor = self._f.get_tensor(key)
        if t.dtype != dtype or (shape is not None and t.shape != shape):
            want = f"{dtype} {tuple(shape)}" if shape is not None else str(dtype)
            raise SnakeError(f"load: {self.path}: tensor {key!r} is {t.dtype} {tuple(t.shape)}, expected {want}")
        return t


def _ranges(f: _TensorFile, name: str, shape: torch.Size) -> Callable[[int, int, int], torch.Tensor]:
    """A resident parameter's state in the checkpoint as `Kernels.set_resident` reads it:
    (component, first, end) -> those elements of its flat master, m or v."""
    def read(c: int, a: int, b: int) -> torch.Tensor:
        return f.take_range(f"{COMPS[c]}/{name}", shape, a, b)

    return read


def _spread(src: torch.Tensor, at: int, k: int, head: torch.Tensor, tail: torch.Tensor | None) -> None:
    """Copy `src`, a unit's elements [at, at + len), to its head ([0, k)) and tail ([k, n))."""
    end = at + src.numel()
    if at < k:
        head[at : min(end, k)] = src[: min(end, k) - at]
    if end > k:
        assert tail is not None
        tail[max(at, k) - k : end - k] = src[max(at, k) - at :]


def apply_checkpoint(
    e: Engine, parts: ModelParts, target: Path, manifest: dict[str, Any],
    obuf: HostBuffer | None = None, pbuf: HostBuffer | None = None, stop: threading.Event | None = None,
) -> dict[str, torch.Tensor]:
    """Blocking, on a freshly set-up engine: overwrite the optimizer and parameter units
    (heads and tails), the resident state and the counters. Returns the RNG state. Raises
    Stopped before the next layer once `stop` is set (its task was cancelled)."""
    ostore, pstore = e.stores["opt"], e.stores["param"]
    obuf = obuf if obuf is not None else alloc_host(max(ostore.max_tail_bytes, 1), pin=False)
    pbuf = pbuf if pbuf is not None else alloc_host(max(pstore.max_tail_bytes, 1), pin=False)
    specs = layer_specs(parts)
    for layer in range(e.N):
        if stop is not None and stop.is_set():
            raise Stopped(f"load from {target} cancelled part-way")
        # unit by unit, each parameter's piece straight into the unit's head and staging
        # buffer (no copy of the layer's state: one parameter's tensor at a time)
        prefix = f"{parts.blocks_prefix}.{layer}."
        with _TensorFile(target / layer_file(layer)) as f:
            s0 = 0
            for part, n in enumerate(e.layer_parts[layer]):
                if not n:
                    continue
                ou, pu = ostore.unit((layer, part)), pstore.unit((layer, part))
                ohead, phead = ostore.head(ou), pstore.head(pu)[0]
                otail = ostore.tail(ou, obuf) if ou.tail_n else None
                ptail = pstore.tail(pu, pbuf)[0] if pu.tail_n else None
                a = 0
                for name, shape in specs[layer]:
                    b = a + shape.numel()
                    lo, hi = max(a, s0), min(b, s0 + n)
                    if lo < hi:
                        for c, comp in enumerate(COMPS):
                            piece = f.take(f"{comp}/{prefix}{name}", shape).view(-1)[lo - a : hi - a]
                            _spread(piece, lo - s0, ou.k, ohead[c], otail[c] if otail is not None else None)
                            if c == 0:  # the parameters: what the optimizer derives from the master
                                _spread(piece.to(e.dtype), lo - s0, pu.k, phead, ptail)
                    a = b
                if ou.tail_n:
                    ostore.write_tail(ou, obuf)
                if pu.tail_n:
                    pstore.write_tail(pu, pbuf)
                s0 += n
    k = e.kernels
    with torch.no_grad(), contextlib.ExitStack() as files:
        f = files.enter_context(_TensorFile(target / RESIDENT))
        layer_files: dict[int, _TensorFile] = {}
        prefix = parts.blocks_prefix + "."
        for i, (name, p) in enumerate(resident_named_params(parts)):
            src = f
            if f"{COMPS[0]}/{name}" not in f.keys() and name.startswith(prefix):
                # a layer's parameter an earlier snake streamed (`_held_now`): in its layer file
                layer = int(name[len(prefix):].partition(".")[0])
                if layer not in layer_files:
                    layer_files[layer] = files.enter_context(_TensorFile(target / layer_file(layer)))
                src = layer_files[layer]
            k.set_resident(i, _ranges(src, name, p.shape))
    synchronize(e.device)
    step = int(manifest["step"])
    e.next_t = step
    _set_missed_steps(e, manifest.get("missed_steps", {}))
    if e.scaler is not None and manifest.get("loss_scale") is not None:
        e.scaler.load(manifest["loss_scale"])  # (a checkpoint without one: the config's init_scale)
    # nothing is pending after the flush at save time: the delayed steps of iteration
    # `step` would apply the gradients of iteration step - 1, which the masters hold
    e.first_delayed = step + 1 if step > 0 else 0
    for layer in range(e.N):
        for part, n in enumerate(e.layer_parts[layer]):
            if n:
                e.ledger.set(("param", layer, part), step)
                e.ledger.set(("opt", layer, part), step)
    with _TensorFile(target / RNG) as f:
        if "torch/cpu" not in f.keys():
            raise SnakeError(f"load: {target / RNG} lacks the torch RNG state: the checkpoint is damaged")
        return {key: f.take(key, dtype=torch.uint8) for key in sorted(f.keys())}
