"""kvikio (GPUDirect Storage) backend. Used only when CUDA and the CUDA driver are present:
kvikio imports without them but every transfer then fails, even in compat mode."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from snake.errors import StorageError


def kvikio_usable() -> bool:
    """kvikio imports and a CUDA driver (libcuda) is loadable."""
    from snake.device import cuda_driver_present

    if not cuda_driver_present():
        return False
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return False
    return True


class KvikioOpenError(RuntimeError):
    """kvikio's CuFile would not open a file (its driver, the file system): the file itself
    was made and preallocated, so another backend can take it."""


class KvikioFile:
    def __init__(self, path: Path, nbytes: int) -> None:
        import kvikio

        self.path = Path(path)
        self.backend = "kvikio"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if nbytes > 0:
                os.posix_fallocate(fd, 0, nbytes)  # (a full disk fails here, as with any backend)
        except OSError:
            self.path.unlink(missing_ok=True)  # as PosixFile: no file of the failed build stays
            raise
        finally:
            os.close(fd)
        try:
            self._f = kvikio.CuFile(self.path, "r+")
        except Exception as e:
            raise KvikioOpenError(f"kvikio could not open {self.path} ({type(e).__name__}: {e})") from e

    def pread(self, buf: memoryview, offset: int) -> None:
        # kvikio takes host arrays through the array interface: hand it numpy views
        n = self._f.pread(np.frombuffer(buf, dtype=np.uint8), len(buf), offset).get()
        if n != len(buf):
            raise StorageError(5, f"short read from {self.path} at {offset}: {n} of {len(buf)}")

    def pwrite(self, buf: memoryview, offset: int) -> None:
        n = self._f.pwrite(np.frombuffer(buf, dtype=np.uint8), len(buf), offset).get()
        if n != len(buf):
            raise StorageError(5, f"short write to {self.path} at {offset}: {n} of {len(buf)}")

    def close(self) -> None:
        self._f.close()
