"""`snake train`'s signals: a first SIGINT or SIGTERM stops the run after the steps in flight
(and saves), a second one at once; before the run starts either ends the setup cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


class _Interrupted(Exception):
    """SIGINT or SIGTERM stopped `snake train`: its run stopped after the steps in flight
    (their checkpoint saved, where --checkpoint is given), or was cancelled (a second
    signal, or one while it set up, evaluated or saved) and the trainer closed."""

    def __init__(self, signum: int, steps: int, saved: tuple[str, int] | None = None) -> None:
        kept = (f"; the checkpoint in {saved[0]} holds step {saved[1]} (--resume {saved[0]} to go on)"
                if saved else "")
        super().__init__(f"interrupted ({signal.Signals(signum).name}) after {steps} steps{kept}")
        self.signum = signum


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Signals:
    """SIGINT and SIGTERM while `snake train` runs. The first asks the run in progress to
    stop after the steps in flight (`graceful`, where one is set and says it will: the run
    then ends as it would, keeping what it trained); else, or at a second signal, the task
    is cancelled, once: a later signal is ignored, so the trainer's cleanup is not cut
    short. `caught`: the signals caught."""

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.caught: list[int] = []
        self.graceful: Callable[[], bool] | None = None
        self._task = task
        self._cancelled = False

    def on_signal(self, signum: int) -> None:
        self.caught.append(signum)
        if len(self.caught) == 1 and self.graceful is not None and self.graceful():
            print(f"\nsnake train: {signal.Signals(signum).name}: stopping after the steps in flight "
                  f"(again to stop at once)", file=sys.stderr)
            return
        if not self._cancelled:
            self._cancelled = True
            self._task.cancel()


@contextlib.contextmanager
def _signals_cancel_this_task() -> Iterator[_Signals]:
    """While inside, SIGINT and SIGTERM go to a `_Signals` of the running task (yielded).
    The handlers before are put back at the end (off the main thread, or where the loop has
    no signal handlers, the signals keep them throughout)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    signals = _Signals(task)
    before: dict[signal.Signals, Any] = {}
    try:
        for signum in _STOP_SIGNALS:
            handler = signal.getsignal(signum)
            try:
                loop.add_signal_handler(signum, signals.on_signal, signum)
            except (NotImplementedError, RuntimeError, ValueError):
                continue
            before[signum] = handler
        yield signals
    finally:
        for signum, handler in before.items():
            loop.remove_signal_handler(signum)
            if handler is not None:  # None: set outside Python; the removal leaves the default
                signal.signal(signum, handler)


class _StoppedBySignal(Exception):
    """The run stopped after the steps in flight, as a signal asked (`_Signals.graceful`)."""


def _interrupt_setup(signum: int, frame: Any) -> None:
    raise _Interrupted(signum, 0)
