"""One `run()`: build the mailboxes and actors for a range of iterations and run them
under one TaskGroup. The first actor failure cancels the rest and surfaces as
`ActorFailed`, naming the actor and where it was, chained from the cause."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from snake.actors.base import Actor
from snake.actors.compute import Compute, StepReport
from snake.actors.data import DataFeeder
from snake.actors.device_mover import DeviceToHost, HostToDevice
from snake.actors.optimizer import OptimizerWorker
from snake.actors.storage_mover import SsdRead, SsdWrite
from snake.channels import Mailbox, StageClock
from snake.data import DataSource
from snake.engine import Engine
from snake.errors import ActorFailed


async def _guarded(actor: Actor) -> None:
    try:
        await actor.run()
    except Exception as exc:
        raise ActorFailed(
            actor.name, exc, iteration=actor.iteration, layer=actor.layer, micro_batch=actor.micro_batch
        ) from exc


def build_actors(
    engine: Engine,
    source: DataSource,
    iterations: range,
    reports: list[StepReport],
    *,
    vocab_size: int | None,
    on_step: Callable[[StepReport], None] | None = None,
) -> tuple[list[Actor], list[Mailbox]]:
    e = engine
    depth = max(4, 2 * e.M)
    compute_in = Mailbox("compute", depth)
    d2h_in = Mailbox("d2h", depth)
    h2d_in = Mailbox("h2d", depth)
    write_in = Mailbox("ssd_write", 2 * depth)
    opt_in = [Mailbox(f"optimizer[{i}]", depth) for i in range(e.workers)]
    clock = StageClock(start=iterations.start * e.S - 1)
    actors: list[Actor] = [
        DataFeeder(
            e, source, compute=compute_in, iterations=iterations,
            expect_shape=e.input_shape, vocab_size=vocab_size,
        ),
        Compute(
            e, inbox=compute_in, d2h=d2h_in, clock=clock, iterations=iterations, reports=reports, on_step=on_step
        ),
        HostToDevice(e, inbox=h2d_in, compute=compute_in, clock=clock, iterations=iterations),
        DeviceToHost(e, inbox=d2h_in, ssd_write=write_in, optimizers=opt_in),
        SsdRead(e, h2d=h2d_in, optimizers=opt_in, clock=clock, iterations=iterations),
        SsdWrite(e, inbox=write_in, h2d=h2d_in, producers=1 + e.workers),
    ]
    actors += [
        OptimizerWorker(e, i, inbox=opt_in[i], ssd_write=write_in, clock=clock, iterations=iterations)
        for i in range(e.workers)
    ]
    return actors, [compute_in, d2h_in, h2d_in, write_in, *opt_in]


async def run_iterations(
    engine: Engine,
    source: DataSource,
    steps: int,
    *,
    vocab_size: int | None,
    on_step: Callable[[StepReport], None] | None = None,
) -> list[StepReport]:
    iterations = range(engine.next_t, engine.next_t + steps)
    reports: list[StepReport] = []
    actors, mailboxes = build_actors(engine, source, iterations, reports, vocab_size=vocab_size, on_step=on_step)
    try:
        async with asyncio.TaskGroup() as tg:
            for a in actors:
                tg.create_task(_guarded(a), name=a.name)
    except BaseExceptionGroup as eg:
        failures = [x for x in eg.exceptions if isinstance(x, ActorFailed)]
        if not failures:
            raise
        first = failures[0]
        for other in failures[1:]:
            first.add_note(f"also: {other}")
        raise first from first.__cause__
    leftovers = [m.name for m in mailboxes if m.pending()]
    assert not leftovers, f"messages left undelivered in {leftovers} (internal error)"
    engine.check_pools()
    engine.next_t = iterations.stop
    engine.traffic.finish(iterations.stop - 1)
    return reports
