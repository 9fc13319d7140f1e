"""Audit of `snake.Epochs` (a loader's epochs as one stream, reseeded with seed + epoch
before each pass, stateful over a stateful loader, a length of epochs * len(loader) where
the loader's length is known) and of the checkpoint's `batch` record (a load whose data has
no batch left builds the engine from a zeros stand-in of the recorded shapes and dtypes).

Adversarial cases: users' own samplers (a generator under another name, no len), batch
samplers given as `batch_sampler=`, iterable datasets, lists of batches, explicit seeds,
seeds at the edge of torch's range, run() to the end of a number of epochs and past it, an
Epochs the user iterated first or shares between trainers, malformed states, Hugging Face
batch mappings and bfloat16 through a load at the data's end, and tampered `batch` records.

Each parity check compares fp32 masters (`trainer.state_dict()`, torch.equal) against one
uninterrupted run. Each test's docstring says what it guards; those that say what the code
did before were found failing by the audit and fixed."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

from snake import ConfigError, DataError, DataExhausted, Epochs, SnakeError, SnakeTrainer
from snake.data import _known_length
from snake.epochs import StatefulEpochs
from tests.helpers import batches, tiny_gpt
from tests.test_data_state import Rows, _cfg, _manifest, _quiet_loader, _same, _state
from tests.test_hf_batches import hf_batches as collator_batches

T = 60  # seconds: every awaited trainer call is bounded by this


# -- helpers ------------------------------------------------------------------------------------------


class NoLenShuffler(Sampler[int]):
    """A user's shuffling sampler without a length whose torch.Generator is the attribute
    `attr` (`generator`, which Epochs finds, or another name); its __iter__ a generator
    function (it draws its permutation at the first next(), as torch's RandomSampler)."""

    def __init__(self, n: int, seed: int, attr: str = "generator") -> None:
        self.n, self.attr = n, attr
        setattr(self, attr, torch.Generator().manual_seed(seed))

    def __iter__(self):
        yield from torch.randperm(self.n, generator=getattr(self, self.attr)).tolist()


class Shuffler(NoLenShuffler):
    def __len__(self) -> int:
        return self.n


class Stream(IterableDataset):
    """`n` (inputs, targets) rows of `batches`' data, as an IterableDataset; `claimed`: a
    __len__ the user gives (an estimate, not what it yields)."""

    def __init__(self, n: int = 8, claimed: int | None = None) -> None:
        self.rows = Rows(n)
        self.claimed = claimed

    def __iter__(self):
        for i in range(len(self.rows)):
            yield self.rows[i]

    def __len__(self) -> int:
        if self.claimed is None:
            raise TypeError("no len")
        return self.claimed


def _ids(batch) -> torch.Tensor:
    """The first token of each row: identifies which rows a batch holds."""
    return batch[0][:, 0].clone()


def _order(epochs) -> list[list[int]]:
    return [_ids(b).tolist() for b in epochs]


def _shuffled_loader(n: int = 12, seed: int = 3, **kw) -> DataLoader:
    return DataLoader(Rows(n), batch_size=4, drop_last=True, shuffle=True, generator=torch.Generator().manual_seed(seed),
                      **kw)


async def _run(t: SnakeTrainer, steps: int | None = None, **kw):
    return await asyncio.wait_for(t.run(steps, **kw), T)


def _rewrite(path, edit) -> None:
    m = _manifest(path)
    edit(m)
    (path / "manifest.json").write_text(json.dumps(m))


def hf_batches(n: int, rows: int = 4, seq: int = 16, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    """test_hf_batches' collator batches, in the tiny GPT's vocabulary."""
    return collator_batches(n, rows, seq, seed, vocab=96)


# -- 1. a user's own sampler ----------------------------------------------------------------------------


def test_1a_an_explicit_seed_over_a_sampler_with_a_generator_under_another_name_is_not_silently_ignored():
    """An explicit seed where Epochs finds no generator to seed (a sampler's is `rng`) is
    refused as the Epochs is made (it was taken and did nothing)."""
    def epochs(sampler_seed: int):
        return Epochs(DataLoader(Rows(12), batch_size=4, drop_last=True, sampler=Shuffler(12, sampler_seed, "rng")), 2,
                      seed=7)

    try:
        a, b = epochs(1), epochs(2)
    except (ConfigError, DataError):
        return  # refused: the seed cannot be applied (acceptable)
    assert _order(a) == _order(b), "Epochs(seed=7) did not seed the sampler's own generator, and said nothing"


def test_1b_a_sampler_without_len_is_not_refused_and_claims_no_length():
    """drop_last=False over a sampler without a length: Epochs cannot see a short batch (it
    does not refuse), and claims no length; the epochs it gives are the loader's passes."""
    loader = DataLoader(Rows(12), batch_size=4, drop_last=False, sampler=NoLenShuffler(12, 1, "rng"))
    e = Epochs(loader, 2)
    assert not isinstance(e, StatefulEpochs)
    assert e.seed is None  # no generator named `generator`: nothing seeded
    assert _known_length(e) == (None, None)
    got = list(e)
    assert len(got) == 6 and e.epoch == 2
    assert sorted(sum((_ids(b).tolist() for b in got[:3]), [])) == sorted(_ids((Rows(12).x, None)).tolist())


def test_1c_a_users_sampler_with_a_generator_attribute_is_seeded_per_epoch():
    """The DistributedSampler rule on a user's sampler whose generator is `generator`: the
    same explicit seed gives the same order over differently seeded samplers, and epoch k's
    order is the sampler's first pass with its generator seeded seed + k."""
    def loader(sampler_seed: int) -> DataLoader:
        return DataLoader(Rows(12), batch_size=4, drop_last=True, sampler=Shuffler(12, sampler_seed))

    a, b = _order(Epochs(loader(1), 3, seed=7)), _order(Epochs(loader(2), 3, seed=7))
    assert a == b
    for k in range(3):
        alone = loader(123)
        alone.sampler.generator.manual_seed(7 + k)
        assert a[3 * k: 3 * k + 3] == [_ids(x).tolist() for x in alone]
    # default seed: the sampler's own; two seeds, two orders
    assert _order(Epochs(loader(1), 2)) != _order(Epochs(loader(2), 2))
    assert _known_length(Epochs(loader(1), 3)) == (None, None)  # a user's sampler: no length claimed


@pytest.mark.asyncio
@pytest.mark.parametrize("sampler, attr", [(Shuffler, "generator")], ids=["lazy_generator"])
async def test_1d_a_stateful_loader_over_a_users_sampler_resumes_in_order(tmp_path, sampler, attr):
    """A user's sampler whose generator is `generator` and whose __iter__ is a generator
    function: resumed in order. (Two kinds are not promised, and README says so: a generator
    under another name, which Epochs cannot find to reseed, and a sampler that draws its
    permutation as iter() is called, which torchdata 0.11's restore calls twice.)"""
    def data():
        return Epochs(_quiet_loader(Rows(12), batch_size=4, drop_last=True, sampler=sampler(12, 1, attr)), 3)

    model = tiny_gpt(n_layer=2)
    async with SnakeTrainer(model, data=data(), config=_cfg(tmp_path / "a")) as t:
        await _run(t, 7)
        straight = await _state(t)
    async with SnakeTrainer(model, data=data(), config=_cfg(tmp_path / "b")) as t:
        await _run(t, 4 if attr == "rng" else 2)  # rng: into the second epoch
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
    async with SnakeTrainer(model, data=data(), config=_cfg(tmp_path / "c")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        await _run(t, 3 if attr == "rng" else 5)
        assert _same(await _state(t), straight), "resumed on another shuffle order"


# -- 2. batch samplers, iterable datasets, lists ------------------------------------------------------


@pytest.mark.parametrize("rows, drop_last, refused", [(10, False, True), (12, False, False), (10, True, False)])
def test_2a_a_batch_sampler_given_as_batch_sampler(rows, drop_last, refused):
    def loader(gen_seed: int) -> DataLoader:
        inner = RandomSampler(Rows(rows), generator=torch.Generator().manual_seed(gen_seed))
        return DataLoader(Rows(rows), batch_sampler=BatchSampler(inner, 4, drop_last=drop_last))

    if refused:
        with pytest.raises(DataError, match=r"batch of 2 rows where the others have 4.*drop_last=True"):
            Epochs(loader(1), 2)
        return
    per_epoch = rows // 4
    e = Epochs(loader(1), 2)
    assert e.seed == 1  # the batch sampler's sampler's generator
    assert _known_length(e) == (2 * per_epoch, None)
    a = _order(e)
    assert len(a) == 2 * per_epoch
    assert a == _order(Epochs(loader(5), 2, seed=1))  # seeded from the seed and epoch alone
    assert a[:per_epoch] != a[per_epoch:]  # each epoch its own shuffle


def test_2b_an_iterable_dataset_loader_claims_no_length_and_no_short_batch():
    """An IterableDataset's len() (where it has one) is the user's estimate: no length
    claimed, and no short-batch refusal (its batch sampler's sampler has no length)."""
    for claimed in (None, 3, 100):
        loader = DataLoader(Stream(10, claimed), batch_size=4, drop_last=False)
        e = Epochs(loader, 2)
        assert _known_length(e) == (None, None)
        got = list(e)
        assert [len(b[0]) for b in got] == [4, 4, 2, 4, 4, 2]


@pytest.mark.asyncio
async def test_2c_an_iterable_dataset_loader_trains_to_the_end_of_its_epochs(tmp_path):
    data = Epochs(DataLoader(Stream(8), batch_size=4, drop_last=True), 3)
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=data, config=_cfg(tmp_path / "a")) as t:
        report = await _run(t)  # no length: until the data ends
        assert len(report.steps) == 6 and not report.stopped
        with pytest.raises(DataExhausted):
            await _run(t, 1)
        await _run(t, 1, data=batches(1, 4))  # usable


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", [list, tuple])
async def test_2d_a_sequence_of_batches_is_epochs_times_its_length(tmp_path, kind):
    data = batches(3, 4)
    e = Epochs(kind(data), 3)
    assert _known_length(e) == (9, None)
    model = tiny_gpt(n_layer=2)
    async with SnakeTrainer(model, data=data * 3, config=_cfg(tmp_path / "a")) as t:
        await _run(t)
        straight = await _state(t)
    async with SnakeTrainer(model, data=e, config=_cfg(tmp_path / "b")) as t:
        assert len((await _run(t)).steps) == 9
        assert _same(await _state(t), straight)
    with pytest.raises(DataError, match="gave no batch in epoch 0"):
        list(Epochs(kind(), 2))


# -- 3. seeds ----------------------------------------------------------------------------------------------


def test_3a_the_same_explicit_seed_gives_the_same_order_over_loaders_seeded_apart():
    a = _order(Epochs(_shuffled_loader(seed=3), 3, seed=11))
    b = _order(Epochs(_shuffled_loader(seed=99), 3, seed=11))
    assert a == b
    # each epoch k: the loader's first pass with its generator seeded 11 + k
    for k in range(3):
        assert a[3 * k: 3 * k + 3] == _order(_shuffled_loader(seed=11 + k))
    # the default seed: the loader's generator's; two of them, two orders, epoch 0 the loader's own
    d3, d99 = _order(Epochs(_shuffled_loader(seed=3), 2)), _order(Epochs(_shuffled_loader(seed=99), 2))
    assert d3 != d99 and d3[:3] == _order(_shuffled_loader(seed=3))
    # a re-iteration of a finished Epochs gives nothing more (its epochs are spent)
    e = Epochs(_shuffled_loader(seed=3), 1)
    assert len(list(e)) == 3 and list(e) == []


def test_3b_a_seed_past_torchs_range_is_refused_as_epochs_is_made():
    """seed=2**64 is refused as made (it failed at the first pass, inside torch)."""
    loader = _shuffled_loader()
    try:
        e = Epochs(loader, 2, seed=2**64)
    except ConfigError:
        return
    list(e)  # raises ValueError: Overflow when unpacking long long


def test_3c_a_loader_generator_seeded_at_the_top_of_its_range_goes_past_epoch_0():
    """seed + epoch wraps at 2**64 (a default seed of 2**64 - 1 failed at epoch 1)."""
    g = torch.Generator().manual_seed(-1)
    assert g.initial_seed() == 2**64 - 1
    loader = DataLoader(Rows(12), batch_size=4, drop_last=True, shuffle=True, generator=g)
    assert len(list(Epochs(loader, 2))) == 6


# -- 4. run() over a number of epochs --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_4_run_trains_the_epochs_length_then_refuses_cleanly(tmp_path):
    """Epochs(loader, 2) of a 3-batch loader: run() trains 6 steps, the batches of the two
    epochs in order (bitwise one trainer over their list); the next run() and run(1) are a
    DataExhausted, the trainer usable. On a new trainer run(7) is refused before anything
    trains (no engine built), naming 7 and 6; run(6) then trains."""
    model = tiny_gpt(n_layer=2)
    listed = list(Epochs(_shuffled_loader(), 2))
    async with SnakeTrainer(model, data=listed, config=_cfg(tmp_path / "a")) as t:
        await _run(t)
        straight = await _state(t)
    async with SnakeTrainer(model, data=Epochs(_shuffled_loader(), 2), config=_cfg(tmp_path / "b")) as t:
        report = await _run(t)
        assert len(report.steps) == 6 and not report.stopped
        assert _same(await _state(t), straight)
        with pytest.raises(DataExhausted, match="no batch left"):
            await _run(t)
        # (a plain DataError, not a DataExhausted as run()'s: DataSource.check_enough, snake/data.py l.341)
        with pytest.raises(DataError, match=r"run\(1\) needs 1 more global batches but the data has 0 left"):
            await _run(t, 1)
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
        await _run(t, 1, data=Epochs(_shuffled_loader(), 1))
    async with SnakeTrainer(model, data=Epochs(_shuffled_loader(), 2), config=_cfg(tmp_path / "c")) as t:
        with pytest.raises(DataError, match=r"run\(7\) needs 7 more global batches but the data has 6 left"):
            await _run(t, 7)
        assert t.engine is None and t.source.consumed == 0
        assert len((await _run(t, 6)).steps) == 6
        assert _same(await _state(t), straight)


@pytest.mark.asyncio
async def test_4b_a_plain_dataloader_epochs_resume_across_an_epoch_by_reading(tmp_path):
    """A torch DataLoader (no state) in Epochs: the load reads the 4 batches trained before
    (into the second epoch) from a new Epochs, reseeded alike, and goes on in the same order:
    bitwise one run of 6."""
    model = tiny_gpt(n_layer=2)
    async with SnakeTrainer(model, data=Epochs(_shuffled_loader(), 2), config=_cfg(tmp_path / "a")) as t:
        await _run(t)
        straight = await _state(t)
    async with SnakeTrainer(model, data=Epochs(_shuffled_loader(), 2), config=_cfg(tmp_path / "b")) as t:
        await _run(t, 4)
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
    async with SnakeTrainer(model, data=Epochs(_shuffled_loader(seed=50), 2, seed=3), config=_cfg(tmp_path / "c")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        assert len((await _run(t)).steps) == 2
        assert _same(await _state(t), straight)


# -- 5. an Epochs the user iterated first ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_5_an_epochs_iterated_before_the_trainer_claims_no_wrong_length(tmp_path):
    model = tiny_gpt(n_layer=2)
    listed = list(Epochs(_shuffled_loader(), 2))
    # read part of epoch 0 (its generator left suspended): a new iter() starts at epoch 0, 6 batches
    e = Epochs(_shuffled_loader(), 2)
    it = iter(e)
    next(it)
    assert e.epoch == 0 and _known_length(e) == (6, None)
    async with SnakeTrainer(model, data=e, config=_cfg(tmp_path / "a")) as t:
        assert len((await _run(t)).steps) == 6
        assert _same(await _state(t), await _straight_over(model, listed, tmp_path / "s"))
    # read into epoch 1: no length; run() trains what is left (epoch 1), run(4) not refused up front but
    # stopped cleanly after the 3 there are
    e = Epochs(_shuffled_loader(), 2)
    it = iter(e)
    for _ in range(4):
        next(it)
    assert e.epoch == 1 and _known_length(e) == (None, None)
    async with SnakeTrainer(model, data=e, config=_cfg(tmp_path / "b")) as t:
        with pytest.raises(DataExhausted, match=r"run\(4\) stopped cleanly after 3"):
            await _run(t, 4)
        assert _same(await _state(t), await _straight_over(model, listed[3:], tmp_path / "s2"))
    e = Epochs(_shuffled_loader(), 2)
    assert len(list(e)) == 6
    async with SnakeTrainer(model, data=e, config=_cfg(tmp_path / "c")) as t:
        with pytest.raises(DataExhausted, match="it gave none"):
            await _run(t)


async def _straight_over(model, data, path) -> dict:
    async with SnakeTrainer(model, data=list(data), config=_cfg(path)) as t:
        await _run(t)
        return await _state(t)


# -- 6. two trainers sharing one Epochs ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_6_two_trainers_sharing_one_epochs_do_not_crash_obscurely(tmp_path):
    """Both iterate the one Epochs (their generators share its epoch counter): each may get
    fewer batches than its length said (the other's passes count as epochs), which ends
    its run cleanly (a DataError, or run() without steps ending early); never another
    exception, and both trainers stay usable."""
    e = Epochs(batches(3, 4), 2)
    done = {"a": 0, "b": 0}
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=e, config=_cfg(tmp_path / "a")) as a, \
            SnakeTrainer(tiny_gpt(n_layer=2), data=e, config=_cfg(tmp_path / "b")) as b:
        for name, t, steps in (("a", a, 2), ("b", b, None), ("a", a, None), ("b", b, 6), ("a", a, 1)):
            try:
                done[name] += len((await _run(t, steps)).steps)
            except DataError as exc:  # ran out (DataExhausted), or refused
                done[name] += len(exc.report.steps) if getattr(exc, "report", None) else 0
        for t in (a, b):
            await _run(t, 1, data=batches(1, 4, seed=4))  # usable
    # the one Epochs gave 6 batches per trainer's length claim, 12 claimed; fewer were trained
    assert done["a"] + done["b"] <= 12, done


# -- 7. StatefulEpochs.load_state_dict with malformed states ---------------------------------------------


def _stateful():
    return Epochs(_quiet_loader(Rows(12), batch_size=4, drop_last=True, shuffle=True,
                                generator=torch.Generator().manual_seed(3)), 3)


@pytest.mark.parametrize("state", [
    None, [], {"epoch": "1", "seed": 3, "loader": {}}, {"seed": 3, "loader": {}}, {"epoch": 1, "seed": 3},
    {"epoch": 1, "seed": "3", "loader": {}}, {"epoch": 1.0, "seed": 3, "loader": {}},
])
def test_7a_a_malformed_state_is_a_data_error(state):
    e = _stateful()
    with pytest.raises(DataError, match="Epochs.load_state_dict: expected"):
        e.load_state_dict(state)
    assert e.epoch == 0 and e.seed == 3


@pytest.mark.parametrize("bad", [{"epoch": -1}, {"epoch": True}, {"seed": -4}, {"seed": False}])
def test_7b_an_out_of_range_epoch_or_seed_is_a_data_error(bad):
    """A negative or bool epoch or seed in a state is refused (a negative epoch gave more
    passes than epochs, silently)."""
    e = _stateful()
    state = {**e.state_dict(), **bad}
    with pytest.raises(DataError):
        e.load_state_dict(state)


class FussyLoader:
    """A stateful loader (a list of batches) whose load_state_dict refuses a state without
    'i' (as a loader of the user's checks its own)."""

    def __init__(self, data) -> None:
        self.data, self.i, self.generator = data, 0, torch.Generator().manual_seed(5)

    def __iter__(self):
        while self.i < len(self.data):
            self.i += 1
            yield self.data[self.i - 1]
        self.i = 0

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state) -> None:
        if "i" not in state:
            raise KeyError("i")
        self.i = state["i"]


def test_7c_a_state_the_loader_refuses_leaves_the_epochs_as_it_was():
    """A state the loader refuses leaves the Epochs as it was, and comes as a DataError (it
    was left half-loaded, in another epoch and shuffle)."""
    e = Epochs(FussyLoader(batches(3, 4)), 3)
    assert isinstance(e, StatefulEpochs) and e.seed == 5
    with pytest.raises(Exception):  # noqa: B017 - whichever the loader raises
        e.load_state_dict({"epoch": 2, "seed": 1, "loader": {"j": 0}})
    assert (e.epoch, e.seed, e.loader.generator.initial_seed()) == (0, 5, 5), (e.epoch, e.seed)


def test_7d_a_loader_state_torchdata_accepts_but_cannot_use_fails_at_the_first_pass():
    """torchdata 0.11's StatefulDataLoader.load_state_dict takes any dict and fails at the
    next iter(): what a trainer's load() meets at its build (a DataError at the first batch)."""
    e = _stateful()
    e.load_state_dict({"epoch": 1, "seed": 3, "loader": {"garbage": 1}})
    with pytest.raises(AssertionError, match="_num_yielded"):
        next(iter(e))


@pytest.mark.asyncio
async def test_7e_a_tampered_epoch_in_a_checkpoints_data_state(tmp_path):
    """A checkpoint's data_state with the epoch made a string: the load refuses it as a
    DataError naming Epochs.load_state_dict (the trainer is then closed: it is past the
    point where a load changes the data)."""
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=_stateful(), config=_cfg(tmp_path / "a")) as t:
        await _run(t, 4)
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
    m = _manifest(tmp_path / "ck")
    tree = m["data_state"]
    assert tree["dict"][0] == ["epoch", 1], tree["dict"][0]
    _rewrite(tmp_path / "ck", lambda m: m["data_state"]["dict"][0].__setitem__(1, "one"))
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=_stateful(), config=_cfg(tmp_path / "b")) as t:
        with pytest.raises(DataError, match="load_state_dict"):
            await asyncio.wait_for(t.load(tmp_path / "ck"), T)


# -- 8. the `batch` record with Hugging Face batch mappings ------------------------------------------


@pytest.mark.asyncio
async def test_8_hf_batches_trained_to_their_end_load_evaluate_and_go_on(tmp_path):
    """3 collator mappings, run() to their end, save; a new trainer over the same 3 loads
    (nothing left: the stand-in builds it), evaluates as the first trainer did, and
    run(2, data=more) gives bitwise the first trainer's weights after the same run; a save
    right after the load records the same `batch`, and loads likewise."""
    model = tiny_gpt(n_layer=2)
    data, more, held = hf_batches(3), hf_batches(2, seed=8), hf_batches(2, seed=9)
    async with SnakeTrainer(model, data=list(data), config=_cfg(tmp_path / "a")) as t:
        assert len((await _run(t)).steps) == 3
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
        want_eval = (await asyncio.wait_for(t.evaluate(held), T)).loss
        await _run(t, 2, data=list(more))
        straight = await _state(t)
    spec = {"shape": [4, 16], "dtype": "int64"}
    assert _manifest(tmp_path / "ck")["batch"] == {"inputs": spec, "targets": spec}
    async with SnakeTrainer(model, data=list(data), config=_cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        assert (await asyncio.wait_for(t.evaluate(held), T)).loss == want_eval
        await asyncio.wait_for(t.save(tmp_path / "ck2"), T)
        with pytest.raises(DataExhausted):
            await _run(t)
        await _run(t, 2, data=list(more))
        assert _same(await _state(t), straight)
    assert _manifest(tmp_path / "ck2")["batch"] == {"inputs": spec, "targets": spec}
    async with SnakeTrainer(model, data=iter([]), config=_cfg(tmp_path / "c")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck2", skip_data=False), T)
        # another batch shape is refused, the trainer usable
        with pytest.raises(DataError, match=r"shape \(4, 8\)"):
            await _run(t, 1, data=hf_batches(1, seq=8))
        await _run(t, 2, data=list(more))
        assert _same(await _state(t), straight)


@pytest.mark.asyncio
async def test_8b_int32_input_ids_are_recorded_and_stood_in_as_int32(tmp_path):
    model = tiny_gpt(n_layer=2)
    data = [{**b, "input_ids": b["input_ids"].int()} for b in hf_batches(2)]
    more = [{**b, "input_ids": b["input_ids"].int()} for b in hf_batches(1, seed=8)]
    async with SnakeTrainer(model, data=list(data), config=_cfg(tmp_path / "a")) as t:
        await _run(t)
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
        await _run(t, 1, data=list(more))
        straight = await _state(t)
    assert _manifest(tmp_path / "ck")["batch"]["inputs"]["dtype"] == "int32"
    async with SnakeTrainer(model, data=list(data), config=_cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        await _run(t, 1, data=list(more))
        assert _same(await _state(t), straight)


# -- 9. bfloat16, and tampered `batch` records ------------------------------------------------------------


@pytest.mark.asyncio
async def test_9a_bfloat16_at_the_data_end_loads_and_goes_on(tmp_path):
    model = tiny_gpt(n_layer=2)
    data, more = batches(3, 4), batches(2, 4, seed=8)
    async with SnakeTrainer(model, data=Epochs(list(data), 1), config=_cfg(tmp_path / "a", dtype="bfloat16")) as t:
        await _run(t)
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
        want_eval = (await asyncio.wait_for(t.evaluate(batches(2, 4, seed=9)), T)).loss
        await _run(t, 2, data=list(more))
        straight = await _state(t)
    async with SnakeTrainer(model, data=Epochs(list(data), 1), config=_cfg(tmp_path / "b", dtype="bfloat16")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        assert (await asyncio.wait_for(t.evaluate(batches(2, 4, seed=9)), T)).loss == want_eval
        await _run(t, 2, data=list(more))
        assert _same(await _state(t), straight)


async def _end_checkpoint(tmp_path) -> None:
    """tmp_path/good: a run trained to the end of 3 batches; tmp_path/bad: a copy of it."""
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(3, 4), config=_cfg(tmp_path / "w")) as t:
        await _run(t)
        await asyncio.wait_for(t.save(tmp_path / "good"), T)
    shutil.copytree(tmp_path / "good", tmp_path / "bad")


def _set(part: str, key: str, value):
    return lambda m: m["batch"][part].__setitem__(key, value)


TAMPERED = {
    # what spec_error sees (snake/batch_spec.py l.24-35)
    "bad_dtype_name": _set("inputs", "dtype", "int65"),
    "zero_dim": _set("inputs", "shape", [4, 0]),
    "missing_targets": lambda m: m["batch"].pop("targets"),
    "shape_not_a_list": _set("targets", "shape", "4x16"),
    "bool_dim": _set("inputs", "shape", [True, 16]),
    "batch_not_a_mapping": lambda m: m.__setitem__("batch", [4, 16]),
    # what it lets through, that no run records (a run records a batch split_batch took)
    "float_inputs": _set("inputs", "dtype", "float32"),
    "int32_targets": _set("targets", "dtype", "int32"),
    "one_dim_inputs": lambda m: [_set(p, "shape", [64])(m) for p in ("inputs", "targets")],
    "shapes_disagree": _set("targets", "shape", [4, 8]),
    "rows_not_divisible_by_micro_batches": lambda m: [_set(p, "shape", [3, 16])(m) for p in ("inputs", "targets")],
    "overflowing_shape": lambda m: [_set(p, "shape", [2**40, 2**40])(m) for p in ("inputs", "targets")],
}


@pytest.mark.asyncio
@pytest.mark.parametrize("tamper", list(TAMPERED))
async def test_9b_a_tampered_batch_record_is_damaged_before_the_trainer_changes(tmp_path, tamper):
    await _end_checkpoint(tmp_path)
    _rewrite(tmp_path / "bad", TAMPERED[tamper])
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(3, 4), config=_cfg(tmp_path / "x")) as t:
        with pytest.raises(SnakeError, match=r"batch=.*the manifest is damaged"):
            await asyncio.wait_for(t.load(tmp_path / "bad"), T)
        await asyncio.wait_for(t.load(tmp_path / "good"), T)  # the trainer is as it was
        await _run(t, 1, data=batches(1, 4, seed=8))


# -- 10. a checkpoint saved before any run --------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("empty", ["list", "iterator", "epochs_of_nothing_left"])
async def test_10_a_checkpoint_before_any_run_loaded_with_no_data_is_a_clear_error(tmp_path, empty):
    """No engine at the save: no `batch` recorded. Loaded where the data has no batch, there
    is nothing to size the trainer from: a DataExhausted saying so and what to give, not a
    crash; a new trainer with data loads it."""
    model = tiny_gpt(n_layer=2)
    async with SnakeTrainer(model, data=batches(2, 4), config=_cfg(tmp_path / "a")) as t:
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
    m = _manifest(tmp_path / "ck")
    assert "batch" not in m and m["step"] == 0 and m["consumed_batches"] == 0
    if empty == "list":
        data = []
    elif empty == "iterator":
        data = iter([])
    else:
        data = Epochs(batches(2, 4), 1)
        list(data)  # spent
    async with SnakeTrainer(model, data=data, config=_cfg(tmp_path / "b")) as t:
        with pytest.raises(DataExhausted, match="records no batch shapes.*give data with a batch"):
            await asyncio.wait_for(t.load(tmp_path / "ck"), T)
    async with SnakeTrainer(model, data=batches(2, 4), config=_cfg(tmp_path / "c")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        assert len((await _run(t)).steps) == 2


# -- 11. an Epochs of an Epochs ----------------------------------------------------------------------------


def test_11_an_epochs_of_an_epochs_is_refused_or_claims_what_it_gives():
    """An Epochs of an Epochs is refused as made (it claimed 18 batches and gave 6)."""
    inner = Epochs(batches(3, 4), 2)
    try:
        outer = Epochs(inner, 3)
    except (ConfigError, DataError):
        return
    claimed = _known_length(outer)[0]
    given = 0
    with pytest.raises(DataError):
        for _ in outer:
            given += 1
    assert given == 6
    assert claimed is None or claimed == given, f"claims {claimed} batches, gives {given}"
