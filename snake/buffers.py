"""Fixed host and device buffers, and pools of them.

Host buffers are ALIGN-aligned (mmap, or pinned memory when CUDA is present) so they can
take O_DIRECT transfers. A pool hands out a fixed set: running out means waiting (back-
pressure), never allocating. At the end of a run every pool checks that all came back.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from snake.device import register_host_memory
from snake.errors import Stopped
from snake.io.base import ALIGN, align_up


@dataclass(eq=False)
class HostBuffer:
    """`data`: a uint8 tensor of `nbytes` at an ALIGN-aligned address."""

    data: torch.Tensor
    _keep: object = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        nb = numel * torch.empty((), dtype=dtype).element_size()
        return self.data[:nb].view(dtype)

    def memoryview(self, nbytes: int) -> memoryview:
        """A view of the first `nbytes` (rounded up to ALIGN) for pread/pwrite."""
        arr: Any = self.data.numpy()
        return memoryview(arr)[: align_up(nbytes)]


HUGE_PAGE = 2 << 20  # host buffers this large or larger ask for transparent huge pages
# page-locks (ptr, nbytes), returning how to undo it, or None where it cannot
Register = Callable[[int, int], Callable[[], None] | None]


def alloc_host(nbytes: int, *, pin: bool, register: Register | None = None) -> HostBuffer:
    """An aligned host buffer of at least `nbytes` (rounded up to ALIGN); `pin`: page-locked
    for the device's DMA, exactly its size (`mapped`)."""
    n = max(align_up(nbytes), ALIGN)
    t = mapped(n, pin=pin, register=register)
    if t is None:  # CUDA would not register the mapping: torch's (power-of-two) allocator
        raw = torch.empty(n + ALIGN, dtype=torch.uint8, pin_memory=True)
        skip = (-raw.data_ptr()) % ALIGN
        return HostBuffer(raw[skip : skip + n], raw)
    return HostBuffer(t)


def mapped(nbytes: int, *, pin: bool, register: Register | None = None,
           stop: threading.Event | None = None) -> torch.Tensor | None:
    """A zeroed uint8 tensor of `nbytes` in an anonymous mapping of its own (page-aligned,
    so O_DIRECT can take it; huge pages asked for where large). `pin`: also page-locked by
    `register` (by default `snake.device.register_host_memory`: cudaHostRegister), exactly
    `nbytes`, where torch's `pin_memory=True` rounds up to a power of two and keeps what it
    rounded after it is freed. The registration is undone
    when the last tensor viewing the memory is gone, while it is still mapped. None where
    `register` refused (the caller falls back to torch's pinned allocator). `stop`: the
    pages are faulted in ZERO_CHUNK bytes at a time before they are locked, raising
    Stopped once it is set."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= HUGE_PAGE:
        advise_huge_pages(m)
    if not pin:
        return torch.frombuffer(m, dtype=torch.uint8)
    # not in a forked child (a DataLoader's worker), as RDMA registrations do (ibv_fork_init):
    # a fork makes a page-locked private page copy-on-write, and the parent's next write then
    # moves it away from the page the device reads, or (Linux 5.9 on, for pinned pages)
    # copies it into the child at the fork, each worker taking a copy of every pinned buffer
    dontfork = getattr(mmap, "MADV_DONTFORK", None)
    if dontfork is not None:
        m.madvise(dontfork)
    # the tensors' storage keeps this ctypes view alive, and it keeps the mapping: its
    # finalizer runs once no tensor uses the memory, and unregisters before the unmap
    raw = (ctypes.c_uint8 * nbytes).from_buffer(m)
    t = torch.frombuffer(raw, dtype=torch.uint8)
    if stop is not None:
        _fault_in(t, stop)
    undo = (register or register_host_memory)(t.data_ptr(), nbytes)
    if undo is None:
        del t, raw
        try:
            m.close()
        except BufferError:  # still exported somewhere: the mapping goes with its last user
            pass
        return None
    # not at exit (the process's end releases it), nor in a forked child (a DataLoader's
    # worker), which has no CUDA of its own
    weakref.finalize(raw, _unregister, undo, m, os.getpid()).atexit = False
    return t


def _unregister(undo: Callable[[], None], m: mmap.mmap, pid: int) -> None:
    if os.getpid() == pid:
        undo()  # `m` is passed only to keep the memory mapped until here
        return
    # a forked child (a DataLoader's worker): the mapping was not forked (MADV_DONTFORK),
    # and the child may have mapped its own memory at that address since; dropping `m` here
    # would unmap that under it. Its mmap object is kept for the child's life instead.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(m))


def _fault_in(t: torch.Tensor, stop: threading.Event) -> None:
    step = ZERO_CHUNK
    for a in range(0, t.numel(), step):
        if stop.is_set():
            raise Stopped("allocating host memory cancelled part-way")
        t[a : a + step].zero_()


def advise_huge_pages(m: mmap.mmap) -> None:
    """Ask Linux to back the mapping with transparent huge pages where it can (the default
    THP mode, "madvise", only does so when asked). An O_DIRECT transfer pins every page of
    its buffer: with 2 MiB pages the kernel's share of a transfer fell ~4x (measured: 0.043-0.083
    s of system CPU per 2 GiB written and read with 4 KiB pages, 0.009-0.020 s with huge pages;
    BENCHMARKS.md section 3). A no-op where THP is off or the platform has no such advice."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return
    try:
        m.madvise(advice)
    except OSError:  # a kernel built without THP: EINVAL
        pass


# bytes zeroed between two looks at a stop event (alloc_host_tensor): ~0.2 s of fresh pages
ZERO_CHUNK = 64 << 20


def alloc_host_tensor(
    numel: int, dtype: torch.dtype, *, pin: bool, stop: threading.Event | None = None,
    register: Register | None = None,
) -> torch.Tensor:
    """A plain host tensor, zero-filled; `pin` (only with CUDA): page-locked, exactly its
    size (`mapped`). With `stop`: zeroed ZERO_CHUNK bytes at a time, raising Stopped before
    the next chunk once it is set (fresh pages fill at ~0.3 GiB/s, so a store's CPU heads
    alone took seconds of an engine's build)."""
    if pin:
        esize = torch.empty((), dtype=dtype).element_size()
        raw = mapped(max(numel * esize, 1), pin=True, register=register, stop=stop)
        if raw is not None:
            return raw[: numel * esize].view(dtype)
    if stop is None:
        return torch.zeros(numel, dtype=dtype, pin_memory=pin)
    t = torch.empty(numel, dtype=dtype, pin_memory=pin)
    step = max(1, ZERO_CHUNK // t.element_size())
    for a in range(0, numel, step):
        if stop.is_set():
            raise Stopped("allocating host memory cancelled part-way")
        t[a : a + step].zero_()
    return t


T = TypeVar("T")


class BufferPool(Generic[T]):
    """A fixed set of buffers. `acquire` waits while all are out."""

    def __init__(self, name: str, buffers: list[T]) -> None:
        if not buffers:
            raise ValueError(f"pool {name!r} needs at least one buffer")
        self.name = name
        self.size = len(buffers)
        self._free: asyncio.Queue[T] = asyncio.Queue(maxsize=len(buffers))
        self._all = {id(b) for b in buffers}
        for b in buffers:
            self._free.put_nowait(b)

    async def acquire(self) -> T:
        return await self._free.get()

    def try_acquire(self) -> T | None:
        """A free buffer, or None if all are out (never waits)."""
        try:
            return self._free.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def release(self, buf: T) -> None:
        assert id(buf) in self._all, f"buffer returned to the wrong pool {self.name!r}"
        self._free.put_nowait(buf)

    @property
    def free(self) -> int:
        return self._free.qsize()

    def check_all_returned(self, held: int = 0) -> None:
        """Every buffer is back but the `held` ones kept on purpose."""
        if self._free.qsize() != self.size - held:
            raise RuntimeError(
                f"pool {self.name!r}: {self.size - self._free.qsize()} of {self.size} buffers "
                f"were not returned{f' ({held} are held)' if held else ''} (internal error)"
            )

    def reset(self, buffers: list[T]) -> None:
        """After a failed run: take the buffers back whatever their state."""
        while not self._free.empty():
            self._free.get_nowait()
        for b in buffers:
            self._free.put_nowait(b)
