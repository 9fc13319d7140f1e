"""An audit of README.md's promises about data, runs, stop(), on_step, evaluate(), learning
rates, float16's loss scale, state_dict()/save()/load() and failures that no other test
checked. Each test quotes the sentence it checks."""

from __future__ import annotations

import asyncio
import copy
import gc
import inspect
import math
import threading
import time
import weakref

import pytest
import torch
import torch.nn.functional as F

from snake import (
    AdamW,
    DataError,
    DataExhausted,
    DynamicLossScale,
    Placement,
    SnakeConfig,
    SnakeError,
    SnakeTrainer,
)
from tests.helpers import batches, reference, tiny_gpt

MIXED = Placement(param=0.3, ckpt=0.3, opt=0.3, grad=0.0)
T = 60.0  # a timeout for each call that could hang


def _cfg(path, **kw) -> SnakeConfig:
    return SnakeConfig(**{"micro_batches": 2, "device": "cpu", "offload_dir": path, "stall_timeout_s": 30.0,
                          "alpha": 0.3, "placement": MIXED, **kw})


def _snake_threads() -> list[str]:
    return [th.name for th in threading.enumerate() if th.name.startswith("snake-") and th.is_alive()]


async def _no_snake_threads(deadline_s: float = 5.0) -> None:
    end = time.monotonic() + deadline_s
    while _snake_threads() and time.monotonic() < end:  # noqa: ASYNC110 - threads signal nothing here
        await asyncio.sleep(0.05)
    assert not _snake_threads()


def _equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _close_states(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


def _eval_loss(model, state, data) -> tuple[float, int]:
    """PyTorch's eval-mode mean cross-entropy over every target that is not -100."""
    m = copy.deepcopy(model)
    m.load_state_dict(state)
    m.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in data:
            logits = m(x).double()
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100,
                                           reduction="sum"))
            count += int((y != -100).sum())
    return total / count, count


# -- close() --------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_two_closes_during_a_run_both_wait_for_it():
    """"close() during a run cancels that run's task and waits for it. Every close() call
    returns once the trainer is closed (two at once both wait for it)"."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        async def slow():
            for b in batches(200, 4):
                await asyncio.sleep(0.02)
                yield b

        t = SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=slow(), config=_cfg(d + "/off"))
        steps = asyncio.Event()
        task = asyncio.create_task(t.run(200, on_step=lambda r: steps.set()))
        await asyncio.wait_for(steps.wait(), T)
        results = await asyncio.wait_for(asyncio.gather(t.close(), t.close(), return_exceptions=True), T)
        assert results == [None, None]
        assert task.done() and task.cancelled()  # both returned after the run had stopped
        with pytest.raises(SnakeError, match="closed"):
            await t.run(1)
        await _no_snake_threads()


# -- the model given ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_model_keeps_its_weights_and_gets_its_modes_back(tmp_path):
    """"The model you give the trainer keeps the weights it had: snake trains its own copy";
    "`model.load_state_dict(await trainer.state_dict())` puts the trained weights into it";
    the trainer "gives the model's modes back at close"."""
    model = tiny_gpt(n_layer=2, bias=False, dropout=0.1)
    model.train()
    model.blocks[1].eval()
    model.ln_f.eval()
    modes = {n: m.training for n, m in model.named_modules()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    async with SnakeTrainer(model, data=batches(3, 4), config=_cfg(tmp_path / "off")) as t:
        await asyncio.wait_for(t.run(3), T)
        trained = await asyncio.wait_for(t.state_dict(), T)
    _equal_states(model.state_dict(), before)
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert any(not torch.equal(trained[k], before[k]) for k in before)
    model.load_state_dict(trained)
    _equal_states(model.state_dict(), trained)


@pytest.mark.asyncio
async def test_the_models_mode_does_not_change_training(tmp_path):
    """"the trainer also keeps the embedding's and head's dropout on in every run whatever
    mode the model was put in": a model in eval() trains as the same model in train()."""
    states = []
    for i, mode in enumerate(("train", "eval")):
        model = tiny_gpt(n_layer=2, bias=False, dropout=0.2)
        getattr(model, mode)()
        async with SnakeTrainer(model, data=batches(3, 4), config=_cfg(tmp_path / f"off{i}")) as t:
            await asyncio.wait_for(t.run(3), T)
            states.append(await asyncio.wait_for(t.state_dict(), T))
        assert model.training == (mode == "train")
    _equal_states(*states)


@pytest.mark.asyncio
async def test_state_dict_gives_new_tensors(tmp_path):
    """"`await trainer.state_dict()` returns the fp32 master weights ... as new tensors":
    writing into them changes nothing the trainer holds."""
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(4, 4), config=_cfg(tmp_path / "off")) as t:
        await asyncio.wait_for(t.run(2), T)
        first = await asyncio.wait_for(t.state_dict(), T)
        kept = {k: v.clone() for k, v in first.items()}
        for v in first.values():
            v.zero_()
        _equal_states(await asyncio.wait_for(t.state_dict(), T), kept)
        await asyncio.wait_for(t.run(2), T)
        after = await asyncio.wait_for(t.state_dict(), T)
    ref, _ = reference(tiny_gpt(n_layer=2, bias=False), batches(4, 4), 2)
    _close_states(after, ref)


# -- run reports and on_step ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_steps_add_up_to_the_run_and_on_step_gets_each_on_the_loop(tmp_path):
    """"a run's steps add up to its wall time (less the set-up of a trainer's first `run()`),
    and `report.tokens_per_s` is the rate it trained at"; "`on_step` is called on the event
    loop with each step's report as it finishes"."""
    seen, threads = [], set()

    def on_step(r):
        seen.append(r)
        threads.add(threading.get_ident())

    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(8, 4), config=_cfg(tmp_path / "off")) as t:
        await asyncio.wait_for(t.run(2), T)  # the set-up
        start = time.monotonic()
        report = await asyncio.wait_for(t.run(5, on_step=on_step), T)
        wall = time.monotonic() - start
    assert seen == report.steps and [s.step for s in seen] == [2, 3, 4, 5, 6]
    assert threads == {threading.get_ident()}
    assert all(s.tokens == 4 * 16 for s in report.steps)
    # the steps' and the time after the last one (its on_step's)
    assert report.seconds == pytest.approx(sum(s.seconds for s in report.steps) + report.tail_s)
    assert report.seconds <= wall + 1e-3 and report.seconds >= 0.7 * wall - 0.1, (report.seconds, wall)
    assert report.tokens_per_s == pytest.approx(5 * 64 / report.seconds)


@pytest.mark.asyncio
async def test_the_rate_counts_over_every_run_and_each_step_reports_it(tmp_path):
    """"`AdamW(lr=3e-4, lr_schedule=f)` steps iteration i (0-based, counted over every run
    and across `save`/`load`) with the rate `lr * f(i)`"; "Each step's report carries its
    rate (`.lr`)"."""
    f = lambda i: 1.0 / (i + 1)  # noqa: E731
    data = batches(6, 4)
    cfg = lambda d: _cfg(d, optimizer=AdamW(lr=1e-3, lr_schedule=f))  # noqa: E731
    lrs = []
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=data, config=cfg(tmp_path / "a")) as t:
        lrs += [s.lr for s in (await asyncio.wait_for(t.run(2), T)).steps]
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=data, config=cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        lrs += [s.lr for s in (await asyncio.wait_for(t.run(1), T)).steps]
        lrs += [s.lr for s in (await asyncio.wait_for(t.run(3), T)).steps]
        got = await asyncio.wait_for(t.state_dict(), T)
    assert lrs == pytest.approx([1e-3 * f(i) for i in range(6)], rel=1e-12)
    ref, _ = reference(tiny_gpt(n_layer=2, bias=False), data, 2, lr=1e-3, lr_lambda=f)
    _close_states(got, ref)


# -- data -----------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_list_with_fewer_batches_than_the_run_is_refused_before_it_trains(tmp_path):
    """"A list ... says how many batches it has: `run(steps)` is refused before it trains
    where there are fewer (a `snake.DataExhausted` where none are left)"."""
    data = batches(3, 4)
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=data, config=_cfg(tmp_path / "off")) as t:
        with pytest.raises(DataError) as e:
            await asyncio.wait_for(t.run(4), T)
        assert not isinstance(e.value, DataExhausted)
        await asyncio.wait_for(t.run(1), T)
        with pytest.raises(DataError):
            await asyncio.wait_for(t.run(3), T)
        assert len((await asyncio.wait_for(t.run(2), T)).steps) == 2
        with pytest.raises(DataExhausted):
            await asyncio.wait_for(t.run(1), T)
        got = await asyncio.wait_for(t.state_dict(), T)
    ref, _ = reference(tiny_gpt(n_layer=2, bias=False), data, 2)
    _close_states(got, ref)


@pytest.mark.asyncio
async def test_ignored_targets_weigh_micro_batches_as_one_big_batch(tmp_path):
    """"Targets of -100 ... are not trained on: the mean is over the other targets of the
    global batch, so a micro-batch weighs by how many it keeps, as in one big batch"."""
    data = []
    for x, y in batches(3, 4):
        y = y.clone()
        y[:2, 3:] = -100  # the first micro-batch keeps far fewer targets than the second
        data.append((x, y))
    model = tiny_gpt(n_layer=2, bias=False)
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(m(x).reshape(-1, 96), y.reshape(-1), ignore_index=-100)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    async with SnakeTrainer(model, data=data, config=_cfg(tmp_path / "off", optimizer=AdamW(lr=1e-3))) as t:
        report = await asyncio.wait_for(t.run(3), T)
        got = await asyncio.wait_for(t.state_dict(), T)
    assert [s.loss for s in report.steps] == pytest.approx(losses, rel=1e-5)
    _close_states(got, m.state_dict())


# -- evaluate() --------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_evaluate_batches_of_any_shape_and_ignored_targets(tmp_path):
    """"`.loss`, the mean cross-entropy over every target token that is not -100, `.tokens`,
    `.batches`"; "forward only with dropout off"; "(of at most the training micro-batch's
    rows: batches of any size and length)"."""
    g = torch.Generator().manual_seed(5)
    held = []
    for rows, seq in ((4, 16), (3, 8), (7, 12), (1, 5)):
        x = torch.randint(0, 96, (rows, seq + 1), generator=g)
        y = x[:, 1:].clone()
        y[0, : seq // 2] = -100
        held.append((x[:, :-1].contiguous(), y))
    model = tiny_gpt(n_layer=2, bias=False, dropout=0.3)
    async with SnakeTrainer(model, data=batches(3, 4), config=_cfg(tmp_path / "off")) as t:
        await asyncio.wait_for(t.run(2), T)
        state = await asyncio.wait_for(t.state_dict(), T)
        first = await asyncio.wait_for(t.evaluate(held), T)
        again = await asyncio.wait_for(t.evaluate(iter(held)), T)
    loss, count = _eval_loss(model, state, held)
    assert first.batches == 4 and first.tokens == count
    assert first.loss == pytest.approx(loss, rel=1e-5)
    assert again.loss == first.loss and again.tokens == count


@pytest.mark.asyncio
async def test_evaluate_max_batches_and_one_batch_per_pass(tmp_path):
    """"`await trainer.evaluate(data, max_batches=None, batches_per_pass=None)`";
    "`batches_per_pass=k` caps a pass at k batches"; `.passes`: how many times the model
    was streamed."""
    held = batches(5, 4, seed=9)
    model = tiny_gpt(n_layer=2, bias=False)
    async with SnakeTrainer(model, data=batches(3, 4), config=_cfg(tmp_path / "off")) as t:
        two = await asyncio.wait_for(t.evaluate(iter(held), max_batches=2), T)
        ones = await asyncio.wait_for(t.evaluate(held, batches_per_pass=1), T)
        state = await asyncio.wait_for(t.state_dict(), T)
    assert two.batches == 2 and two.tokens == 2 * 64
    assert two.loss == pytest.approx(_eval_loss(model, state, held[:2])[0], rel=1e-5)
    assert ones.batches == 5 and ones.passes == 5
    assert ones.loss == pytest.approx(_eval_loss(model, state, held)[0], rel=1e-5)


# -- float16 ------------------------------------------------------------------------------------


def test_the_dynamic_scale_has_gradscalers_defaults():
    """"`loss_scale=snake.DynamicLossScale()`, with GradScaler's arguments and defaults:
    `init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000`"."""
    torch_defaults = inspect.signature(torch.amp.GradScaler.__init__).parameters
    ours = DynamicLossScale()
    for name in ("init_scale", "growth_factor", "backoff_factor", "growth_interval"):
        assert getattr(ours, name) == torch_defaults[name].default, name


@pytest.mark.asyncio
async def test_float16_scales_by_1024_by_default_and_reports_it(tmp_path):
    """"fp16 scales the loss: by a fixed number (`loss_scale=1024.0`, the default)"; "Each
    step's report carries the scale its backward used (`.loss_scale`)"."""
    assert SnakeConfig(dtype="float16", offload_dir=tmp_path / "x").loss_scale == 1024.0
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(3, 4),
                            config=_cfg(tmp_path / "off", dtype="float16")) as t:
        report = await asyncio.wait_for(t.run(3), T)
    assert [s.loss_scale for s in report.steps] == [1024.0] * 3
    assert not any(s.skipped for s in report.steps)
    assert all(math.isfinite(s.loss) for s in report.steps)


# -- save() -------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_save_into_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path):
    """"`dir` must be new, empty or an earlier checkpoint": a directory of other files is
    refused, left as it was, and the trainer goes on; an empty one is fine."""
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    empty = tmp_path / "empty"
    empty.mkdir()
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(4, 4), config=_cfg(tmp_path / "off")) as t:
        await asyncio.wait_for(t.run(2), T)
        with pytest.raises(SnakeError, match="not a snake checkpoint"):
            await asyncio.wait_for(t.save(other), T)
        assert sorted(p.name for p in other.iterdir()) == ["todo.txt"]
        await asyncio.wait_for(t.save(empty), T)
        await asyncio.wait_for(t.save(empty), T)  # over an earlier checkpoint
        await asyncio.wait_for(t.run(2), T)
        got = await asyncio.wait_for(t.state_dict(), T)
    ref, _ = reference(tiny_gpt(n_layer=2, bias=False), batches(4, 4), 2)
    _close_states(got, ref)
    assert (empty / "manifest.json").is_file()


# -- failures ------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_exceptions_of_other_calls_hold_no_trainer(tmp_path):
    """"An exception a trainer's call raises ..., kept by a service's job record, holds no
    trainer: the locals of snake's frames in its traceback are cleared ..., so a closed
    trainer's engine, tiers and model go when you drop the trainer": evaluate(), save(),
    load() and run(data=...) refusals kept."""
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")

    def bad_eval():
        yield batches(1, 4)[0]
        raise ValueError("a bad held-out batch")

    model = tiny_gpt(n_layer=2, bias=False)
    t = SnakeTrainer(model, data=batches(4, 4), config=_cfg(tmp_path / "off"))
    refs = [weakref.ref(t), weakref.ref(model)]
    await asyncio.wait_for(t.run(1), T)
    refs.append(weakref.ref(t.engine))
    kept = await _failures(t, bad_eval(), other, tmp_path / "missing")
    assert all(isinstance(e, SnakeError) for e in kept), kept
    await t.close()
    del t, model
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


async def _failures(t, bad_eval, other, missing) -> list[BaseException | None]:
    """Each call in a task of its own, its exception kept as a job record keeps it."""
    kept = []
    for coro in (t.evaluate(bad_eval), t.save(other), t.run(1, data=batches(2, 3)), t.load(missing)):
        task = asyncio.ensure_future(coro)
        del coro
        await asyncio.wait([task], timeout=T)
        kept.append(task.exception())
    return kept
