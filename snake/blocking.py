"""Running blocking work (file I/O, AdamW, compute) on executors without abandoning it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

R = TypeVar("R")


async def run_blocking(executor: Executor, fn: Callable[..., R], *args: Any) -> R:
    """Run `fn(*args)` on `executor`. If the awaiting task is cancelled, wait for the thread
    to finish first (it cannot be interrupted, and it may be using a buffer the caller will
    release), then re-raise the cancellation."""
    return await wait_blocking(asyncio.get_running_loop().run_in_executor(executor, fn, *args))


async def wait_blocking(fut: asyncio.Future[R]) -> R:
    """Await an executor future; if cancelled, first wait for its thread to finish."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await settle(fut)
        raise


async def settle(fut: asyncio.Future[Any]) -> None:
    """Wait until an executor future is done, through any cancellation, and mark its
    exception (if any) as retrieved: for cleaning up after another failure."""
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            continue
    if not fut.cancelled():
        fut.exception()
