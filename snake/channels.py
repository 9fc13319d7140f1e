"""The channels actors talk through: mailboxes (bounded queues), the stage clock
(the compute actor's published deadlines) and the ledger (versions of stored units)."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
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
    movers wait until the stage their operation must precede comes within its lead."""

    def __init__(self, start: int = -1) -> None:
        self.now = start
        self._cond = asyncio.Condition()

    async def publish(self, stage: int) -> None:
        async with self._cond:
            self.now = stage
            self._cond.notify_all()

    async def wait_for(self, stage: int) -> None:
        if self.now >= stage:
            return
        async with self._cond:
            await self._cond.wait_for(lambda: self.now >= stage)


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
