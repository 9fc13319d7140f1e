"""A checkpoint's files on disk: writing and fsyncing them, the room a save needs, publishing
the finished directory over the old one atomically, and mapping a layer file to read it."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file as st_save_file

from snake.adapters import ModelParts, layer_specs, resident_named_params
from snake.errors import ConfigError, SnakeError, StorageError
from snake.manifest import MANIFEST, _siblings
from snake.memory import fmt_size

if TYPE_CHECKING:
    from snake.trainer import SnakeTrainer

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
    """fsync a directory (the new checkpoint's, before it is published); its failure is a
    StorageError that says the target is unchanged."""
    try:
        _sync_dir(path)
    except OSError as exc:
        raise StorageError(
            exc.errno if isinstance(exc.errno, int) else errno.EIO,
            f"save: syncing the new checkpoint's directory {path.name} failed ({exc}); the target and any "
            f"checkpoint there are unchanged. Check the disk of {path.parent} or save somewhere else",
        ) from exc


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    offload_dir (`ResidentState.snapshot`), on the same disk or another. Only what
    certainly does not fit is refused: the bytes counted are the tensors', not the headers'."""
    disk = next(p for p in (target, *target.parents) if p.exists())
    # per file system (st_dev): where, and what the save writes there
    needs: dict[int, tuple[Path, list[tuple[str, int]]]] = {
        disk.stat().st_dev: (disk, [("the checkpoint", checkpoint_bytes(trainer.parts, frozen))])}
    e = trainer.engine
    if e is not None and e.kernels.resident.store is not None:
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
    try:
        _sync_dir(target.parent)
    except OSError as exc:  # the new checkpoint is in place, whole: the old one goes all the same
        raise StorageError(
            exc.errno if isinstance(exc.errno, int) else errno.EIO,
            f"save: the new checkpoint replaced {target}, but syncing {target.parent} failed ({exc}), so the "
            "replacement may not survive a crash of the machine; check that disk and save again",
        ) from exc
    finally:
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
