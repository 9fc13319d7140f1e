"""An audit of what the run reports say (README: `StepReport` / `RunReport` and `on_step`,
`snake train`'s report.json, progress bar and last line, `trainer.trace.summary()`), each
field against a computation of its own: plain PyTorch's loss per step on the whole global
batch, `clip_grad_norm_`'s norm, LambdaLR's rate, GradScaler's scale and skips, the wall
clock around the calls, `trainer.traffic()` summed over the steps, and PyTorch's eval-mode
loss of the weights a checkpoint holds. No expected number is written in here: each comes
from such a computation or from a definition the README gives."""

from __future__ import annotations

import asyncio
import copy
import json
import math
import re
import threading
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

from snake import AdamW, DynamicLossScale, Placement, SnakeConfig, SnakeTrainer
from snake.lr import WarmupConstant, WarmupCosine, WarmupLinear
from tests.helpers import batches, tiny_gpt

T = 60.0  # a timeout for each call that could hang
MIXED = Placement(param=0.5, ckpt=0.5, opt=0.5, grad=0.0)
LR, WD = 1e-3, 0.01


def gpt() -> torch.nn.Module:
    return tiny_gpt(n_layer=2, n_embd=32, bias=False)


def config(path, **kw) -> SnakeConfig:
    return SnakeConfig(**{"micro_batches": 2, "device": "cpu", "offload_dir": path, "stall_timeout_s": 30.0,
                          "alpha": 0.5, "placement": MIXED, **kw})


def ignoring(data: list, seed: int = 5) -> list:
    """-100 spread unevenly: each row drops a share of its targets at random places, the
    share going 0 .. 1 down the rows (the last two rows all) and rotating by two rows from
    batch to batch, so micro-batches keep very different counts (of two rows, one keeps
    none) and no batch keeps all or none."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b, (x, y) in enumerate(data):
        rows, seq = y.shape
        p = torch.linspace(0.0, 1.0, rows)
        p[-2:] = 1.0
        p = p.roll(2 * b)[:, None]
        y = y.masked_fill(torch.rand(rows, seq, generator=g) < p, -100)
        assert 0 < int((y != -100).sum()) < y.numel()
        out.append((x, y))
    return out


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """torch's kernels (snake's compute thread's and the references') on one thread: on this
    2-core machine shared with other test processes, torch's OpenMP team of two made a step
    of the tiny GPT take 0.03 to 2 s, and the float16 reference 2.4 s against 0.05 s. The
    numbers the reports carry are checked within tolerances no thread count changes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def torch_steps(model: torch.nn.Module, data, *, lr: float = LR, wd: float = WD, lr_lambda=None,
                max_norm: float = math.inf) -> list[tuple[float, float, float]]:
    """Plain PyTorch on each whole global batch (README: "the result equals one big batch with
    plain PyTorch and torch.optim.AdamW"): (mean cross-entropy over the targets not -100, the
    norm `clip_grad_norm_(parameters, max_norm)` returns, the rate `optimizer.step()` used)
    per step; LambdaLR stepped after each step."""
    m = copy.deepcopy(model)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd)
    sched = None if lr_lambda is None else torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    out = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        logits = m(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
        rate = opt.param_groups[0]["lr"]
        opt.step()
        if sched is not None:
            sched.step()
        out.append((float(loss.detach()), float(norm), float(rate)))
    return out


def link_sums(traffics: list[dict]) -> dict[str, int]:
    """{"src->dst": bytes} of `trainer.traffic()` dicts ({(src, dst, kind): bytes}) summed."""
    out: dict[str, int] = {}
    for traffic in traffics:
        for (src, dst, _kind), n in traffic.items():
            out[f"{src}->{dst}"] = out.get(f"{src}->{dst}", 0) + n
    return {k: v for k, v in out.items() if v}


def check_summary(summary: dict) -> None:
    """trace.summary(): a busy fraction per actor in [0, 1], its busy seconds over the wall."""
    wall = summary["wall_s"]
    assert wall > 0
    assert summary["actors"], "no actor in the summary"
    for actor, v in summary["actors"].items():
        assert 0.0 <= v["busy_fraction"] <= 1.0, (actor, v)
        assert 0.0 <= v["busy_s"] <= wall * (1 + 1e-9), (actor, v, wall)
        assert v["busy_fraction"] == pytest.approx(v["busy_s"] / wall, rel=1e-9), (actor, v, wall)
    loop = summary.get("event_loop")
    if loop is not None:
        assert 0.0 <= loop["cpu_fraction"] <= 1.0 + 1e-9 and loop["cpu_s"] <= loop["run_wall_s"] * (1 + 1e-9), loop


# -- each step's loss, norm, tokens and rate; the trace's links -----------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,micro,alpha,bound", [
    ("vertical", 4, 0.5, math.inf), ("horizontal", 2, 0.0, math.inf), ("vertical", 1, 0.0, math.inf),
    ("horizontal", 4, 1.0, 0.3),  # clipped (the tiny GPT's norms are about 1 here): every step waits for the norm
])
async def test_each_steps_loss_norm_rate_and_tokens_with_targets_ignored_unevenly(tmp_path, schedule, micro, alpha,
                                                                                  bound):
    """"the loss is the mean cross-entropy over the whole global batch ... Targets of -100 ...
    the mean is over the other targets of the global batch"; "`max_grad_norm=math.inf` only
    measures the norm (`.grad_norm`), at any alpha"; `AdamW(max_grad_norm=...)` with `alpha=1.0`
    clips "as `torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` before
    `optimizer.step()` does" and reports "the norm before clipping (`.grad_norm`, what
    `clip_grad_norm_` returns)"; "Each step's report carries its rate (`.lr`)"; the `.step`s of runs one after
    the other go on; trace.summary()'s links are "the bytes the schedule moved (what
    `trainer.traffic()` counts)", and its busy fractions are fractions of its wall time.
    `.tokens` is not defined by the README: snake counts every target of the batch, the
    ignored ones too (`snake.data.split_batch`), which is what this checks."""
    model = gpt()
    data = ignoring(batches(3, 8))
    want = torch_steps(model, data, max_norm=bound)
    cfg = config(tmp_path / "off", micro_batches=micro, schedule=schedule, alpha=alpha,
                 optimizer=AdamW(lr=LR, weight_decay=WD, max_grad_norm=bound))
    steps, traffics = [], []
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        for _ in range(3):  # one step per run: traffic() is the last step's
            report = await asyncio.wait_for(t.run(1), T)
            steps += report.steps
            traffics.append(t.traffic())
            assert report.traffic == traffics[-1] and not report.stopped
        summary = t.trace.summary()
    assert [s.step for s in steps] == [0, 1, 2]
    assert [s.loss for s in steps] == pytest.approx([w[0] for w in want], rel=1e-5)
    assert [s.grad_norm for s in steps] == pytest.approx([w[1] for w in want], rel=1e-5)
    assert [s.lr for s in steps] == [w[2] for w in want]
    assert [s.tokens for s in steps] == [y.numel() for _, y in data]
    if math.isfinite(bound):
        assert min(w[1] for w in want) > bound, "the reference did not clip every step"
    assert all(s.loss_scale is None and s.skipped is False for s in steps)
    assert all(0.0 <= s.data_wait_s <= s.seconds for s in steps)
    check_summary(summary)
    moved = {link: v["bytes"] for link, v in summary["links"].items() if v["bytes"]}
    assert moved == link_sums(traffics), "the trace's bytes per link are not the steps' traffic() summed"


# -- learning rates ---------------------------------------------------------------------------------


def cosine(i: int, *, warmup: int, total: int, floor: float) -> float:
    """README: transformers' cosine factor (warm-up from 0, then half a cosine from 1 down to
    `floor` at `total`), staying at `floor` after `total`."""
    if i < warmup:
        return i / warmup
    if i >= total:
        return floor
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (i - warmup) / (total - warmup)))


def linear(i: int, *, warmup: int, total: int, floor: float) -> float:
    """README: transformers' linear factor, staying at `floor` after `total`."""
    if i < warmup:
        return i / warmup
    if i >= total:
        return floor
    return floor + (1 - floor) * (total - i) / (total - warmup)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
async def test_each_steps_rate_is_the_schedules_over_runs_and_past_its_end(tmp_path, kind):
    """"`AdamW(lr=3e-4, lr_schedule=f)` steps iteration i (0-based, counted over every run ...)
    with the rate `lr * f(i)`, as `torch.optim.lr_scheduler.LambdaLR(optimizer, f)` stepped
    after each `optimizer.step()` does"; `WarmupConstant`, `WarmupLinear` and `WarmupCosine` "give
    transformers' factors ... and stay at `min_ratio` after it"; "Each step's report carries its rate";
    "`run()` without `steps` trains as many steps as the data has left ... an iterator's until
    it runs out ... (each step's learning rate is then checked as its batch comes)". The
    reference is LambdaLR over the formula written out here; the losses say the rates
    reported are the rates the weights were stepped with."""
    total, warmup, floor, n = 3, 1, 0.2, 5  # steps 0 .. 4: the warm-up, the decay, its end and past it
    if kind == "constant":
        warmup = 2
        schedule = WarmupConstant(warmup_steps=warmup)
    else:
        schedule = (WarmupCosine if kind == "cosine" else WarmupLinear)(total_steps=total, warmup_steps=warmup,
                                                                        min_ratio=floor)

    def factor(i: int) -> float:
        if kind == "constant":  # transformers' get_constant_schedule_with_warmup
            return i / warmup if i < warmup else 1.0
        return (cosine if kind == "cosine" else linear)(i, warmup=warmup, total=total, floor=floor)

    model = gpt()
    data = batches(n, 4)
    want = torch_steps(model, data, lr_lambda=factor)
    cfg = config(tmp_path / "off", optimizer=AdamW(lr=LR, weight_decay=WD, lr_schedule=schedule))
    async with SnakeTrainer(model, data=iter(data), config=cfg) as t:
        first = await asyncio.wait_for(t.run(2), T)
        rest = await asyncio.wait_for(t.run(), T)  # to the iterator's end
    steps = first.steps + rest.steps
    assert [s.step for s in steps] == list(range(n)) and not rest.stopped
    assert [s.lr for s in steps] == pytest.approx([w[2] for w in want], rel=1e-12, abs=1e-15)
    assert [s.lr for s in steps] == pytest.approx([LR * factor(i) for i in range(n)], rel=1e-12, abs=1e-15)
    assert steps[0].lr == 0.0  # "the warm-up starts from 0, so the first step's rate is 0"
    assert [s.loss for s in steps] == pytest.approx([w[0] for w in want], rel=1e-5)


# -- step numbering across runs, a stop, a save and a load ---------------------------------------


@pytest.mark.asyncio
async def test_steps_are_numbered_on_across_runs_a_stop_and_a_load_each_with_its_batchs_loss(tmp_path):
    """`.step` counts "over every run and across `save`/`load`"; a stopped run "returns the
    steps trained with `report.stopped` set; batches read for steps that did not run come
    first in the next run, so none is lost or trained twice". So the k-th step reported,
    whichever run it came in, is step k, on batch k, with the loss and rate plain PyTorch has
    at step k (a callable schedule, LambdaLR's rate)."""
    f = lambda i: 1.0 / (1.0 + i)  # noqa: E731
    model = gpt()
    data = batches(8, 4)
    want = torch_steps(model, data, lr_lambda=f)
    cfg = lambda d: config(d, optimizer=AdamW(lr=LR, weight_decay=WD, lr_schedule=f))  # noqa: E731
    steps, reports = [], []
    async with SnakeTrainer(model, data=data, config=cfg(tmp_path / "a")) as t:
        reports.append(await asyncio.wait_for(t.run(2), T))
        asked: list[bool] = []
        reports.append(await asyncio.wait_for(t.run(4, on_step=lambda _r: asked.append(t.stop())), T))
        assert asked[0] and reports[-1].stopped and len(reports[-1].steps) < 4
        reports.append(await asyncio.wait_for(t.run(1), T))
        await asyncio.wait_for(t.save(tmp_path / "ck"), T)
    done = sum(len(r.steps) for r in reports)
    async with SnakeTrainer(gpt(), data=data, config=cfg(tmp_path / "b")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ck"), T)
        seen: list = []
        reports.append(await asyncio.wait_for(t.run(8 - done, on_step=seen.append), T))
    assert seen == reports[-1].steps
    assert [r.stopped for r in reports] == [False, True, False, False]
    for s in (s for r in reports for s in r.steps):
        steps.append(s)
    assert [s.step for s in steps] == list(range(8))
    assert [s.loss for s in steps] == pytest.approx([w[0] for w in want], rel=1e-5)
    assert [s.lr for s in steps] == pytest.approx([w[2] for w in want], rel=1e-12)
    for r in reports:
        # its steps', and the time after the last one's end (its on_step's, `tail_s`)
        assert r.seconds == pytest.approx(sum(s.seconds for s in r.steps) + r.tail_s)
        assert 0 <= r.tail_s < 0.05
        assert r.tokens_per_s == pytest.approx(sum(s.tokens for s in r.steps) / r.seconds)
        assert r.data_wait_s == pytest.approx(sum(s.data_wait_s for s in r.steps))


# -- float16's loss scale ------------------------------------------------------------------------


def fp16_gpt() -> torch.nn.Module:
    """The GPT in float16, its head untied (autograd sums a tied weight's two gradients in
    float16, snake in fp32: README)."""
    model = gpt()
    model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
    return model.to(torch.float16)


def grad_scaler_steps(model: torch.nn.Module, data: list, micro: int, scale: DynamicLossScale,
                      lr_lambda) -> list[dict]:
    """Plain PyTorch mixed precision with torch.amp.GradScaler: the model in float16, fp32
    masters, the micro-batches' gradients summed in fp32, unscaled, the norm
    `clip_grad_norm_` returns then, GradScaler's step and update, LambdaLR stepped after
    every `scaler.step`. Per step: loss, the scale its backward used, skipped, norm, rate."""
    m = copy.deepcopy(model)
    m.train()
    params = list(m.parameters())
    masters = [p.detach().float().clone() for p in params]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale.init_scale, growth_factor=scale.growth_factor,
                                  backoff_factor=scale.backoff_factor, growth_interval=scale.growth_interval)
    out = []
    for x, y in data:
        acc: list[torch.Tensor | None] = [None] * len(params)
        total = 0.0
        for xc, yc in zip(x.chunk(micro), y.chunk(micro), strict=True):
            logits = m(xc)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), yc.reshape(-1)) / micro
            total += float(loss.detach())
            for i, g in enumerate(torch.autograd.grad(scaler.scale(loss), params)):
                acc[i] = g.float() if acc[i] is None else acc[i] + g.float()
        for master, g in zip(masters, acc, strict=True):
            master.grad = g
        scaler.unscale_(opt)
        norm = float(torch.nn.utils.clip_grad_norm_(masters, math.inf))
        before, rate = scaler.get_scale(), opt.param_groups[0]["lr"]
        scaler.step(opt)
        scaler.update()
        with warnings.catch_warnings():  # after a step GradScaler skipped, as intended
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)` before")
            sched.step()
        with torch.no_grad():
            for p, master in zip(params, masters, strict=True):
                p.copy_(master)
        out.append({"loss": total, "scale": before, "skipped": scaler.get_scale() < before, "norm": norm,
                    "lr": rate})
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["dynamic", "static"])
async def test_float16_reports_gradscalers_scale_skips_and_the_unscaled_loss_and_norm(tmp_path, kind):
    """"fp16 scales the loss: by a fixed number (`loss_scale=1024.0`, the default), or
    dynamically as `torch.amp.GradScaler` does"; "Each step's report carries the scale its
    backward used (`.loss_scale`), whether it was skipped (`.skipped`) and the norm
    (`.grad_norm`: inf or NaN for a skipped one)"; a skipped iteration's rate: "the
    learning-rate schedule still counts it". The loss reported is the loss, not the scaled
    one, and the norm that of the unscaled gradients (what `clip_grad_norm_` returns after
    `scaler.unscale_`); a fixed scale that never overflows is GradScaler's that never grows,
    with no norm (`.grad_norm` is None without clipping or a dynamic scale) and no skip."""
    f = lambda i: 1.0 / (1.0 + i)  # noqa: E731
    model = fp16_gpt()
    data = batches(4, 4)
    if kind == "dynamic":
        scale = DynamicLossScale(init_scale=2.0**20, growth_interval=1)  # backs off, then grows into overflows again
        want = grad_scaler_steps(model, data, 2, scale, f)
        assert any(w["skipped"] for w in want) and not all(w["skipped"] for w in want), want  # a test of both
        cfg = config(tmp_path / "off", alpha=1.0, dtype="float16", loss_scale=scale,
                     optimizer=AdamW(lr=LR, weight_decay=WD, lr_schedule=f))
    else:
        fixed = SnakeConfig(dtype="float16", offload_dir=tmp_path / "unused").loss_scale  # the default
        want = grad_scaler_steps(model, data, 2, DynamicLossScale(init_scale=fixed, growth_interval=10**6), f)
        assert not any(w["skipped"] for w in want), want
        cfg = config(tmp_path / "off", alpha=0.5, dtype="float16", optimizer=AdamW(lr=LR, weight_decay=WD, lr_schedule=f))
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        report = await asyncio.wait_for(t.run(4), T)
    got = report.steps
    assert [(s.loss_scale, s.skipped) for s in got] == [(w["scale"], w["skipped"]) for w in want]
    assert [s.lr for s in got] == pytest.approx([w["lr"] for w in want], rel=1e-12)
    assert [s.loss for s in got] == pytest.approx([w["loss"] for w in want], rel=1e-4)
    for s, w in zip(got, want, strict=True):
        if kind == "static":
            assert s.grad_norm is None, s
        elif w["skipped"]:
            assert not math.isfinite(s.grad_norm), (s, w)
        else:
            assert s.grad_norm == pytest.approx(w["norm"], rel=1e-4), (s, w)


# -- seconds and the wait for data -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_steps_seconds_run_from_the_step_befores_end_and_add_up_to_the_run(tmp_path):
    """"A step's `.seconds` is wall time, from the end of the step before (for a run's first,
    the start of its steps) to its end ...: a run's steps add up to its wall time (less the
    set-up of a trainer's first `run()`)"; "`on_step` is called ... with each step's report
    as it finishes"; "`.data_wait_s` ... stays near 0 unless the data is slower than
    training" (a list). Measured around the calls: each step's seconds against the time
    between its on_step and the one before, the run's sum against the wall time of `run()`
    (the set-up done by a run before). An `on_step` that takes `pause` (snake's own code
    counts its time as the next step's, `snake/actors/compute.py`): the run's seconds still
    add up to its wall time, the last one's in `report.tail_s` (until round 44 in nothing:
    report.seconds fell short, and tokens_per_s overstated the rate)."""
    pause, n = 0.2, 3
    marks: list[float] = []

    def on_step(_r) -> None:  # type: ignore[no-untyped-def]
        marks.append(time.perf_counter())
        time.sleep(pause)

    async with SnakeTrainer(gpt(), data=batches(n + 1, 4), config=config(tmp_path / "off")) as t:
        await asyncio.wait_for(t.run(1), T)  # the set-up
        start = time.perf_counter()
        report = await asyncio.wait_for(t.run(n, on_step=on_step), T)
        wall = time.perf_counter() - start
    steps = report.steps
    assert len(marks) == n
    for i in range(1, n):  # step i ran from step i-1's end (its report, then on_step) to its own end
        assert steps[i].seconds == pytest.approx(marks[i] - marks[i - 1], abs=0.01), (i, steps[i].seconds)
        assert steps[i].seconds >= pause
    assert steps[0].seconds == pytest.approx(marks[0] - start, abs=0.05)
    assert report.data_wait_s <= 0.25 * report.seconds, [(s.data_wait_s, s.seconds) for s in steps]
    assert all(0.0 <= s.data_wait_s <= s.seconds for s in steps)
    assert report.tail_s == pytest.approx(pause, abs=0.05)
    gap = wall - report.seconds
    assert gap < pause / 2, (
        f"run() took {wall:.3f} s but its steps add up to {report.seconds:.3f} s: {gap:.3f} s, the last on_step's "
        f"{pause} s, is in no step (each on_step's time is counted as the next step's, the last one's nowhere), "
        f"so report.seconds falls short of the run's wall time and tokens_per_s overstates its rate")


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_source_behind_the_steps_shows_its_wait_in_data_wait(tmp_path, kind):
    """"The data is read on a thread of its own (an async iterable on the event loop)";
    "`.data_wait_s` is the part of it the step waited for its batch (`report.data_wait_s`
    over the run)". A source that gives batch i only `delay` after step i-1 ended (its
    on_step): step i (which starts at that end) waits from its start until the source
    yields, whatever the steps' own speed. Each step's wait against that, measured here."""
    delay, n = 0.2, 3
    data = batches(n + 1, 4)
    ended = {i: threading.Event() for i in range(n + 1)}
    yielded: dict[int, float] = {}
    marks: dict[int, float] = {}

    def sync_source():
        for i, item in enumerate(data):
            if i >= 2:  # the set-up run's batch and the first of the next come at once
                assert ended[i - 1].wait(T)
                time.sleep(delay)
            yielded[i] = time.perf_counter()
            yield item

    async def async_source():
        for i, item in enumerate(data):
            if i >= 2:
                while not ended[i - 1].is_set():  # noqa: ASYNC110 - set by on_step, on this loop
                    await asyncio.sleep(0.002)
                await asyncio.sleep(delay)
            yielded[i] = time.perf_counter()
            yield item

    def on_step(r) -> None:  # type: ignore[no-untyped-def]
        marks[r.step] = time.perf_counter()
        ended[r.step].set()

    source = async_source() if kind == "async" else sync_source()
    async with SnakeTrainer(gpt(), data=source, config=config(tmp_path / "off")) as t:
        await asyncio.wait_for(t.run(1, on_step=on_step), T)
        start = time.perf_counter()
        report = await asyncio.wait_for(t.run(n, on_step=on_step), T)
        wall = time.perf_counter() - start
    steps = report.steps
    assert [s.step for s in steps] == list(range(1, n + 1))
    assert report.seconds == pytest.approx(wall, abs=0.05)
    assert report.data_wait_s == pytest.approx(sum(s.data_wait_s for s in steps))
    assert all(0.0 <= s.data_wait_s <= s.seconds for s in steps)
    assert steps[0].data_wait_s <= 0.05, steps[0]  # its batch was in before the run
    for s in steps[1:]:  # from its start (the step before's end) to its batch's yield, and the hand-over
        want = yielded[s.step] - marks[s.step - 1]
        assert want >= delay
        assert s.data_wait_s == pytest.approx(want, abs=0.05), (s.step, s.data_wait_s, want)
    assert report.data_wait_s >= (n - 1) * delay


# -- snake train: report.json, the progress bar and the last line ----------------------------------

GPT = ["--layers", "2", "--embd", "32", "--heads", "2", "--seq", "16", "--batch", "4", "--micro-batches", "2"]
# float32 with --max-grad-norm inf: a norm, no loss scale
STEP_KEYS = {"step": int, "loss": float, "seconds": float, "data_wait_s": float, "tokens": int, "lr": float,
             "grad_norm": float, "loss_scale": type(None), "skipped": bool}


def _no_constant(name: str) -> None:
    raise AssertionError(f"report.json holds {name}: not strict JSON")


def torch_eval_loss(model: torch.nn.Module, data: list) -> float:
    """PyTorch's eval-mode mean cross-entropy over every target not -100, in float64 sums."""
    m = copy.deepcopy(model)
    m.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in data:
            logits = m(x).double()
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100,
                                           reduction="sum"))
            count += int((y != -100).sum())
    return total / count


def test_snake_train_report_json_progress_bar_and_last_line_are_the_runs(tmp_path, capsys):
    """report.json (strict JSON): each step's numbers as plain PyTorch has them on the same
    windows from the same initial weights (its loss, `--max-grad-norm inf`'s norm, "the norm
    alone", and `--lr-schedule cosine --warmup-steps 1`'s rate, decaying "to reach 0 just
    after the run's last step (at step index N)"), the run's `data_wait_s` their sum
    ("`report.json` has it per step and in all"), `tokens_per_s` the tokens over
    `wall_seconds` (the runs, "their setup included", so at least the steps' seconds),
    `val_loss` "before and after training" the eval-mode loss of the initial and the trained
    weights on the held-out windows (PyTorch's, on the weights its --checkpoint holds, and
    `trainer.evaluate` of them), `trace_summary`'s fractions; the progress bar's last state
    shows the last step's loss, tokens/s, rate and norm; the last line "loss A -> B in W s;
    held-out loss C -> D"."""
    from snake import cli
    from snake.corpus import holdout_windows, pydoc_bytes, random_windows
    from snake.models import GPT as GPTModel
    from snake.models import GPTConfig

    out, ck = tmp_path / "out", tmp_path / "ck"
    steps, evals, seed, batch, seq = 3, 2, 3, 4, 16
    capsys.readouterr()
    assert cli.main(["train", *GPT, "--steps", str(steps), "--eval-batches", str(evals), "--seed", str(seed),
                     "--lr-schedule", "cosine", "--warmup-steps", "1", "--max-grad-norm", "inf",
                     "--out", str(out), "--offload-dir", str(tmp_path / "off"), "--checkpoint", str(ck)]) == 0
    printed = capsys.readouterr()
    r = json.loads((out / "report.json").read_text(), parse_constant=_no_constant)
    opt = r["config"]["optimizer"]

    # plain PyTorch on the windows `snake train` draws, from the model it builds
    corpus = pydoc_bytes()
    torch.manual_seed(seed)  # as `snake train` builds its model
    model = GPTModel(GPTConfig(**r["model"]))
    assert r["model"]["dropout"] == 0.0  # else PyTorch's steps would draw other masks
    windows = random_windows(corpus, batch=batch, seq=seq, seed=seed, holdout=cli.HOLDOUT)
    data = [next(windows) for _ in range(steps)]
    want = torch_steps(model, data, lr=opt["lr"], wd=opt["weight_decay"],
                       lr_lambda=lambda i: cosine(i, warmup=1, total=steps, floor=0.0))

    # each step: the documented keys, each of its type, and PyTorch's numbers
    assert [s["step"] for s in r["steps"]] == list(range(steps))
    for s in r["steps"]:
        assert s.keys() == STEP_KEYS.keys(), s
        assert all(isinstance(s[k], kind) for k, kind in STEP_KEYS.items()), s
        assert s["seconds"] > 0 and 0 <= s["data_wait_s"] <= s["seconds"], s
        assert s["tokens"] == batch * seq and s["skipped"] is False, s
    assert [s["loss"] for s in r["steps"]] == pytest.approx([w[0] for w in want], rel=1e-5)
    assert [s["grad_norm"] for s in r["steps"]] == pytest.approx([w[1] for w in want], rel=1e-5)
    assert [s["lr"] for s in r["steps"]] == pytest.approx([w[2] for w in want], rel=1e-12, abs=1e-18)
    seconds = sum(s["seconds"] for s in r["steps"])
    assert r["data_wait_s"] == pytest.approx(sum(s["data_wait_s"] for s in r["steps"]))
    assert r["wall_seconds"] >= seconds
    assert r["tokens_per_s"] == pytest.approx(sum(s["tokens"] for s in r["steps"]) / r["wall_seconds"])
    check_summary(r["trace_summary"])

    # val_loss: PyTorch's eval-mode loss of the initial weights and of the checkpoint's
    held = holdout_windows(corpus, batch=batch, seq=seq, batches=evals, holdout=cli.HOLDOUT)
    assert r["val_loss"]["before"] == pytest.approx(torch_eval_loss(model, held), rel=1e-5)
    cfg = SnakeConfig(micro_batches=2, alpha=r["config"]["alpha"], seed=seed, device="cpu",
                      offload_dir=tmp_path / "off2", placement=Placement.all_cpu(),
                      optimizer=AdamW(max_grad_norm=math.inf))

    async def loaded():  # the checkpoint's weights, and snake's evaluation of them
        async with SnakeTrainer(model, data=held, config=cfg) as t:
            await asyncio.wait_for(t.load(ck, skip_data=False), T)
            return await asyncio.wait_for(t.state_dict(), T), await asyncio.wait_for(t.evaluate(held), T)

    state, again = asyncio.run(loaded())
    trained = copy.deepcopy(model)
    trained.load_state_dict(state)
    after = r["val_loss"]["after"]
    assert after == pytest.approx(torch_eval_loss(trained, held), rel=1e-5)
    assert after == pytest.approx(again.loss, rel=1e-6)

    # the last line, and the progress bar's last state (tqdm, on stderr)
    last = printed.out.strip().splitlines()[-1]
    first, final = r["steps"][0], r["steps"][-1]
    assert last.startswith(f"loss {first['loss']:.4f} -> {final['loss']:.4f} in {r['wall_seconds']:.1f} s; "
                           f"held-out loss {r['val_loss']['before']:.4f} -> {after:.4f}"), last
    states = [line for line in printed.err.replace("\r", "\n").splitlines() if f"{steps}/{steps}" in line]
    assert states, printed.err
    shown = {k.strip(): v for k, v in re.findall(r"([\w/ ]+)=([^,\]]+)", states[-1])}
    assert shown.get("loss") == f"{final['loss']:.4f}", states[-1]
    assert shown.get("tok/s") == f"{final['tokens'] / final['seconds']:.0f}", states[-1]
    assert shown.get("lr") == f"{final['lr']:.2e}", states[-1]
    assert shown.get("gnorm") == f"{final['grad_norm']:.3f}", states[-1]
