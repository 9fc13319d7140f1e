"""Deterministic fault injection, for tests: storage faults below the backend's retry
loop (EIO, ENOSPC, short transfers, latency spikes, flipped bytes) and actor faults (an
exception, or a stall, at a chosen piece of an actor's work).

    inject_storage(trainer.engine.stores["opt"].file, StorageFaults(seed=1, read_error=0.1))
    trainer.engine.fault_hook = ActorFaults(fail={"d2h": 5})
"""

from __future__ import annotations

import asyncio
import errno
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from snake.io.base import ALIGN


@dataclass(frozen=True, kw_only=True, slots=True)
class StorageFaults:
    """Per-call probabilities (drawn from `seed`), after `after` clean calls.

    read_error / write_error: EIO. no_space: ENOSPC on a write. short: the call moves only
    part of the buffer (the backend must carry on). flip: a read returns one byte flipped
    (the checksum must catch it). spike: the call first sleeps `spike_s`."""

    seed: int = 0
    read_error: float = 0.0
    write_error: float = 0.0
    no_space: float = 0.0
    short: float = 0.0
    flip: float = 0.0
    spike: float = 0.0
    spike_s: float = 0.05
    after: int = 0


class _Injector:
    def __init__(self, faults: StorageFaults, preadv: Any, pwritev: Any) -> None:
        self.f = faults
        self.rng = random.Random(faults.seed)
        self.lock = threading.Lock()
        self.calls = 0
        self.real_preadv, self.real_pwritev = preadv, pwritev

    def _draw(self) -> tuple[float, ...]:
        with self.lock:
            self.calls += 1
            if self.calls <= self.f.after:
                return (1.0,) * 6
            return tuple(self.rng.random() for _ in range(6))

    @staticmethod
    def _shorten(bufs: Sequence[memoryview]) -> list[memoryview]:
        n = len(bufs[0])
        part = (n // 2) // ALIGN * ALIGN
        return [bufs[0][:part]] if part else list(bufs)

    def preadv(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        err, _, _, short, flip, spike = self._draw()
        f = self.f
        if spike < f.spike:
            time.sleep(f.spike_s)
        if err < f.read_error:
            raise OSError(errno.EIO, "Input/output error (injected)")
        bufs = self._shorten(bufs) if short < f.short else list(bufs)
        n = self.real_preadv(fd, bufs, offset)
        if flip < f.flip and n > 0:
            with self.lock:
                i = self.rng.randrange(n)
            bufs[0][i] ^= 0xFF
        return n

    def pwritev(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        _, err, full, short, _, spike = self._draw()
        f = self.f
        if spike < f.spike:
            time.sleep(f.spike_s)
        if err < f.write_error:
            raise OSError(errno.EIO, "Input/output error (injected)")
        if full < f.no_space:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        bufs = self._shorten(bufs) if short < f.short else list(bufs)
        return self.real_pwritev(fd, bufs, offset)


def inject_storage(file: Any, faults: StorageFaults) -> None:
    """Make a POSIX storage file (or a throttled one around it) misbehave as `faults` says."""
    inner = getattr(file, "inner", file)
    inj = _Injector(faults, inner._preadv, inner._pwritev)
    inner._preadv = inj.preadv
    inner._pwritev = inj.pwritev


class ActorFaults:
    """An engine `fault_hook`: before the n-th piece of work (0-based) of an actor, raise
    (`fail`) or hang until cancelled (`stall`)."""

    def __init__(self, *, fail: dict[str, int] | None = None, stall: dict[str, int] | None = None) -> None:
        self.fail = dict(fail or {})
        self.stall = dict(stall or {})
        self.count: dict[str, int] = {}

    @classmethod
    def random(cls, seed: int, actors: Sequence[str], *, within: int = 20, stall: bool = False) -> ActorFaults:
        rng = random.Random(seed)
        pick = {rng.choice(list(actors)): rng.randrange(within)}
        return cls(stall=pick) if stall else cls(fail=pick)

    async def __call__(self, actor: str, label: str) -> None:
        n = self.count.get(actor, 0)
        self.count[actor] = n + 1
        if self.fail.get(actor) == n:
            raise RuntimeError(f"injected fault in {actor} before {label!r}")
        if self.stall.get(actor) == n:
            await asyncio.Event().wait()  # hangs until the run is cancelled
