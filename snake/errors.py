"""Documented exceptions raised by snake. Every message names what is wrong and how to fix it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import FrameType
from typing import Any


class SnakeError(Exception):
    """Base class of every error snake raises on purpose."""


MISSING = object()  # ConfigError's value for a field that was not given at all


class ConfigError(SnakeError, ValueError):
    """A configuration field has a bad value. The message names the field, the value
    (none for MISSING), the rule and the fix. Raised before any state is touched."""

    def __init__(self, field: str, value: object, rule: str, fix: str = "") -> None:
        self.field = field
        self.value = value
        msg = f"{field} {rule}" if value is MISSING else f"{field}={value!r} {rule}"
        if fix:
            msg += f" ({fix})"
        super().__init__(msg)


class DataError(SnakeError, ValueError):
    """A batch from `data` has the wrong type, shape, dtype or values, or the data ran out.

    Raised by `run()` where the data stops a run part-way (runs out, raises in its next(),
    gives a bad batch): the run ended cleanly after the step before, the trainer is usable,
    and `report` is the `RunReport` of the steps the run trained (else None)."""

    report: Any = None



class DataExhausted(DataError):
    """The data ran out: it gave no batch for a step. Raised by `run()` after the steps it
    had batches for (`report`), the trainer usable: a finite stream's end, as a loop over
    it ends; what the trainer learned stays (`save()` it, or load it into a trainer with
    more data)."""

class ModelError(SnakeError, TypeError):
    """The model cannot be split into resident pre/post parts and streamed blocks, or snake
    would train it wrongly."""


class StorageError(SnakeError, OSError):
    """The SSD tier failed: the message names the file, the offset and the operation."""


class Stopped(SnakeError):
    """Blocking work (a chunked resident step, a save, a load, a state_dict, the engine's
    build) left part-way because the task awaiting it was cancelled or its run is being torn
    down. It never reaches the caller: the cancellation or the run's first failure does."""


class StallError(SnakeError, TimeoutError):
    """No actor made progress for `stall_timeout_s`: something hangs (a disk that does not
    answer, a deadlock). The message says what each actor was doing."""


class GradientOverflow(SnakeError, FloatingPointError):
    """float16 with a static loss scale: a gradient came out inf or nan (the scaled backward
    overflowed float16), found before the step that would have put it into the weights. The
    message names the layer and iteration and the fix: a dynamic loss scale, which skips
    such steps, or a smaller static one. Reaches the caller as an ActorFailed's cause."""

    def __init__(self, where: str, t: int, scale: float) -> None:
        super().__init__(
            f"the gradient of {where} in iteration {t} is not finite: float16 overflowed at the static "
            f"loss_scale={scale:.10g}, and its optimizer step would put inf or nan into the weights; it was "
            "not applied. Use loss_scale=snake.DynamicLossScale() (snake train: --loss-scale dynamic; "
            "with alpha=1.0: it skips such steps and lowers the scale, as torch.amp.GradScaler does) or a "
            "smaller static loss_scale, and resume from your last checkpoint"
        )


class ActorFailed(SnakeError, RuntimeError):
    """An actor of the runtime raised. `__cause__` holds the original exception.

    Attributes name where it happened: the actor (`compute`, `ssd_read`, `optimizer[1]`),
    and when known the iteration, layer and micro-batch it was working on."""

    def __init__(
        self,
        actor: str,
        cause: BaseException,
        *,
        iteration: int | None = None,
        layer: int | None = None,
        micro_batch: int | None = None,
    ) -> None:
        self.actor = actor
        self.iteration = iteration
        self.layer = layer
        self.micro_batch = micro_batch
        where = ", ".join(
            f"{k}={v}"
            for k, v in (("iteration", iteration), ("layer", layer), ("micro_batch", micro_batch))
            if v is not None
        )
        super().__init__(
            f"actor {actor!r} failed{' at ' + where if where else ''}: "
            f"{type(cause).__name__}: {cause}"
        )


def release_frames(exc: BaseException) -> None:
    """Clear the local variables of snake's own frames in `exc`'s traceback, and in those of
    its cause, its context and an exception group's members, all the way down. A caller that
    keeps the exception (a service's record of a failed or cancelled job, a done task,
    gather(return_exceptions=True)) kept a closed trainer's engine, stores and buffers alive
    through them: +75 MiB per job of a 3.2 M-parameter GPT (an audit, round 38). The
    tracebacks keep their lines; frames still running (the raising one) and the user's own
    frames are left as they are."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # snake's and planner's parent
    ours = tuple(os.path.join(root, name) + os.sep for name in ("snake", "planner"))
    for frame in traceback_frames(exc):
        if frame.f_code.co_filename.startswith(ours):
            with contextlib.suppress(RuntimeError):  # a frame still running
                frame.clear()


def traceback_frames(exc: BaseException) -> Iterator[FrameType]:
    """The frames of `exc`'s traceback and of those of its cause, its context and an
    exception group's members, all the way down (each exception once)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            yield tb.tb_frame
            tb = tb.tb_next
        todo += [e.__cause__, e.__context__]
        if isinstance(e, BaseExceptionGroup):
            todo += list(e.exceptions)
