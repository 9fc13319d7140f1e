"""The data actor: pulls global batches from the user's data, validates and splits them
(into copies of their own: a loader may refill its tensors), and hands them to compute: at
most two ahead of the step running (batch t once compute took batch t - 2: `StageClock.may_read`),
and only this run's (a run reads as many batches as it has steps). It tells the clock
each batch it has (`StageClock.got`: no actor starts any work of an iteration before its
batch is in hand) and, where the data runs out, raises or gives a bad batch, stops the
run there (`StageClock.stop_at`): the run ends cleanly after the iteration before, and
`run()` raises the data's error with the trainer still usable. Once a stop is asked for
it reads no more (a next() in progress goes on in the source, for the next run).

| consumes  | the user's iterable / async iterable                                   |
| produces  | BatchReady -> compute                                                  |
| waits for | the next item (traced `next(data)`; sync iterators on the data thread) |
| unblocked | by compute taking batch t - 2 (`StageClock.took`), or a stop          |
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable
from concurrent.futures import Executor
from typing import Any

import torch

from snake.actors.base import Actor
from snake.channels import Mailbox, StageClock
from snake.data import DataSource, Vocab, split_batch
from snake.engine import Engine
from snake.errors import ConfigError, DataError
from snake.lr import check_rates
from snake.messages import BatchReady


class DataFeeder(Actor):
    name = "data"

    def __init__(
        self,
        engine: Engine,
        source: DataSource,
        *,
        compute: Mailbox,
        clock: StageClock,
        expect_shape: torch.Size,
        vocab: Vocab,
        check_rate: bool = False,
    ) -> None:
        super().__init__(engine.tracer)
        self.e = engine
        self.source = source
        self.compute = compute
        self.clock = clock
        self.expect_shape = expect_shape
        self.vocab = vocab
        self.check_rate = check_rate  # each step's learning rate, before its iteration begins

    async def run(self) -> None:
        ex = self.e.executors["data"]
        for t in self.clock.iterations():
            self.at(t)
            if not await self.clock.may_read(t):
                return  # the run stops early: no more batches are read
            label, start = f"next(data) {t}", self.tracer.now()
            self.busy = (label, start)  # the stall watchdog names a slow source
            try:
                item = await self._next(ex)
            except Exception as exc:  # the user's iterator raised, or ran out (DataError)
                await self.clock.stop_at(t, exc)
                return
            finally:
                self.busy = None
                # a span like any work: a slow source shows on the data track, not as idle
                self.tracer.add(self.name, label, start, self.tracer.now())
            if item is _STOPPING:
                return  # its next() goes on in the source: the next run's first batch
            if isinstance(item, BatchReady):  # split by a run that stopped before its step
                ready = dataclasses.replace(item, t=t)
            else:
                split = functools.partial(
                    split_batch,
                    item,
                    micro_batches=self.e.M,
                    device=self.e.device,
                    expect_shape=self.expect_shape,
                    vocab=self.vocab,
                )
                try:
                    ins, tgs, tokens, trained = await self.work(ex, f"batch {t}", split)
                except DataError as exc:  # a bad batch: its shape, dtype or values
                    await self.clock.stop_at(t, exc)
                    return
                ready = BatchReady(t, ins, tgs, tokens, trained)
            if self.check_rate:
                try:
                    check_rates(self.e.config.optimizer, range(t + 1, t + 2))
                except ConfigError as exc:
                    self.source.unread(ready)  # trained on by the next run, whose rate may be good
                    await self.clock.stop_at(t, exc)
                    return
            await self.clock.got(t)
            await self.compute.put(ready)  # never waits: `may_read` keeps it to two

    async def _next(self, ex: Executor) -> Any:
        """The data's next item, or _STOPPING where the run is to stop first (the next()
        goes on: the source hands its item out next time, as after a cancellation)."""
        item = asyncio.ensure_future(_carrying(self.source.next(ex)))
        stop = asyncio.ensure_future(self.clock.stopping.wait())
        try:
            await asyncio.wait([item, stop], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            item.cancel()
            raise
        finally:
            stop.cancel()
        if item.done():
            got = item.result()
            if isinstance(got, _Carried):
                raise got.exc  # here, in the actor's task, which carries it to run()
            return got
        item.cancel()
        await asyncio.wait([item])
        if not item.cancelled() and item.exception() is None:  # it came as it was cancelled
            got = item.result()
            if isinstance(got, _Carried):
                raise got.exc
            self.source.unread(got)
        return _STOPPING


_STOPPING = object()


class _Carried:
    """A KeyboardInterrupt or SystemExit the data's next() raised, returned by its task (a
    task that raises either re-raises it out of the event loop as well: it came twice)."""

    def __init__(self, exc: KeyboardInterrupt | SystemExit) -> None:
        self.exc = exc


async def _carrying(next_item: Awaitable[Any]) -> Any:
    try:
        return await next_item
    except (KeyboardInterrupt, SystemExit) as exc:
        return _Carried(exc)
