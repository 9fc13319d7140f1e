"""`Epochs`: a loader's epochs one after another, as the one stream of batches a trainer's
`data` is, with a state a checkpoint keeps where the loader has one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader

from snake.errors import ConfigError, DataError


class Epochs:
    """`loader`'s epochs one after another (`epochs` of them; None: without end), as one
    stream: `SnakeTrainer(model, data=Epochs(loader, 3), config=...)`, where
    `(b for _ in range(3) for b in loader)` would do but for a resume.

    Each epoch's shuffle depends only on `seed` and the epoch, as DistributedSampler's
    does: before each pass over the loader, the generators that shuffle it (the loader's
    `generator=`, its sampler's and its batch sampler's sampler's) are seeded with
    `seed + epoch` (modulo 2**64; `seed`: default, the loader's generator's, else its
    sampler's, as given; where none has a `generator`, nothing is seeded and `seed` is
    None: a seed given then is refused), and a sampler's `set_epoch(epoch)` is called where
    it has one (DistributedSampler). Not promised: the order of a resume over a sampler of
    your own whose generator has another name (nothing reseeds it), or whose `__iter__`
    draws its permutation as it is called rather than as a generator function
    (torchdata 0.11's restore calls it twice). An epoch in which
    the loader gives no batch is a DataError (an empty loader would loop for ever), as is
    a DataLoader whose epochs end with a short batch (drop_last=False), at once.

    Over a loader with `state_dict()` and `load_state_dict()` (torchdata's
    StatefulDataLoader) it has them too (it is then a `StatefulEpochs`): its state is the
    epoch and the loader's state in it, so that a checkpoint's `load()` resumes at the
    batch after the last one trained on, in the same epoch and shuffle order, instead of
    reading and dropping the batches trained before (the seed is part of the state).
    (With a loader of torch's own, the
    batches it gives after a load are the loader's restore: torchdata 0.11's gives those
    of an uninterrupted run, with or without worker processes, which the seeding above
    makes hold past the epoch's end too: `tests/test_data_state.py`.)"""

    def __new__(cls, loader: Any, epochs: int | None = None, *, seed: int | None = None) -> Epochs:
        if cls is Epochs and callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None)
        ):
            cls = StatefulEpochs
        return super().__new__(cls)

    def __init__(self, loader: Any, epochs: int | None = None, *, seed: int | None = None) -> None:
        if isinstance(loader, Epochs):
            raise DataError("Epochs(loader): the loader is an Epochs already (its epochs would run out after the first "
                            "pass): give the loader itself, Epochs(loader, n * m)")
        if not hasattr(loader, "__iter__") or hasattr(loader, "__next__"):
            raise DataError(
                f"Epochs(loader): expected a loader that gives a new pass over its data at each iter() (a "
                f"DataLoader, a list), got {type(loader).__name__}, an iterator that gives one pass only"
            )
        if epochs is not None and (not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1):
            raise ConfigError("Epochs(epochs=...)", epochs, "must be an integer >= 1, or None: without end")
        if seed is not None and not _is_seed(seed):
            raise ConfigError("Epochs(seed=...)", seed, "must be an integer in [0, 2**64), or None: the loader's "
                              "generator's")
        short = _short_last_batch(loader)
        if short is not None:
            rows, size = short
            raise DataError(
                f"Epochs(loader): each epoch would end with a batch of {rows} rows where the others have {size} (its "
                f"sampler's length is not a multiple of batch_size={size}); snake keeps the batch shape fixed: pass "
                "drop_last=True to the DataLoader (or to the BatchSampler you gave it)"
            )
        self.loader = loader
        self.epochs = epochs
        self.epoch = 0  # the epoch being read
        self._generators = _shufflers(loader)
        if seed is not None and not self._generators:
            raise ConfigError(
                "Epochs(seed=...)", seed,
                "has no generator to seed: the loader shuffles with none Epochs finds (the loader's `generator=`, "
                "its sampler's or its batch sampler's sampler's `.generator`)",
                "give the loader (or your sampler) a torch.Generator as `generator`, or leave seed out",
            )
        self.seed = seed if seed is not None or not self._generators else self._generators[0].initial_seed()
        self._resumed = False  # a load_state_dict came: the next pass finishes its epoch, and may give nothing

    def __iter__(self) -> Iterator[Any]:
        while self.epochs is None or self.epoch < self.epochs:
            resumed, self._resumed = self._resumed, False
            self._start_epoch()
            gave = False
            for batch in self.loader:
                gave = True
                yield batch
            if not gave and not resumed:
                raise DataError(f"Epochs: the loader gave no batch in epoch {self.epoch}: is it empty (a dataset "
                                "shorter than one batch with drop_last=True)?")
            self.epoch += 1

    def _start_epoch(self) -> None:
        if self.seed is not None:
            for g in self._generators:
                g.manual_seed((self.seed + self.epoch) % 2**64)  # torch's seeds are 64-bit
        for s in _samplers(self.loader):
            if callable(getattr(s, "set_epoch", None)):
                s.set_epoch(self.epoch)


class StatefulEpochs(Epochs):
    """`Epochs` over a loader with a state (`Epochs` makes one where the loader has
    `state_dict()` and `load_state_dict()`)."""

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "seed": self.seed, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The epoch, seed and the loader's state of `state_dict()`; DataError (and nothing
        changed) where `state` is not one, or the loader refuses its part. The next pass
        seeds the epoch's generators as that run did, before the loader's restore draws."""
        epoch = state.get("epoch") if isinstance(state, dict) else None
        seed = state.get("seed") if isinstance(state, dict) else None
        if not (isinstance(state, dict) and "loader" in state and isinstance(epoch, int) and not isinstance(epoch, bool)
                and epoch >= 0 and (seed is None or _is_seed(seed))):
            shown = repr(state) if len(repr(state)) < 200 else type(state).__name__
            raise DataError("Epochs.load_state_dict: expected {'epoch': an integer >= 0, 'seed': an integer in "
                            f"[0, 2**64) or None, 'loader': the loader's state}}, got {shown}")
        try:
            self.loader.load_state_dict(state["loader"])
        except Exception as exc:
            line = next(iter(str(exc).splitlines()), "")
            raise DataError(f"Epochs.load_state_dict: the loader's load_state_dict raised {type(exc).__name__}: "
                            f"{line}") from exc
        # the seed the state's run shuffled with (a sampler that seeds itself from torch's
        # global generator has another one in each process)
        self.epoch, self.seed = epoch, seed
        self._resumed = True


def _is_seed(seed: object) -> bool:
    return isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**64


def _short_last_batch(loader: Any) -> tuple[int, int] | None:
    """(rows, batch_size) of the short batch that ends each epoch of a DataLoader (its
    BatchSampler, drop_last=False, over a sampler whose length is not a multiple of
    batch_size), else None."""
    batches = getattr(loader, "batch_sampler", None)
    if not isinstance(loader, DataLoader) or not isinstance(batches, BatchSampler) or batches.drop_last:
        return None
    try:
        rows = len(batches.sampler)  # type: ignore[arg-type]
    except TypeError:  # a sampler without a length
        return None
    return (rows % batches.batch_size, batches.batch_size) if rows % batches.batch_size else None


def _samplers(loader: Any) -> list[Any]:
    """The loader's sampler, batch sampler and the batch sampler's sampler (those it has)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    found = [getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)]
    out: list[Any] = []
    for s in found:
        if s is not None and all(s is not o for o in out):
            out.append(s)
    return out


def _shufflers(loader: Any) -> list[torch.Generator]:
    """The torch generators that shuffle `loader`: its own `generator` and its samplers'
    (not torch's global one, given as one of them: that is the process's to seed)."""
    out: list[torch.Generator] = []
    for owner in [loader, *_samplers(loader)]:
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and g is not torch.default_generator and all(g is not o for o in out):
            out.append(g)
    return out
