"""POSIX pread/pwrite backend, with O_DIRECT (default) or buffered (fallback)."""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

from snake.errors import StorageError


class PosixFile:
    """A preallocated file accessed with os.preadv / os.pwritev. Thread-safe: positional I/O
    shares no file offset, so several executor threads may use one file at once."""

    def __init__(self, path: Path, nbytes: int, *, direct: bool) -> None:
        self.path = Path(path)
        self.direct = direct
        self.backend = "posix-direct" if direct else "posix-buffered"
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        if direct:
            flags |= os.O_DIRECT
        self._fd = os.open(self.path, flags, 0o600)
        try:
            if nbytes > 0:
                os.posix_fallocate(self._fd, 0, nbytes)
        except OSError as e:
            os.close(self._fd)
            self._fd = -1
            self.path.unlink(missing_ok=True)  # no file of the failed build stays (it was snake's own tier file)
            if e.errno == errno.ENOSPC:
                raise StorageError(
                    e.errno,
                    f"not enough space for {nbytes} bytes in {self.path}: free space in the "
                    "offload_dir or place more on CPU (placement)",
                ) from e
            raise
        self.nbytes = nbytes

    # the system calls, an attribute so that fault injection (snake.faults) can wrap them
    _preadv = staticmethod(os.preadv)
    _pwritev = staticmethod(os.pwritev)

    def pread(self, buf: memoryview, offset: int) -> None:
        done = 0
        total = len(buf)
        while done < total:
            try:
                n = self._preadv(self._fd, [buf[done:]], offset + done)
            except OSError as e:
                raise self._error("read", total, offset, e) from e
            if n <= 0:
                raise StorageError(
                    errno.EIO,
                    f"short read from {self.path} at offset {offset + done}: "
                    f"got {done} of {total} bytes (file truncated?)",
                )
            done += n

    def pwrite(self, buf: memoryview, offset: int) -> None:
        done = 0
        total = len(buf)
        while done < total:
            try:
                n = self._pwritev(self._fd, [buf[done:]], offset + done)
            except OSError as e:
                raise self._error("write", total, offset, e) from e
            if n <= 0:
                raise StorageError(
                    errno.EIO, f"short write to {self.path} at offset {offset + done}"
                )
            done += n

    def _error(self, op: str, nbytes: int, offset: int, e: OSError) -> StorageError:
        hint = " (the disk is full: free space in the offload_dir or place more on CPU)" if e.errno == errno.ENOSPC else ""
        return StorageError(e.errno or errno.EIO, f"{op} of {nbytes} bytes at offset {offset} of {self.path} failed: {e.strerror}{hint}")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            warnings.warn(f"snake: {self.path} was never closed; closed now", ResourceWarning, stacklevel=2)
            self.close()


def o_direct_works(directory: Path) -> bool:
    """Can files in `directory` be opened with O_DIRECT? (tmpfs says no: EINVAL)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = Path(directory) / ".snake-odirect-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    else:
        os.close(fd)
        return True
    finally:
        probe.unlink(missing_ok=True)
