"""The channels actors talk through: mailboxes (bounded queues), the stage clock
(the compute actor's published deadlines, and the iterations the data lets the run train)
and the ledger (versions of stored units)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Hashable, Iterator
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
    at the run's last + 1 and comes down where the run stops early: at the iteration whose
    batch the data could not give (it ran out, raised, or gave a bad batch: `stop_at`), or,
    once a stop is asked for (`request_stop`: the trainer's `stop()`, a failed `on_step`),
    at the first iteration not yet begun. An iteration begins (is admitted) when an actor
    first asks to start work of it (`runs`, `reach`) and its batch is in hand (`got`);
    none starts any work of an iteration not admitted, so a run that stops early ends
    cleanly after the iteration before, every unit where a run of that many steps leaves
    it. The data actor reads batch t once compute has taken batch t - 2 (`may_read`), and
    no operation of t starts before the last stage of t - 2: the wait costs nothing unless
    the data is slower than the steps (or at a run's first iteration, whose reads wait for
    its first batch)."""

    def __init__(self, start: int = -1, iterations: range | None = None) -> None:
        self.now = start
        self._cond = asyncio.Condition()
        self.first = 0 if iterations is None else iterations.start
        self.end = sys.maxsize if iterations is None else iterations.stop
        self._got = self.end if iterations is None else self.first  # below it: the batch is in hand
        self._have = self._got  # below it: admitted, work may start
        self._taken = self.first  # below it: compute took the batch
        self.stopped_by: Exception | None = None  # what stopped the data (`stop_at`)
        self.failed_callback: Exception | None = None  # what a failed `on_step` raised (`request_stop`)
        self.stop_requested = False
        self._wakers: set[asyncio.Task[None]] = set()
        self.stopping = asyncio.Event()  # set once the run is to stop early (the data actor reads no more)

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

    def _decide(self, t: int) -> bool | None:
        """Whether iteration t trains, admitting it (and those before it) where its batch
        is in hand; None: not known yet (its batch is still to come)."""
        if t < self._have or t >= self.end:
            return t < self.end
        if self.stop_requested:
            self._end_at(self._have)
            return False
        if t < self._got:
            self._have = t + 1
            return True
        return None

    def _end_at(self, t: int) -> None:
        if t < self.end:
            self.end = t
            self.stopping.set()

    async def _settle(self, ready: Callable[[], bool], t: int) -> bool:
        end = self.end
        if not ready():
            async with self._cond:
                await self._cond.wait_for(ready)
        if self.end != end:  # this call ended the run: the others waiting see it
            async with self._cond:
                self._cond.notify_all()
        return t < self.end

    async def reach(self, stage: int, t: int) -> bool:
        """Wait for `stage` and for iteration t to begin: True, or False (and then at once)
        where the run ends before iteration t (its operation is skipped)."""
        return await self._settle(lambda: t >= self.end or (self.now >= stage and self._decide(t) is not None), t)

    async def runs(self, t: int) -> bool:
        """Whether iteration t trains, once that is known (its batch, or the end)."""
        return await self._settle(lambda: self._decide(t) is not None, t)

    async def begun(self, t: int) -> bool:
        """Wait until iteration t has begun (another actor started work of it) or the run
        ended before it, without beginning it: an actor with nothing to do in t (`Idle`).
        Whether it trains."""
        return await self._settle(lambda: t < self._have or t >= self.end, t)

    async def got(self, t: int) -> None:
        """Iteration t's batch is in hand: the iteration may begin."""
        async with self._cond:
            self._got = t + 1
            self._cond.notify_all()

    async def took(self, t: int) -> None:
        """Compute took iteration t's batch: the data actor may read batch t + 2."""
        async with self._cond:
            self._taken = t + 1
            self._cond.notify_all()

    async def may_read(self, t: int) -> bool:
        """Wait until batch t may be read (compute took batch t - 2): True, or False where
        the run ends before iteration t, or a stop was asked for (no more batches are read)."""
        if self.stop_requested or t >= self.end:
            return False
        async with self._cond:
            await self._cond.wait_for(lambda: self.stop_requested or t >= self.end or self._taken >= t - 1)
        return not (self.stop_requested or t >= self.end)

    async def stop_at(self, t: int, cause: Exception) -> None:
        """The data gave no batch for iteration t (`cause` says why): the run ends before it."""
        async with self._cond:
            self._end_at(t)
            self.stopped_by = cause
            self._cond.notify_all()

    def request_stop(self, cause: Exception | None = None) -> None:
        """End the run before its first iteration not yet begun (`cause`: why, where it is
        an error to raise once the run has ended: a failed `on_step`). On the run's loop."""
        self.stop_requested = True
        if cause is not None and self.failed_callback is None:
            self.failed_callback = cause
        self.stopping.set()
        task = asyncio.get_running_loop().create_task(self._wake())
        self._wakers.add(task)
        task.add_done_callback(self._wakers.discard)

    async def _wake(self) -> None:
        async with self._cond:
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
