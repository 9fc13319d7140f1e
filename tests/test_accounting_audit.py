"""An audit of what snake reports about bytes and memory, against an independent count.

The SSD tier's reads and writes are counted where they happen (TierStore.read_tail /
write_tail, and below them the backend's pread / pwrite: the bytes the O_DIRECT calls
move, each rounded up to a 4 KiB block) and compared with `trainer.traffic()`, the run
report, the trace's per-link totals (and trace.json's), the planner's
`Plan.ssd_bytes_per_iteration` and the files under `offload_dir`. Every expectation is
computed here from the model's parameter counts, the batch shape, the shares and the
paper's traffic model (GreedySnake section 3: each layer's parameters are loaded twice
per iteration by vertical, twice per micro-batch by horizontal; optimizer states on SSD
are read and written once per iteration; the delayed gradients go to SSD and back once,
but layer 0's), never from snake's own counters."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

import pytest
import torch

from planner.model import phases_for
from planner.profile import MachineProfile, shape_of_parts
from planner.solve import Plan, solve
from snake import DynamicLossScale, Placement, SnakeConfig, SnakeTrainer
from snake.adapters import describe
from snake.io.posix import PosixFile
from snake.stores import TierStore
from snake.trace import load_trace
from tests.helpers import batches, tiny_gpt

ALIGN = 4096
SEQ = 16
EMBD = 32
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# -- the independent count ---------------------------------------------------------------


class IO:
    """Every SSD transfer of the tier stores: (kind, "r"/"w", bytes of the unit's SSD part),
    and every backend call: (file name, "r"/"w", bytes the pread/pwrite moved)."""

    def __init__(self) -> None:
        self.store: list[tuple[str, str, int]] = []
        self.backend: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()

    def mark(self) -> tuple[int, int]:
        return len(self.store), len(self.backend)

    def since(self, mark: tuple[int, int] = (0, 0)) -> Counter:
        """Bytes per (kind, "r"/"w") since `mark`, the resident state's counted as its own kind."""
        out: Counter = Counter()
        for kind, op, n in self.store[mark[0]:]:
            out[(kind, op)] += n
        return out

    def check_backend(self, mark: tuple[int, int] = (0, 0)) -> None:
        """The backend moved each store transfer's bytes rounded up to whole 4 KiB blocks."""
        want: Counter = Counter()
        for kind, op, n in self.store[mark[0]:]:
            want[(f"{kind}.bin", op)] += -(-n // ALIGN) * ALIGN
        got: Counter = Counter()
        for name, op, n in self.backend[mark[1]:]:
            got[(name, op)] += n
        assert got == want, f"backend pread/pwrite bytes {dict(got)} are not the stores' transfers {dict(want)}"


@pytest.fixture
def io(monkeypatch) -> IO:
    rec = IO()
    read_tail, write_tail = TierStore.read_tail, TierStore.write_tail
    pread, pwrite = PosixFile.pread, PosixFile.pwrite

    def nbytes(store: TierStore, u) -> int:  # the unit's SSD part: (n - k) elements per component
        return u.comps * (u.n - u.k) * torch.empty((), dtype=store.dtype).element_size()

    def r(self, u, buf):  # type: ignore[no-untyped-def]
        read_tail(self, u, buf)
        rec.store.append((self.kind, "r", nbytes(self, u)))

    def w(self, u, buf):  # type: ignore[no-untyped-def]
        write_tail(self, u, buf)
        rec.store.append((self.kind, "w", nbytes(self, u)))

    def pr(self, buf, offset):  # type: ignore[no-untyped-def]
        pread(self, buf, offset)
        rec.backend.append((self.path.name, "r", len(buf)))

    def pw(self, buf, offset):  # type: ignore[no-untyped-def]
        pwrite(self, buf, offset)
        rec.backend.append((self.path.name, "w", len(buf)))

    monkeypatch.setattr(TierStore, "read_tail", r)
    monkeypatch.setattr(TierStore, "write_tail", w)
    monkeypatch.setattr(PosixFile, "pread", pr)
    monkeypatch.setattr(PosixFile, "pwrite", pw)
    return rec


def ssd_traffic(traffic: dict) -> Counter:
    """traffic() in the IO's terms: (kind, "r") for ssd->cpu, (kind, "w") for cpu->ssd."""
    out: Counter = Counter()
    for (src, dst, kind), n in traffic.items():
        if src == "ssd":
            out[(kind, "r")] += n
        elif dst == "ssd":
            out[(kind, "w")] += n
    return out


def as_traffic(io_bytes: Counter) -> Counter:
    """The IO's count as traffic() labels it: the resident optimizer state is "opt" traffic."""
    out: Counter = Counter()
    for (kind, op), n in io_bytes.items():
        out[("opt" if kind == "resident" else kind, op)] += n
    return out


def trained(model) -> list[int]:
    return [sum(p.numel() for p in b.parameters() if p.requires_grad) for b in model.blocks]


def streamed_frozen(model) -> list[int]:
    return [sum(p.numel() for p in b.parameters() if not p.requires_grad) for b in model.blocks]


def resident(model) -> int:
    """Trained parameters outside the blocks (embeddings, final norm; the head is tied)."""
    seen = {id(p) for b in model.blocks for p in b.parameters()}
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()
               if p.requires_grad and id(p) not in seen)


def parts(n: int, alpha: float) -> list[int]:
    """A layer's optimizer step: the first 1 - alpha of its elements now, alpha delayed."""
    if alpha >= 1.0:
        return [0, n]
    d = round(alpha * n)
    return [n - d, d]


def ssd_part(n: int, share: float) -> int:
    """Elements of a unit of n elements not in CPU memory at a CPU share (its first
    round(share x n) elements are)."""
    return n - (n if share >= 1.0 else round(share * n))


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def ckpt_units_on_ssd(units: int, share: float) -> int:
    return units - int(share * units + 0.5)


def expected(model, *, schedule: str, alpha: float, pl: Placement, m: int, rows: int, dtype: str,
             first: bool = False) -> Counter:
    """SSD bytes of one iteration per (kind, r/w) for a model without frozen parameters:
    `first`, the first iteration of a trainer (no delayed step of an iteration before)."""
    db, n_layer = BYTES[dtype], len(model.blocks)
    loads = 2 if schedule == "vertical" else 2 * m
    out: Counter = Counter()
    for n in trained(model):
        now, delayed = parts(n, alpha)
        stepped = [now] if first else [now, delayed]
        out[("param", "r")] += loads * (ssd_part(now, pl.param) + ssd_part(delayed, pl.param)) * db
        out[("param", "w")] += sum(ssd_part(k, pl.param) for k in stepped) * db
        out[("opt", "r")] += sum(ssd_part(k, pl.opt) for k in stepped) * 12
        out[("opt", "w")] += sum(ssd_part(k, pl.opt) for k in stepped) * 12
    ck = rows * SEQ * EMBD * db
    out[("ckpt", "r")] = out[("ckpt", "w")] = ckpt_units_on_ssd(n_layer * m, pl.ckpt) * ck
    if schedule == "vertical" and alpha > 0:
        assert pl.grad == 0.0 and pl.param == 0.0, "the closed form: every delayed gradient on SSD"
        moved = sum(parts(n, alpha)[1] for n in trained(model)[1:]) * 4  # layer 0's stays in its buffer
        out[("grad", "w")] = moved
        out[("grad", "r")] = 0 if first else moved
    return +out


def profile(model, rows: int, dtype: str) -> MachineProfile:
    """A profile of unit costs and memory to spare: Plan.ssd_bytes_per_iteration depends on
    the model's shape, the shares, micro-batches and alpha alone."""
    shape = shape_of_parts(describe(model), rows, SEQ, dtype)
    return MachineProfile(
        fwd_seconds=1.0, recompute_seconds=1.0, bwd_seconds=1.0, pre_post_seconds=1.0, h2d_bytes_per_s=1.0,
        d2h_bytes_per_s=1.0, ssd_read_bytes_per_s=1.0, ssd_write_bytes_per_s=1.0, adam_elems_per_s=1.0,
        cpu_memory_bytes=2.0**40, device_memory_bytes=2.0**40, shape=shape, device="cpu")


def config(tmp_path, **kw) -> SnakeConfig:
    return SnakeConfig(device="cpu", offload_dir=tmp_path, **kw)


def gpt(n_layer: int = 3):
    return tiny_gpt(n_layer=n_layer, n_embd=EMBD, bias=False)


def link_bytes(trainer) -> dict[str, float]:
    return {k: v["bytes"] for k, v in trainer.trace.summary()["links"].items()}


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


# -- traffic() against the backend, the closed form and the planner ----------------------

CASES = [
    # schedule, alpha, placement, micro-batches, dtype
    ("vertical", 0.0, Placement(param=0.5, ckpt=0.5, opt=0.5), 2, "float32"),
    ("vertical", 0.5, Placement(param=0.0, ckpt=0.0, opt=0.0, grad=0.0), 4, "bfloat16"),
    ("vertical", 1.0, Placement(param=0.0, ckpt=1.0, opt=0.5, grad=0.0), 1, "float16"),
    ("horizontal", 0.5, Placement(param=0.5, ckpt=0.5, opt=1.0), 2, "float32"),
    ("horizontal", 0.0, Placement(param=0.0, ckpt=0.0, opt=0.0), 1, "bfloat16"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("schedule", "alpha", "pl", "m", "dtype"), CASES)
async def test_traffic_is_what_the_backend_moves_and_the_model_predicts(tmp_path, io, schedule, alpha, pl, m, dtype):
    """After a first iteration, the next: the stores' SSD transfers are traffic()'s ssd<->cpu
    counts, the run report's, and what the trace's link totals grew by; the backend's
    O_DIRECT calls moved them (in whole blocks); they are the closed form of the paper's
    model (vertical loads a layer's parameters twice per iteration whatever the
    micro-batches, horizontal twice per micro-batch) and the planner's
    Plan.ssd_bytes_per_iteration for that placement."""
    model, rows = gpt(), 1
    extra = {"loss_scale": DynamicLossScale()} if dtype == "float16" else {}
    cfg = config(tmp_path, micro_batches=m, placement=pl, alpha=alpha, schedule=schedule, dtype=dtype, **extra)
    async with SnakeTrainer(model, data=batches(2, rows * m), config=cfg) as t:
        await asyncio.wait_for(t.run(1), 60)
        mark, links = io.mark(), link_bytes(t)
        report = await asyncio.wait_for(t.run(1), 60)
        moved = io.since(mark)
        traffic = t.traffic()
        grown = delta(link_bytes(t), links)
    io.check_backend(mark)
    per_iteration = ssd_traffic(traffic)
    assert report.traffic == traffic
    assert as_traffic(moved) == per_iteration, f"the stores moved {dict(moved)}; traffic() says {dict(per_iteration)}"
    assert per_iteration == expected(model, schedule=schedule, alpha=alpha, pl=pl, m=m, rows=rows, dtype=dtype)
    for link, op in (("ssd->cpu", "r"), ("cpu->ssd", "w")):
        assert grown.get(link, 0) == sum(n for (_, o), n in moved.items() if o == op), link
    plan = solve(profile(model, rows, dtype), n_micro=m, alpha=alpha, schedule=schedule, placement=pl)
    assert isinstance(plan, Plan)
    assert plan.ssd_bytes_per_iteration == pytest.approx(sum(per_iteration.values()), rel=1e-9)


@pytest.mark.asyncio
@pytest.mark.parametrize(("schedule", "m", "alpha"), [("vertical", 4, 0.5), ("vertical", 1, 0.0),
                                                      ("horizontal", 3, 0.5)])
async def test_the_time_models_device_link_bytes_are_what_the_runtime_moves(tmp_path, schedule, m, alpha):
    """The planner's per-layer phases, summed over the layers, move what traffic() counts
    across the device link each way (parameters, checkpoints, inter-layer and parameter
    gradients): its time model prices the bytes the runtime moves (layer 0's forward loads
    no checkpoint: its inputs are the embedding's)."""
    model, rows = gpt(), 1
    cfg = config(tmp_path, micro_batches=m, placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=alpha,
                 schedule=schedule)
    async with SnakeTrainer(model, data=batches(2, rows * m), config=cfg) as t:
        await asyncio.wait_for(t.run(2), 60)
        traffic = t.traffic()
    prof = profile(model, rows, "float32")
    phases = phases_for(prof, m, alpha, schedule)
    n = prof.shape.n_layers
    for src, dst, field in (("cpu", "gpu", "h2d_bytes"), ("gpu", "cpu", "d2h_bytes")):
        moved = sum(v for (a, b, _), v in traffic.items() if (a, b) == (src, dst))
        predicted = n * sum(ph.count * getattr(ph.traffic, field) for ph in phases)
        assert predicted == pytest.approx(moved, rel=1e-9), (src, dst, traffic)


# -- the files under offload_dir, and the CPU heads ---------------------------------------


def expected_files(model, *, schedule: str, alpha: float, pl: Placement, m: int, rows: int, dtype: str) -> dict:
    """Bytes of each tier file the placement implies: per unit its SSD part, each in a
    region of whole 4 KiB blocks (no file where a kind is wholly in CPU memory)."""
    db = BYTES[dtype]
    units = [k for n in trained(model) for k in parts(n, alpha) if k]
    files = {
        "param.bin": sum(aligned(ssd_part(k, pl.param) * db) for k in units),
        "opt.bin": sum(aligned(3 * ssd_part(k, pl.opt) * 4) for k in units),
        "ckpt.bin": ckpt_units_on_ssd(len(model.blocks) * m, pl.ckpt) * aligned(rows * SEQ * EMBD * db),
    }
    if schedule == "vertical" and alpha > 0:  # every delayed gradient's SSD part (pl.param == 0: none reused)
        files["grad.bin"] = sum(aligned(ssd_part(parts(n, alpha)[1], pl.grad) * 4) for n in trained(model))
    return {k: v for k, v in files.items() if v}


def expected_heads(model, *, alpha: float, pl: Placement, dtype: str) -> dict:
    """CPU bytes of each kind's heads: the first round(share x n) elements of every unit."""
    units = [k for n in trained(model) for k in parts(n, alpha) if k]
    return {"param": sum(k - ssd_part(k, pl.param) for k in units) * BYTES[dtype],
            "opt": sum(k - ssd_part(k, pl.opt) for k in units) * 12}


FILE_CASES = [
    ("vertical", 0.5, Placement(param=0.0, ckpt=0.25, opt=0.5, grad=0.0), 4, "bfloat16"),
    ("horizontal", 0.0, Placement(param=0.5, ckpt=1.0, opt=0.0), 2, "float32"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("schedule", "alpha", "pl", "m", "dtype"), FILE_CASES)
async def test_offload_dir_holds_what_the_placement_puts_on_ssd(tmp_path, schedule, alpha, pl, m, dtype):
    """The tier files' sizes (and the disk blocks allocated for them) are the SSD shares of
    the model's units, the stores' CPU heads the rest; closing the trainer removes them."""
    model, rows = gpt(), 1
    off = tmp_path / "off"
    cfg = config(off, micro_batches=m, placement=pl, alpha=alpha, schedule=schedule, dtype=dtype)
    async with SnakeTrainer(model, data=batches(1, rows * m), config=cfg) as t:
        await asyncio.wait_for(t.run(1), 60)
        files = {f.name: f.stat() for f in off.glob("*.bin")}
        assert t.engine is not None
        heads = {k: t.engine.stores[k].cpu_bytes() for k in ("param", "opt")}
    want = expected_files(model, schedule=schedule, alpha=alpha, pl=pl, m=m, rows=rows, dtype=dtype)
    assert {k: s.st_size for k, s in files.items()} == want
    for name, s in files.items():
        assert s.st_blocks * 512 >= s.st_size, f"{name}: {s.st_blocks * 512} bytes allocated of {s.st_size}"
    assert heads == expected_heads(model, alpha=alpha, pl=pl, dtype=dtype)
    assert not list(off.glob("*.bin")), "the SSD tier's files outlived the trainer"


# -- a trainer's first iteration, its set-up, and the trace file ---------------------------


@pytest.mark.asyncio
async def test_first_iteration_setup_writes_and_trace_json_totals(tmp_path, io):
    """The set-up writes each unit's SSD part of the initial weights and optimizer state
    once, which no iteration counts; the first iteration has no delayed step before it (no
    delayed optimizer or gradient reads); the second is the steady one. trace.json's
    totals per SSD link are every store transfer of the iterations."""
    model, m, rows, alpha = gpt(), 2, 1, 0.5
    pl = Placement(param=0.0, ckpt=0.5, opt=0.5, grad=0.0)
    kw = dict(schedule="vertical", alpha=alpha, pl=pl, m=m, rows=rows, dtype="float32")
    cfg = config(tmp_path / "off", micro_batches=m, placement=pl, alpha=alpha)
    async with SnakeTrainer(model, data=batches(2, rows * m), config=cfg) as t:
        await asyncio.wait_for(t.run(1), 60)
        first, mark = ssd_traffic(t.traffic()), io.mark()
        await asyncio.wait_for(t.run(1), 60)
        second = ssd_traffic(t.traffic())
        t.trace.save(tmp_path / "trace.json")
        summary = t.trace.summary()["links"]
    io.check_backend()
    setup = Counter()
    for n in trained(model):
        for k in parts(n, alpha):
            setup[("param", "w")] += ssd_part(k, pl.param) * 4
            setup[("opt", "w")] += ssd_part(k, pl.opt) * 12
    assert first == expected(model, first=True, **kw)
    assert second == expected(model, **kw)
    assert io.since() - io.since(mark) == first + setup, "the first run's SSD transfers: set-up and iteration 0"
    assert io.since(mark) == second
    _spans, records = load_trace(tmp_path / "trace.json")
    moved = records["totals"]["moved"]
    assert moved.get("ssd->cpu", 0) == sum(n for (_, op), n in (first + second).items() if op == "r")
    assert moved.get("cpu->ssd", 0) == sum(n for (_, op), n in (first + second).items() if op == "w")
    assert {k: v["bytes"] for k, v in summary.items()} == moved


# -- counters across evaluate(), stopped runs, save and load --------------------------------


@pytest.mark.asyncio
async def test_counters_across_evaluate_a_stopped_run_and_a_load(tmp_path, io):
    """evaluate() leaves traffic() as it was and adds its layer loads to the trace's links
    (nothing else); the run after it starts without the delayed steps it applied; a stopped
    run's report and traffic() are its last step's, and its SSD transfers are those of the
    steps it ran, none of a step it did not; after load() traffic() is empty and the first
    run's iteration has no delayed step (the checkpoint holds them applied); a run to the
    data's end reports its last step and moves nothing for the step that had no batch."""
    model, m, rows, alpha = gpt(), 2, 1, 0.5
    pl = Placement(param=0.0, ckpt=0.5, opt=0.5, grad=0.0)
    kw = dict(schedule="vertical", alpha=alpha, pl=pl, m=m, rows=rows, dtype="float32")
    steady, fresh = expected(model, **kw), expected(model, first=True, **kw)
    data = batches(8, rows * m)

    def cfg(name: str) -> SnakeConfig:
        return config(tmp_path / name, micro_batches=m, placement=pl, alpha=alpha)

    async with SnakeTrainer(model, data=data, config=cfg("a")) as t:
        await asyncio.wait_for(t.run(1), 60)
        before, links, mark = t.traffic(), link_bytes(t), io.mark()
        ev = await asyncio.wait_for(t.evaluate(batches(2, 2, seed=3), batches_per_pass=1), 60)
        grown = delta(link_bytes(t), links)
        assert t.traffic() == before, "evaluate() changed traffic(), the last training iteration's"
        loads = sum(ssd_part(k, pl.param) for n in trained(model) for k in parts(n, alpha)) * 4
        assert io.since(mark)[("param", "r")] == ev.passes * loads
        assert grown == {"ssd->cpu": ev.passes * loads, "cpu->gpu": ev.passes * sum(trained(model)) * 4}

        mark = io.mark()
        report = await asyncio.wait_for(t.run(1), 60)
        assert ssd_traffic(report.traffic) == ssd_traffic(t.traffic()) == io.since(mark) == fresh

        stops = []

        def stop(_step) -> None:  # type: ignore[no-untyped-def]
            stops.append(t.stop())

        mark = io.mark()
        report = await asyncio.wait_for(t.run(3, on_step=stop), 60)
        ran = len(report.steps)
        assert report.stopped and ran < 3 and stops[0]
        assert report.traffic == t.traffic() and ssd_traffic(t.traffic()) == steady
        assert io.since(mark) == Counter({k: ran * v for k, v in steady.items()}), (
            f"a run stopped after {ran} steps moved {dict(io.since(mark))}")
        mark = io.mark()
        await asyncio.wait_for(t.run(1), 60)
        assert io.since(mark) == steady == ssd_traffic(t.traffic())
        await asyncio.wait_for(t.save(tmp_path / "ckpt"), 60)

    def two_more():  # data that ends: run() without steps trains to its end
        yield from batches(2, rows * m, seed=5)

    async with SnakeTrainer(model, data=data, config=cfg("b")) as t:
        await asyncio.wait_for(t.load(tmp_path / "ckpt"), 60)
        assert t.traffic() == {}
        mark = io.mark()
        await asyncio.wait_for(t.run(1), 60)
        assert io.since(mark) == ssd_traffic(t.traffic()) == fresh
        mark = io.mark()
        report = await asyncio.wait_for(t.run(data=two_more()), 60)
        assert len(report.steps) == 2 and report.traffic == t.traffic() and ssd_traffic(t.traffic()) == steady
        assert io.since(mark) == Counter({k: 2 * v for k, v in steady.items()}), "reads for a step the data had no batch for"
    io.check_backend()


# -- frozen parameters --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_streamed_frozen_weights_count_as_moved_to_the_device(tmp_path):
    """Frozen parameters inside a block stream with their layer (README, "Frozen
    parameters"): on CUDA the device mover copies them into the slot after the trained ones
    and counts them as cpu->gpu param bytes. traffic() and the trace's links count the bytes
    the schedule moves, copied or not (a CPU device uses CPU memory in place, and the
    trained parameters' loads still count). So each of vertical's two loads per layer and
    iteration, and each of evaluate()'s, moves the layer's trained and frozen weights."""
    model, m = gpt(), 2
    for b in model.blocks:  # attention frozen, the MLP and norms trained: every layer streams both
        for name, p in b.named_parameters():
            p.requires_grad_("attn" not in name)
    every = [a + b for a, b in zip(trained(model), streamed_frozen(model), strict=True)]
    assert all(streamed_frozen(model))
    cfg = config(tmp_path, micro_batches=m, placement=Placement.all_cpu(), alpha=0.0)
    async with SnakeTrainer(model, data=batches(1, m), config=cfg) as t:
        await asyncio.wait_for(t.run(1), 60)
        loads = t.traffic()[("cpu", "gpu", "param")]
        links = link_bytes(t)
        ev = await asyncio.wait_for(t.evaluate(batches(1, 2, seed=3)), 60)
        evaluated = delta(link_bytes(t), links).get("cpu->gpu", 0)
    want, want_eval = 2 * sum(every) * 4, ev.passes * sum(every) * 4
    assert (loads, evaluated) == (want, want_eval), (
        f"cpu->gpu param bytes per iteration {loads} and of evaluate() {evaluated} leave out the streamed frozen "
        f"weights ({sum(streamed_frozen(model))} elements per pass over the layers) on a CPU device: "
        f"want {want} and {want_eval}, as the CUDA path counts them")


@pytest.mark.asyncio
async def test_planner_predicts_the_ssd_bytes_of_a_fine_tune_of_the_top_layers(tmp_path, io):
    """The README's usual fine-tune: the bottom layers and the embeddings frozen, no backward
    below the lowest trained layer. With a delayed share, every trained layer's delayed
    gradient goes to SSD and back (layer 0's would stay in its staging buffer, but layer 0
    trains nothing). The runtime moves that (as counted here); Plan.ssd_bytes_per_iteration,
    the planner's prediction for this very placement, should too."""
    model, m, rows, alpha = gpt(n_layer=4), 2, 1, 0.5
    for i in (0, 1):
        model.blocks[i].requires_grad_(False)
    model.wte.weight.requires_grad_(False)
    model.wpe.weight.requires_grad_(False)
    pl = Placement(param=0.0, ckpt=0.0, opt=0.0, grad=0.0)
    cfg = config(tmp_path, micro_batches=m, placement=pl, alpha=alpha)
    async with SnakeTrainer(model, data=batches(2, rows * m), config=cfg) as t:
        await asyncio.wait_for(t.run(1), 60)
        mark = io.mark()
        await asyncio.wait_for(t.run(1), 60)
        per_iteration = ssd_traffic(t.traffic())
    io.check_backend(mark)
    assert as_traffic(io.since(mark)) == per_iteration
    sizes = trained(model)
    delayed = sum(parts(n, alpha)[1] for n in sizes)  # layers 2 and 3, none of them layer 0
    ck = ckpt_units_on_ssd(2 * m, pl.ckpt) * rows * SEQ * EMBD * 4  # the inputs of the two layers with a backward
    want = Counter({("param", "r"): 2 * sum(sizes) * 4, ("param", "w"): sum(sizes) * 4,
                    ("opt", "r"): sum(sizes) * 12, ("opt", "w"): sum(sizes) * 12,
                    ("ckpt", "r"): ck, ("ckpt", "w"): ck, ("grad", "r"): delayed * 4, ("grad", "w"): delayed * 4})
    assert per_iteration == want
    plan = solve(profile(model, rows, "float32"), n_micro=m, alpha=alpha, schedule="vertical", placement=pl)
    assert isinstance(plan, Plan)
    measured = sum(per_iteration.values())
    assert plan.ssd_bytes_per_iteration == pytest.approx(measured, rel=1e-9), (
        f"the planner predicts {plan.ssd_bytes_per_iteration:.0f} SSD bytes per iteration, the runtime moves "
        f"{measured} ({2 * delayed * 4} of them delayed gradients): planner.model.vertical_phases charges the "
        f"delayed gradients of (n_layers - 1) / n_layers of n_layers mean layers, as if layer 0 had its mean "
        f"share of them (which stays in its buffer), while a frozen layer 0 has none")


# -- the resident optimizer state on SSD ----------------------------------------------------


@pytest.mark.asyncio
async def test_resident_state_on_ssd_is_24_bytes_per_parameter_in_backend_traffic_and_plan(tmp_path, io):
    """resident_optimizer="ssd": the embeddings' and norm's master, m and v are read and
    written once per iteration (12 bytes each way per resident parameter), counted as "opt"
    traffic beside the layers'; the planner's plan with the state on SSD predicts the sum."""
    model, m, rows = gpt(n_layer=2), 1, 1
    pl = Placement(param=1.0, ckpt=1.0, opt=0.5)
    cfg = config(tmp_path, micro_batches=m, placement=pl, alpha=0.0, resident_optimizer="ssd")
    async with SnakeTrainer(model, data=batches(2, rows * m), config=cfg) as t:
        await asyncio.wait_for(t.run(1), 60)
        mark = io.mark()
        await asyncio.wait_for(t.run(1), 60)
        per_iteration = ssd_traffic(t.traffic())
    io.check_backend(mark)
    moved = io.since(mark)
    r = resident(model)
    assert moved[("resident", "r")] == moved[("resident", "w")] == 12 * r
    assert as_traffic(moved) == per_iteration
    layers = sum(ssd_part(n, pl.opt) for n in trained(model)) * 12
    assert per_iteration == Counter({("opt", "r"): layers + 12 * r, ("opt", "w"): layers + 12 * r})
    plan = solve(profile(model, rows, "float32"), n_micro=m, alpha=0.0, schedule="vertical", placement=pl,
                 resident="ssd")
    assert isinstance(plan, Plan) and plan.resident_optimizer == "ssd"
    assert plan.ssd_bytes_per_iteration == pytest.approx(sum(per_iteration.values()), rel=1e-9)


# -- snake train's report.json ----------------------------------------------------------------


def test_snake_train_report_traffic_is_the_closed_form(tmp_path):
    """report.json's traffic_last_step (after the held-out evaluation) is one steady
    iteration of the model `snake train` builds, and its trace_summary's link bytes are
    trace.json's totals."""
    from snake.cli import main
    from snake.models import GPT, GPTConfig

    layers, embd, seq, batch, m, alpha = 2, 32, 16, 4, 2, 0.5
    out = tmp_path / "out"
    assert main(["train", "--layers", str(layers), "--embd", str(embd), "--heads", "2", "--seq", str(seq),
                 "--batch", str(batch), "--micro-batches", str(m), "--placement", "0,0.5,0.5,0", "--alpha", str(alpha),
                 "--steps", "3", "--eval-batches", "1", "--out", str(out), "--offload-dir", str(tmp_path / "off")]) == 0
    report = json.loads((out / "report.json").read_text())
    model = GPT(GPTConfig(n_layer=layers, n_head=2, n_embd=embd, vocab_size=256, block_size=seq))
    db, ck = 4, (batch // m) * seq * embd * 4
    split = [parts(n, alpha) for n in trained(model)]
    want = {
        "ssd/cpu/param": 2 * sum(sum(s) for s in split) * db, "cpu/ssd/param": sum(sum(s) for s in split) * db,
        "ssd/cpu/opt": sum(ssd_part(k, 0.5) for s in split for k in s) * 12,
        "cpu/ssd/opt": sum(ssd_part(k, 0.5) for s in split for k in s) * 12,
        "ssd/cpu/ckpt": ckpt_units_on_ssd(layers * m, 0.5) * ck, "cpu/ssd/ckpt": ckpt_units_on_ssd(layers * m, 0.5) * ck,
        "ssd/cpu/grad": sum(s[1] for s in split[1:]) * 4, "cpu/ssd/grad": sum(s[1] for s in split[1:]) * 4,
    }
    got = {k: v for k, v in report["traffic_last_step"].items() if "ssd" in k}
    assert got == want
    _spans, records = load_trace(out / "trace.json")
    assert {k: v["bytes"] for k, v in report["trace_summary"]["links"].items()} == records["totals"]["moved"]


@pytest.mark.asyncio
async def test_every_ssd_byte_moved_is_traced_as_a_copy(tmp_path, io):
    """An SSD transfer is never used in place: per SSD link the trace summary's copied bytes
    (its ssd_read / ssd_write spans, what `busy_bytes_per_s` is computed from) are the bytes
    moved, which are the stores' transfers of the iterations. With the resident optimizer
    state on SSD too (README: 24 bytes of SSD traffic per resident parameter and iteration,
    which traffic() counts as "opt")."""
    model = gpt(n_layer=2)
    cfg = config(tmp_path, micro_batches=1, placement=Placement(param=0.5, ckpt=0.0, opt=0.5), alpha=0.0,
                 resident_optimizer="ssd")
    async with SnakeTrainer(model, data=batches(2, 1), config=cfg) as t:
        await asyncio.wait_for(t.run(1), 60)
        mark, before = io.mark(), t.trace.summary()["links"]
        await asyncio.wait_for(t.run(1), 60)
        after = t.trace.summary()["links"]
    moved = io.since(mark)
    got = {link: (after[link]["bytes"] - before[link]["bytes"], after[link]["copied_bytes"] - before[link]["copied_bytes"])
           for link in ("ssd->cpu", "cpu->ssd")}
    want = {link: (sum(n for (_, o), n in moved.items() if o == op),) * 2 for link, op in (("ssd->cpu", "r"), ("cpu->ssd", "w"))}
    assert got == want, (
        f"per SSD link (moved, copied) in one iteration {got}, the stores moved {want}: the resident optimizer "
        f"state's {12 * resident(model)} bytes each way are moved but traced as no copy (no ssd_read / ssd_write "
        f"span: snake/actors/compute.py adds them to traffic only)")
