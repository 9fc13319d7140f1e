"""The only place that probes CUDA. Every other module asks here."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from threadpoolctl import threadpool_limits

from snake.blocking import name_native_thread
from snake.errors import ConfigError


def cuda_available() -> bool:
    return torch.cuda.is_available()


@cache
def cuda_driver_present() -> bool:
    """libcuda (the driver, not the runtime) can be found: kvikio needs it even for host buffers."""
    if not cuda_available():
        return False
    return ctypes.util.find_library("cuda") is not None


def resolve_device(name: str | None) -> torch.device:
    """None: CUDA if present, else CPU. A CUDA name without CUDA is a ConfigError."""
    if name is None:
        return torch.device("cuda" if cuda_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not cuda_available():
            raise ConfigError("device", name, "asks for CUDA but none is available", "use device='cpu' or None")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(
                "device", name, f"does not exist: {torch.cuda.device_count()} CUDA device(s)", "pick an existing index"
            )
    return dev


def pin_host_memory(device: torch.device) -> bool:
    """Pinned host buffers only make sense (and only work) with CUDA."""
    return device.type == "cuda"


# cudaHostRegisterPortable: page-locked for every CUDA context (as torch's own helper asks)
HOST_REGISTER_PORTABLE = 1


def register_host_memory(ptr: int, nbytes: int) -> Callable[[], None] | None:
    """Page-lock the host bytes [ptr, ptr + nbytes) for the device's DMA (cudaHostRegister),
    exactly those: torch's pinned allocator (`pin_memory=True`) rounds each allocation up to
    the next power of two and keeps it cached after it is freed, so a 40 GB store head took
    64 GiB of page-locked memory that the memory check and the planner never counted.
    Returns the function that undoes it (cudaHostUnregister; call it while the bytes are
    still mapped), or None where CUDA refused (the caller falls back to torch's allocator)."""
    cudart = torch.cuda.cudart()
    # torch's bindings set no device: the call goes to the thread's current one (`on_device`
    # makes it the trainer's for the engine's build; else cuda:1's buffers set up cuda:0)
    device = torch.cuda.current_device()
    if int(cudart.cudaHostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE)) != 0:
        _clear_cuda_error()
        return None

    def unregister() -> None:  # on whichever thread drops the buffer last
        with torch.cuda.device(device):
            int(cudart.cudaHostUnregister(ptr))  # after a device error: nothing more to do

    return unregister


def on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """`device` as the calling thread's current CUDA device for the block (a no-op on a CPU
    device): CUDA calls that take no device (host registration, events) go to it."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _clear_cuda_error() -> None:
    """Reset the runtime's last error after a refused cudaHostRegister, so the next kernel
    launch's check (which reads cudaGetLastError) does not report it as its own. Best
    effort: torch's bindings do not expose cudaGetLastError, the runtime library does."""
    names = ["libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0", "libcudart.so"]
    try:  # the one loaded, whatever its name (some wheels bundle a hashed copy)
        with open("/proc/self/maps") as maps:
            names += sorted({line.split()[-1] for line in maps if "libcudart" in line and "/" in line})
    except OSError:
        pass
    for name in names:
        try:
            lib = ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0))
        except OSError:
            continue
        lib.cudaGetLastError()
        return


def device_memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return None


def helper_thread_init(device: torch.device) -> Callable[[], None]:
    """The initializer for snake's threads other than the compute thread (copies, I/O,
    optimizer, data). Each one names its OS thread (`snake.blocking.name_native_thread`).

    On a CPU device the compute thread's kernels are the device: they keep torch's intra-op
    threads, and every other snake thread runs its torch ops on one thread. Otherwise each
    of them brings its own OpenMP team onto the same cores, the compute team's worker gets
    preempted, every parallel region of a kernel waits for it, and the compute kernels ran
    at 0.65-0.75x of their speed alone on 2 cores (BENCHMARKS.md section 0). Only the
    calling thread's OpenMP setting changes: the caller's, torch's default for new threads
    and BLAS pools stay as they were. On CUDA the kernels run on the GPU and the CPU
    optimizer wants every core: the OpenMP count stays."""
    if device.type != "cpu":
        return name_native_thread
    return _one_intraop_thread


def _one_intraop_thread() -> None:
    name_native_thread()
    torch.get_num_threads()  # torch sets each thread's OpenMP count on first use: do that first
    threadpool_limits(1, user_api="openmp")  # this thread's count only (an OpenMP per-thread setting)


def synchronize(device: torch.device) -> None:
    """Wait for the device's current stream. Call only off the event loop."""
    if device.type == "cuda":
        wait_stream(torch.cuda.current_stream(device))


def wait_stream(stream: Any) -> None:
    """Block this thread until `stream` has done what is queued on it, asleep: a stream's
    (or a plain event's) synchronize busy-waits on a core (CUDA's default schedule), and the
    sync, copy and data threads waited so for every job and copy of a GPU-bound run, on the
    cores the CPU optimizer steps on. A blocking event yields the core instead."""
    ev = torch.cuda.Event(blocking=True)
    ev.record(stream)
    ev.synchronize()


class StreamMarks:
    """Points on the current (compute) stream of a CUDA device: CUDA events with timing.
    The compute thread marks each job's start and end and goes on to the next job without
    waiting; the job's outputs are handed on once its end mark is reached, and its trace
    span is the GPU's, read from the marks (`snake.actors.compute`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> Any:
        # blocking: `wait` sleeps instead of spinning on a core (`wait_stream`)
        ev = torch.cuda.Event(enable_timing=True, blocking=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def wait(self, mark: Any) -> None:
        """Block until the device has reached `mark`. Off the event loop."""
        mark.synchronize()

    def seconds(self, a: Any, b: Any) -> float:
        """Device time from mark `a` to mark `b` (both reached)."""
        return float(a.elapsed_time(b)) / 1e3

    def drain(self) -> None:
        """Wait for everything queued on the stream (after a failed job)."""
        synchronize(self.device)


def stream_marks(device: torch.device) -> StreamMarks | None:
    """Marks for the compute stream; None on a CPU device, whose kernels are done when
    they return."""
    return StreamMarks(device) if device.type == "cuda" else None


class Copier:
    """Host <-> device copies for the device mover: on CUDA on its own stream (so they
    overlap compute), waited for on the mover's executor thread; on CPU plain copies."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A device tensor to copy into for the compute stream. On CUDA it comes from the
        copy stream's share of the caching allocator: a block the compute thread has freed
        may still be in use by kernels it queued (it does not wait for them), and only the
        compute stream is ordered after those. `record_stream` keeps the block from being
        reused by the copy stream until the compute stream is done with it."""
        if self.stream is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        with torch.cuda.stream(self.stream):
            out = torch.empty(shape, dtype=dtype, device=self.device)
        out.record_stream(torch.cuda.default_stream(self.device))
        return out

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Blocking: dst.copy_(src) for each (dst, src) pair."""
        if self.stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return
        # compute's outputs arrive here only once the device has reached their job's end
        # mark, and buffers it reads are released only then (snake.actors.compute)
        try:
            with torch.cuda.stream(self.stream):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
        finally:  # also after a failed copy: the caller releases these buffers next
            wait_stream(self.stream)
