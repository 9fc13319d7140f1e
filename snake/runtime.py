"""One `run()`: build the mailboxes and actors for a range of iterations and run them
under one TaskGroup. The first actor failure cancels the rest and surfaces as
`ActorFailed`, naming the actor and where it was, chained from the cause. Data that runs
out, raises or gives a bad batch part-way, a stop asked for (`RunControl`) and an `on_step`
that raises are no failure of the run: it ends cleanly before an iteration not yet begun
(and raises `RunStopped` where that is an error)."""

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
from snake.data import DataSource, Vocab
from snake.engine import Engine
from snake.errors import ActorFailed, StallError


class RunStopped(Exception):
    """A run ended cleanly before its last iteration, and that is an error to raise: the
    data ran out, raised or gave a bad batch (`by` "data": `StageClock.stop_at`), or the
    user's `on_step` raised (`by` "on_step": the run stopped before its first iteration
    not yet begun). `cause` is what stopped it, `reports` the steps it trained (of the
    `steps` asked for). Every actor finished and none began any work of an iteration not
    trained: the trainer is where a run of `len(reports)` steps leaves it."""

    def __init__(self, by: str, cause: Exception, reports: list[StepReport], steps: int) -> None:
        super().__init__(f"{by} stopped the run after {len(reports)} of {steps} steps: {cause}")
        self.by = by
        self.cause = cause
        self.reports = reports
        self.steps = steps


class RunControl:
    """How the trainer asks a run in progress to stop early (`SnakeTrainer.stop`): the run
    ends before its first iteration not yet begun. Called on the run's loop; a stop asked
    for before the run's clock exists (the first run still setting up) applies as it starts."""

    def __init__(self) -> None:
        self.clock: StageClock | None = None
        self.asked = False

    def stop(self) -> None:
        self.asked = True
        if self.clock is not None:
            self.clock.request_stop()


class _Interrupted(Exception):
    """A KeyboardInterrupt or SystemExit the user's code raised inside an actor (`on_step`,
    the data's `next()`), carried out of the TaskGroup as an error, so that `run()` raises it
    once the other actors have stopped: asyncio re-raises either out of the event loop from
    every task it ends, so it came out of the loop first from the actor's task, before the
    trainer shut down, and then again from run()'s, out of whatever the loop ran next (a
    `close()` then stopped part-way, or `asyncio.run`'s clean-up)."""

    def __init__(self, exc: KeyboardInterrupt | SystemExit) -> None:
        super().__init__(repr(exc))
        self.exc = exc


async def _guarded(actor: Actor) -> None:
    try:
        await actor.run()
    except (KeyboardInterrupt, SystemExit) as exc:
        raise _Interrupted(exc) from None
    except Exception as exc:
        raise ActorFailed(
            actor.name, exc, iteration=actor.iteration, layer=actor.layer, micro_batch=actor.micro_batch
        ) from exc


async def _watchdog(
    engine: Engine, actors: list[Actor], mailboxes: list[Mailbox], tasks: list[asyncio.Task[None]], stall_s: float
) -> None:
    """Fails the run when no actor finishes any work (nor reports progress inside one long
    piece of it, `Tracer.progress`) for `stall_s` seconds, blaming the actor whose work in
    progress is oldest (else compute, which waits for its inputs)."""
    done = asyncio.Event()
    left = [len(tasks)]

    def one_done(_: asyncio.Task[None]) -> None:
        left[0] -= 1
        if left[0] == 0:
            done.set()

    for t in tasks:
        t.add_done_callback(one_done)
    tracer = engine.tracer
    mark, since = (tracer.last_end_s, tracer.last_progress_s), tracer.now()
    tick = min(1.0, stall_s / 4)
    while True:
        try:
            await asyncio.wait_for(done.wait(), tick)
            return
        except TimeoutError:
            pass
        now_mark = (tracer.last_end_s, tracer.last_progress_s)
        if now_mark != mark:
            mark, since = now_mark, tracer.now()
            continue
        if tracer.now() - since < stall_s:
            continue
        busy = sorted(((a.busy[1], i) for i, a in enumerate(actors) if a.busy), key=lambda x: x[0])
        culprit = actors[busy[0][1]] if busy else next(a for a in actors if a.name == "compute")
        now = tracer.now()
        doing = [f"{a.name} busy with {a.busy[0]!r} for {now - a.busy[1]:.1f} s" for a in actors if a.busy]
        waits = [f"{m.name} waits for {m.waiting}" for m in mailboxes if m.waiting is not None]
        stall = StallError(f"no actor finished any work for {stall_s:.1f} s; " + "; ".join(doing + waits))
        raise ActorFailed(
            culprit.name, stall, iteration=culprit.iteration, layer=culprit.layer, micro_batch=culprit.micro_batch
        ) from stall


def build_actors(
    engine: Engine,
    source: DataSource,
    clock: StageClock,
    reports: list[StepReport],
    *,
    vocab: Vocab,
    on_step: Callable[[StepReport], None] | None = None,
    check_rate: bool = False,
) -> tuple[list[Actor], list[Mailbox]]:
    e = engine
    depth = max(4, 2 * e.M)
    compute_in = Mailbox("compute", depth)
    # batches have a mailbox of their own: in `compute_in` the compute actor's waits for
    # loads stashed every batch that came, so the data actor read on without bound (the
    # whole run's batches, on the device, before the first step ended). It holds two at
    # most: batch t is read once compute took batch t - 2 (`StageClock.may_read`)
    batches_in = Mailbox("batches", 2)
    d2h_in = Mailbox("d2h", depth)
    h2d_in = Mailbox("h2d", depth)
    write_in = Mailbox("ssd_write", 2 * depth)
    opt_in = [Mailbox(f"optimizer[{i}]", depth) for i in range(e.workers)]
    actors: list[Actor] = [
        DataFeeder(
            e, source, compute=batches_in, clock=clock,
            expect_shape=e.input_shape, vocab=vocab, check_rate=check_rate,
        ),
        Compute(
            e, inbox=compute_in, batches=batches_in, d2h=d2h_in, clock=clock, reports=reports, on_step=on_step
        ),
        HostToDevice(e, inbox=h2d_in, compute=compute_in, clock=clock),
        DeviceToHost(e, inbox=d2h_in, ssd_write=write_in, optimizers=opt_in),
        SsdRead(e, h2d=h2d_in, optimizers=opt_in, clock=clock),
        SsdWrite(e, inbox=write_in, h2d=h2d_in, producers=1 + e.workers),
    ]
    actors += [
        OptimizerWorker(e, i, inbox=opt_in[i], ssd_write=write_in, clock=clock)
        for i in range(e.workers)
    ]
    return actors, [compute_in, batches_in, d2h_in, h2d_in, write_in, *opt_in]


async def run_iterations(
    engine: Engine,
    source: DataSource,
    steps: int,
    *,
    vocab: Vocab,
    on_step: Callable[[StepReport], None] | None = None,
    control: RunControl | None = None,
    check_rate: bool = False,
) -> list[StepReport]:
    """The run's step reports: `steps` of them, or fewer where `control` stopped it early.
    RunStopped where the data or `on_step` stopped it (the steps it trained are kept).
    `check_rate`: check each step's learning rate as its batch comes (a run whose length is
    not known before, so `check_rates` could not check them all first)."""
    iterations = range(engine.next_t, engine.next_t + steps)
    # pre/post train (their dropout on) as the layers' shells do, whatever mode the user's
    # model was put in since the last run (`Kernels.restore_modes` gives theirs back at close)
    engine.kernels.parts.model.train()
    reports: list[StepReport] = []
    clock = StageClock(start=iterations.start * engine.S - 1, iterations=iterations)
    actors, mailboxes = build_actors(engine, source, clock, reports, vocab=vocab, on_step=on_step,
                                     check_rate=check_rate)
    if control is not None:
        control.clock = clock
        if control.asked:
            clock.request_stop()
    for a in actors:
        a.fault_hook = engine.fault_hook
        a.on_cancel = engine.stop.set
    try:
        with engine.tracer.loop_clock():
            await _run_actors(engine, actors, mailboxes)
    except BaseExceptionGroup as eg:
        interrupts = [x.exc for x in eg.exceptions if isinstance(x, _Interrupted)]
        if interrupts:
            raise interrupts[0] from None
        failures = [x for x in eg.exceptions if isinstance(x, ActorFailed)]
        if not failures:
            raise
        first = failures[0]
        for other in failures[1:]:
            first.add_note(f"also: {other}")
        raise first from first.__cause__
    # batches read for iterations the run stopped before: handed out again, in order, next time
    unread = sorted(next(m for m in mailboxes if m.name == "batches").pending(), key=lambda b: b.t)
    assert all(b.t >= clock.end for b in unread), "a batch of a trained iteration left over (internal error)"
    for batch in reversed(unread):
        source.unread(batch)
    leftovers = [m.name for m in mailboxes if m.pending()]
    assert not leftovers, f"messages left undelivered in {leftovers} (internal error)"
    engine.check_pools()
    engine.next_t = clock.end
    if clock.end > iterations.start:
        engine.traffic.finish(clock.end - 1)
    if clock.failed_callback is not None:
        raise RunStopped("on_step", clock.failed_callback, reports, steps)
    if clock.stopped_by is not None:
        raise RunStopped("data", clock.stopped_by, reports, steps)
    return reports


async def _run_actors(engine: Engine, actors: list[Actor], mailboxes: list[Mailbox]) -> None:
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(_guarded(a), name=a.name) for a in actors]
        timeout = engine.config.stall_timeout_s
        if timeout is not None:
            tg.create_task(_watchdog(engine, actors, mailboxes, tasks, timeout), name="watchdog")
