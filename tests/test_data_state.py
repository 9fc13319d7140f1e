"""A stateful data source (`state_dict()` and `load_state_dict()`: torchdata's
StatefulDataLoader, `snake.Epochs` over one) is resumed where its checkpoint's run left it:
the checkpoint holds the data's state after the last batch trained on (not the batches read
ahead), and `load()` hands it to the new data instead of reading and dropping the batches
trained before. Before, a load read every batch trained again (hours of a long run's
loading), and a shuffled DataLoader could not be resumed in its order at all.
`snake.data_state` stores the state without pickle; `snake.Epochs` strings a loader's epochs
together, each shuffled from its seed and epoch alone, so that the order holds across a
resume past an epoch's end too."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from snake import (
    AdamW,
    DataError,
    DataExhausted,
    Epochs,
    Placement,
    SnakeConfig,
    SnakeError,
    SnakeTrainer,
)
from snake.data_state import Snapshot, check_tree, restore, take
from snake.epochs import StatefulEpochs
from tests.helpers import batches, tiny_gpt

MIXED = Placement(param=0.5, ckpt=0.3, opt=0.6)


class Rows(Dataset):
    """(inputs, targets) rows of `batches`' data; counts the rows read (in this process)."""

    def __init__(self, n: int = 48) -> None:
        data = batches(n, 1)
        self.x = torch.cat([x for x, _ in data])
        self.y = torch.cat([y for _, y in data])
        self.reads = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.reads += 1
        return self.x[i], self.y[i]


class Counter:
    """A stateful iterable of `data` from position `i`; `fail_at`: its state_dict() raises
    once, where `i` is that."""

    def __init__(self, data, fail_at: int | None = None) -> None:
        self.data, self.i, self.fail_at, self.loads = data, 0, fail_at, []

    def __iter__(self):
        while self.i < len(self.data):
            self.i += 1
            yield self.data[self.i - 1]

    def state_dict(self):
        if self.i == self.fail_at:
            self.fail_at = None
            raise RuntimeError("the state went missing")
        return {"i": self.i}

    def load_state_dict(self, state) -> None:
        self.loads.append(state)
        self.i = state["i"]


class AsyncCounter(Counter):
    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for item in Counter.__iter__(self):
            await asyncio.sleep(0)
            yield item

    __iter__ = None  # type: ignore[assignment]


def _quiet_loader(*args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata's deprecation notice of torch.set_vital
        return StatefulDataLoader(*args, **kw)


def _shuffled(rows: Rows, workers: int = 0, how: str = "generator", process_seed: int = 11):
    """`how` it shuffles: its own generator, its sampler's, or one its sampler seeds from
    torch's global generator as it is made (`process_seed`: that generator's seed then; a
    resumed process has another)."""
    kw = dict(batch_size=4, drop_last=True, num_workers=workers)
    if how == "generator":
        return _quiet_loader(rows, shuffle=True, generator=torch.Generator().manual_seed(3), **kw)
    if how == "sampler":
        return _quiet_loader(rows, sampler=RandomSampler(rows, generator=torch.Generator().manual_seed(3)), **kw)
    torch.manual_seed(process_seed)
    return _quiet_loader(rows, shuffle=True, **kw)


def _cfg(path, **kw) -> SnakeConfig:
    return SnakeConfig(offload_dir=path, device="cpu", micro_batches=2, **{"alpha": 0.3, "placement": MIXED, **kw})


async def _state(t: SnakeTrainer) -> dict:
    return await asyncio.wait_for(t.state_dict(), 60)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


# -- the snapshot: what a checkpoint holds of the state ---------------------------------------


def test_a_snapshot_gives_back_the_state_through_strict_json():
    """Every kind of value a state_dict holds comes back as it was: tuples stay tuples, keys
    that are not strings (or look like the tags) stay keys, nan and infinities, bytes, a big
    seed, tensors (copied: a later change to the live one does not reach the snapshot). The
    tree is strict JSON, as the manifest is."""
    live = torch.arange(6, dtype=torch.uint8)
    state = {"epoch": 3, 7: (1, [2.5, None], True), "dict": {"list": "tuple"}, "seed": 2**62 + 1,
             "inf": float("inf"), "ninf": -math.inf, "b": b"\x00\xff", "g": live, ("a", 1): torch.ones(2, 3)}
    snap = take(lambda: state)
    live += 1  # the source moves on
    tree = json.loads(json.dumps(snap.tree, allow_nan=False))
    back = restore(Snapshot(tree, snap.tensors))
    assert back.keys() == state.keys()
    assert back[7] == (1, [2.5, None], True) and isinstance(back[7], tuple)
    assert back["dict"] == {"list": "tuple"} and back["seed"] == 2**62 + 1 and back["b"] == b"\x00\xff"
    assert back["inf"] == math.inf and back["ninf"] == -math.inf
    assert torch.equal(back["g"], torch.arange(6, dtype=torch.uint8)) and torch.equal(back[("a", 1)], torch.ones(2, 3))
    assert math.isnan(restore(take(lambda: {"x": float("nan")}))["x"])
    assert check_tree(tree, set(snap.tensors)) is None


def test_a_state_a_checkpoint_cannot_hold_is_refused_with_where_it_is():
    with pytest.raises(DataError, match=r"numpy\.ndarray at state\['rng'\]\[1\].*torch\.from_numpy"):
        take(lambda: {"rng": ("MT19937", np.zeros(3))})
    loop: dict = {"a": []}
    loop["a"].append(loop)
    with pytest.raises(DataError, match=r"holds itself at state\['a'\]\[0\]"):
        take(lambda: loop)
    with pytest.raises(DataError, match=r"state_dict\(\) raised RuntimeError: boom"):
        take(lambda: (_ for _ in ()).throw(RuntimeError("boom")))


@pytest.mark.parametrize("tree, why", [
    ({"dict": [[1]]}, "malformed 'dict'"),
    ({"tensor": "t9"}, "lacks"),
    ({"bytes": "zz"}, "not hex"),
    ({"float": "1.5"}, "malformed 'float'"),
    ({"what": 1}, "not a tagged value"),
    ({"dict": [[{"list": []}, 1]]}, "key of type list"),
])
def test_a_damaged_tree_is_named(tree, why):
    assert why in check_tree(tree, {"t0"})


# -- resuming a trainer on stateful data ----------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("workers, how", [(0, "generator"), (2, "generator"), (0, "sampler"), (0, "global")])
async def test_a_shuffled_loader_resumes_where_it_was_without_reading_a_batch_again(tmp_path, workers, how):
    """Epochs over a shuffled StatefulDataLoader, 12 batches an epoch: 7 steps, save, load
    into a new trainer with a new loader, 13 more, past the epoch's end: bitwise the
    weights of 20 steps in one trainer. The new trainer read the 13 batches it trained on
    and no others (without workers, where the rows read are counted here); the same load
    with the plain DataLoader reads the 7 trained before again."""
    rows = [Rows() for _ in range(3)]
    model = tiny_gpt(n_layer=2)
    async with SnakeTrainer(model, data=Epochs(_shuffled(rows[0], workers, how)), config=_cfg(tmp_path / "a")) as t:
        await asyncio.wait_for(t.run(20), 120)
        straight = await _state(t)
    async with SnakeTrainer(model, data=Epochs(_shuffled(rows[1], workers, how)), config=_cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.run(7), 60)
        await t.save(tmp_path / "ck")
    manifest = _manifest(tmp_path / "ck")
    assert manifest["consumed_batches"] == 7 and "data.safetensors" in manifest["files"]
    data = Epochs(_shuffled(rows[2], workers, how, process_seed=12))
    async with SnakeTrainer(model, data=data, config=_cfg(tmp_path / "c")) as t:
        await t.load(tmp_path / "ck")
        assert data.epoch == 0 and isinstance(data, StatefulEpochs)
        await asyncio.wait_for(t.run(13), 120)
        resumed = await _state(t)
    assert _same(resumed, straight)
    if workers == 0:
        assert rows[2].reads == 13 * 4, rows[2].reads
        plain = Rows()
        loader = DataLoader(plain, batch_size=4, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(3))
        async with SnakeTrainer(model, data=Epochs(loader), config=_cfg(tmp_path / "d")) as t:
            await t.load(tmp_path / "ck")
        # no state: the batches trained before read and dropped, then the next, which the build reads first
        assert plain.reads == (7 + 1) * 4


@pytest.mark.asyncio
@pytest.mark.parametrize("is_async", [False, True])
async def test_the_state_saved_is_after_the_last_batch_trained_not_those_read_ahead(tmp_path, is_async):
    """A run stopped by stop() after its second step has read batches ahead for steps it did
    not run (they are handed back). The checkpoint holds the state after the last batch
    trained on, and a trainer loaded from it ends, over the rest, at the weights of one
    that trained all 10 in one go; so does the first trainer, which hands the batches back
    to its next run (with their states: its second save says 10)."""
    data = batches(10, 4)
    kind = AsyncCounter if is_async else Counter
    model = tiny_gpt(n_layer=2)
    async with SnakeTrainer(model, data=kind(data), config=_cfg(tmp_path / "a")) as t:
        await asyncio.wait_for(t.run(10), 60)
        straight = await _state(t)
    source = kind(data)
    async with SnakeTrainer(model, data=source, config=_cfg(tmp_path / "b")) as t:
        def on_step(s):
            if s.step == 1:
                t.stop()

        done = len((await asyncio.wait_for(t.run(10, on_step=on_step), 60)).steps)
        assert done < source.i, (done, source.i)  # batches were read ahead
        await t.save(tmp_path / "ck")
        await asyncio.wait_for(t.run(10 - done), 60)
        assert _same(await _state(t), straight)
        await t.save(tmp_path / "ck2")
    assert _manifest(tmp_path / "ck")["data_state"] == {"dict": [["i", done]]}
    assert _manifest(tmp_path / "ck2")["data_state"] == {"dict": [["i", 10]]}
    again = kind(data)
    async with SnakeTrainer(model, data=again, config=_cfg(tmp_path / "c")) as t:
        await t.load(tmp_path / "ck")
        assert again.loads == [{"i": done}]
        await asyncio.wait_for(t.run(10 - done), 60)
        assert _same(await _state(t), straight)


@pytest.mark.asyncio
async def test_resumed_twice_with_clipping_is_one_run(tmp_path):
    """Save, load, train, save, load, train: each load starts the data where the save's
    run left it (the state a loaded trainer saves is the one it loaded, moved on)."""
    rows = [Rows() for _ in range(4)]
    model = tiny_gpt(n_layer=2)
    cfg = dict(alpha=1.0, optimizer=AdamW(max_grad_norm=0.5))
    async with SnakeTrainer(model, data=Epochs(_shuffled(rows[0])), config=_cfg(tmp_path / "a", **cfg)) as t:
        await asyncio.wait_for(t.run(15), 120)
        straight = await _state(t)
    async with SnakeTrainer(model, data=Epochs(_shuffled(rows[1])), config=_cfg(tmp_path / "b", **cfg)) as t:
        await asyncio.wait_for(t.run(5), 60)
        await t.save(tmp_path / "ck1")
    async with SnakeTrainer(model, data=Epochs(_shuffled(rows[2])), config=_cfg(tmp_path / "c", **cfg)) as t:
        await t.load(tmp_path / "ck1")
        await asyncio.wait_for(t.run(5), 60)
        await t.save(tmp_path / "ck2")
    async with SnakeTrainer(model, data=Epochs(_shuffled(rows[3])), config=_cfg(tmp_path / "d", **cfg)) as t:
        await t.load(tmp_path / "ck2")
        await asyncio.wait_for(t.run(5), 60)
        resumed = await _state(t)
    assert _same(resumed, straight)
    assert rows[3].reads == 5 * 4


@pytest.mark.asyncio
async def test_load_without_skipping_and_a_checkpoint_without_a_state_leave_load_state_dict_alone(tmp_path):
    """load(skip_data=False): the data is taken as it is given (already past the batches
    trained). A checkpoint of data without state (a list): the stateful data's batches
    trained before are read and dropped, as any data's."""
    data = batches(8, 4)
    model = tiny_gpt(n_layer=2)
    async with SnakeTrainer(model, data=Counter(data), config=_cfg(tmp_path / "a")) as t:
        await asyncio.wait_for(t.run(3), 60)
        await t.save(tmp_path / "stateful")
    async with SnakeTrainer(model, data=list(data), config=_cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.run(3), 60)
        await t.save(tmp_path / "plain")
    assert "data_state" not in _manifest(tmp_path / "plain")
    assert "data.safetensors" not in _manifest(tmp_path / "plain")["files"]
    given = Counter(data[3:])
    async with SnakeTrainer(model, data=given, config=_cfg(tmp_path / "c")) as t:
        await t.load(tmp_path / "stateful", skip_data=False)
        assert given.loads == [] and given.i == 1  # the first batch, which the build reads
    read = Counter(data)
    async with SnakeTrainer(model, data=read, config=_cfg(tmp_path / "d")) as t:
        await t.load(tmp_path / "plain")
        assert read.loads == [] and read.i == 3 + 1


@pytest.mark.asyncio
async def test_a_state_dict_that_fails_mid_run_stops_it_and_loses_no_batch(tmp_path):
    """state_dict() raising after the fourth batch: the run stops cleanly (a DataError naming
    it, its report with the steps trained), that batch is kept, and the next run trains it:
    the weights of 8 steps in one go."""
    data = batches(8, 4)
    model = tiny_gpt(n_layer=2)
    async with SnakeTrainer(model, data=iter(data), config=_cfg(tmp_path / "a")) as t:
        await asyncio.wait_for(t.run(8), 60)
        straight = await _state(t)
    async with SnakeTrainer(model, data=Counter(data, fail_at=4), config=_cfg(tmp_path / "b")) as t:
        with pytest.raises(DataError, match=r"state_dict\(\) raised RuntimeError: the state went missing") as err:
            await asyncio.wait_for(t.run(8), 60)
        done = len(err.value.report.steps)
        assert done == 3
        await asyncio.wait_for(t.run(8 - done), 60)
        assert _same(await _state(t), straight)


@pytest.mark.asyncio
async def test_refused_states_name_the_fix(tmp_path):
    """A state_dict() a checkpoint cannot hold is refused at the first batch, before the
    first run builds anything (it can be tried again); a load_state_dict() that refuses the
    checkpoint's state fails the load, naming it; a damaged data_state in the manifest is
    named as damage."""
    class Numpy(Counter):
        def state_dict(self):
            return {"i": np.int64(self.i)}

    async with SnakeTrainer(tiny_gpt(n_layer=2), data=Numpy(batches(4, 4)), config=_cfg(tmp_path / "a")) as t:
        with pytest.raises(DataError, match=r"numpy\.int64 at state\['i'\].*int\(n\)"):
            await asyncio.wait_for(t.run(2), 60)
        assert t.engine is None

    class Refuses(Counter):
        def load_state_dict(self, state):
            raise KeyError("not mine")

    model = tiny_gpt(n_layer=2)
    async with SnakeTrainer(model, data=Counter(batches(4, 4)), config=_cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.run(2), 60)
        await t.save(tmp_path / "ck")
    async with SnakeTrainer(model, data=Refuses(batches(4, 4)), config=_cfg(tmp_path / "c")) as t:
        with pytest.raises(DataError, match=r"load_state_dict\(\) raised KeyError.*skip_data=False"):
            await t.load(tmp_path / "ck")
    manifest = _manifest(tmp_path / "ck")
    manifest["data_state"] = {"dict": [["i", {"tensor": "t5"}]]}
    (tmp_path / "ck" / "manifest.json").write_text(json.dumps(manifest))
    async with SnakeTrainer(model, data=Counter(batches(4, 4)), config=_cfg(tmp_path / "d")) as t:
        with pytest.raises(SnakeError, match=r"data_state\['i'\] names tensor 't5'.*damaged"):
            await t.load(tmp_path / "ck")


# -- Epochs ------------------------------------------------------------------------------------


def test_epochs_strings_a_loaders_epochs_together():
    assert list(Epochs([1, 2, 3], 2)) == [1, 2, 3, 1, 2, 3]
    assert not hasattr(Epochs([1, 2]), "state_dict")  # a list has no state: neither has this
    endless = iter(Epochs([1]))
    assert [next(endless) for _ in range(5)] == [1] * 5
    with pytest.raises(DataError, match="no batch in epoch 0"):
        list(Epochs([]))
    with pytest.raises(DataError, match="one pass only"):
        Epochs(iter([1, 2]))
    with pytest.raises(SnakeError, match="epochs"):
        Epochs([1], 0)
    with pytest.raises(DataError, match="batch of 2 rows where the others have 4.*drop_last=True"):
        Epochs(DataLoader(Rows(10), batch_size=4))
    with pytest.raises(DataError, match="batch of 2 rows"):
        Epochs(_quiet_loader(Rows(10), batch_size=4, shuffle=True))
    assert list(Epochs(DataLoader(Rows(10), batch_size=5), 1)) != []  # no short batch: taken


def test_epochs_reshuffles_each_epoch_from_its_seed_and_calls_set_epoch():
    """Each epoch's order depends on the seed and the epoch alone: two Epochs over loaders
    with the same generator seed agree epoch by epoch, and the epochs differ; a
    DistributedSampler's set_epoch is called with each epoch."""
    rows = Rows(16)

    def firsts(loader, n):
        return [b[0][:, 0].tolist() for b in list(Epochs(loader, n))]

    def plain():
        return DataLoader(rows, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))

    a, b = firsts(plain(), 3), firsts(plain(), 3)
    assert a == b and a[:4] != a[4:8]
    state = torch.get_rng_state()
    global_gen = DataLoader(rows, batch_size=4, sampler=RandomSampler(rows, generator=torch.default_generator))
    assert Epochs(global_gen).seed is None  # torch's global generator is the process's to seed: left alone
    assert torch.equal(torch.get_rng_state(), state)
    sampler = DistributedSampler(rows, num_replicas=1, rank=0, shuffle=True, seed=1)
    seen = []
    sampler.set_epoch = lambda e, f=sampler.set_epoch: (seen.append(e), f(e))[1]
    list(Epochs(DataLoader(rows, batch_size=4, sampler=sampler), 3))
    assert seen == [0, 1, 2]


@pytest.mark.parametrize("workers, how", [(0, "generator"), (2, "generator"), (0, "sampler"), (2, "global")])
def test_epochs_of_a_stateful_loader_resume_at_every_point(workers, how):
    """The state after each batch, loaded into a new Epochs over a new loader, gives the
    batches of the uninterrupted stream from there on: mid-epoch, at an epoch's last batch
    and into the next epochs. (In a plain epoch loop, without the reseeding, torchdata
    0.11's restore gave another order after the resumed epoch with the loader's generator
    and no workers, and from a resume in the second epoch with a sampler's generator.)"""
    rows = Rows(20)  # 5 batches an epoch
    first = Epochs(_shuffled(rows, workers, how))
    it = iter(first)
    stream, states = [], []
    for _ in range(13):
        stream.append(next(it)[0][:, 0].tolist())
        states.append(copy.deepcopy(first.state_dict()))
    for k in (1, 4, 5, 8):
        again = Epochs(_shuffled(Rows(20), workers, how, process_seed=12))
        again.load_state_dict(states[k])
        rest = iter(again)
        assert [next(rest)[0][:, 0].tolist() for _ in range(12 - k)] == stream[k + 1:], k


@pytest.mark.asyncio
async def test_a_number_of_epochs_says_its_length(tmp_path):
    """Epochs(loader, 2) of a DataLoader whose length is known has 2 x its length: run()
    without steps trains that many, and a longer run(steps) is refused before it trains
    (it would stop at the data's end)."""
    loader = DataLoader(Rows(12), batch_size=4, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(3))
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=Epochs(loader, 2), config=_cfg(tmp_path / "a")) as t:
        with pytest.raises(DataError, match=r"run\(7\) needs 7 more global batches but the data has 6 left"):
            await asyncio.wait_for(t.run(7), 60)
        report = await asyncio.wait_for(t.run(), 60)
        assert len(report.steps) == 6


def test_the_batch_record_gives_back_the_shapes_and_names_what_it_cannot_hold():
    """A checkpoint records its batches' shapes and dtypes; a load whose data has no batch
    left sizes the trainer from a batch of zeros of them. What no run trains on is not
    recorded (a load would refuse it as damage); a damaged record is named: one a run could
    not have written is refused before the load changes the trainer (an audit's find: float
    inputs, shapes that differ, rows micro_batches does not divide, a size past any batch)."""
    from snake.batch_spec import batch_spec, spec_error, stand_in_batch

    x, y = torch.ones(4, 16, dtype=torch.int32), torch.ones(4, 16, dtype=torch.int64)
    spec = batch_spec((x, y))
    assert spec == {"inputs": {"shape": [4, 16], "dtype": "int32"}, "targets": {"shape": [4, 16], "dtype": "int64"}}
    ins, tgs = stand_in_batch(spec)
    assert (ins.shape, ins.dtype, tgs.dtype, int(ins.abs().sum())) == (x.shape, torch.int32, torch.int64, 0)
    assert batch_spec((x.to(torch.uint16), y)) is None
    assert spec_error(spec, micro_batches=2) is None
    tg = spec["targets"]
    for bad, why in [
        ({"inputs": {"shape": [0, 16], "dtype": "int64"}, "targets": tg}, "inputs.shape"),
        ({"inputs": {"shape": [4, 16], "dtype": "float32"}, "targets": tg}, "inputs.dtype"),
        ({"inputs": spec["inputs"], "targets": {"shape": [4, 16], "dtype": "int32"}}, "targets.dtype"),
        ({"inputs": {"shape": [64], "dtype": "int64"}, "targets": tg}, "[rows, tokens]"),
        ({"inputs": {"shape": [4, 8], "dtype": "int64"}, "targets": tg}, "one shape"),
        ({"inputs": {"shape": [2**20, 2**20], "dtype": "int64"}, "targets": {"shape": [2**20, 2**20], "dtype": "int64"}},
         "elements"),
        ({"inputs": spec["inputs"]}, "mapping of inputs and targets"),
    ]:
        assert why in spec_error(bad), (bad, why)
    assert "multiple of micro_batches=3" in spec_error(spec, micro_batches=3)


@pytest.mark.asyncio
async def test_a_stateful_loader_says_its_length_as_a_dataloader_does(tmp_path):
    """A StatefulDataLoader given directly is one pass of len() batches, as a DataLoader:
    run(steps) past them is refused before it trains, run() without steps trains them all,
    and a short last batch (drop_last=False) is refused up front. Once its state was loaded
    (its pass starts part-way) it says no length: the run goes to its end."""
    rows = Rows(24)  # 6 batches of 4
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=_quiet_loader(rows, batch_size=4, drop_last=True),
                            config=_cfg(tmp_path / "a")) as t:
        with pytest.raises(DataError, match="6"):
            await t.run(7)
        assert len((await t.run()).steps) == 6
    short = _quiet_loader(Rows(22), batch_size=4, drop_last=False)
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=short, config=_cfg(tmp_path / "b")) as t:
        with pytest.raises(DataError, match="drop_last=True"):
            await t.run(6)
    first = _quiet_loader(rows, batch_size=4, drop_last=True)
    it = iter(first)
    next(it), next(it)
    resumed = _quiet_loader(rows, batch_size=4, drop_last=True)
    resumed.load_state_dict(first.state_dict())
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=resumed, config=_cfg(tmp_path / "c")) as t:
        with pytest.raises(DataExhausted) as ran_out:  # not refused up front: its 4 batches trained
            await t.run(7)
        assert len(ran_out.value.report.steps) == 4
