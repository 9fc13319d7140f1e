"""A data source that draws from torch's global random generator (nanoGPT's get_batch with
torch.randint, a DataLoader shuffling without generator=) while snake trains: the compute
thread seeds that generator around each block for dropout (the recompute's masks must be
the forward's) and puts it back after, and the data is read on another thread meanwhile.
Its draws came out of the seeded states at times, so the batches depended on timing (and
its own stream was put back after each), and a draw between a seeding and the dropout
changed the forward's mask from the recompute's. On a CPU device the data's next() and the
seeded stretches now take turns; on CUDA the CPU generator is not seeded at all (dropout
draws from the device's: tests/test_cuda.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from snake import SnakeConfig, SnakeTrainer
from tests.helpers import tiny_gpt

VOCAB, SEQ, ROWS = 96, 16, 8


def get_batch(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's: random windows, drawn from torch's global generator."""
    ix = torch.randint(len(tokens) - SEQ - 1, (ROWS,))
    return (torch.stack([tokens[i : i + SEQ] for i in ix]), torch.stack([tokens[i + 1 : i + 1 + SEQ] for i in ix]))


def random_windows(n: int, seen: list[torch.Tensor] | None = None):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(VOCAB, (4096,), generator=g)
    for _ in range(n):
        x, y = get_batch(tokens)
        if seen is not None:
            seen.append(x.clone())
        yield x, y


async def _train(make_data, steps: int, tmp_path, schedule: str) -> dict[str, torch.Tensor]:
    model = tiny_gpt(n_layer=4, dropout=0.2)  # (it seeds the global generator itself)
    torch.manual_seed(1234)  # the data's stream, from here on
    cfg = SnakeConfig(device="cpu", micro_batches=4, alpha=0.5, schedule=schedule, offload_dir=tmp_path)
    async with SnakeTrainer(model, data=make_data(), config=cfg) as t:
        await asyncio.wait_for(t.run(steps), 120)
        return await t.state_dict()


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_data_drawn_from_the_global_generator_is_the_same_batches_and_weights(tmp_path, schedule):
    """The batches are those the source gives read alone from the same seed, and the
    weights those of the same batches given as a list: the seeded dropout masks did not
    move and the data's own stream was left alone. Before, the batches of 12 steps
    differed from the source's own (drawn in the seeded stretches), and so did the
    weights."""
    steps = 12
    torch.manual_seed(1234)
    pairs = list(random_windows(steps))
    listed = await _train(lambda: pairs, steps, tmp_path / "list", schedule)
    seen: list[torch.Tensor] = []
    got = await _train(lambda: random_windows(steps, seen), steps, tmp_path / "gen", schedule)
    assert len(seen) == steps
    for i, (a, (b, _)) in enumerate(zip(seen, pairs, strict=True)):
        assert torch.equal(a, b), f"batch {i} is not the source's own"
    for k in listed:
        assert torch.equal(got[k], listed[k]), k


class Windows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randint(VOCAB, (40, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i, :-1], self.x[i, 1:]


@pytest.mark.asyncio
async def test_a_shuffling_dataloader_over_epochs_gives_its_own_order(tmp_path):
    """A DataLoader shuffling without generator= draws each epoch's order from torch's
    global generator when the epoch starts. Before, the trainer's set-up drew from it too
    (the embedding's dropout, run to find the checkpoints' shape), so the second and third
    epochs came in another order than the loader's own; and such a draw could fall in a
    seeded stretch. Three epochs of 5 batches."""
    loader = torch.utils.data.DataLoader(Windows(), batch_size=ROWS, shuffle=True, drop_last=True)
    steps = 15
    torch.manual_seed(1234)
    pairs = [b for _ in range(3) for b in loader]
    listed = await _train(lambda: pairs, steps, tmp_path / "list", "vertical")
    seen: list[torch.Tensor] = []

    def epochs():
        for _ in range(3):
            for x, y in loader:
                seen.append(x.clone())
                yield x, y

    got = await _train(epochs, steps, tmp_path / "gen", "vertical")
    assert len(seen) == steps
    for i, (a, (b, _)) in enumerate(zip(seen, pairs, strict=True)):
        assert torch.equal(a, b), f"batch {i} is not the loader's own"
    for k in listed:
        assert torch.equal(got[k], listed[k]), k


@pytest.mark.asyncio
async def test_a_source_that_draws_nothing_is_read_without_the_lock(tmp_path):
    """Only a source seen drawing from the global generator takes turns with the compute
    thread: one that does not (a list, a loader without shuffle) is read while blocks run
    (a slow or stuck one must not hold the compute thread up: test_lifecycle's watchdog)."""
    cfg = SnakeConfig(device="cpu", micro_batches=2, offload_dir=tmp_path)
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=list(random_windows(3)), config=cfg) as t:
        await t.run(1)
        assert t.source.rng_lock is not None and not t.source.draws_rng
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=random_windows(3), config=cfg) as t:
        await t.run(1)
        assert t.source.draws_rng


@pytest.mark.asyncio
async def test_a_stuck_source_that_draws_does_not_hold_up_the_runs_end(tmp_path):
    """A source seen drawing from the global generator holds the lock its draws share with
    the compute thread while its next() runs. One whose next() then never returns (a
    producer that died) stalled the compute thread on that lock: the watchdog named the
    data, and the run's end, close() with it, waited for the next() (60 s here)."""
    import threading
    import time

    from snake import ActorFailed

    release = threading.Event()

    def stuck():
        for i, item in enumerate(random_windows(5)):
            if i == 3:
                release.wait(60)
            yield item

    cfg = SnakeConfig(device="cpu", micro_batches=2, offload_dir=tmp_path, stall_timeout_s=0.5)
    start = time.perf_counter()
    try:
        async with SnakeTrainer(tiny_gpt(n_layer=2), data=stuck(), config=cfg) as t:
            with pytest.raises(ActorFailed, match="data"):
                await asyncio.wait_for(t.run(5), 120)
            assert t.source.draws_rng
        assert time.perf_counter() - start < 10
    finally:
        release.set()


@pytest.mark.asyncio
async def test_an_async_source_that_draws_is_warned_of_on_a_cpu_device(tmp_path):
    """An async source's __anext__ runs on the event loop, which cannot take turns with the
    compute thread's seeded stretches: it is not covered, and now says so (it was silent)."""
    import warnings

    from snake.data import AsyncDataRandomWarning

    async def drawing():
        for item in random_windows(3):
            yield item

    made = list(random_windows(3))  # drawn before: the source itself draws nothing

    async def own():
        for item in made:
            yield item

    cfg = SnakeConfig(device="cpu", micro_batches=2, offload_dir=tmp_path)
    with pytest.warns(AsyncDataRandomWarning, match="generator of its own"):
        async with SnakeTrainer(tiny_gpt(n_layer=2), data=drawing(), config=cfg) as t:
            await t.run(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AsyncDataRandomWarning)
        async with SnakeTrainer(tiny_gpt(n_layer=2), data=own(), config=cfg) as t:
            await t.run(1)
            assert t.source.is_async and not t.source.draws_rng
