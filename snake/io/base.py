"""The storage protocol and the pieces every backend shares."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Protocol

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffer addresses


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class StorageFallbackWarning(UserWarning):
    """O_DIRECT was refused by the file system; snake uses buffered I/O instead."""


class StorageFile(Protocol):
    """One preallocated file of the SSD tier. Calls block: run them on an executor.

    `buf` is a writable (for pread) or readable (for pwrite) memoryview whose address is
    ALIGN-aligned and whose length is a multiple of ALIGN; `offset` is a multiple of ALIGN.
    Short transfers are retried; a transfer that cannot complete raises StorageError."""

    path: Path
    backend: str

    def pread(self, buf: memoryview, offset: int) -> None: ...

    def pwrite(self, buf: memoryview, offset: int) -> None: ...

    def close(self) -> None: ...


class TokenBucket:
    """Caps throughput at `rate` bytes/s across threads; bursts up to `burst` bytes."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(rate / 20, ALIGN))
        self._tokens = self.burst
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> float:
        """Take `nbytes` of tokens; returns the seconds the caller must wait before moving
        them (0 within the burst)."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            deficit = -self._tokens
        return deficit / self.rate if deficit > 0 else 0.0

    def consume(self, nbytes: int) -> None:
        """Blocking: take `nbytes` and sleep until they may move."""
        wait = self.reserve(nbytes)
        if wait > 0:
            time.sleep(wait)


class Throttled:
    """Wraps a StorageFile so that its transfers respect a TokenBucket."""

    def __init__(self, inner: StorageFile, bucket: TokenBucket) -> None:
        self.inner = inner
        self.bucket = bucket
        self.path = inner.path
        self.backend = f"{inner.backend}+cap"

    def pread(self, buf: memoryview, offset: int) -> None:
        self.bucket.consume(len(buf))
        self.inner.pread(buf, offset)

    def pwrite(self, buf: memoryview, offset: int) -> None:
        self.bucket.consume(len(buf))
        self.inner.pwrite(buf, offset)

    def close(self) -> None:
        self.inner.close()
