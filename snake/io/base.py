"""The storage protocol and the pieces every backend shares."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
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
    """Caps throughput at `rate` bytes/s across threads; bursts up to `burst` bytes.

    Reads go first (`reading`, `wait_for_reads`), as a disk's I/O scheduler serves them: a
    read is what some work waits for, while a write only frees a buffer."""

    reads_first = True  # a switch for A/B runs (benchmarks/contention.py --ab reads)

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(rate / 20, ALIGN))
        self._tokens = self.burst
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self._readers = 0
        self._no_readers = threading.Condition(self._lock)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Marks a read in progress for its whole transfer: writes wait (`wait_for_reads`)."""
        with self._lock:
            self._readers += 1
        try:
            yield
        finally:
            with self._lock:
                self._readers -= 1
                if not self._readers:
                    self._no_readers.notify_all()

    def wait_for_reads(self) -> None:
        """Blocking: a write's next piece waits while any read is in progress."""
        if not self.reads_first:
            return
        with self._lock:
            while self._readers:
                self._no_readers.wait()

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
    """Wraps a StorageFile so that its transfers respect a TokenBucket.

    A transfer takes its tokens in CHUNK-sized pieces, sleeping for each, and a write's next
    piece waits while a read is in progress; the bytes then move in one system call. So a
    read issued while a large write is waiting out its tokens waits for one piece of it, not
    for all of it, and then has the bandwidth to itself, as a disk's I/O scheduler serves
    reads first (work waits on them; a write only frees a buffer). Taking a whole transfer's
    tokens at once made a 0.6 MB read wait ~70 ms behind a 10.8 MB write at 150 MB/s. Each
    piece costs a sleep (~70 us of CPU on a 2-core VM) and moving the bytes in pieces as well
    cost more again, hence pieces this large and one transfer (BENCHMARKS.md section 14)."""

    CHUNK = 4 << 20

    def __init__(self, inner: StorageFile, bucket: TokenBucket) -> None:
        self.inner = inner
        self.bucket = bucket
        self.path = inner.path
        self.backend = f"{inner.backend}+cap"

    def _take(self, nbytes: int, *, write: bool) -> None:
        for start in range(0, nbytes, self.CHUNK):
            if write:
                self.bucket.wait_for_reads()
            self.bucket.consume(min(self.CHUNK, nbytes - start))

    def pread(self, buf: memoryview, offset: int) -> None:
        with self.bucket.reading():
            self._take(len(buf), write=False)
            self.inner.pread(buf, offset)

    def pwrite(self, buf: memoryview, offset: int) -> None:
        self._take(len(buf), write=True)
        self.inner.pwrite(buf, offset)

    def close(self) -> None:
        self.inner.close()
