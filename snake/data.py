"""Batches from the user's `data`: any iterable or async iterable of (inputs, targets).
A global batch is split into `micro_batches` along dim 0."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import sys
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset

from snake import data_state
from snake.blocking import retrieved
from snake.data_state import Snapshot
from snake.epochs import Epochs
from snake.errors import DataError, DataExhausted, traceback_frames

_END = object()
# snapshots of a stateful source's state kept below the batches handed out: a run hands back
# at most the few it read ahead of the steps it trained
_KEEP_STATES = 8


@dataclass(frozen=True, slots=True)
class _Interrupt:
    """A KeyboardInterrupt or SystemExit an async iterator's `__anext__` raised: returned by
    its task, since asyncio lets one raised in a task out of the event loop at once, before
    the trainer has stopped (`run()` raises it once, after)."""

    exc: BaseException


async def _anext(aiter: AsyncIterator[Any], state_of: Callable[[], Any] | None, unhooked: bool = False) -> Any:
    """(item or _END, its snapshot), or an _Interrupt. `unhooked`: an async generator's
    first iteration, kept from this loop's async-generator hooks (`DataSource.home`)."""
    before = torch.is_inference_mode_enabled()
    try:
        if unhooked:
            hooks = sys.get_asyncgen_hooks()
            sys.set_asyncgen_hooks(firstiter=None, finalizer=None)
            try:
                step = anext(aiter, _END)  # the generator's first __anext__ calls the hook, if any
            finally:
                sys.set_asyncgen_hooks(*hooks)
        else:
            step = anext(aiter, _END)
        item = await step
    except (KeyboardInterrupt, SystemExit) as e:
        return _Interrupt(e)
    _check_mode_left(before)
    return item, _snapshot(item, state_of)


def _next_with_state(
    it: Iterator[Any], lock: threading.Lock | None, drew: list[bool] | None, state_of: Callable[[], Any] | None
) -> tuple[Any, Snapshot | DataError | None]:
    """(`_next_item`, the source's state after it), on the data thread."""
    item = _next_item(it, lock, drew)
    return item, _snapshot(item, state_of)


def _snapshot(item: Any, state_of: Callable[[], Any] | None) -> Snapshot | DataError | None:
    """A stateful source's state right after it gave `item` (None: no state, or no item);
    the DataError its state_dict() gave, to raise once the item is kept (none is lost)."""
    if item is _END or state_of is None:
        return None
    try:
        return data_state.take(state_of)
    except DataError as exc:
        return exc


def _check_mode_left(before: bool) -> None:
    """DataError where the user's next() returned with torch.inference_mode turned on in the
    thread that called it (snake's data thread, or the event loop's for an async iterator):
    a generator that yields inside `with torch.inference_mode():` leaves it on there while it
    is suspended (the mode is the thread's, not the generator's), and the engine built
    on that thread, or the tensors made on the loop, were inference tensors: the run failed
    deep inside, in-place updates or autograd refused. (In a plain loop the training step
    would run in inference mode too, and fail.)"""
    if torch.is_inference_mode_enabled() and not before:
        raise DataError(
            "data: the iterator's next() returned with torch.inference_mode on: it yields inside a `with "
            "torch.inference_mode():` block, which stays on in the thread that reads it (a plain training loop "
            "would then run its step in inference mode too); make each batch inside the block and yield it "
            "after the block"
        )


def _next_item(it: Iterator[Any], lock: threading.Lock | None = None, drew: list[bool] | None = None) -> Any:
    """`next(it)` (on the data thread), or _END. A DataLoader iterator's error holds no
    reference to it: the frames of its own methods in the traceback (whose `self` it is)
    have their locals cleared, their lines kept. A service that keeps a failed job's
    exception kept the iterator through them, and with it the DataLoader's worker
    processes. (The frames of other iterators, which may be the user's code, are left as
    they are, as `snake.errors.release_frames` leaves them.) `lock`: held throughout
    (`DataSource.rng_lock`). `drew`: appended to, whether the call drew from torch's global
    CPU generator (its state changed; alone in the process: nothing else may use it)."""
    before = torch.is_inference_mode_enabled()
    state = torch.default_generator.get_state() if drew is not None else None
    try:
        if lock is None:
            item = next(it, _END)
        else:  # out of the compute thread's seeded stretches of the global generator
            with lock:
                item = next(it, _END)
        if state is not None and drew is not None:
            drew.append(not torch.equal(state, torch.default_generator.get_state()))
    except BaseException as exc:
        if type(it).__module__ == "torch.utils.data.dataloader":
            _drop_frames_holding(exc, it)
        del it
        raise
    _check_mode_left(before)
    return item


def _drop_frames_holding(exc: BaseException, obj: object) -> None:
    """Clear the frames in `exc`'s traceback (and its cause's and context's) that hold `obj`."""
    for frame in traceback_frames(exc):
        # its referents, not f_locals, which would keep a snapshot of them in the frame
        if any(v is obj for v in gc.get_referents(frame)):
            with contextlib.suppress(RuntimeError):  # a frame still running (_next_item's own)
                frame.clear()


class DataSource:
    """One iterator over `data`, kept across `run()` calls. Sync iterators are advanced on
    an executor thread (a DataLoader may block); async ones on the loop.

    A cancellation does not wait for a sync iterator's `next()` (the user's code, which may
    block for long: a stuck loader, a queue): the call goes on on its thread, and the batch
    it returns is the one the next `next()` hands out, so none is skipped. An async one's
    `__anext__` goes on as a task of its own likewise (a cancellation thrown into an async
    generator would end it for good).

    A stateful source (`state_dict()` and `load_state_dict()`: torchdata's
    StatefulDataLoader, `snake.Epochs` over one) has its state taken after each batch, on
    the thread that read it (`snake.data_state`): `state()` is the one after the last batch
    handed out and not handed back, which a checkpoint stores, and `restore` puts new data
    there (`load()`), where a stateless one reads and drops the batches trained before."""

    def __init__(self, data: Any) -> None:
        check_container(data, "data")
        # a list or tuple, or a DataLoader of a map-style dataset, says how many batches it
        # has: run() checks there are enough (seen before the iterator is made: a
        # StatefulDataLoader's loaded state goes to its iterator)
        self._len, self._short_last = _known_length(data)
        if hasattr(data, "__aiter__"):
            self._aiter: AsyncIterator[Any] | None = data.__aiter__()
            self._iter: Iterator[Any] | None = None
        elif hasattr(data, "__iter__"):
            self._aiter = None
            self._iter = iter(data)
        else:
            if isinstance(data, Dataset):  # map-style: indexed, not iterated
                fix = "; a Dataset of rows is batched by a DataLoader: data=DataLoader(dataset, batch_size=..., drop_last=True)"
            elif callable(data):
                fix = f"; pass what calling it gives: data={getattr(data, '__name__', 'f')}()"
            else:
                fix = ""
            raise DataError(
                f"data: expected an iterable or async iterable of (inputs, targets), got {type(data).__name__}{fix}"
            )
        self._peeked: list[tuple[Any, Snapshot | None]] = []  # handed back: (item, its snapshot)
        self._data: Any = data
        # an async generator is registered with the event loop that first iterates it, which
        # closes it as that loop ends (asyncio.run): one first read outside the runs' loop (a
        # load() or evaluate() in an asyncio.run() of its own) is read unhooked there, and
        # registered with the runs' loop once one starts (`home`)
        self._home: asyncio.AbstractEventLoop | None = None
        self._unhooked: AsyncIterator[Any] | None = None  # first iterated unhooked, not registered yet
        self._read_any = False  # an item asked of the async iterator
        state_of, load_state = getattr(data, "state_dict", None), getattr(data, "load_state_dict", None)
        stateful = callable(state_of) and callable(load_state)
        self._state_of: Callable[[], Any] | None = state_of if stateful else None
        self._load_state: Callable[[Any], Any] | None = load_state if stateful else None
        # the state after each batch handed out, by how many were then (none before the
        # first: a save then needs none, and a StatefulDataLoader's state_dict() would start
        # its iterator, worker processes and all, on the thread that makes the trainer)
        self._states: dict[int, Snapshot | None] = {}
        self._restoring: Future[Any] | None = None  # `restore`'s load_state_dict, on the data thread
        # batches counted in `consumed` that this data never gave (load(skip_data=False): it
        # starts after them): its own state is then not the position the count says
        self.skipped = 0
        self._pending: asyncio.Future[Any] | None = None  # a next() a cancellation left running
        self._call: Future[Any] | None = None  # that next() on its thread: done as it returns
        self.consumed = 0  # global batches handed out
        self._taken = 0  # items taken from the iterator (load(skip_data=False) does not count)
        # on a CPU device the engine's `Kernels.rng_lock`: a sync next() of a source that
        # draws from torch's global generator (`draws_rng`) holds it, so that its draws never
        # fall in the compute thread's seeded stretches of it (an async source's run on the
        # loop: not covered). Whether it draws is seen at the first batch (`peek`), read
        # before anything else runs; a source that does not draws without the lock, so that
        # a slow or blocked one does not hold the compute thread up
        self.rng_lock: threading.Lock | None = None
        self.draws_rng = False

    async def next(self, executor: Executor, drew: list[bool] | None = None) -> Any:
        if self._peeked:
            item, snap = self._peeked.pop()
        else:
            pending = self._pending
            if pending is not None and pending.get_loop() is not asyncio.get_running_loop():
                pending = self._adopt(pending)
            if pending is None and self._aiter is not None:
                pending = self._pending = asyncio.ensure_future(_anext(self._aiter, self._state_of, self._unhook()))
                pending.add_done_callback(retrieved)  # its error, where no run awaits it any more
            elif pending is None:
                assert self._iter is not None
                lock = self.rng_lock if self.draws_rng else None
                self._call = executor.submit(_next_with_state, self._iter, lock, drew, self._state_of)
                pending = self._pending = asyncio.wrap_future(self._call)
            try:
                got = await asyncio.shield(pending)
            except BaseException:
                if pending.done() and (pending.cancelled() or pending.exception() is not None):
                    self._pending = None  # it failed: nothing to hand out later
                raise  # else it runs on, or holds a batch: the next call hands that out
            self._pending = None
            if isinstance(got, _Interrupt):
                raise got.exc  # here, in the data actor's task, which carries it to run()
            item, snap = got
            self._taken += item is not _END  # (the end is no item: left() stays 0 after it)
            if isinstance(snap, DataError):  # its state_dict() failed: the item comes next time
                self._peeked.append((item, None))
                raise snap
        if item is _END:
            raise DataExhausted(f"data: ran out after {self.consumed} global batches" + (
                " (it gave none: an iterator that was read to its end before, a generator another loop or "
                "trainer used up, gives no more)" if self.consumed == 0 else "")
                + f"; give more batches (or an endless iterator{_EPOCHS}) or run fewer steps")
        self.consumed += 1
        if self._state_of is not None:
            self._states[self.consumed] = snap
            for k in [k for k in self._states if k < self.consumed - _KEEP_STATES]:
                del self._states[k]
        return item

    def home(self) -> None:
        """This loop is the runs' (the trainer's first `run()` is in it): an async generator
        read unhooked before (`_unhook`) is registered with it now, so that it is closed as
        this loop ends, as one first read here would be."""
        self._home = asyncio.get_running_loop()
        agen, self._unhooked = self._unhooked, None
        firstiter = sys.get_asyncgen_hooks().firstiter
        if agen is not None and firstiter is not None:
            firstiter(agen)  # type: ignore[arg-type]

    def _unhook(self) -> bool:
        """Read an async generator's first item unhooked (outside the runs' loop: the loop
        of a load() or evaluate() before the first run, which may be an asyncio.run() of its
        own and close it as it ends)?"""
        if self._read_any:
            return False
        self._read_any = True
        if not inspect.isasyncgen(self._aiter) or self._home is asyncio.get_running_loop():
            return False
        self._unhooked = self._aiter
        return True

    def _adopt(self, pending: asyncio.Future[Any]) -> asyncio.Future[Any]:
        """A next() a cancellation left running in another event loop (a first run() timed
        out in one asyncio.run(), tried again in the next): a sync iterator's is awaited here
        through its thread's own future (awaiting the other loop's copy failed, "attached to
        a different loop", and closed the trainer); an async one's `__anext__` runs in that
        loop, where its batch stays."""
        if self._call is None:
            raise DataError(
                "data: the async iterator's __anext__ that a cancelled call left running belongs to another event "
                "loop; call the trainer from one loop (one asyncio.run() around its calls), or give a sync iterable"
            )
        self._pending = asyncio.wrap_future(self._call)
        return self._pending

    async def close(self, grace: float) -> None:
        """Drop the iterator (the trainer is closed): a DataLoader's worker processes, which
        its iterator owns, end with it. The data it came from is the user's, left as it is.
        Also dropped: the last next()'s future, whose error's traceback holds the iterator
        (a DataLoader whose worker raised kept its workers after close()), and an async
        iterator's `__anext__` a cancellation left running, cancelled and given `grace`
        seconds to end (its generator's `finally` runs now; left pending, the task held the
        generator until the loop closed, or was collected with it: "Task was destroyed but
        it is pending!")."""
        pending, self._pending, self._call = self._pending, None, None
        unhooked, self._unhooked = self._unhooked, None
        self._iter = self._aiter = None
        self._data = self._state_of = self._load_state = self._restoring = None
        self._peeked.clear()
        self._states.clear()
        if not isinstance(pending, asyncio.Task) or pending.done():
            if inspect.isasyncgen(unhooked) and unhooked.ag_frame is not None and not unhooked.ag_running:
                # an async generator no loop closes (read unhooked, no run since): its
                # `finally` runs now, as the loop that first read it would have run it
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(unhooked.aclose(), grace)
            return
        home = pending.get_loop()
        if home is not asyncio.get_running_loop():  # close() from another loop: cancelled in its own
            with contextlib.suppress(RuntimeError):  # that loop is closed: the task never runs again
                home.call_soon_threadsafe(pending.cancel)
            return
        pending.cancel()
        await asyncio.wait([pending], timeout=grace)

    def unread(self, item: Any) -> None:
        """Hand `item` out again first (a batch a run read but stopped before training on:
        items handed back in the reverse of their order come out in it)."""
        self._peeked.append((item, self._states.pop(self.consumed, None)))
        self.consumed -= 1

    @property
    def stateful(self) -> bool:
        """Has the data `state_dict()` and `load_state_dict()`?"""
        return self._state_of is not None

    def state(self) -> Snapshot | None:
        """A stateful source's state after the last batch handed out and not handed back
        (between runs: the last one trained on); None where the data has no state, where
        no batch was (the start needs none), where that state is not known (its
        state_dict() failed there), or where the count includes batches the data never
        gave (`skipped`)."""
        return None if self.skipped else self._states.get(self.consumed)

    def state_lost(self) -> bool:
        """Is a stateful source's state after its last batch unknown for want of a
        snapshot (its state_dict() failed there), not by design (`state`)?"""
        return self.stateful and self.consumed > 0 and not self.skipped and self._states.get(self.consumed) is None

    async def restore(self, snap: Snapshot, consumed: int, executor: Executor) -> None:
        """Put a stateful source where `snap` says (its `load_state_dict`, then a new
        iterator of it, on `executor`: the user's code) and count `consumed` batches handed
        out, as a checkpoint's load does before anything reads it. DataError where the data
        refuses the state."""
        assert self._load_state is not None and not self.consumed and self._pending is None
        data, load_state, state = self._data, self._load_state, data_state.restore(snap)

        def load() -> Iterator[Any] | None:
            try:
                load_state(state)
            except Exception as exc:
                line = next(iter(str(exc).splitlines()), "")
                raise DataError(
                    f"load: data.load_state_dict() raised {type(exc).__name__}: {line}; the checkpoint's data state "
                    "does not fit this data: give the data (of the same kind and settings) the checkpoint was trained "
                    "on, or load(..., skip_data=False) with data that starts after the batches it trained on"
                ) from exc
            return None if self._aiter is not None else iter(data)

        self._restoring = executor.submit(load)
        it = await asyncio.wrap_future(self._restoring)
        self._restoring = None
        if self._aiter is not None:
            self._aiter = data.__aiter__()
        else:
            self._iter = it
        self._peeked.clear()
        self._states = {consumed: snap}
        self.consumed = consumed
        self._len = self._short_last = None  # its position is its own now
        self._taken = 0

    @property
    def is_async(self) -> bool:
        return self._aiter is not None

    def left(self) -> int | None:
        """Batches still to come from a list or tuple or a DataLoader of a map-style dataset
        (None: the data does not say)."""
        return None if self._len is None else self._len - self._taken + len(self._peeked)

    def check_enough(self, steps: int) -> None:
        """DataError, before a run(steps) trains, where the data says it has fewer batches
        (else the run would train that far and stop there, short of what was asked; a
        DataExhausted where it has none left), or
        where the run would reach a DataLoader's last batch, which is short (snake keeps a
        batch's shape fixed: that batch would fail the run at the end of the epoch)."""
        left = self.left()
        if left is None:
            return
        if left < steps:
            # none left: the data's end, as where a run finds it (DataExhausted); some: too short
            raise (DataExhausted if left <= 0 else DataError)(
                f"data: run({steps}) needs {steps} more global batches but the data has {max(left, 0)} left; "
                f"give more batches (or an endless iterator{_EPOCHS}) or run fewer steps"
            )
        if self._short_last is not None and left == steps and self._len is not None and self._len > 1:
            rows, size = self._short_last
            raise DataError(
                f"data: run({steps}) would reach the DataLoader's last batch, which has {rows} rows where the others "
                f"have {size} (its sampler's length is not a multiple of batch_size={size}); snake keeps the "
                "batch shape fixed: pass drop_last=True to the DataLoader (or to the BatchSampler you gave it), or run "
                "fewer steps"
            )

    def fetching(self) -> bool:
        """Is a sync iterator's next() still running on the data thread (left by a
        cancellation)?"""
        # the thread's own future, not the loop's copy, which is marked done only when the
        # loop next runs its callbacks (also: a `restore`'s load_state_dict a cancelled
        # load() left running)
        if self._restoring is not None and not self._restoring.done():
            return True
        return self._pending is not None and self._call is not None and not self._call.done()

    def thread_call(self) -> Future[Any] | None:
        """The next() (or load_state_dict) running on the data thread (`fetching`), else None."""
        if self._restoring is not None and not self._restoring.done():
            return self._restoring
        return self._call if self.fetching() else None

    async def settle(self, grace: float) -> bool:
        """Wait up to `grace` seconds for a next() a cancellation left running; True if none
        runs now. A quick iterator (a list) has returned by then and its thread can be
        joined; a stuck one is left to end on its own."""
        pending = self._pending
        if pending is not None and self.fetching():
            await asyncio.wait([pending], timeout=grace)
        return not self.fetching()

    async def peek(self, executor: Executor, where: str) -> Any:
        """The next batch, handed out again by the next `next()`. Called first before
        anything else runs (the trainer's build, `run(data=...)`): it also sees whether the
        data draws from torch's global generator (`draws_rng`). An exception its next()
        raises is a DataError (`next_raised`, `where`: which batch this is)."""
        drew: list[bool] = []
        # an async source's first __anext__ runs on this loop: its draws are seen from here
        # (the generator's state as bytes: no kernel runs on the loop's thread)
        state = _rng_bytes() if self._aiter is not None and not self._peeked else None
        try:
            item = await self.next(executor, drew)
        except DataError:
            raise
        except Exception as exc:
            raise next_raised(exc, where) from exc
        if state is not None:
            drew.append(state != _rng_bytes())
        self.draws_rng = self.draws_rng or any(drew)
        self.unread(item)
        return item


def next_raised(exc: BaseException, where: str) -> DataError:
    """The DataError for an exception the data's next() raised (`where`: which batch): its
    first line (a DataLoader worker's has the worker's traceback after it; the whole of it
    is the `__cause__` the caller chains)."""
    line = next(iter(str(exc).splitlines()), "")
    return DataError(f"data: its next() raised {type(exc).__name__}: {line} ({where})")


_EPOCHS = ": several epochs of a DataLoader or a list are `snake.Epochs(loader, epochs)`"


def _rng_bytes() -> bytes:
    """torch's global CPU generator's state."""
    return bytes(torch.default_generator.get_state().numpy())


class AsyncDataRandomWarning(UserWarning):
    """An async data source draws from torch's global random generator on a CPU device,
    where snake's compute thread seeds that generator around each block for dropout: its
    `__anext__` runs on the event loop, which cannot take turns with those stretches as a
    sync source's next() does, so its batches depend on timing and a draw can move a
    forward's dropout mask from its recompute's. Give it a `torch.Generator` of its own."""


def check_async_draws(source: DataSource, device: torch.device) -> None:
    """AsyncDataRandomWarning where it applies (after the first batch, `DataSource.peek`)."""
    if device.type == "cpu" and source.is_async and source.draws_rng:
        warnings.warn(
            "snake: the async data source draws from torch's global random generator, which the compute thread "
            "seeds around each block for dropout on a CPU device, and an async source cannot take turns with it: "
            "its batches depend on timing; give it a generator of its own (torch.randint(..., generator=g), "
            "DataLoader(..., generator=g))",
            AsyncDataRandomWarning, stacklevel=3,
        )


def _known_length(data: Any) -> tuple[int | None, tuple[int, int] | None]:
    """How many batches `data` gives where it says so (a list or tuple; a DataLoader of a
    map-style dataset with torch's samplers, whose len() is exact; `Epochs` of either, a
    number of epochs from the first), and (rows, batch_size)
    of a DataLoader's short last batch (drop_last=False over a sampler whose length is not
    a multiple of batch_size), else (None, None)."""
    if isinstance(data, Sequence):
        return len(data), None
    if isinstance(data, Epochs):  # a number of whole epochs, from the first (no short batch: Epochs refuses one)
        if data.epochs is None or data.epoch:
            return None, None
        n = _known_length(data.loader)[0]
        return (None if n is None else n * data.epochs), None
    if not isinstance(data, DataLoader) or isinstance(data.dataset, IterableDataset):
        return None, None  # an IterableDataset's len(), where it has one, is the user's estimate
    # torchdata's StatefulDataLoader: one pass of len() batches, as a DataLoader, unless its
    # state was loaded (its next pass starts where that state left it)
    stateful = (type(data).__name__, type(data).__module__) == _STATEFUL_LOADER
    if stateful and getattr(data, "next_iter_state", None) is not None:
        return None, None
    if not stateful and (type(data).__iter__ is not DataLoader.__iter__ or type(data).__len__ is not DataLoader.__len__):
        return None, None  # a subclass's own (one that cycles its epochs forever goes past len())
    ours = ("torch.utils.data", _STATEFUL_SAMPLERS) if stateful else ("torch.utils.data",)
    samplers = (data.sampler, data.batch_sampler, getattr(data.batch_sampler, "sampler", None))
    if not all(type(s).__module__.startswith(ours) for s in samplers if s is not None):
        return None, None  # a sampler of the user's may go on past its len() (an endless one)
    batches: Any = data.batch_sampler  # torch's BatchSampler: given, or made of batch_size and drop_last
    plain = type(batches) is BatchSampler or (stateful and isinstance(batches, BatchSampler))
    try:
        n = len(data)
        samples = len(batches.sampler) if plain else None
    except TypeError:  # a sampler without a length
        return None, None
    short = None
    if samples is not None and not batches.drop_last and samples % batches.batch_size:
        short = (samples % batches.batch_size, batches.batch_size)
    return n, short


_STATEFUL_LOADER = ("StatefulDataLoader", "torchdata.stateful_dataloader.stateful_dataloader")
_STATEFUL_SAMPLERS = "torchdata.stateful_dataloader.sampler"


def check_container(data: Any, what: str) -> None:
    """DataError for an iterable that is one batch or a text rather than batches (a dict
    iterates its keys, a tensor its rows, a str its characters), said of `data` itself."""
    if isinstance(data, Mapping | torch.Tensor | str | bytes | bytearray):
        raise DataError(
            f"{what}: expected an iterable or async iterable of (inputs, targets) batches, got a "
            f"{type(data).__name__}; for one batch pass [(inputs, targets)]"
        )


IGNORE_INDEX = -100  # a target that is not trained on (Hugging Face's and F.cross_entropy's convention)


@dataclass(frozen=True, slots=True)
class Vocab:
    """The token-id ranges batches are checked against: [0, inputs) for inputs (the
    embedding's rows) and [0, targets) for targets (the head's logits). None: unknown, not
    checked (targets then only >= 0)."""

    inputs: int | None = None
    targets: int | None = None


HF_KEYS = ("input_ids", "labels", "attention_mask")


def pair_of(item: Any) -> tuple[Any, Any]:
    """(inputs, targets) of one batch: a pair as it is, or a Hugging Face batch (a mapping of
    `HF_KEYS`, as a DataCollatorForLanguageModeling(mlm=False) makes) as the pair its causal
    LM loss trains on: the input_ids, and the labels shifted one to the left (the label of
    the token after each; the last position's -100), the padding's labels -100 where there
    are none. Its loss, the mean over the global batch's labels that are not -100, is then
    the model's own (`model(**batch).loss` over the whole global batch). Snake feeds the
    model no attention mask: the same for padding on the right, which causal attention
    never lets a real token see; padding on the left is refused."""
    if isinstance(item, Mapping):
        return _hf_pair(item)
    if not isinstance(item, tuple | list) or len(item) != 2:
        raise DataError(
            f"data: each batch must be a pair (inputs, targets) or a mapping with input_ids (and labels, "
            f"attention_mask) as Hugging Face's collators give, got {type(item).__name__}"
            + (": token ids alone may be given as {'input_ids': ids} (trained on the next token of each, as "
               "Hugging Face's causal LM loss does), and one batch as data=[(inputs, targets)]"
               if isinstance(item, torch.Tensor) else "")
        )
    return item[0], item[1]


def _hf_pair(batch: Mapping[Any, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    keys = [str(k) for k in batch]
    extra = [k for k in keys if k not in HF_KEYS]
    if extra:
        hint = " (the tokenizer's return_token_type_ids=False leaves it out)" if extra[0] == "token_type_ids" else ""
        raise DataError(
            f"data: a batch's {extra[0]!r} is not one snake gives the model: it feeds input_ids alone, at positions "
            f"0..seq-1, and trains on labels (and attention_mask's padding); leave {extra[0]!r} out of the "
            f"batch{hint}"
        )
    if "input_ids" not in batch:
        raise DataError(f"data: a batch given as a mapping needs 'input_ids' (and may have 'labels' and "
                        f"'attention_mask'), got {keys}")
    ids, labels, mask = (batch.get(k) for k in HF_KEYS)
    for name, x in (("input_ids", ids), ("labels", labels), ("attention_mask", mask)):
        if x is not None and not isinstance(x, torch.Tensor):
            raise DataError(f"data: batch[{name!r}] must be a torch.Tensor, got {type(x).__name__}{_as_tensor(x)}")
    assert isinstance(ids, torch.Tensor)
    given = {name: x for name, x in (("input_ids", ids), ("labels", labels), ("attention_mask", mask)) if x is not None}
    devices = {x.device for x in given.values()}
    meta = any(d.type == "meta" for d in devices)
    if len(devices) > 1 or meta:  # (checked before any of their values is read)
        where = ", ".join(f"{name} on {x.device}" for name, x in given.items())
        raise DataError(f"data: a batch's tensors are {where}; give them all on the CPU (or all on the training "
                        f"device){'; a meta tensor holds no values' if meta else ''}")
    if ids.dim() != 2:
        raise DataError(f"data: batch['input_ids'] must have shape (batch, seq), got {tuple(ids.shape)}")
    if ids.dtype not in (torch.long, torch.int32):
        raise DataError(f"data: batch['input_ids'] must be integer token ids (int64 or int32), got {ids.dtype}; "
                        "convert them with .long()")
    for name, x in (("labels", labels), ("attention_mask", mask)):
        if x is not None and x.shape != ids.shape:
            raise DataError(f"data: batch[{name!r}] has shape {tuple(x.shape)}, input_ids {tuple(ids.shape)}: they "
                            "must be the same")
    if labels is not None and labels.dtype != torch.long:
        raise DataError(f"data: batch['labels'] must be int64 token ids (torch.long), got {labels.dtype}; convert "
                        "them with .long()")
    if mask is not None:
        if mask.is_floating_point() or mask.is_complex() or ((mask != 0) & (mask != 1)).any():
            raise DataError("data: batch['attention_mask'] must hold 0 (padding) and 1 (a token), as integers or "
                            "bools")
        real = mask.bool()
        if (real[:, 1:] & ~real[:, :-1]).any():
            raise DataError(
                "data: batch['attention_mask'] pads on the left (a 0 before a 1 in a row); snake gives the model no "
                "mask, which is the same only for padding on the right: set tokenizer.padding_side = 'right'"
            )
        if labels is None:
            labels = ids.long().masked_fill(~real, IGNORE_INDEX)
        elif (labels[~real] != IGNORE_INDEX).any():
            raise DataError(
                "data: batch['labels'] trains on padding (labels that are not -100 where attention_mask is 0), "
                "which snake would compute without the mask; set them to -100, as DataCollatorForLanguageModeling "
                "does"
            )
    elif labels is None:
        labels = ids.long()
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return ids, torch.cat([labels[:, 1:], pad], dim=1)


def _as_tensor(x: Any) -> str:
    """How to make `x` (not a tensor) one, for a DataError."""
    if type(x).__module__ == "numpy":
        return "; convert it with torch.from_numpy(x).long()"
    if isinstance(x, list):
        return ("; convert it with torch.tensor(x) (a Hugging Face tokenizer or collator gives tensors with "
                "return_tensors='pt')")
    return ""


def split_batch(
    item: Any,
    *,
    micro_batches: int,
    device: torch.device,
    expect_shape: torch.Size | None,
    vocab: Vocab,
    no_targets_ok: bool = False,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], int, int | None]:
    """Validate one global batch and split it: (inputs per micro-batch, targets per
    micro-batch, target tokens, targets trained on where some are IGNORE_INDEX, else None).
    Raises DataError naming what is wrong. `no_targets_ok`: a batch whose every target is
    IGNORE_INDEX is taken (an evaluation's: it adds no token to the mean), not refused as a
    training step's (its loss would be 0/0)."""
    inputs, targets = pair_of(item)
    for name, x in (("inputs", inputs), ("targets", targets)):
        if not isinstance(x, torch.Tensor):
            raise DataError(f"data: batch {name} must be a torch.Tensor, got {type(x).__name__}{_as_tensor(x)}")
        if x.layout != torch.strided or x.is_nested:
            got = "a nested tensor" if x.is_nested else f"a {x.layout} tensor"
            raise DataError(f"data: batch {name} must be a dense (strided) tensor, got {got}; convert it with "
                            + ("torch.nested.to_padded_tensor" if x.is_nested else ".to_dense()"))
        if x.device.type not in ("cpu", device.type):
            raise DataError(
                f"data: batch {name} are on {x.device}; give CPU tensors (or tensors on the training device {device})"
            )
        if x.is_floating_point() and not torch.isfinite(x).all():
            raise DataError(f"data: batch {name} contains NaN or inf")
    if inputs.dtype not in (torch.long, torch.int32):
        raise DataError(
            f"data: inputs must be integer token ids (int64 or int32) of shape (batch, seq), got {inputs.dtype}; "
            "convert them with .long()"
        )
    if targets.dtype != torch.long:
        raise DataError(
            f"data: targets must be int64 token ids (torch.long) of shape (batch, seq), got {targets.dtype}; "
            "convert them with .long()"
        )
    if inputs.dim() != 2:
        raise DataError(
            f"data: batch inputs must have shape (batch, seq), got {tuple(inputs.shape)}; "
            "a single sequence needs a batch dimension: x[None]"
        )
    if targets.shape != inputs.shape:
        raise DataError(
            f"data: inputs and targets disagree in shape: {tuple(inputs.shape)} vs {tuple(targets.shape)}; "
            "targets must have the inputs' shape (batch, seq): the next token for each input token"
        )
    if inputs.numel() == 0:
        raise DataError(
            f"data: batch has 0 tokens (inputs shape {tuple(inputs.shape)}); "
            "give batches with at least one row and one token per row"
        )
    b = inputs.shape[0]
    if b % micro_batches:
        raise DataError(
            f"data: global batch size {b} is not divisible by micro_batches={micro_batches}; "
            "use a batch size that is a multiple of micro_batches"
        )
    if expect_shape is not None and inputs.shape != expect_shape:
        raise DataError(
            f"data: batch inputs have shape {tuple(inputs.shape)} but the first batch had "
            f"{tuple(expect_shape)}; snake sizes its buffers from the first batch, keep shapes fixed"
        )
    if vocab.inputs is not None:
        lo, hi = int(inputs.min()), int(inputs.max())
        if lo < 0 or hi >= vocab.inputs:
            raise DataError(f"data: token ids must be in [0, {vocab.inputs}), got min {lo}, max {hi}")
    ignored = targets == IGNORE_INDEX
    n_ignored = int(ignored.sum())
    if vocab.targets is not None:
        kept = targets[~ignored] if n_ignored else targets
        if kept.numel():
            tlo, thi = int(kept.min()), int(kept.max())
            if tlo < 0 or thi >= vocab.targets:
                raise DataError(
                    f"data: target ids must be in [0, {vocab.targets}) (the model's logits per token) or "
                    f"{IGNORE_INDEX} (not trained on), got min {tlo}, max {thi}"
                )
    elif n_ignored < targets.numel() and (lo := int(targets[~ignored].min())) < 0:
        raise DataError(f"data: target ids must be >= 0 or {IGNORE_INDEX} (not trained on), got min {lo}")
    if n_ignored == targets.numel() and not no_targets_ok:
        raise DataError(
            f"data: every target of the batch is {IGNORE_INDEX} (not trained on): its loss would be 0/0; "
            "leave such batches out"
        )
    # copies of their own (`.to` alone returns the batch's own tensors on their device): a
    # loader that refills one buffer for each batch, as a plain loop may consume it, changed
    # the batches read ahead under the steps using them (the data actor reads up to two
    # ahead; evaluate() holds a pass's targets), and those trained on other batches' tokens
    ins = tuple(c.to(device, copy=True) for c in inputs.chunk(micro_batches))
    tgs = tuple(c.to(device, copy=True) for c in targets.chunk(micro_batches))
    return ins, tgs, int(targets.numel()), (int(targets.numel()) - n_ignored if n_ignored else None)
