"""The channels actors talk through: mailboxes (bounded queues), the stage clock
(the compute actor's published deadlines, and the iterations the data lets the run train)
and the ledger (versions of stored units)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Hashable, Iterator
from typing import Any, Protocol


class Keyed(Protocol):
    @property
    def key(self) -> Hashable: ...


class Mailbox:
    """A bounded queue. `take(key)` returns the message with that key, keeping others that
    arrive first in a stash, so a consumer can wait for inputs in its own order while the
    producers never block on a consumer that is waiting for something else."""

    def __init__(self, name: str, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"mailbox {name!r} needs maxsize >= 1")
        self.name = name
        self._q: asyncio.Queue[Any] = asyncio.Queue(maxsize=maxsize)
        self._stash: dict[Hashable, Any] = {}
        self.waiting: Hashable | None = None  # the key its consumer waits for (diagnostics)

    async def put(self, msg: Any) -> None:
        await self._q.put(msg)

    async def get(self) -> Any:
        """Next message in arrival order (stashed ones first)."""
        if self._stash:
            k = next(iter(self._stash))
            return self._stash.pop(k)
        return await self._q.get()

    async def take(self, key: Hashable) -> Any:
        if key in self._stash:
            return self._stash.pop(key)
        self.waiting = key
        try:
            while True:
                msg = await self._q.get()
                if msg.key == key:
                    return msg
                self._stash[msg.key] = msg
        finally:
            self.waiting = None

    def ready(self, *keys: Hashable) -> bool:
        """Whether messages with all these keys are in, without waiting (they stay in)."""
        while not self._q.empty():
            msg = self._q.get_nowait()
            self._stash[msg.key] = msg
        return all(k in self._stash for k in keys)

    def pending(self) -> list[Any]:
        """Everything not yet taken (for cleanup after a failure)."""
        out = list(self._stash.values())
        self._stash.clear()
        while not self._q.empty():
            out.append(self._q.get_nowait())
        return out


class StageClock:
    """The compute actor publishes the global index of the stage it is about to run;
    movers wait until the stage their operation must precede comes within its lead.

    It also says which iterations the run trains: `range(first, end)`, where `end` starts
    at the run's last + 1 and comes down to the iteration whose batch the data could not
    give (it ran out, raised, or gave a bad batch: `stop_at`). An actor starts no work of
    iteration t before its batch is in hand (`have`), so a run the data stops ends cleanly
    after the iteration before, every unit where a run of that many steps leaves it. The
    data actor reads batch t once compute has taken batch t - 2, and no operation of t
    starts before the last stage of t - 2: the wait costs nothing unless the data is slower
    than the steps (or at a run's first iteration, whose reads wait for its first batch)."""

    def __init__(self, start: int = -1, iterations: range | None = None) -> None:
        self.now = start
        self._cond = asyncio.Condition()
        self.first = 0 if iterations is None else iterations.start
        self.end = sys.maxsize if iterations is None else iterations.stop
        self._have = self.end if iterations is None else self.first  # below it: the batch is in hand
        self.stopped_by: Exception | None = None  # what stopped the data (`stop_at`)

    def iterations(self) -> Iterator[int]:
        """The run's iterations, as far as `end` is known when each is asked for (a plan's
        generator pulls the next iteration's operations once it needs them)."""
        t = self.first
        while t < self.end:
            yield t
            t += 1

    async def publish(self, stage: int) -> None:
        async with self._cond:
            self.now = stage
            self._cond.notify_all()

    async def wait_for(self, stage: int) -> None:
        if self.now >= stage:
            return
        async with self._cond:
            await self._cond.wait_for(lambda: self.now >= stage)

    async def reach(self, stage: int, t: int) -> bool:
        """Wait for `stage` and for iteration t's batch: True, or False (and at once) when
        the run ends before iteration t (its operation is skipped)."""
        if t >= self.end or (self.now >= stage and t < self._have):
            return t < self.end
        async with self._cond:
            await self._cond.wait_for(lambda: t >= self.end or (self.now >= stage and t < self._have))
        return t < self.end

    async def runs(self, t: int) -> bool:
        """Whether iteration t trains, once the data actor knows (its batch, or the end)."""
        if t < self._have or t >= self.end:
            return t < self.end
        async with self._cond:
            await self._cond.wait_for(lambda: t < self._have or t >= self.end)
        return t < self.end

    async def have(self, t: int) -> None:
        """Iteration t's batch is in hand: its work may start."""
        async with self._cond:
            self._have = t + 1
            self._cond.notify_all()

    async def stop_at(self, t: int, cause: Exception) -> None:
        """The data gave no batch for iteration t (`cause` says why): the run ends before it."""
        async with self._cond:
            self.end = min(self.end, t)
            self.stopped_by = cause
            self._cond.notify_all()


class Ledger:
    """Version of every stored unit: how many times it has been written (checkpoints) or
    how many optimizer steps it holds (parameters, optimizer states). Readers wait for the
    version they need; writers mark it once both the CPU part and the SSD part are written."""

    def __init__(self) -> None:
        self._v: dict[Hashable, int] = {}
        self._cond = asyncio.Condition()

    def version(self, key: Hashable) -> int:
        return self._v.get(key, 0)

    def set(self, key: Hashable, version: int) -> None:
        self._v[key] = version

    async def mark(self, key: Hashable, version: int) -> None:
        async with self._cond:
            self._v[key] = version
            self._cond.notify_all()

    async def wait_for(self, key: Hashable, version: int) -> None:
        if self._v.get(key, 0) >= version:
            return
        async with self._cond:
            await self._cond.wait_for(lambda: self._v.get(key, 0) >= version)
