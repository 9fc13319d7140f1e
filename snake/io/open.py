"""Choosing a backend for a file of the SSD tier."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Literal

from snake.io.base import StorageFallbackWarning, StorageFile, Throttled, TokenBucket
from snake.io.kvikio_file import KvikioFile, KvikioOpenError, kvikio_usable
from snake.io.posix import PosixFile, o_direct_works

Backend = Literal["auto", "posix", "buffered", "kvikio"]


def open_storage(
    path: str | Path,
    nbytes: int,
    *,
    backend: Backend = "auto",
    bucket: TokenBucket | None = None,
    use_gds: bool = False,
) -> StorageFile:
    """Create (or reuse) and preallocate `path` to `nbytes`, with the best backend available.

    auto: kvikio if `use_gds` and CUDA's driver are there, else O_DIRECT if the file system
    takes it, else buffered I/O with a StorageFallbackWarning."""
    path = Path(path)
    f: StorageFile | None = None
    if backend == "auto" and use_gds and kvikio_usable():
        try:
            f = KvikioFile(path, nbytes)
        except KvikioOpenError as e:  # chosen, not asked for: the store goes on with O_DIRECT
            warnings.warn(
                f"{e}; using POSIX I/O there (storage_backend='posix' chooses it without trying kvikio)",
                StorageFallbackWarning,
                stacklevel=2,
            )
    if f is not None:
        pass
    elif backend == "kvikio":
        f = KvikioFile(path, nbytes)
    elif backend == "buffered":
        f = PosixFile(path, nbytes, direct=False)
    elif backend in ("posix", "auto"):
        if o_direct_works(path.parent):
            f = PosixFile(path, nbytes, direct=True)
        elif backend == "posix":
            raise OSError(f"O_DIRECT is not supported in {path.parent}")
        else:
            warnings.warn(
                f"O_DIRECT is refused in {path.parent} (tmpfs?); using buffered I/O there: "
                "put offload_dir on a local SSD for real SSD-tier numbers",
                StorageFallbackWarning,
                stacklevel=2,
            )
            f = PosixFile(path, nbytes, direct=False)
    else:
        raise ValueError(f"backend={backend!r} must be auto, posix, buffered or kvikio")
    return Throttled(f, bucket) if bucket is not None else f
