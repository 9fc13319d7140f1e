"""The data actor: pulls global batches from the user's data, validates and splits them
(into copies of their own: a loader may refill its tensors), and hands them to compute: at
most two ahead of the step running (one in the `batches` mailbox of one, one waiting to be
put), and only this run's (a run reads as many batches as it has steps).

| consumes  | the user's iterable / async iterable                                   |
| produces  | BatchReady -> compute                                                  |
| waits for | the next item (traced `next(data)`; sync iterators on the data thread) |
| unblocked | by compute taking batches (its mailbox is bounded)                     |
"""

from __future__ import annotations

import functools

import torch

from snake.actors.base import Actor
from snake.channels import Mailbox
from snake.data import DataSource, Vocab, split_batch
from snake.engine import Engine
from snake.messages import BatchReady


class DataFeeder(Actor):
    name = "data"

    def __init__(
        self,
        engine: Engine,
        source: DataSource,
        *,
        compute: Mailbox,
        iterations: range,
        expect_shape: torch.Size,
        vocab: Vocab,
    ) -> None:
        super().__init__(engine.tracer)
        self.e = engine
        self.source = source
        self.compute = compute
        self.iterations = iterations
        self.expect_shape = expect_shape
        self.vocab = vocab

    async def run(self) -> None:
        ex = self.e.executors["data"]
        for t in self.iterations:
            self.at(t)
            label, start = f"next(data) {t}", self.tracer.now()
            self.busy = (label, start)  # the stall watchdog names a slow source
            try:
                item = await self.source.next(ex)
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
            ins, tgs, tokens, trained = await self.work(ex, f"batch {t}", split)
            await self.compute.put(BatchReady(t, ins, tgs, tokens, trained))
