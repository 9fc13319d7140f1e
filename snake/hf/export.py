"""`export_hf`: trained weights written as a directory `from_pretrained` loads (safetensors)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from snake.errors import ModelError, StorageError
from snake.memory import fmt_size


def _check_export_space(model: nn.Module, out: Path) -> None:
    """Refuse, before a file is written, an export whose tensors alone (each storage once, as
    save_pretrained writes a tied weight once) exceed the free space where `out` is."""
    seen: dict[tuple[int, int], int] = {}
    for t in model.state_dict().values():
        if t.device.type != "meta":
            seen[(t.untyped_storage().data_ptr(), t.storage_offset())] = t.numel() * t.element_size()
    need = sum(seen.values())
    disk = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(disk).free
    if need > free:
        raise StorageError(
            errno.ENOSPC,
            f"export_hf: {disk} has {fmt_size(free)} free but the model's weights take at least "
            f"{fmt_size(need)}; nothing was written: free space there or export somewhere else",
        )


def _drop_stale_index(out: Path) -> None:
    """Remove a sharded model's index that names shards no longer there: save_pretrained over
    a directory that held one removes the old shards but not their index, which loaders read
    first (a directory of one model.safetensors and an index of shards gone)."""
    index = out / "model.safetensors.index.json"
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return  # none, or not one save_pretrained writes: left as it is
    if not all((out / name).is_file() for name in shards):
        index.unlink()


def export_hf(state_dict: Mapping[str, torch.Tensor], model: nn.Module, out_dir: str | os.PathLike[str]) -> Path:
    """Load `state_dict` (e.g. `await trainer.state_dict()`) into `model` (strictly, cast to
    the model's dtypes) and save it with `save_pretrained` as safetensors in `out_dir`, which
    `from_pretrained` / `load_hf` load. Returns the directory."""
    save: Callable[..., Any] | None = getattr(model, "save_pretrained", None)
    if save is None:
        raise ModelError(f"export_hf: {type(model).__name__} is not a transformers model (no save_pretrained)")
    source = getattr(getattr(model, "snake_layer_weights", None), "directory", None)
    if isinstance(source, Path) and source.exists() and Path(out_dir).exists() and Path(out_dir).samefile(source):
        # save_pretrained rewrites its files in place: a trainer of the model reads them (its
        # layers, the frozen weights it left there), and a mapping of a truncated file is a
        # SIGBUS at the next touch
        raise ModelError(f"export_hf: {str(out_dir)!r} is the directory the model streams its layers from "
                         "(stream_hf); export elsewhere")
    if any(p.is_meta for p in model.parameters()):
        # a model from stream_hf: its layers take the trained tensors (cast to its dtypes;
        # it holds them from now on), and a tied head is tied again
        own = model.state_dict()
        model.load_state_dict(
            {k: v.to(own[k].dtype) if k in own and v.is_floating_point() else v for k, v in state_dict.items()},
            strict=True, assign=True,
        )
        tie = getattr(model, "tie_weights", None)
        if callable(tie):
            tie()
    else:
        model.load_state_dict(dict(state_dict), strict=True)
    out = Path(out_dir)
    _check_export_space(model, out)
    out.mkdir(parents=True, exist_ok=True)
    save(str(out))  # safetensors is the default (the only format in transformers >= 5)
    _drop_stale_index(out)
    if not any(out.glob("*.safetensors")):
        raise ModelError(f"export_hf: save_pretrained wrote no safetensors file in {str(out)!r}")
    return out
