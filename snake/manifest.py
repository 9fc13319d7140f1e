"""A checkpoint's manifest (`manifest.json`, described in `snake.checkpoint`): the file names,
the records a save writes (config, model, PEFT adapters, digests of the frozen weights,
missed steps) and the checks a load makes of them before it touches the trainer."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from snake.adapters import (
    ModelParts,
    has_peft_layers,
    iter_frozen,
    layer_kinds,
    layer_specs,
    resident_named_params,
)
from snake.batch_spec import spec_error
from snake.clip import json_float
from snake.config import DynamicLossScale, Placement, SnakeConfig
from snake.errors import ConfigError, SnakeError
from snake.lr import describe

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


def layer_file(layer: int) -> str:
    return f"layer-{layer:05d}.safetensors"


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
    if not callable(to_dict):
        return None
    # a PEFT model's layers hold adapters its config does not build (`snake export` refuses)
    out = {"kind": "transformers+peft" if has_peft_layers(model) else "transformers", **to_dict()}
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):  # the model's, as save_pretrained records it (a model cast
        # with .to() keeps the dtype it was built with in its config)
        for key in [k for k in ("dtype", "torch_dtype") if k in out] or ["dtype"]:
            out[key] = str(dtype).removeprefix("torch.")
    source = out.get("_name_or_path")
    if isinstance(source, str) and source and not os.path.isabs(source) and os.path.isdir(source):
        out["_name_or_path"] = os.path.abspath(source)  # the directory it was loaded from, wherever export runs
    return out


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
            + ("; it was saved by a newer snake: load it with that one, or upgrade this one"
               if isinstance(manifest.get("version"), int) and manifest["version"] > max(READS) else "")
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
    """`loss_scale` (a dynamic loss scale's state; absent without one): a finite scale >= 0
    and a growth tracker >= 0."""
    state = manifest.get("loss_scale")
    if state is None:
        return
    if not isinstance(state, dict):
        raise damaged("loss_scale", type(state).__name__, "must be a mapping")
    scale, tracker = state.get("scale"), state.get("growth_tracker")
    # (0 where overflow after overflow backed it off past float32's range, as GradScaler's)
    if not isinstance(scale, int | float) or isinstance(scale, bool) or not (math.isfinite(scale) and scale >= 0):
        raise damaged("loss_scale.scale", scale, "must be a finite number >= 0")
    if not isinstance(tracker, int) or isinstance(tracker, bool) or tracker < 0:
        raise damaged("loss_scale.growth_tracker", tracker, "must be an integer >= 0")


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


def _siblings(target: Path, kind: str) -> list[Path]:
    """`target`'s own temporary ("tmp") or set-aside ("old") directories, oldest first: the
    exact name and hex digits, so that another checkpoint's (a name with glob characters,
    "ck*", or one that starts like this one's, "ck.tmp-x") never matches."""
    if not target.parent.is_dir():
        return []
    own = re.compile(rf"\.{re.escape(target.name)}\.{kind}-[0-9a-f]+")
    found = [p for p in target.parent.iterdir() if own.fullmatch(p.name)]
    return sorted(found, key=lambda p: p.stat().st_mtime)
