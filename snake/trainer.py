"""`SnakeTrainer`: the public entry point. An async context manager around one engine."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import torch
from torch import nn

from snake.actors.compute import StepReport
from snake.actors.optimizer import flush_delayed
from snake.adapters import (
    ModelParts,
    describe,
    input_rows,
    real_param,
    vocab_size,
)
from snake.batch_spec import batch_spec
from snake.blocking import run_blocking, settle
from snake.config import SnakeConfig
from snake.data import (
    DataSource,
    Vocab,
    check_async_draws,
    next_raised,
    pair_of,
    split_batch,
)
from snake.device import device_memory_bytes, helper_thread_init, on_device, resolve_device
from snake.engine import Engine
from snake.errors import ConfigError, DataError, DataExhausted, SnakeError, release_frames
from snake.lr import check_rates
from snake.model_features import check_flags_unchanged, requires_grad_flags
from snake.offload_dir import DirLock, check_offload_dir, memory_fs
from snake.optim import decay_flags
from snake.runtime import RunControl, RunStopped, run_iterations
from snake.state_dict import assemble_state_dict, initial_state_dict
from snake.trace import Tracer

if TYPE_CHECKING:
    from snake.evaluate import EvalReport

log = logging.getLogger("snake")

# the key in the user's model's __dict__ naming the trainer whose call uses it (a weakref)
_USER = "_snake_trainer"
# how long shutting down waits for a data next() a cancellation left running (a list's
# returns at once) before it leaves that thread to end on its own
_NEXT_GRACE_S = 0.25
P = ParamSpec("P")
R = TypeVar("R")


def _releasing(method: Callable[Concatenate[Any, P], Awaitable[R]]) -> Callable[Concatenate[Any, P], Awaitable[R]]:
    """A trainer's call whose exceptions leave no trainer behind them: snake's frames in
    their tracebacks cleared (`snake.errors.release_frames`), and this wrapper's own frame,
    which the traceback keeps, holding neither the trainer nor the arguments. A service that
    keeps a failed or cancelled job's exception (or its task) kept the trainer's engine and
    model alive through them: +75 MiB per job of a 3.2 M-parameter GPT (an audit, round 38)."""

    @functools.wraps(method)
    async def call(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        self._calling = method.__name__  # what `_begin` records as in progress, before any await
        try:
            return await method(self, *args, **kwargs)
        except BaseException as exc:
            release_frames(exc)
            del self, args, kwargs
            raise

    return call


@dataclass(frozen=True, slots=True)
class RunReport:
    """steps[i]: .loss (mean over the global batch), .seconds (wall time, the wait for its batch
    included), .data_wait_s (that wait), .tokens, .lr (the rate it stepped with), .grad_norm,
    .loss_scale and .skipped (float16's loss scale; `StepReport`)."""

    steps: list[StepReport]
    traffic: dict[tuple[str, str, str], int] = field(default_factory=dict)
    stopped: bool = False  # the run ended early, as `stop()` asked: fewer steps than run(steps)
    # the time after the last step's end: its on_step's (each other on_step's time is in the
    # next step's seconds)
    tail_s: float = 0.0

    @property
    def seconds(self) -> float:
        """The run's wall time from the start of its steps: theirs and the last on_step's."""
        return sum(s.seconds for s in self.steps) + self.tail_s

    @property
    def tokens_per_s(self) -> float:
        return sum(s.tokens for s in self.steps) / max(self.seconds, 1e-12)

    @property
    def data_wait_s(self) -> float:
        """The part of `seconds` the steps waited for their batches: near 0 unless the data
        is slower than training."""
        return sum(s.data_wait_s for s in self.steps)


class SnakeTrainer:
    """Trains `model` on `data` with `config`. `await run(steps)`; `run` again continues.

    After a failure or a cancellation inside `run()` the trainer is closed: its in-memory
    state is part-way through an iteration. Start a new trainer (from a checkpoint). (A bad
    first batch or a cancellation while the first `run()` sets up, before its engine
    exists, leaves nothing behind: `run` can be tried again.) Data that runs out, raises or
    gives a bad batch part-way is not such a failure: the run ends cleanly after the step
    before that batch and raises a `DataError` whose `report` holds the steps it trained;
    the trainer holds them and goes on (`run()` again, `save()`).
    One call at a time: a `run()`, `save()`, `load()`, `evaluate()` or `state_dict()` while
    another is in progress is refused, as is one while another trainer's call uses the same
    model object. `close()` while one is in progress cancels the task awaiting it, waits for
    it to stop, then closes. The trainer runs in the event loop of its first `run()`; call it
    from that loop (`save()`, `state_dict()`, `evaluate()`, `close()`, and setting up before
    the first run, `load()`, work from any loop; `close()` from another thread's too)."""

    def __init__(self, model: nn.Module | ModelParts, *, data: Any, config: SnakeConfig) -> None:
        if not isinstance(config, SnakeConfig):
            raise ConfigError("config", type(config).__name__, "must be a snake.SnakeConfig")
        self.config = config
        self.device = resolve_device(config.device)
        self.parts = describe(model)
        decay_flags(self.parts, config.optimizer)  # a no_decay that fails: a ConfigError now
        self.source = DataSource(data)
        # last: it creates the directory, which a bad model or data should not leave behind
        self.offload_dir = check_offload_dir(config.offload_dir)
        self.trace = Tracer()
        self.engine: Engine | None = None
        self._lock: DirLock | None = None
        self._data_ex: ThreadPoolExecutor | None = None
        self._closed = False
        self._closing: asyncio.Future[None] | None = None  # the one close() all callers wait for
        self._broken: str | None = None
        # the frozen parameters' digests, taken at the first save or load (snake.checkpoint)
        self._frozen_digests: dict[str, str] | None = None
        self._running = False
        self._control: RunControl | None = None  # the run() in progress's: `stop()` asks it
        self._control_loop: asyncio.AbstractEventLoop | None = None
        self._calling = ""  # the public call starting now (`_releasing`)
        self._doing = ""  # the one in progress, named in a refusal
        self._task: asyncio.Task[Any] | None = None  # the task of the run/save/load in progress
        self._loop: asyncio.AbstractEventLoop | None = None  # the first run()'s: the engine's queues belong to it
        self._vocab = Vocab()  # measured when the engine is built (_ckpt_shape)
        self._built_flags: list[tuple[str, bool]] = []  # each parameter's requires_grad then
        # the first batch's shapes and dtypes (`batch_spec`: a checkpoint records them), and
        # a batch of them a load() builds the engine from where the data has none left
        self._batch_spec: dict[str, Any] | None = None
        self._stand_in: tuple[torch.Tensor, torch.Tensor] | None = None

    async def __aenter__(self) -> SnakeTrainer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- running ----------------------------------------------------------------------
    @_releasing
    async def run(self, steps: int | None = None, *, data: Any = None,
                  on_step: Callable[[StepReport], None] | None = None) -> RunReport:
        """Train `steps` iterations (continuing from the last run), or without `steps` as
        many as the data has left (one pass over a DataLoader: the run ends where the data
        runs out, and at least one step). `on_step` is called on the event loop with each
        step's report as it finishes (keep it quick). The run ends early and cleanly where
        `stop()` asks it to (the report says `stopped`), where the data runs out (but for a
        run without `steps`), raises or gives a bad batch (a `DataError`), or where `on_step`
        raises (its exception, with a note): each time before a step not yet begun, the
        steps trained kept and the trainer usable. `data`: train on this data from this run
        on, in place of the trainer's (the next epoch's DataLoader, another dataset): the
        old iterator is dropped (a DataLoader's workers end, batches it had read and not
        trained on with it), the new one's batches must have the shape of the first, and a
        checkpoint counts the batches consumed of it (`load()` skips as many)."""
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
            raise ConfigError("steps", steps, "must be an integer >= 1, or None: as many as the data has left")
        _check_on_step(on_step)
        self._check_usable()
        self._check_idle("run")
        if self._loop is not None and self._loop is not asyncio.get_running_loop():
            raise SnakeError(
                "run: this trainer's first run() was in another event loop, which its queues belong to; "
                "call run() from that loop (one asyncio.run() around all of the trainer's calls), "
                "or save() a checkpoint and load() it into a new trainer in this loop"
            )
        self.source.home()  # this loop is the runs'
        first = self.engine.next_t if self.engine is not None else 0
        to_the_end = steps is None
        self._begin()
        control = self._control = RunControl()  # stop() asks this run from here on
        self._control_loop = asyncio.get_running_loop()
        try:  # nothing changes before the run starts: new data is the trainer's once all is checked
            new = await self._open_data(data) if data is not None else None
            try:
                steps, rate_each_step = self._run_length(steps, new or self.source, first)
            except BaseException:
                if new is not None:
                    await self._drop_data(new)
                raise
            if new is not None:
                old, self.source = self.source, new
                await old.close(_NEXT_GRACE_S)
        except BaseException:
            self._control = None
            self._end()
            raise
        try:
            if self.engine is None:
                await self._setup()
            assert self.engine is not None
            # the actors' waits bind the engine's queues (its buffer pools) to this loop;
            # setting up (also by a load() or evaluate() in another loop) binds none
            self._loop = asyncio.get_running_loop()
            reports = await run_iterations(
                self.engine, self.source, steps, vocab=self._vocab, on_step=on_step, control=control,
                check_rate=rate_each_step,
            )
        except RunStopped as stop:  # ended cleanly before a step not yet begun: the trainer goes on
            traffic = self.engine.traffic.last() if stop.reports and self.engine is not None else {}
            tail = self.engine.tail_s if self.engine is not None else 0.0
            if to_the_end and isinstance(stop.cause, DataExhausted) and stop.reports:
                return RunReport(stop.reports, traffic, stopped=False, tail_s=tail)  # the data's end is the run's
            if isinstance(stop.cause, ConfigError):  # a step's rate (a run without `steps`)
                stop.cause.add_note(f"snake: run() stopped cleanly after {len(stop.reports)} steps, before that one: "
                                    f"the trainer holds what they trained and is usable")
                raise stop.cause from None
            called = "run()" if to_the_end else f"run({steps})"  # as the user called it
            if stop.by == "data":
                raise _data_stopped(stop, RunReport(stop.reports, traffic, tail_s=tail), first, called) from stop.cause
            stop.cause.add_note(
                f"snake: on_step raised this; {called} stopped cleanly after {len(stop.reports)} of its steps "
                f"(their reports came to on_step): the trainer holds what they trained and is usable")
            raise stop.cause from None
        except BaseException as exc:
            # before the engine exists a bad input or a cancellation leaves nothing behind
            # (_setup): the trainer can be given another try
            if self.engine is not None or not isinstance(exc, SnakeError | asyncio.CancelledError):
                self._broken = f"{type(exc).__name__}: {exc}"
                await self._shutdown()
                await self.source.close(_NEXT_GRACE_S)  # closed: it holds no iterator of the data
            raise
        finally:
            self._control = None
            self._end()
        traffic = self.engine.traffic.last() if reports else {}
        return RunReport(reports, traffic, stopped=control.asked and len(reports) < steps, tail_s=self.engine.tail_s)

    def stop(self) -> bool:
        """Ask the `run()` in progress to end early and cleanly: before its first step not
        yet begun (the step running finishes, and the one after it where that one's work
        has begun: a step's reads start while the one before ends). No more batches are
        read (a `next()` in progress finishes for the next run); batches read for steps
        that do not run are handed out again by the next run, in order. That run() then
        returns the steps it trained, its report saying `stopped`, and the trainer is usable
        (`save()`, `run()` on). Callable from any thread (a signal handler's loop, a
        service's request handler). Returns whether a run was in progress; without one it
        does nothing."""
        control, loop = self._control, self._control_loop
        if control is None or loop is None:
            return False
        try:  # scheduled, also from the loop's own thread: a signal handler may run inside the loop's code
            loop.call_soon_threadsafe(control.stop)
        except RuntimeError:  # its loop is closed: no run is in progress there
            return False
        return True

    def _run_length(self, steps: int | None, source: DataSource, first: int) -> tuple[int, bool]:
        """run()'s number of steps over `source` (`steps`, or as many as it has left) and
        whether each step's learning rate is checked as its batch comes (a source that does
        not say its length); the rates checked now, and a source shorter than `steps`
        refused (ConfigError, DataError, DataExhausted)."""
        if steps is None:
            left = source.left()
            if left == 0:
                raise DataExhausted("data: it has no batch left for run() to train on; give it more: "
                                    "run(data=...) (the next epoch's DataLoader, say)")
            # an iterator that does not say how long it is: each step's rate is checked as
            # its batch comes (`DataFeeder`), not all of them now
            steps = left if left is not None else _UNTIL_THE_END
        rate_each_step = steps == _UNTIL_THE_END
        if not rate_each_step:
            check_rates(self.config.optimizer, range(first + 1, first + steps + 1))
        source.check_enough(steps)  # else the run would stop short, where the data ends
        return steps, rate_each_step

    async def _open_data(self, data: Any) -> DataSource:
        """`run(data=...)`'s data, not yet the trainer's: its first batch read and of the
        trainer's batch shape (else the error, the trainer's data as it was). A next() of
        the trainer's data still running on the data thread (a run cancelled or stopped
        while it waited) is left to end there: the new data gets a thread of its own."""
        new = DataSource(data)
        new.home()
        if self.engine is None or self._data_ex is None:  # the first run sets up on it
            return new
        if not await self.source.settle(_NEXT_GRACE_S):
            self._new_data_thread()
        try:
            first = await new.peek(self._data_ex, "the new data's first batch; the trainer keeps its data")
            shape = pair_of(first)[0].shape
            if shape != self.engine.input_shape:
                raise DataError(
                    f"data: the new data's first batch has inputs of shape {tuple(shape)} but this trainer's "
                    f"have {tuple(self.engine.input_shape)} (its buffers are sized from its first batch); "
                    f"give batches of that shape, or a new SnakeTrainer for these"
                )
        except BaseException:
            await self._drop_data(new)
            raise
        new.rng_lock = self.engine.kernels.rng_lock
        check_async_draws(new, self.device)
        return new

    async def _drop_data(self, source: DataSource) -> None:
        """Close data that is not the trainer's (refused, or its first read cancelled): a
        next() of it still running keeps the data thread, so the trainer's data and
        evaluate() get another."""
        call = source.thread_call()
        await source.close(_NEXT_GRACE_S)
        if call is not None:
            await asyncio.wait([asyncio.wrap_future(call)], timeout=_NEXT_GRACE_S)
            if not call.done():
                self._new_data_thread()

    def _new_data_thread(self) -> None:
        """A data thread of its own for what comes next, where a next() holds the one there
        is (its data's: it ends there on its own, and that thread with it). Nothing waits for
        it: close() joined it, and evaluate() and other data queued behind it."""
        old = self._data_ex
        if old is None:
            return
        old.shutdown(wait=False, cancel_futures=True)
        self._data_ex = ThreadPoolExecutor(1, thread_name_prefix="snake-data", initializer=helper_thread_init(self.device))
        if self.engine is not None:
            self.engine.executors["data"] = self._data_ex

    def traffic(self) -> dict[tuple[str, str, str], int]:
        """Bytes moved in the last finished iteration, by (src tier, dst tier, kind)."""
        return self.engine.traffic.last() if self.engine is not None else {}

    @_releasing
    async def state_dict(self, *, trained_only: bool = False) -> dict[str, torch.Tensor]:
        """fp32 master weights with the keys and shapes of `model.state_dict()`; with
        `trained_only` only those of the trained parameters (requires_grad: a LoRA
        fine-tune's adapters, which `model.load_state_dict(..., strict=False)` takes), so
        that the frozen weights are neither copied nor, for a model from `stream_hf`, read."""
        if not isinstance(trained_only, bool):
            raise ConfigError("state_dict(trained_only=...)", trained_only, "must be True or False")
        self._check_usable()
        self._check_idle("state_dict")
        # a cancelled state_dict stops at its next layer or tensor: it only reads, so the
        # trainer goes on as without it
        stop = threading.Event()
        self._begin()
        try:
            if self.engine is None:
                with ThreadPoolExecutor(1, "snake-state", initializer=helper_thread_init(self.device)) as once:
                    return await run_blocking(once, initial_state_dict, self.parts, stop, trained_only,
                                              on_cancel=stop.set)
            e = self.engine
            await self._flush("state_dict")
            pool = e.pools["opt"]
            scratch = pool.try_acquire() if pool is not None else None  # a staging buffer, idle outside a run
            assert pool is None or scratch is not None, "a run's buffers are out (internal error)"
            try:
                # assembled off the event loop: large copies on its thread would give it an OpenMP
                # team that slows a CPU device's kernels for the rest of the run
                return await run_blocking(e.executors["io"], assemble_state_dict, self.parts, e, scratch, stop,
                                          trained_only, on_cancel=stop.set)
            finally:
                if scratch is not None:
                    assert pool is not None
                    pool.release(scratch)
        finally:
            self._end()

    @_releasing
    async def evaluate(self, data: Any, *, max_batches: int | None = None,
                       batches_per_pass: int | None = None) -> EvalReport:
        """The validation loss of the current weights: the mean cross-entropy over every
        target token (not -100) of `data`'s (inputs, targets) batches, or of its first
        `max_batches`; forward only, dropout off, streamed layer by layer. Batches of any
        size and length (each cut into micro-batches of at most the training one's rows).
        Each pass over the model takes as many batches as the CPU memory training leaves
        idle between runs holds (at least one), or at most `batches_per_pass`, which may
        also go beyond that memory (the batches past it in memory of their own).
        Changes nothing: a run after it goes on as without it. See snake.evaluate."""
        from snake.evaluate import evaluate_model

        if not self._running and self.source.fetching():
            # a run stopped or cancelled while its data's next() blocked: that keeps the
            # data thread, where evaluate() cuts its batches
            self._new_data_thread()
        return await evaluate_model(self, data, max_batches, batches_per_pass)

    @_releasing
    async def save(self, directory: Any, *, frozen: bool | None = None) -> None:
        """Write a checkpoint to `directory` (atomically; see snake.checkpoint): fp32 master
        weights, AdamW state, step, RNG state, data position. Pending delayed optimizer
        steps are applied first. `frozen`: whether it holds the frozen parameters too
        (`snake export` builds the whole model from them; a load checks the model's against
        their digests either way); by default it does, but not for a PEFT model, whose
        adapters `snake export` cannot build, so that a LoRA checkpoint holds what trains."""
        from snake.checkpoint import save_checkpoint

        await save_checkpoint(self, directory, frozen=frozen)

    @_releasing
    async def load(self, directory: Any, *, skip_data: bool = True) -> None:
        """Resume from a checkpoint: on a new trainer, before `run`. Checks the checkpoint
        against the model and config (ConfigError naming the field), puts `data` after the
        global batches the checkpoint consumed (skip_data=False: `data` already starts
        after them): data with `state_dict()` and `load_state_dict()` (a StatefulDataLoader,
        `snake.Epochs` over one) gets the state the checkpoint holds, other data is read
        that far; then sets the trainer up and restores its state."""
        from snake.checkpoint import load_checkpoint

        self._check_usable()
        self._check_idle("load")  # else "has already run" while a first run() sets up
        await load_checkpoint(self, directory, skip_data=skip_data)

    async def close(self) -> None:
        """Stop threads, close files, release the offload_dir lock. Idempotent. A run(),
        save(), load(), evaluate() or state_dict() in progress is cancelled (its task) and
        waited for first. Every call returns once the trainer is closed (two at once, a
        service's shutdown and an `async with` exit, both wait for it); a call cancelled
        while it waits leaves the closing to go on to its end."""
        if self._closing is None:
            self._closed = True
            self._closing = asyncio.ensure_future(self._close(asyncio.current_task()))
        await asyncio.shield(self._closing)

    async def _close(self, caller: asyncio.Task[Any] | None) -> None:
        task = self._task
        if task is not None and task is not caller and not task.done():
            await _cancel_and_wait(task)
        await self._shutdown()
        await self.source.close(_NEXT_GRACE_S)
        self._release_model()  # where the call's task never ends (its loop stopped)

    # -- internals --------------------------------------------------------------------
    def _check_idle(self, what: str) -> None:
        """One call at a time: run, save, load, evaluate and state_dict share the engine's
        buffers and stores."""
        if self._running:
            raise SnakeError(f"{what}: a run(), save(), load(), evaluate() or state_dict() of this trainer is in "
                             f"progress ({self._doing}() now); await it first")

    def _begin(self) -> None:
        """A run(), save(), load(), evaluate() or state_dict() starts: no other may until
        `_end`, nor a call of another trainer on the same model, whose modules both would
        swap their weights into (the embedding's and head's, `Kernels.pre`): each then
        computed with the other's weights now and then, and trained wrong."""
        model = self.parts.model
        holder = vars(model).get(_USER)
        other = holder() if holder is not None else None
        # (a copy of the model made meanwhile, copy.deepcopy, copied the mark too)
        if other is not None and other is not self and other.parts.model is model and other._running \
                and not other._closed:
            raise SnakeError(
                f"{self._calling}: the model is in use by another SnakeTrainer's {other._doing}(), which swaps its "
                "weights into the model's modules as it computes; give each trainer its own model "
                "(copy.deepcopy(model)), or await (or close) the other trainer's call first"
            )
        vars(model)[_USER] = weakref.ref(self)  # taken off at `_end`: a model pickles without it
        self._running = True
        self._doing = self._calling
        self._task = asyncio.current_task()

    def _end(self) -> None:
        self._running = False
        self._task = None
        self._release_model()

    def _release_model(self) -> None:
        users = vars(self.parts.model)
        holder = users.get(_USER)
        if holder is not None and holder() is self:
            del users[_USER]

    async def _flush(self, what: str) -> None:
        """Apply the pending delayed optimizer steps (state_dict, save). They update the CPU
        copies layer by layer in place: one that stops part-way (an I/O error) leaves the
        finished layers stepped and the rest not, and a retry would step those twice, so
        then the trainer is closed. One that fails before it changed anything (the first
        layer's read) can be retried."""
        e = self.engine
        assert e is not None
        try:
            await run_blocking(e.executors["io"], flush_delayed, e)
        except BaseException as exc:
            if e.flush_partial:  # some layers stepped, some not
                self._broken = f"{what} failed applying the delayed optimizer steps: {type(exc).__name__}: {exc}"
                await self._shutdown()
            raise
        finally:  # the steps they waited for are applied (also where a cancellation came after)
            if not e.plans.has_delayed(e.next_t, e.first_delayed):
                e.release_held_grads()

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise SnakeError(
                f"this trainer stopped after {self._broken}; it is closed: make a new SnakeTrainer "
                "(and load a checkpoint) to continue"
            )
        if self._closed:
            raise SnakeError("this trainer is closed; make a new SnakeTrainer")
        if self.engine is not None:  # what it trains was fixed when the engine was built
            check_flags_unchanged(self.parts.model, self._built_flags)

    def _find_vocab(self) -> Vocab:
        """The token-id ranges batches are checked against: the model config's vocab_size
        for inputs and targets. A model without one (a ModelParts) has its head's width
        measured (one token through its embedding and head) for the targets, which an
        out-of-range id would otherwise fail deep in the loss, and its embedding's rows
        found (`input_rows`) for the inputs; what cannot be measured goes unchecked."""
        cfg = getattr(self.parts.model, "config", None)
        v = getattr(cfg, "vocab_size", None)
        if isinstance(v, int):
            return Vocab(v, v)
        try:
            inputs = input_rows(self.parts)
        except Exception as exc:  # a pre that cannot take one token: not checked
            log.debug("snake: the model's embedding rows could not be found (%s); inputs unchecked", exc)
            inputs = None
        try:
            return Vocab(inputs, vocab_size(self.parts))
        except Exception as exc:  # an embedding or head that cannot take one token: not checked
            log.debug("snake: the model's logits per token could not be measured (%s); targets unchecked", exc)
            return Vocab(inputs, None)

    async def _setup(self) -> None:
        """Build the engine from the first batch. On failure before the engine exists
        (bad input, no plan, no disk space), or while it writes the initial weights (a
        cancellation, which stops that at its next layer), nothing stays behind: no thread,
        no lock, no offload file, and the trainer can be given another try."""
        try:
            await self._build()
        except BaseException:
            if self.engine is None:
                await self._shutdown()
            raise

    async def _build(self) -> None:
        cfg = given = self.config
        self._data_ex = ThreadPoolExecutor(
            1, thread_name_prefix="snake-data", initializer=helper_thread_init(self.device)
        )
        try:
            first = await self.source.peek(self._data_ex, "its first batch")  # nothing built: run() can be tried again
        except DataExhausted:
            if self._stand_in is None:
                raise
            # load(): the data ends where the checkpoint's run did (one trained to its end):
            # the engine is sized from the batch shapes the checkpoint records, and trains on
            # the data of a later run(data=...)
            first = self._stand_in
        planned = (cfg.micro_batches is None or cfg.placement is None or cfg.alpha is None
                   or cfg.resident_optimizer is None)
        if planned:
            cfg = await self._plan(first)
        assert cfg.micro_batches is not None
        # The first micro-batch's embedding (for the checkpoint shape) runs on the data
        # thread: a torch op on the event loop thread would give it an OpenMP team that stays
        # alive for the whole run and, on a CPU device, slows every compute kernel (see
        # snake.device.helper_thread_init).
        h_shape = await run_blocking(self._data_ex, self._ckpt_shape, first, cfg.micro_batches)
        self._batch_spec = batch_spec(first)
        if not planned:  # a placement the planner checked fits; one the user fixed is checked here
            await run_blocking(self._data_ex, self._check_memory, cfg, first)
        self._lock = DirLock(self.offload_dir)
        data_ex = self._data_ex
        build_stop = threading.Event()
        def build() -> Engine:
            with on_device(self.device):  # its host buffers are registered with the trainer's GPU
                return Engine(
                    self.parts, cfg, self.device, ckpt_shape=h_shape, input_shape=pair_of(first)[0].shape,
                    offload_dir=self.offload_dir, tracer=self.trace, data_executor=data_ex, stop=build_stop,
                )

        built = asyncio.get_running_loop().run_in_executor(data_ex, build)
        try:
            engine = await asyncio.shield(built)
        except asyncio.CancelledError:
            # cancelled while the engine was being built: its thread cannot be interrupted, so
            # the build stops at its next piece (having closed what it opened), or one that
            # finished first is closed here, or its files would stay open
            build_stop.set()
            await settle(built)
            if not built.cancelled() and built.exception() is None:
                built.result().close()
            raise
        self.engine = engine
        self._built_flags = requires_grad_flags(self.parts.model)
        self.config = cfg
        # a sync source's next() and the compute thread's seeded stretches of torch's global
        # generator take turns on a CPU device (`Kernels.rng`)
        self.source.rng_lock = engine.kernels.rng_lock
        check_async_draws(self.source, self.device)
        stop = threading.Event()
        try:
            await run_blocking(engine.executors["io"], engine.load_initial_weights, stop, on_cancel=stop.set)
        except BaseException:  # nothing has run: the engine goes, and the config the user gave comes back
            self.engine, self._loop, self.config = None, None, given
            engine.close()
            raise
        log.info(
            "snake: %d blocks x %d params, M=%d, alpha=%s, placement=%s, %s on %s, offload %.1f MiB in %s",
            engine.N, engine.P, cfg.micro_batches, cfg.alpha, cfg.placement, cfg.schedule,
            self.device, engine.offload_bytes() / 2**20, self.offload_dir,
        )

    def _ckpt_shape(self, first: Any, micro_batches: int) -> torch.Size:
        self._vocab = self._find_vocab()
        ins, _tgs, _, _ = split_batch(
            first, micro_batches=micro_batches, device=torch.device("cpu"),
            expect_shape=None, vocab=self._vocab,
        )
        model = self.parts.model
        mdev = real_param(model).device
        # in eval mode: the embedding's dropout drew from torch's global generator, and a
        # data source drawing from it (nanoGPT's get_batch) got another stream than alone
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        try:
            with torch.no_grad():
                return self.parts.pre(model, ins[0].to(mdev)).shape
        finally:
            for m, training in modes:
                m.training = training

    def _check_memory(self, cfg: SnakeConfig, first: Any) -> None:
        """Before anything is allocated: does a placement the user fixed fit in the memory
        (`cpu_memory_bytes`, else what is available now; on CUDA the device's free memory)?
        By the planner's memory model, which bounds the process's growth
        (tests/test_memory_budget.py). A ConfigError saying by how much and what to change,
        where the run would otherwise fail out of memory part-way (or swap)."""
        import psutil

        from planner.profile import shape_of_parts
        from planner.solve import fmt_bytes
        from snake.memory import (
            device_memory,
            off_budget_bytes,
            placement_bytes,
            resident_host_bytes,
        )

        assert cfg.micro_batches is not None and cfg.placement is not None and cfg.alpha is not None
        m, p = cfg.micro_batches, cfg.placement
        shape_in = pair_of(first)[0].shape
        b, seq = int(shape_in[0]), int(shape_in[1])
        shape = shape_of_parts(self.parts, b // m, seq, cfg.dtype)
        kind = self.device.type
        in_memory = memory_fs(self.offload_dir) is not None  # its "SSD" tier is memory too
        need = placement_bytes(shape, n_micro=m, alpha=cfg.alpha, schedule=cfg.schedule, workers=cfg.optimizer_workers,
                               param=p.param, ckpt=p.ckpt, opt=p.opt, grad=p.grad, device_type=kind,
                               resident_on_ssd=cfg.resident_optimizer == "ssd", offload_in_memory=in_memory)
        given = cfg.cpu_memory_bytes is not None
        have = float(cfg.cpu_memory_bytes) if cfg.cpu_memory_bytes is not None else float(
            psutil.virtual_memory().available)
        fix = ("use smaller CPU shares in placement (more on SSD), more micro-batches (smaller ones), shorter "
               "sequences, or placement=None to have the planner place the model in the memory there is"
               + ("; resident_optimizer='ssd' puts the embeddings' and head's optimizer state on SSD "
                  f"({fmt_bytes(resident_host_bytes(shape.resident_params, False, kind == 'cuda'))} of CPU memory now)"
                  if cfg.resident_optimizer == "cpu" and shape.resident_params else ""))
        if cfg.steps_wait and cfg.schedule == "vertical":  # alpha = 1: what holding every gradient costs
            kw = dict(n_micro=m, schedule=cfg.schedule, workers=cfg.optimizer_workers, param=p.param, ckpt=p.ckpt,
                      opt=p.opt, device_type=kind, resident_on_ssd=cfg.resident_optimizer == "ssd",
                      offload_in_memory=in_memory)
            held = need - placement_bytes(shape, alpha=0.0, **kw)  # type: ignore[arg-type]
            if held > 0:
                why = "clipping (optimizer.max_grad_norm)" if cfg.optimizer.clips else "a dynamic loss_scale"
                fix += (f"; {why} holds every layer's fp32 gradient until its step, "
                        f"{fmt_bytes(held)} of the need (without it, alpha=0.0 needs none of it)"
                        + (f": a smaller placement.grad (now {p.grad:g}) puts more of them on SSD"
                           if p.grad > 0 else ""))
        if in_memory:
            fix = (f"put offload_dir on a disk: {self.offload_dir} is in memory (tmpfs), so its SSD tier takes CPU "
                   f"memory too (counted here); or {fix}")
        if need > have:
            other = off_budget_bytes(shape, n_micro=m, device_type=kind)
            raise ConfigError(
                "placement", p,
                f"needs about {fmt_bytes(need)} of CPU memory for this model and batch at micro_batches={m} "
                f"({fmt_bytes(need - other)} of placed data and buffers, {fmt_bytes(other)} of "
                f"{'the CPU device working set and ' if kind == 'cpu' else ''}runtime overhead), more than "
                f"{'cpu_memory_bytes=' if given else 'the '}{fmt_bytes(have)}{'' if given else ' available now'}",
                fix,
            )
        if kind == "cuda":
            free = device_memory_bytes(self.device)
            dev = device_memory(shape, n_micro=m)
            if cfg.device_memory_bytes is not None:
                free = cfg.device_memory_bytes
            if free is not None and dev > free:
                raise ConfigError(
                    "micro_batches", m,
                    f"needs about {fmt_bytes(dev)} of device memory for this model and micro-batch, more than "
                    f"the {fmt_bytes(free)} free", "use more micro-batches (smaller ones) or shorter sequences",
                )

    async def _plan(self, first: Any) -> SnakeConfig:
        try:
            from planner.integrate import plan_for_trainer
        except ImportError as exc:  # pragma: no cover - planner ships with snake
            raise ConfigError("placement", None, "needs the planner package", "install snake fully") from exc
        return await plan_for_trainer(self, first)

    async def _shutdown(self) -> None:
        e, self.engine = self.engine, None
        self._loop = None
        if e is not None:
            e.close()  # joins executor threads: quick, their work was awaited or is done
        data_ex, self._data_ex = self._data_ex, None
        if data_ex is not None:
            # not joined while the user's next() still runs there after a short grace (a
            # cancellation does not wait for it: it may block for long); that thread ends
            # when it returns
            idle = False
            try:
                idle = await self.source.settle(_NEXT_GRACE_S)
            finally:
                data_ex.shutdown(wait=idle, cancel_futures=True)
                self._release_lock()
        self._release_lock()

    def _release_lock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()


# run() without steps, over data that does not say how long it is: until it runs out
_UNTIL_THE_END = 2**62


def _data_stopped(stop: RunStopped, report: RunReport, first: int, called: str) -> DataError:
    """The error run() raises where the data stopped it part-way (`RunStopped`): the data's
    own words (or what its next() raised), then what the run did and what the trainer holds.
    A DataExhausted where the data ran out, else a DataError."""
    cause, done = stop.cause, len(stop.reports)
    said = str(cause) if isinstance(cause, DataError) else str(
        next_raised(cause, f"global batch {first + done} of this trainer's"))
    ran_out = isinstance(cause, DataExhausted)
    then = ("run(data=...) with more data goes on, or save() it" if ran_out else
            "fix the data and run() on, run(data=...) with other data, or save() it")
    kind = DataExhausted if ran_out else DataError
    err = kind(
        f"{said}. {called} stopped cleanly after {done} of its steps, before iteration {first + done}: "
        f"the trainer holds what they trained and is usable ({then}); this error's `report` has the steps' reports"
    )
    err.report = report
    return err


async def _cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and wait until it is done. A task of another event loop (the trainer's
    calls made from a loop in another thread, its close() from the service's) is cancelled
    in its own loop, thread-safely (`Task.cancel` is not; and its done-callbacks run there,
    so `asyncio.wait` here was never woken: close() hung); one whose loop has stopped or
    closed never runs again and is not waited for (`close()` raised "Event loop is closed"
    and left the threads, files and lock): the shutdown joins its blocking work's threads."""
    home = task.get_loop()
    if home is asyncio.get_running_loop():
        task.cancel()
        await asyncio.wait([task])
        return
    here = asyncio.get_running_loop()
    done = here.create_future()

    def finish() -> None:
        if not done.done():
            done.set_result(None)

    def wake(_: object) -> None:
        if not here.is_closed():
            here.call_soon_threadsafe(finish)

    def cancel() -> None:
        task.cancel()
        task.add_done_callback(wake)

    try:
        home.call_soon_threadsafe(cancel)
    except RuntimeError:  # its loop is closed
        return
    while not done.done() and home.is_running():
        await asyncio.wait([done], timeout=0.05)


def _check_on_step(on_step: object) -> None:
    if on_step is None:
        return
    if not callable(on_step):
        raise ConfigError("on_step", on_step, "must be a function taking a StepReport, or None")
    if inspect.iscoroutinefunction(on_step) or inspect.iscoroutinefunction(type(on_step).__call__):
        raise ConfigError(
            "on_step", on_step, "is a coroutine function, which the trainer would call without awaiting",
            "pass a plain function; to do async work, start it there with asyncio.create_task",
        )
    try:
        signature = inspect.signature(on_step)
    except (TypeError, ValueError):  # a builtin without one: called as it is
        return
    try:
        signature.bind(None)
    except TypeError as e:  # else the first step's report would fail the run, closing the trainer
        raise ConfigError("on_step", on_step, f"cannot be called with one StepReport ({e})",
                          "pass a function of one argument, e.g. lambda report: print(report.loss)") from None


