"""The data actor: pulls global batches from the user's data, validates and splits them
(into copies of their own: a loader may refill its tensors), and hands them to compute: at
most two ahead of the step running (one in the `batches` mailbox of one, one waiting to be
put), and only this run's (a run reads as many batches as it has steps). It tells the clock
each batch it has (`StageClock.have`: the other actors start no work of an iteration before
its batch is in hand) and, where the data runs out, raises or gives a bad batch, stops the
run there (`StageClock.stop_at`): the run ends cleanly after the iteration before, and
`run()` raises the data's error with the trainer still usable.

| consumes  | the user's iterable / async iterable                                   |
| produces  | BatchReady -> compute                                                  |
| waits for | the next item (traced `next(data)`; sync iterators on the data thread) |
| unblocked | by compute taking batches (its mailbox is bounded)                     |
"""

from __future__ import annotations

import functools

import torch

from snake.actors.base import Actor
from snake.channels import Mailbox, StageClock
from snake.data import DataSource, Vocab, split_batch
from snake.engine import Engine
from snake.errors import DataError
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
    ) -> None:
        super().__init__(engine.tracer)
        self.e = engine
        self.source = source
        self.compute = compute
        self.clock = clock
        self.expect_shape = expect_shape
        self.vocab = vocab

    async def run(self) -> None:
        ex = self.e.executors["data"]
        for t in self.clock.iterations():
            self.at(t)
            label, start = f"next(data) {t}", self.tracer.now()
            self.busy = (label, start)  # the stall watchdog names a slow source
            try:
                item = await self.source.next(ex)
            except Exception as exc:  # the user's iterator raised, or ran out (DataError)
                await self.clock.stop_at(t, exc)
                return
            finally:
                self.busy = None
                # a span like any work: a slow source shows on the data track, not as idle
                self.tracer.add(self.name, label, start, self.tracer.now())
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
            await self.clock.have(t)
            await self.compute.put(BatchReady(t, ins, tgs, tokens, trained))
