"""Training data that is an async generator, read first in an event loop other than the
runs' (a script's `asyncio.run()` per phase: `evaluate()` or `load()` first, `run()` in the
next). asyncio registers an async generator with the loop that first iterates it and closes
it as that loop ends; snake reads its first item outside the runs' loop unregistered and
registers it with the runs' loop once a run starts (`DataSource.home`)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from snake import SnakeConfig, SnakeTrainer
from tests.helpers import batches, tiny_gpt


def cfg(path) -> SnakeConfig:
    return SnakeConfig(micro_batches=2, offload_dir=path, alpha=0.0, device="cpu")


def one_loop(path, data, steps: int) -> dict:
    """The weights of `steps` steps on listed data, in one loop."""
    async def body():
        async with SnakeTrainer(tiny_gpt(n_layer=2), data=data, config=cfg(path)) as t:
            await t.run(steps)
            return await t.state_dict()
    return asyncio.run(body())


def same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def stream(data, log: list[str]):
    async def gen():
        try:
            for b in data:
                yield b
        finally:
            log.append("closed")
    return gen()


def test_an_evaluation_in_a_loop_of_its_own_leaves_the_training_stream_whole(tmp_path):
    data, log = batches(3, 4), []
    t = SnakeTrainer(tiny_gpt(n_layer=2), data=stream(data, log), config=cfg(tmp_path))
    asyncio.run(t.evaluate(batches(1, 4, seed=9)))
    assert log == []  # the evaluation's loop ended without closing the training data

    async def train():
        try:
            report = await t.run(3)
            return report, await t.state_dict()
        finally:
            await t.close()

    report, got = asyncio.run(train())
    assert len(report.steps) == 3
    same(got, one_loop(tmp_path / "one", data, 3))


def test_a_load_in_a_loop_of_its_own_skips_and_the_run_goes_on(tmp_path):
    data = batches(5, 4)

    async def first():
        t = SnakeTrainer(tiny_gpt(n_layer=2), data=data, config=cfg(tmp_path / "a"))
        try:
            await t.run(2)
            await t.save(tmp_path / "ckpt")
        finally:
            await t.close()

    asyncio.run(first())
    log: list[str] = []
    t = SnakeTrainer(tiny_gpt(n_layer=2), data=stream(data, log), config=cfg(tmp_path / "b"))
    asyncio.run(t.load(tmp_path / "ckpt"))  # reads and drops the 2 batches trained

    async def rest():
        try:
            report = await t.run(3)
            return report, await t.state_dict()
        finally:
            await t.close()

    report, got = asyncio.run(rest())
    assert len(report.steps) == 3
    same(got, one_loop(tmp_path / "one", data, 5))


@pytest.mark.parametrize("first_read", ["run", "evaluate"])
def test_the_stream_is_closed_as_the_runs_loop_ends(tmp_path, first_read):
    """As any async generator the runs' loop iterates: its `finally` runs as that loop ends
    (asyncio.run), where a run left it part-way, also where an evaluation in an earlier loop
    read its first item."""
    log: list[str] = []
    t = SnakeTrainer(tiny_gpt(n_layer=2), data=stream(batches(4, 4), log), config=cfg(tmp_path))
    if first_read == "evaluate":
        asyncio.run(t.evaluate(batches(1, 4, seed=9)))

    async def train():
        await t.run(1)
        assert log == []

    asyncio.run(train())
    assert log == ["closed"]
    asyncio.run(t.close())


def test_a_stream_no_run_read_is_closed_with_the_trainer(tmp_path):
    """Read by an evaluation in a loop of its own and never by a run, the stream is closed
    (its `finally` runs, an await in it too) when the trainer closes, in another loop."""
    log: list[str] = []

    async def gen():
        try:
            for b in batches(4, 4):
                yield b
        finally:
            await asyncio.sleep(0)  # (a generator dropped unclosed cannot run this)
            log.append("closed")

    t = SnakeTrainer(tiny_gpt(n_layer=2), data=gen(), config=cfg(tmp_path))
    asyncio.run(t.evaluate(batches(1, 4, seed=9)))
    assert log == []
    asyncio.run(t.close())
    assert log == ["closed"]
