"""Running blocking work (file I/O, AdamW, compute) on executors without abandoning it."""

from __future__ import annotations

import asyncio
import concurrent.futures.thread
import ctypes
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from functools import cache
from typing import Any, TypeVar

R = TypeVar("R")


def _forget_pool_threads() -> None:
    """In a child forked from a thread of a ThreadPoolExecutor (a DataLoader's workers,
    started by the data's next() on snake's data thread), forget the parent's pool threads,
    which the child does not have. CPython 3.11 (gh-88110) keeps them, and the
    child's exit joined its own thread: "cannot join current thread", exit code 1. Each
    DataLoader worker of an epoch after the first ended so, and where a DataLoader
    iterator made on the main thread had set torch's SIGCHLD handler (a batch looked at
    before training, a StatefulDataLoader's state), the handler raised "DataLoader worker
    exited unexpectedly" in whatever the main thread ran then: an actor of the run, which
    failed. Later CPython registers the same clear itself (3.14's pool module does)."""
    concurrent.futures.thread._threads_queues.clear()  # type: ignore[attr-defined]


if hasattr(os, "register_at_fork"):  # once per process, as the pool module's own at-fork hook
    os.register_at_fork(after_in_child=_forget_pool_threads)


async def run_blocking(
    executor: Executor, fn: Callable[..., R], *args: Any, on_cancel: Callable[[], None] | None = None
) -> R:
    """Run `fn(*args)` on `executor`. If the awaiting task is cancelled, call `on_cancel`
    (which may ask long work to stop early), wait for the thread to finish (it cannot be
    interrupted, and it may be using a buffer the caller will release), then re-raise the
    cancellation."""
    return await wait_blocking(asyncio.get_running_loop().run_in_executor(executor, fn, *args), on_cancel)


async def wait_blocking(fut: asyncio.Future[R], on_cancel: Callable[[], None] | None = None) -> R:
    """Await an executor future; if cancelled, call `on_cancel`, then wait for its thread
    to finish."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        if on_cancel is not None:
            on_cancel()
        await settle(fut)
        raise


def retrieved(fut: asyncio.Future[Any]) -> None:
    """A done callback: mark the future's exception (if any) as retrieved, for a future a
    cancellation left running that no one may await again (else asyncio logs its error)."""
    if not fut.cancelled():
        fut.exception()


async def settle(fut: asyncio.Future[Any]) -> None:
    """Wait until an executor future is done, through any cancellation, and mark its
    exception (if any) as retrieved: for cleaning up after another failure."""
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            continue
    retrieved(fut)


_PR_SET_NAME = 15  # prctl option (linux/prctl.h): the calling thread's name, 15 bytes + NUL


@cache
def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def name_native_thread() -> None:
    """Give the calling thread's OS name its Python name ("snake-io_0", cut to 15 bytes), so
    that `top -H`, `ps -L`, py-spy and perf tell snake's threads apart (Python 3.11 leaves
    every thread named after the process). An executor initializer; a no-op off Linux."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_NAME, ctypes.c_char_p(threading.current_thread().name.encode()[:15]), 0, 0, 0)
