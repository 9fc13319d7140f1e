"""Where every offloaded tensor lives: one `TierStore` per kind, splitting each unit between
a CPU-resident head and an SSD-resident tail.

A unit is a flat run of `n` elements (per component: optimizer units have three, master,
m and v, that share one split). Its first `k = round(cpu_share * n)` elements live in CPU
memory; the rest in one ALIGN-aligned region of the kind's file under offload_dir. Loads
and stores move whole units, heads by memcpy and tails by one pread/pwrite each. This is
the one mapping a data-parallel rank or pipeline stage could later own a slice of.

With `whole_units` (checkpoints: many small units) the share counts units instead: about
`cpu_share` of them live wholly in CPU memory and the rest wholly on SSD (`cpu_units`), so a
share below 1 costs SSD operations only for the units on SSD, not a small tail for every one.
"""

from __future__ import annotations

import contextlib
import errno
import math
import threading
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from snake.buffers import HostBuffer, alloc_host_tensor
from snake.errors import StorageError
from snake.io import StorageFile, align_up, open_storage
from snake.io.base import TokenBucket


@dataclass(frozen=True, slots=True)
class Unit:
    key: Hashable
    n: int  # elements per component
    k: int  # elements per component in CPU memory
    comps: int
    head_offset: int  # element offset of the head in the CPU tensor
    file_offset: int  # byte offset of the tail in the file (ALIGN-aligned)

    @property
    def tail_n(self) -> int:
        return self.n - self.k

    def tail_elems(self) -> int:
        return self.comps * (self.n - self.k)


def cpu_units(count: int, share: float) -> list[bool]:
    """Which of `count` units live wholly in CPU memory for a whole-unit store: round(share x
    count) of them, spread evenly over the order given (unit i is in CPU memory when
    floor((i + 1) share + 1/2) > floor(i share + 1/2)), so every run of units (a layer's
    micro-batches) holds its share give or take one."""
    if share >= 1.0:
        return [True] * count
    if share <= 0.0:
        return [False] * count

    def r(v: float) -> int:
        return math.floor(v + 0.5)

    return [r((i + 1) * share) > r(i * share) for i in range(count)]


def head_sizes(sizes: list[tuple[Hashable, int]], cpu_share: float, whole_units: bool) -> list[int]:
    """Elements per component of each unit in CPU memory (its head)."""
    if whole_units:
        return [n if cpu else 0 for (_key, n), cpu in zip(sizes, cpu_units(len(sizes), cpu_share), strict=True)]
    return [n if cpu_share >= 1.0 else int(round(cpu_share * n)) for _key, n in sizes]


def tail_file_bytes(
    sizes: Iterable[tuple[Hashable, int]], *, cpu_share: float, comps: int, esize: int, whole_units: bool = False
) -> int:
    """Bytes the SSD file of a store with these units needs (what TierStore allocates)."""
    units = list(sizes)
    return sum(align_up(comps * (n - k) * esize)
               for (_key, n), k in zip(units, head_sizes(units, cpu_share, whole_units), strict=True) if n - k)


class TierStore:
    """Units of one kind. `cpu` holds all heads; `file` holds all tails (if any)."""

    def __init__(
        self,
        kind: str,
        dtype: torch.dtype,
        sizes: Iterable[tuple[Hashable, int]],
        *,
        cpu_share: float,
        comps: int = 1,
        directory: Path | None = None,
        pin: bool = False,
        bucket: TokenBucket | None = None,
        use_gds: bool = False,
        whole_units: bool = False,
        backend: str = "auto",
        stop: threading.Event | None = None,
        heads: list[int] | None = None,
    ) -> None:
        """`stop`: set, the CPU heads' zeroing raises Stopped before its next chunk (a
        cancelled engine build); the file is made only after them. `heads`: each unit's
        elements in CPU memory, given instead of by `cpu_share`."""
        self.kind = kind
        self.dtype = dtype
        self.comps = comps
        self.esize = torch.empty((), dtype=dtype).element_size()
        self.units: dict[Hashable, Unit] = {}
        head = 0
        off = 0
        units = list(sizes)
        for (key, n), k in zip(units, heads if heads is not None else head_sizes(units, cpu_share, whole_units),
                               strict=True):
            u = Unit(key, n, k, comps, head, off)
            self.units[key] = u
            head += comps * k
            off += align_up(u.tail_elems() * self.esize) if u.tail_n else 0
        self.cpu = alloc_host_tensor(head, dtype, pin=pin, stop=stop)
        self.file_bytes = off
        self.file: StorageFile | None = None
        if off:
            assert directory is not None
            self.file = open_storage(directory / f"{kind}.bin", off, bucket=bucket, use_gds=use_gds,
                                     backend=backend)  # type: ignore[arg-type]
        self._sums: dict[Hashable, int] = {}  # xxh3 of each tail as last written
        self.max_tail_bytes = max((u.tail_elems() * self.esize for u in self.units.values()), default=0)

    def unit(self, key: Hashable) -> Unit:
        return self.units[key]

    def has_tail(self, key: Hashable) -> bool:
        u = self.units.get(key)
        return u is not None and u.tail_n > 0

    def head(self, u: Unit) -> torch.Tensor:
        """(comps, k) view of the unit's CPU part."""
        return self.cpu[u.head_offset : u.head_offset + u.comps * u.k].view(u.comps, u.k)

    def tail(self, u: Unit, buf: HostBuffer) -> torch.Tensor:
        """(comps, n - k) view of a staging buffer holding the unit's SSD part."""
        return buf.view(self.dtype, u.tail_elems()).view(u.comps, u.tail_n)

    def tail_bytes(self, u: Unit) -> int:
        return u.tail_elems() * self.esize

    def head_bytes(self, u: Unit) -> int:
        return u.comps * u.k * self.esize

    def read_tail(self, u: Unit, buf: HostBuffer) -> None:
        """Blocking: SSD -> staging buffer, verified against the checksum of its last write."""
        assert self.file is not None and u.tail_n
        self.file.pread(buf.memoryview(self.tail_bytes(u)), u.file_offset)
        want = self._sums.get(u.key)
        if want is not None:
            got = xxhash.xxh3_64_intdigest(buf.memoryview(self.tail_bytes(u))[: self.tail_bytes(u)])
            if got != want:
                raise StorageError(
                    errno.EIO,
                    f"checksum mismatch reading {self.kind} unit {u.key} (layer {_layer(u.key)}) from "
                    f"{self.file.path} at offset {u.file_offset}: the SSD returned different bytes "
                    "than were written (failing disk or another process writing offload_dir)",
                )

    def write_tail(self, u: Unit, buf: HostBuffer) -> None:
        """Blocking: staging buffer -> SSD; remembers the block's checksum."""
        assert self.file is not None and u.tail_n
        nbytes = self.tail_bytes(u)
        self._sums.pop(u.key, None)  # a failed write leaves no stale checksum behind
        self.file.pwrite(buf.memoryview(nbytes), u.file_offset)
        self._sums[u.key] = xxhash.xxh3_64_intdigest(buf.memoryview(nbytes)[:nbytes])

    def cpu_bytes(self) -> int:
        return int(self.cpu.numel()) * self.esize

    def close(self) -> None:
        """Close the tier's file and remove it: it is scratch space, useless once closed
        (a run resumes from a checkpoint), and left behind it held GBs of a disk."""
        if self.file is not None:
            path = self.file.path
            self.file.close()
            self.file = None
            with contextlib.suppress(OSError):
                path.unlink()


def scatter(src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
    """Copy the concatenation of `src` into the concatenation of `dst` (equal total length),
    converting dtypes, without materialising either concatenation."""
    i = j = 0
    si = di = 0
    while i < len(src) and j < len(dst):
        s, d = src[i], dst[j]
        n = min(s.numel() - si, d.numel() - di)
        if n:
            d[di : di + n].copy_(s[si : si + n])
        si += n
        di += n
        if si == s.numel():
            i, si = i + 1, 0
        if di == d.numel():
            j, di = j + 1, 0
    assert sum(t.numel() for t in src[i:]) - si <= 0 and sum(t.numel() for t in dst[j:]) - di <= 0


def _layer(key: Hashable) -> object:
    return key[0] if isinstance(key, tuple) else key
