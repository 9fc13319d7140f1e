"""A chaos audit: seeded random configurations (placement shares 0 / 0.5 / 1 per kind, alpha
0 / 0.5, vertical or horizontal, 1 or 2 micro-batches, 2 or 3 layers) with faults at
deterministic points (the k-th next() of the data, the k-th on_step, the k-th checkpoint
file, fsync, tensor read or SSD transfer): cancellation of run(), save(), load() and
evaluate(), stop(), a data source and an on_step that raise, and OSErrors in the SSD tier,
the checkpoint's writes and a load's reads.

After each the invariants a service relies on: the error comes within seconds and carries
the original cause; once closed, no thread snake started, no file descriptor, no file in the
offload_dir and no task of snake's on the loop is left; a trainer the README says stays
usable trains on, and its weights are plain PyTorch's (`tests.helpers.reference`) on
exactly the batches its reports say it trained; a checkpoint a save that was cancelled or
failed left is the old one, intact, or a whole new one that loads, and nothing else is
left beside it.

Seeds fix everything: the configuration, the fault's kind and its point. Which events a
seed draws is in its test id."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import snake.checkpoint as checkpoint
from snake import ActorFailed, Placement, SnakeConfig, SnakeError, SnakeTrainer
from snake.errors import DataError, StorageError
from snake.faults import StorageFaults, inject_storage
from tests.helpers import assert_close_state, batches, reference, tiny_gpt

TIMEOUT = 60  # a bound on every await: a hang fails the test instead of stalling the suite
QUICK_S = 5.0  # an error or a cancellation surfaces within this
SHARES = (0.0, 0.5, 1.0)
DATA = batches(40, 4)
EVAL = batches(4, 4, seed=7)


# -- the configuration a seed draws -------------------------------------------------------------
@dataclass(frozen=True)
class Draw:
    n_layer: int
    micro: int
    alpha: float
    schedule: str
    placement: Placement

    def config(self, off: Path) -> SnakeConfig:
        return SnakeConfig(micro_batches=self.micro, offload_dir=off, placement=self.placement, alpha=self.alpha,
                           schedule=self.schedule, device="cpu", stall_timeout_s=20.0)

    def model(self) -> torch.nn.Module:
        return tiny_gpt(n_layer=self.n_layer, bias=False)


def draw(rng: random.Random, *, param_on_ssd: bool = False) -> Draw:
    share = [rng.choice(SHARES) for _ in range(4)]
    if param_on_ssd and share[0] == 1.0:
        share[0] = 0.5
    return Draw(n_layer=rng.choice((2, 3)), micro=rng.choice((1, 2)), alpha=rng.choice((0.0, 0.5)),
                schedule=rng.choice(("vertical", "horizontal")),
                placement=Placement(param=share[0], ckpt=share[1], opt=share[2], grad=share[3]))


@pytest.fixture(autouse=True)
def one_intraop_thread():
    """torch's kernels on one thread while these tests run: the tiny models gain nothing
    from more, and on a busy machine OpenMP teams contending for its cores made single
    steps take seconds (the invariants checked do not depend on it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_REFS: dict[tuple[int, int, int], dict] = {}


def want(d: Draw, n: int) -> dict:
    """Plain PyTorch's weights after the first `n` batches of DATA (cached: placement, alpha
    and schedule change nothing in the math)."""
    key = (d.n_layer, d.micro, n)
    if key not in _REFS:
        _REFS[key] = reference(d.model(), DATA[:n], d.micro)[0]
    return _REFS[key]


# -- what may be left behind --------------------------------------------------------------------
def _fds() -> set[tuple[str, str]]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return out


class Leftovers:
    """Threads and descriptors before the trainer; after close() none may be new, the
    offload_dir must be empty (snake created it: its files and lock go) and no task but the
    test's may be on the loop."""

    def __init__(self) -> None:
        self.threads = set(threading.enumerate())
        self.fds = _fds()

    async def check(self, *offs: Path) -> None:
        deadline = time.monotonic() + 3
        while self._threads() and time.monotonic() < deadline:  # noqa: ASYNC110 - nothing signals a thread's end
            await asyncio.sleep(0.02)
        assert not self._threads(), f"threads left alive after close(): {self._threads()}"
        fds = sorted(t for _, t in _fds() - self.fds)
        assert not fds, f"file descriptors left open after close(): {fds}"
        for off in offs:
            left = sorted(p.name for p in off.iterdir()) if off.exists() else []
            assert left == [], f"files snake created left in offload_dir {off}: {left}"
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not tasks, f"tasks left on the loop after close(): {tasks}"

    def _threads(self) -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t not in self.threads and t.is_alive())


# -- the data -----------------------------------------------------------------------------------
class Source:
    """An iterator over `items` that keeps going after its next() raised (a flaky reader);
    `arm(k, fn)` calls `fn()` at the k-th next() from then on (on snake's data thread), and
    a batch is consumed only by a next() that returns it."""

    def __init__(self, items) -> None:
        self.items, self.pos, self.calls = items, 0, 0
        self.trigger: tuple[int, object] | None = None

    def arm(self, k: int, fn) -> None:
        self.trigger = (self.calls + k, fn)

    def disarm(self) -> None:
        self.trigger = None

    def __iter__(self):
        return self

    def __next__(self):
        i, self.calls = self.calls, self.calls + 1
        if self.trigger is not None and self.trigger[0] == i:
            fn, self.trigger = self.trigger[1], None
            fn()
        if self.pos >= len(self.items):
            raise StopIteration
        self.pos += 1
        return self.items[self.pos - 1]


class Boom(Exception):
    """The user's own exception, injected."""


def chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


async def bounded(aw):
    return await asyncio.wait_for(aw, TIMEOUT)


def tree(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def siblings(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.parent.iterdir() if p.name != ckpt.name)


def step_of(ckpt: Path) -> int:
    import json

    return json.loads((ckpt / checkpoint.MANIFEST).read_text())["step"]


# -- a trainer that stays usable: a random schedule of events -------------------------------------
class Session:
    """One trainer, its data and what it has trained: `trained` is the count of batches
    the reports say were trained, which must be DATA[:trained] in order."""

    def __init__(self, tmp_path: Path, d: Draw, rng: random.Random, monkeypatch) -> None:
        self.tmp, self.d, self.rng, self.mp = tmp_path, d, rng, monkeypatch
        self.off = tmp_path / "off"
        self.ckpt = tmp_path / "ckpts" / "ck"
        self.src = Source(DATA)
        self.t = SnakeTrainer(d.model(), data=self.src, config=d.config(self.off))
        self.trained = 0
        self.log: list[str] = []

    def took(self, reports, what: str) -> None:
        """The steps a run reports: numbered on from the ones before, no gap, no repeat."""
        got = [s.step for s in reports]
        assert got == list(range(self.trained, self.trained + len(got))), f"{what}: step numbers {got} after " \
            f"{self.trained} trained"
        self.trained += len(got)
        self.log.append(f"{what}: {len(got)} steps")

    async def run(self, steps: int, what: str = "run") -> None:
        r = await bounded(self.t.run(steps))
        assert len(r.steps) == steps and not r.stopped
        self.took(r.steps, what)

    # each event leaves the trainer usable, per README
    async def stop(self) -> None:
        k = self.rng.randrange(2)
        self.src.arm(k, self.t.stop)  # from the data thread: "from any thread"
        try:
            r = await bounded(self.t.run(4))
        finally:
            self.src.disarm()
        assert r.stopped == (len(r.steps) < 4), (r.stopped, len(r.steps))
        self.took(r.steps, f"stop() at next() +{k}")

    async def data_raises(self) -> None:
        k, boom = self.rng.randrange(2), Boom("the data source failed")

        def fail() -> None:
            raise boom

        self.src.arm(k, fail)
        t0 = time.monotonic()
        try:
            with pytest.raises(DataError) as e:
                await bounded(self.t.run(4))
        finally:
            self.src.disarm()
        assert time.monotonic() - t0 < QUICK_S + 4  # (the steps before it train first)
        assert boom in chain(e.value), f"the DataError does not carry the data's exception: {chain(e.value)}"
        assert e.value.report is not None
        n = len(e.value.report.steps)
        assert f"after {n} of its steps" in str(e.value), f"the message against {n} steps reported: {e.value}"
        self.took(e.value.report.steps, f"next() +{k} raised")

    async def on_step_raises(self) -> None:
        k, boom, seen = self.rng.randrange(3), Boom("on_step failed"), []

        def on_step(r) -> None:
            seen.append(r)
            if len(seen) == k + 1:
                raise boom

        with pytest.raises(Boom) as e:
            await bounded(self.t.run(5, on_step=on_step))
        assert e.value is boom, "run() raises on_step's own exception"
        notes = " ".join(getattr(boom, "__notes__", []))
        assert f"stopped cleanly after {len(seen)} of its steps" in notes, f"the note against {len(seen)} steps " \
            f"on_step saw: {notes!r}"
        self.took(seen, f"on_step #{k} raised")

    async def cancel_evaluate(self) -> None:
        k, loop = self.rng.randrange(3), asyncio.get_running_loop()
        src = Source(EVAL)
        src.arm(k, lambda: loop.call_soon_threadsafe(task.cancel))
        task = asyncio.ensure_future(self.t.evaluate(src))
        t0 = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await bounded(task)
        assert time.monotonic() - t0 < QUICK_S
        self.log.append(f"evaluate cancelled at next() +{k}")

    async def evaluate_read_fails(self) -> None:
        store = self.t.engine.stores["param"] if self.t.engine is not None else None
        if store is None or store.file is None:  # nothing of the parameters on SSD: the eval data fails instead
            k, boom = self.rng.randrange(3), Boom("the eval data failed")
            src = Source(EVAL)
            src.arm(k, lambda: (_ for _ in ()).throw(boom))
            with pytest.raises(DataError) as e:
                await bounded(self.t.evaluate(src))
            assert boom in chain(e.value), chain(e.value)
            self.log.append(f"eval next() +{k} raised")
            return
        k = self.rng.randrange(self.d.n_layer)  # (a pass reads each layer's parameters once)
        inject_storage(store.file, StorageFaults(seed=k, read_error=1.0, after=k))
        t0 = time.monotonic()
        try:
            with pytest.raises(StorageError) as e:
                await bounded(self.t.evaluate(EVAL))
        finally:
            inner = getattr(store.file, "inner", store.file)
            inner.__dict__.pop("_preadv", None)
            inner.__dict__.pop("_pwritev", None)
        assert time.monotonic() - t0 < QUICK_S
        assert e.value.errno == errno.EIO
        assert any(isinstance(x, OSError) and "injected" in str(x) for x in chain(e.value)[1:]), chain(e.value)
        self.log.append(f"evaluate param read {k} EIO")

    async def cancel_save(self) -> None:
        """save() cancelled as it writes its k-th file: it stops before the next one."""
        await self.baseline()
        before, loop = tree(self.ckpt), asyncio.get_running_loop()
        k = self.rng.randrange(self.d.n_layer + 2)  # layers, resident, rng
        stops: list[threading.Event] = []
        real_save, real_write, calls = checkpoint._save_blocking, checkpoint._write_tensors, [0]

        def save_blocking(*a, **kw):
            stops.append(a[6])
            return real_save(*a, **kw)

        def write(path, *a, **kw):
            if calls[0] == k:
                loop.call_soon_threadsafe(task.cancel)
                assert stops[0].wait(TIMEOUT), "the cancellation never reached the save"
            calls[0] += 1
            return real_write(path, *a, **kw)

        with self.mp.context() as m:
            m.setattr(checkpoint, "_save_blocking", save_blocking)
            m.setattr(checkpoint, "_write_tensors", write)
            task = asyncio.ensure_future(self.t.save(self.ckpt))
            with pytest.raises(asyncio.CancelledError):
                await bounded(task)
        assert calls[0] == k + 1, f"the cancelled save wrote {calls[0] - k - 1} more files after its k-th"
        assert tree(self.ckpt) == before, "a cancelled save changed the checkpoint there"
        assert siblings(self.ckpt) == [], f"a cancelled save left {siblings(self.ckpt)}"
        self.log.append(f"save cancelled at file {k}")

    def fsyncs(self) -> int:
        return self.d.n_layer + 5  # layers, resident, rng, manifest; the new directory, its parent after the rename

    async def save_fsync_fails(self, k: int | None = None) -> None:
        """The save's k-th fsync fails (EIO: a disk error as the data reaches it)."""
        await self.baseline()
        before = tree(self.ckpt)
        n = self.fsyncs()
        k = self.rng.randrange(n) if k is None else k
        real, calls, boom = os.fsync, [0], OSError(errno.EIO, "injected fsync failure")
        where = str(self.ckpt.parent)

        def fsync(fd):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                target = ""
            if target.startswith(where):
                i, calls[0] = calls[0], calls[0] + 1
                if i == k:
                    raise boom
            return real(fd)

        with self.mp.context() as m:
            m.setattr(os, "fsync", fsync)
            t0 = time.monotonic()
            with pytest.raises(OSError) as e:
                await bounded(self.t.save(self.ckpt))
            assert time.monotonic() - t0 < QUICK_S
        assert calls[0] == k + 1, f"fsync calls {calls[0]}, the failure at {k}"
        assert boom in chain(e.value), f"the save's error does not carry the OSError: {chain(e.value)}"
        published = tree(self.ckpt) != before
        assert siblings(self.ckpt) == [], (
            f"save() failing at fsync {k} of {n} left {siblings(self.ckpt)} beside the checkpoint (the "
            f"checkpoint there {'is the new one' if published else 'has the old content'}; save() raised "
            f"{e.value!r}): "
            "a failed save must remove what it wrote and renamed aside, as a cancelled one does")
        if tree(self.ckpt) != before:  # published, whole: it must load and hold what the trainer holds
            assert step_of(self.ckpt) == self.trained
            await self.loads_as_trainer()
        self.log.append(f"save fsync {k}/{n} failed")

    async def baseline(self) -> None:
        if not (self.ckpt / checkpoint.MANIFEST).exists():
            await bounded(self.t.save(self.ckpt))

    async def loads_as_trainer(self) -> None:
        off = self.tmp / f"check-{len(self.log)}"
        async with SnakeTrainer(self.d.model(), data=DATA, config=self.d.config(off)) as u:
            await bounded(u.load(self.ckpt))
            got = await bounded(u.state_dict())
        assert_close_state(got, await bounded(self.t.state_dict()), rtol=0, atol=0)

    async def check_weights(self) -> None:
        got = await bounded(self.t.state_dict())
        assert_close_state(got, want(self.d, self.trained))

    async def check_evaluate(self) -> None:
        """evaluate() now gives PyTorch's eval-mode loss of PyTorch's weights."""
        got = (await bounded(self.t.evaluate(EVAL))).loss
        m = self.d.model()
        m.load_state_dict(want(self.d, self.trained))
        m.eval()
        with torch.no_grad():
            losses = [torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten()) for x, y in EVAL]
        assert abs(got - float(torch.stack(losses).mean())) < 1e-5, (got, float(torch.stack(losses).mean()))


USABLE = ("stop", "data_raises", "on_step_raises", "cancel_evaluate", "evaluate_read_fails", "cancel_save",
          "save_fsync_fails")


def schedule(seed: int) -> tuple[Draw, list[str]]:
    rng = random.Random(seed)
    d = draw(rng)
    return d, rng.sample(USABLE, 3)


SCHEDULE_SEEDS = range(8)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", SCHEDULE_SEEDS, ids=[f"s{s}-" + "+".join(schedule(s)[1]) for s in SCHEDULE_SEEDS])
async def test_a_schedule_of_faults_leaves_a_usable_trainer_on_pytorchs_weights(tmp_path, monkeypatch, seed):
    d, events = schedule(seed)
    rng = random.Random(seed * 1000 + 1)
    left = Leftovers()
    s = Session(tmp_path, d, rng, monkeypatch)
    try:
        await s.run(1)
        for ev in events:
            await getattr(s, ev)()
            await s.run(1, f"after {ev}")  # it trains on at once
        await s.run(2, "last")
        try:
            await s.check_weights()
            await s.check_evaluate()
        except AssertionError as exc:
            raise AssertionError(f"{d}: after {s.log}: {exc}") from exc
        if (s.ckpt / checkpoint.MANIFEST).exists():
            assert step_of(s.ckpt) <= s.trained
    finally:
        await bounded(s.t.close())
    await left.check(s.off, *(s.tmp.glob("check-*")))


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [100])
async def test_a_save_failing_at_each_fsync_keeps_one_whole_checkpoint_and_nothing_else(tmp_path, monkeypatch, seed):
    """Every fsync of a save fails in turn (each file, the new directory, and its parent
    after the rename), a step trained between: each time the checkpoint there is the old one
    or a whole new one, nothing is left beside it, and the trainer trains on to PyTorch's
    weights."""
    rng = random.Random(seed)
    d = draw(rng)
    left = Leftovers()
    s = Session(tmp_path, d, rng, monkeypatch)
    try:
        await s.run(1)
        await s.baseline()
        for k in range(s.fsyncs()):
            await s.run(1, f"before fsync {k}")
            try:
                await s.save_fsync_fails(k)
            except AssertionError as exc:
                raise AssertionError(f"{d}: after {s.log}: {exc}") from exc
        await s.run(1, "last")
        await s.check_weights()
    finally:
        await bounded(s.t.close())
    await left.check(s.off, *(s.tmp.glob("check-*")))


# -- a trainer that closes: cancelled run() or load(), storage faults -------------------------------
CLOSING = ("cancel_run_at_on_step", "cancel_run_at_next", "storage_fault_in_run", "cancel_load", "load_read_fails",
           "load_data_raises")
# every event once, and the two whose point varies most (an SSD transfer of a random kind and
# direction, a next() of the data) with a second configuration
CLOSING_CASES = [(ev, seed) for seed, ev in enumerate(CLOSING)] + [("storage_fault_in_run", 8),
                                                                    ("cancel_run_at_next", 9)]


async def first_trainer(tmp_path, d: Draw, rng) -> tuple[int, Path, dict[str, bytes]]:
    """A trainer that trains 1-2 steps and saves: (steps, checkpoint, its files)."""
    ckpt = tmp_path / "ckpts" / "ck"
    steps = rng.choice((1, 2))
    async with SnakeTrainer(d.model(), data=DATA, config=d.config(tmp_path / "first")) as t:
        await bounded(t.run(steps))
        await bounded(t.save(ckpt))
    return steps, ckpt, tree(ckpt)


async def resumes_to_pytorch(tmp_path, d: Draw, ckpt: Path, steps: int) -> None:
    """The checkpoint loads into a new trainer that trains on to PyTorch's weights."""
    off = tmp_path / "resume"
    async with SnakeTrainer(d.model(), data=DATA, config=d.config(off)) as u:
        await bounded(u.load(ckpt))
        r = await bounded(u.run(1))
        assert [x.step for x in r.steps] == [steps]
        got = await bounded(u.state_dict())
    assert_close_state(got, want(d, steps + 1))


async def closed(t: SnakeTrainer) -> None:
    with pytest.raises(SnakeError, match="closed"):
        await bounded(t.run(1))


@pytest.mark.asyncio
@pytest.mark.parametrize("event,seed", CLOSING_CASES, ids=[f"{e}-s{s}" for e, s in CLOSING_CASES])
async def test_a_fault_that_closes_the_trainer_leaves_nothing_and_the_checkpoint_resumes(
        tmp_path, monkeypatch, event, seed):
    rng = random.Random(seed)
    d = draw(rng, param_on_ssd=True)
    left = Leftovers()
    steps, ckpt, before = await first_trainer(tmp_path, d, rng)
    off = tmp_path / "off"
    loop = asyncio.get_running_loop()
    src = Source(DATA)
    t = SnakeTrainer(d.model(), data=src, config=d.config(off))
    try:
        if event.startswith("cancel_run"):
            await bounded(t.load(ckpt))
            k = rng.randrange(3)
            if event == "cancel_run_at_on_step":
                seen = []

                def on_step(r) -> None:
                    seen.append(r)
                    if len(seen) == k + 1:
                        task.cancel()

                task = asyncio.ensure_future(t.run(6, on_step=on_step))
            else:
                src.arm(k, lambda: loop.call_soon_threadsafe(task.cancel))
                task = asyncio.ensure_future(t.run(6))
            t0 = time.monotonic()
            with pytest.raises(asyncio.CancelledError):
                await bounded(task)
            assert time.monotonic() - t0 < QUICK_S + 6  # (steps before the trigger train first)
            await closed(t)
        elif event == "storage_fault_in_run":
            await bounded(t.load(ckpt))
            stores = [kind for kind, st in sorted(t.engine.stores.items()) if st.file is not None]
            kind = rng.choice(stores)
            op = rng.choice(("read", "write", "nospace"))
            k = rng.randrange(3)
            faults = StorageFaults(seed=seed, after=k, **{"read": {"read_error": 1.0}, "write": {"write_error": 1.0},
                                                          "nospace": {"no_space": 1.0}}[op])
            inject_storage(t.engine.stores[kind].file, faults)
            t0 = time.monotonic()
            with pytest.raises(ActorFailed) as e:
                await bounded(t.run(6))
            assert time.monotonic() - t0 < QUICK_S, f"{kind} {op} after {k}: took {time.monotonic() - t0:.1f} s"
            code = errno.ENOSPC if op == "nospace" else errno.EIO
            causes = chain(e.value)
            assert any(isinstance(x, StorageError) and x.errno == code for x in causes), causes
            assert any(type(x) is OSError and x.errno == code and "injected" in str(x) for x in causes), causes
            assert e.value.actor and e.value.actor in str(e.value)
            await closed(t)
        elif event == "load_data_raises":  # load() reads the checkpoint's batches to skip them
            k, boom = rng.randrange(steps), Boom("the data source failed")

            def fail() -> None:
                raise boom

            src.arm(k, fail)
            t0 = time.monotonic()
            with pytest.raises(BaseException) as e:
                await bounded(t.load(ckpt))
            assert time.monotonic() - t0 < QUICK_S
            assert boom in chain(e.value), f"load() does not carry the data's exception: {chain(e.value)}"
            await closed(t)
        else:
            k = rng.randrange(d.n_layer)
            real_apply, real_file, opened, stops = checkpoint.apply_checkpoint, checkpoint._TensorFile, [], []
            boom = OSError(errno.EIO, "injected read failure")

            def apply(*a, **kw):
                stops.append(a[6])
                return real_apply(*a, **kw)

            class Reading(real_file):
                def __init__(self, path) -> None:
                    super().__init__(path)
                    opened.append(Path(path).name)
                    if len(opened) == k + 1:
                        if event == "cancel_load":
                            loop.call_soon_threadsafe(task.cancel)
                            assert stops[0].wait(TIMEOUT), "the cancellation never reached the load"
                        else:
                            self.__exit__()
                            raise boom

            with monkeypatch.context() as m:
                m.setattr(checkpoint, "apply_checkpoint", apply)
                m.setattr(checkpoint, "_TensorFile", Reading)
                task = asyncio.ensure_future(t.load(ckpt))
                t0 = time.monotonic()
                if event == "cancel_load":
                    with pytest.raises(asyncio.CancelledError):
                        await bounded(task)
                    assert len(opened) == k + 1, f"a load cancelled at layer {k} went on to read {opened}"
                else:
                    with pytest.raises(OSError) as e:
                        await bounded(task)
                    assert boom in chain(e.value), chain(e.value)
                assert time.monotonic() - t0 < QUICK_S
            await closed(t)
    finally:
        await bounded(t.close())
    assert tree(ckpt) == before, "the checkpoint changed"
    assert siblings(ckpt) == []
    await resumes_to_pytorch(tmp_path, d, ckpt, steps)
    await left.check(off, tmp_path / "first", tmp_path / "resume")
