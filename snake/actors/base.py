"""What every actor shares: a stable name (its trace track), where it is (for errors),
and running blocking work on an executor with a trace span around it."""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

from snake.blocking import run_blocking
from snake.trace import Tracer

R = TypeVar("R")


class Actor(abc.ABC):
    name: str = "actor"

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.iteration: int | None = None
        self.layer: int | None = None
        self.micro_batch: int | None = None
        self.busy: tuple[str, float] | None = None  # (label, start) of work in progress
        self.fault_hook: Callable[[str, str], Awaitable[None]] | None = None  # tests only
        # called when the task is cancelled inside blocking work (the run is being torn
        # down): the engine's stop event, which ends long work on the threads early
        self.on_cancel: Callable[[], None] | None = None

    def at(self, iteration: int | None, layer: int | None = None, micro_batch: int | None = None) -> None:
        self.iteration, self.layer, self.micro_batch = iteration, layer, micro_batch

    async def work(
        self, executor: Executor, label: str, fn: Callable[..., R], *args: Any, **span: Any
    ) -> R:
        start = self.tracer.now()
        self.busy = (label, start)
        try:
            if self.fault_hook is not None:
                await self.fault_hook(self.name, label)
            return await run_blocking(executor, fn, *args, on_cancel=self.on_cancel)
        finally:
            self.busy = None
            self.tracer.add(self.name, label, start, self.tracer.now(), **span)

    @abc.abstractmethod
    async def run(self) -> None:
        """The actor's whole life: returns when its work for the run is done."""
