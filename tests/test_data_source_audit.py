"""An audit of what a user may pass as `data=`: a DataLoader with worker processes, generators
and async generators that fail or block, sources shorter than the run, a loader that refills
one buffer. Each test failed before its fix."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
import weakref

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from snake import SnakeConfig, SnakeTrainer
from snake.errors import DataError
from tests.helpers import batches, reference, tiny_gpt


def _config(tmp_path) -> SnakeConfig:
    return SnakeConfig(micro_batches=2, alpha=0.0, device="cpu", offload_dir=tmp_path / "off")


def _children() -> set[int]:
    """This process's live child processes (a DataLoader's workers)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
    return out


class _Rows(Dataset):
    """Rows of `batches(n, 4)`, one (inputs, targets) pair of a sequence each, each after
    `delay_s` (a record read and decoded); index `bad` on raises (a corrupt record) in the
    DataLoader's worker."""

    def __init__(self, n: int, bad: int | None = None, delay_s: float = 0.0) -> None:
        self.rows = [(x[i], y[i]) for x, y in batches(n, 4) for i in range(4)]
        self.bad = bad
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        if self.bad is not None and i >= self.bad:
            raise ValueError(f"a corrupt record at {i}")
        time.sleep(self.delay_s)
        return self.rows[i]


async def _until(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:  # noqa: ASYNC110 - processes signal nothing here
        await asyncio.sleep(0.05)
    return cond()


@pytest.mark.asyncio
async def test_a_dataloader_whose_worker_failed_ends_its_workers_with_the_trainer(tmp_path):
    """A DataLoader (two worker processes) whose dataset raises at the sixth batch: the run
    stops cleanly after five steps, naming it (the trainer is usable), and once the trainer
    is closed it holds no iterator of the data: its workers end, also while the exception
    is kept (a service's record of the job). Before, the last next()'s future kept the
    error, whose traceback holds the iterator (in the frames of its own methods), so the
    two workers lived on after close(), as long as the trainer, and then as long as the
    exception."""
    before = _children()
    loader = DataLoader(_Rows(12, bad=5 * 4), batch_size=4, num_workers=2)
    t = SnakeTrainer(tiny_gpt(n_layer=2), data=loader, config=_config(tmp_path))
    it = weakref.ref(t.source._iter)
    workers = _children() - before
    assert len(workers) == 2
    with pytest.raises(DataError, match=r"next\(\) raised ValueError: Caught ValueError .* after 5 of its steps") as failed:
        await asyncio.wait_for(t.run(8), 60)
    kept = failed.value
    assert len(kept.report.steps) == 5 and t.engine is not None and t.engine.next_t == 5
    assert "a corrupt record at 20" in str(kept.__cause__)
    await t.close()
    gc.collect()
    assert it() is None
    assert await _until(lambda: not workers & _children()), workers & _children()


@pytest.mark.asyncio
async def test_closing_a_trainer_ends_an_async_generator_blocked_in_its_next_batch(tmp_path):
    """An async generator that waits for batches on a queue (a producer that has stopped),
    a run cancelled as it waits: close() cancels that `__anext__` (the generator's finally
    runs) and no task is left. Before, the task went on holding the generator; dropped
    with the trainer, it was collected pending: "Task was destroyed but it is pending!",
    and the generator's finally never ran."""
    errors: list[str] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx["message"]))
    ended = []
    queue: asyncio.Queue = asyncio.Queue()
    for b in batches(3, 4):
        queue.put_nowait(b)

    async def stream(q: asyncio.Queue):
        try:
            while True:
                yield await q.get()
        finally:
            ended.append(True)

    t = SnakeTrainer(tiny_gpt(n_layer=2), data=stream(queue), config=_config(tmp_path))
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(3):
            await t.run(6)
    await t.close()
    assert ended == [True]
    assert [task for task in asyncio.all_tasks() if task is not asyncio.current_task()] == []
    del t, queue
    gc.collect()
    await asyncio.sleep(0.05)
    assert errors == []


def _refilled(data):
    """A loader that fills one pair of tensors for every batch, as a plain training loop,
    which uses each batch before asking for the next, allows."""
    x, y = torch.empty_like(data[0][0]), torch.empty_like(data[0][1])
    for bx, by in data:
        x.copy_(bx)
        y.copy_(by)
        yield x, y


@pytest.mark.asyncio
async def test_a_loader_that_refills_one_buffer_trains_on_each_batch(tmp_path):
    """Each step trains on its own batch: before, the data actor's batches were the loader's
    tensors themselves (on a CPU device), which it refilled with the next batches while
    the step used them, so the steps trained on other batches' tokens (losses off PyTorch's
    by up to 0.07, and differently from run to run)."""
    data = batches(6, 4)
    _, want = reference(tiny_gpt(n_layer=2), data, 2)
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=_refilled(data), config=_config(tmp_path)) as t:
        report = await asyncio.wait_for(t.run(6), 60)
    assert [s.loss for s in report.steps] == pytest.approx(want, rel=1e-5)


@pytest.mark.asyncio
async def test_evaluate_of_a_loader_that_refills_one_buffer(tmp_path):
    """evaluate() holds a pass's targets until its head runs: with one buffer refilled, every
    batch of the pass was scored against the last one's targets."""
    held_out = batches(4, 4, seed=7)
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(2, 4), config=_config(tmp_path)) as t:
        await asyncio.wait_for(t.run(1), 60)
        want = await t.evaluate(held_out)
        got = await t.evaluate(_refilled(held_out))
    assert got.batches == want.batches == 4
    assert got.loss == pytest.approx(want.loss, rel=1e-6)


def _loader(rows: int, **kw) -> DataLoader:
    (x, y), = batches(1, rows)
    return DataLoader(TensorDataset(x, y), batch_size=4, **kw)


@pytest.mark.asyncio
async def test_a_dataloader_shorter_than_the_run_is_refused_before_it_trains(tmp_path):
    """A DataLoader of a map-style dataset says how many batches it has, as a list does:
    run(5) over its 3 is refused at once, and the trainer goes on. Before, the run trained
    3 steps, then failed as the data ran out and closed the trainer, the steps lost."""
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=_loader(12), config=_config(tmp_path)) as t:
        with pytest.raises(DataError, match=r"run\(5\) needs 5 more global batches but the data has 3 left.*epochs"):
            await t.run(5)
        assert t.engine is None
        await asyncio.wait_for(t.run(2), 60)
        with pytest.raises(DataError, match=r"run\(2\) needs 2 more global batches but the data has 1 left"):
            await t.run(2)
        await asyncio.wait_for(t.run(1), 60)


@pytest.mark.asyncio
async def test_a_dataloader_whose_last_batch_is_short_is_refused_before_the_run_reaches_it(tmp_path):
    """10 rows in batches of 4: the last batch has 2 rows, which snake refuses (shapes stay
    fixed). A run that would reach it is refused before it trains, naming drop_last; one
    that stops short of it trains. Before, the run trained the epoch and then failed on its
    last batch, closing the trainer."""
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=_loader(10), config=_config(tmp_path)) as t:
        with pytest.raises(DataError, match=r"last batch, which has 2 rows .* drop_last=True"):
            await t.run(3)
        await asyncio.wait_for(t.run(2), 60)
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=_loader(10, drop_last=True), config=_config(tmp_path)) as t:
        with pytest.raises(DataError, match=r"needs 3 more global batches but the data has 2 left"):
            await t.run(3)


class _Endless(torch.utils.data.Sampler):
    """A sampler of the user's that goes on past its len(), as some iteration-based training
    loops use: its loader is not held to len()."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        i = 0
        while True:
            yield i % self.n
            i += 1


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.asyncio
async def test_a_dataloader_of_an_endless_sampler_is_not_held_to_its_length(tmp_path, batched):
    (x, y), = batches(1, 8)
    if batched:  # in torch's BatchSampler
        sampler = torch.utils.data.BatchSampler(_Endless(8), batch_size=4, drop_last=False)
        loader = DataLoader(TensorDataset(x, y), batch_sampler=sampler)
    else:
        loader = DataLoader(TensorDataset(x, y), batch_size=4, sampler=_Endless(8))
    assert len(loader) == 2
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=loader, config=_config(tmp_path)) as t:
        report = await asyncio.wait_for(t.run(3), 60)
    assert len(report.steps) == 3


@pytest.mark.asyncio
async def test_a_used_up_generator_says_so(tmp_path):
    """A generator another loop (or trainer) read to its end gives no batch: the error says
    that is what an iterator read before does, not only "ran out after 0"."""
    gen = iter(batches(2, 4))
    list(gen)
    t = SnakeTrainer(tiny_gpt(n_layer=2), data=gen, config=_config(tmp_path))
    with pytest.raises(DataError, match=r"ran out after 0 global batches \(it gave none: an iterator that was read"):
        await t.run(1)
    await t.close()


def _lm_tokens():
    yield from batches(2, 4)


@pytest.mark.parametrize(("data", "says"), [
    (_lm_tokens, r"got function; pass what calling it gives: data=_lm_tokens\(\)"),
    (batches(1, 4)[0], r"got Tensor: token ids alone may be given as \{'input_ids': ids\} .* data=\[\(inputs, targets\)\]"),
    ([(x.numpy(), y.numpy()) for x, y in batches(1, 4)], r"got ndarray; convert it with torch.from_numpy\(x\).long\(\)"),
    ([{"input_ids": x.tolist()} for x, _ in batches(1, 4)], r"got list; convert it with torch.tensor\(x\) .*return_tensors='pt'"),
    (_Rows(2), r"got _Rows; a Dataset of rows is batched by a DataLoader: data=DataLoader\(dataset, batch_size"),
])
@pytest.mark.asyncio
async def test_a_generator_function_or_one_batch_as_data_says_what_to_pass(tmp_path, data, says):
    """The generator function itself (not called), one (inputs, targets) batch as the data
    (whose items are then tensors, as a DataLoader of token-id rows gives), numpy arrays, a
    tokenizer's lists, a map-style Dataset: the error says what to pass instead."""
    with pytest.raises(DataError, match=says):
        t = SnakeTrainer(tiny_gpt(n_layer=2), data=data, config=_config(tmp_path))
        try:
            await t.run(1)
        finally:
            await t.close()


@pytest.mark.parametrize("how", ["closed", "cancelled"])
@pytest.mark.asyncio
async def test_a_dataloaders_workers_end_with_the_trainer(tmp_path, how):
    """A DataLoader with two worker processes trains, and its workers end with the trainer:
    at close() after a run, and after a run cancelled while its next() waits for them (that
    next() returns on its thread, and the iterator goes with it)."""
    before = _children()
    loader = DataLoader(_Rows(40, delay_s=0.0 if how == "closed" else 0.1), batch_size=4, num_workers=2)
    t = SnakeTrainer(tiny_gpt(n_layer=2), data=loader, config=_config(tmp_path))
    workers = _children() - before
    assert len(workers) == 2
    if how == "closed":
        report = await asyncio.wait_for(t.run(3), 60)
        assert len(report.steps) == 3
    else:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.5):
                await t.run(40)
    await t.close()
    gc.collect()
    assert await _until(lambda: not workers & _children()), workers & _children()


@pytest.mark.asyncio
async def test_runs_of_an_endless_async_generator_take_each_batch_once(tmp_path):
    """The data actor reads ahead of the step running, within a run only: over run(2),
    run(3), run(1) an endless async generator is read 6 times, and each step trains on its
    own batch (the losses of one plain PyTorch loop over them)."""
    data = batches(8, 4)
    taken = []

    async def endless():
        for i in range(10**9):
            taken.append(i)
            yield data[i % len(data)]

    _, want = reference(tiny_gpt(n_layer=2), data[:6], 2)
    losses = []
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=endless(), config=_config(tmp_path)) as t:
        for steps in (2, 3, 1):
            report = await asyncio.wait_for(t.run(steps), 60)
            losses += [s.loss for s in report.steps]
            assert len(taken) == len(losses)
    assert losses == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.asyncio
async def test_a_source_that_yields_inside_inference_mode_is_named(tmp_path, kind):
    """A generator that yields inside `with torch.inference_mode():` leaves the mode on in the
    thread that reads it (snake's data thread; the event loop's for an async one): the
    engine built there, or tensors made on the loop, were inference tensors, and the run
    failed deep inside ("Inplace update to inference tensor outside InferenceMode", raised
    from the initial weights' copy). Now a DataError says what to change."""
    def sync_source():
        with torch.inference_mode():
            yield from batches(3, 4)

    async def async_source():
        with torch.inference_mode():
            for b in batches(3, 4):
                yield b

    t = SnakeTrainer(tiny_gpt(n_layer=2), data=sync_source() if kind == "sync" else async_source(),
                     config=_config(tmp_path))
    try:
        with pytest.raises(DataError, match=r"returned with torch.inference_mode on: it yields inside .* after the"):
            await asyncio.wait_for(t.run(2), 60)
    finally:
        await t.close()
    assert not torch.is_inference_mode_enabled()


def _rows(n: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 96, (n, 17), generator=g)
    return torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:])


@pytest.mark.asyncio
async def test_a_dataloader_subclass_that_cycles_its_epochs_is_not_held_to_its_length(tmp_path):
    """A common idiom: a DataLoader subclass whose __iter__ goes round its epochs forever.
    Its len() is one epoch's, which the length check took for all it gives: run(5) of a
    2-batch epoch was refused."""

    class Endless(torch.utils.data.DataLoader):
        def __iter__(self):  # type: ignore[no-untyped-def]
            while True:
                yield from super().__iter__()

    loader = Endless(_rows(10), batch_size=4, drop_last=True)
    cfg = SnakeConfig(device="cpu", micro_batches=1, offload_dir=tmp_path)
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=loader, config=cfg) as t:
        report = await asyncio.wait_for(t.run(5), 60)
    assert len(report.steps) == 5


@pytest.mark.asyncio
async def test_a_short_last_batch_of_a_batch_sampler_given_is_refused_before_the_run(tmp_path):
    """A DataLoader given torch's BatchSampler (batch_size None on the loader itself): its
    short last batch was missed, and the run failed at it after training the others."""
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    from snake import DataError

    ds = _rows(10)
    loader = DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 4, drop_last=False))
    cfg = SnakeConfig(device="cpu", micro_batches=1, offload_dir=tmp_path)
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=loader, config=cfg) as t:
        with pytest.raises(DataError, match="last batch, which has 2 rows where the others have 4"):
            await t.run(3)
        report = await asyncio.wait_for(t.run(2), 60)  # the two whole batches train
    assert len(report.steps) == 2
