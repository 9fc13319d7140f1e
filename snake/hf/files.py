"""A local checkpoint's safetensors files: where each tensor is stored, and reading one."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from snake.errors import ModelError


def _read(at: _Stored, dtype: torch.dtype | None, *, own: bool = False) -> torch.Tensor:
    """The stored tensor, cast to `dtype`; `own`: in memory of its own (safetensors gives a
    view of its mapping of the file, which a file truncated in place turns into a SIGBUS at
    the next touch, and which is the file's next contents where it is rewritten)."""
    from safetensors import SafetensorError, safe_open

    try:
        check_unchanged(at)
        with safe_open(str(at.file), framework="pt") as f:
            t = f.get_tensor(at.key)
    except (SafetensorError, OSError) as e:
        raise _gone(at.file, e) from None
    if dtype is not None and t.dtype != dtype:
        return t.to(dtype)
    return t.clone() if own else t


def _stamp(file: Path) -> tuple[int, int, int, int]:
    """What tells a file from another one put in its place, or from itself rewritten."""
    st = os.stat(file)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def check_unchanged(at: _Stored) -> None:
    """OSError unless `at`'s file is the one whose header was read (`_safetensors_keys`)."""
    if at.stamp is not None and _stamp(at.file) != at.stamp:
        raise OSError(errno.ESTALE, "the file was replaced or rewritten since the model was loaded")


def _gone(file: Path, e: BaseException) -> ModelError:
    return ModelError(
        f"stream_hf: cannot read {str(file)!r} ({e}); a streamed model's directory must stay as it "
        "was loaded while the model is in use (snake reads its layers from it when a trainer builds "
        "its tiers, and the frozen weights left in the files whenever it needs them): restore it, "
        "and export elsewhere"
    )


def _stored_shapes(where: Mapping[str, _Stored]) -> dict[str, tuple[int, ...]]:
    """Each stored tensor's shape, from the files' headers."""
    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    by_file: dict[Path, list[str]] = {}
    for k, at in where.items():
        by_file.setdefault(at.file, []).append(k)
    for file, keys in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            out.update({k: tuple(f.get_slice(where[k].key).get_shape()) for k in keys})
    return out


class _Stored(NamedTuple):
    """Where a tensor of the model is stored: its file and its name there (another than the
    model's for the text part of an image-text checkpoint, `_TEXT_PART`), and the file's
    identity when its header was read (`_stamp`: a read checks it is still that file)."""

    file: Path
    key: str
    stamp: tuple[int, int, int, int] | None = None


def _safetensors_keys(directory: Path) -> dict[str, _Stored]:
    """Every tensor name in a local model directory's safetensors weights -> its file
    (`model.safetensors`, or else the shards `model.safetensors.index.json` maps, as
    from_pretrained takes them; else every *.safetensors), each file's
    header read (ModelError for a missing, damaged or incomplete shard: before training, not
    when its layer is reached)."""
    from safetensors import SafetensorError, safe_open

    if not (directory / "config.json").is_file():
        raise ModelError(f"stream_hf: {str(directory)!r} has no config.json; pass a local model directory")
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if single.is_file():  # as from_pretrained: before an index (another save's, stale) and other files
        listed: dict[Path, set[str]] = {single: set()}
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ModelError(f"stream_hf: {str(index)!r} is not a safetensors index ({e}); save the model again") from None
        listed = {}
        for k, f in weight_map.items():
            listed.setdefault(directory / f, set()).add(k)
    else:
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelError(f"stream_hf: {str(directory)!r} has no *.safetensors weights")
        listed = {f: set() for f in files}
    out: dict[str, _Stored] = {}
    for file, keys in listed.items():
        try:
            stamp = _stamp(file)
            with safe_open(str(file), framework="pt") as f:
                have = set(f.keys())
        except (SafetensorError, OSError) as e:
            raise ModelError(f"stream_hf: cannot read {str(file)!r} ({e}); copy or save the model again") from None
        if keys - have:
            raise ModelError(
                f"stream_hf: {str(file)!r} has no {min(keys - have)!r}, which the index puts there; copy or "
                "save the model again"
            )
        out.update({k: _Stored(file, k, stamp) for k in keys or have})
    return out
