"""Per-actor traces (Chrome / Perfetto JSON, one track per actor) and traffic counters."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TIERS = ("gpu", "cpu", "ssd")
LINK_TRACK = "link "  # the track of an emulated host<->device link's waits: "link cpu->gpu"
KINDS = ("param", "grad", "ckpt", "act_grad", "opt")


@dataclass(frozen=True, slots=True)
class Span:
    actor: str
    name: str
    start_s: float
    end_s: float
    link: str | None = None  # "src->dst" for a transfer
    nbytes: int = 0

    @property
    def args(self) -> dict[str, Any]:
        return {"link": self.link, "bytes": self.nbytes} if self.link else {}


class Tracer:
    """Records spans of work per actor. Keeps the newest `max_spans` (about 150 bytes each,
    so memory stays bounded on long runs) for the timeline, and totals over every span
    (busy time per actor, copies per link) for the summary, so a long run's summary covers
    all of it. Times are seconds since the tracer was made.

    Links: the bytes the schedule moves across each tier link (`moved`, fed by the engine's
    traffic counters: what `SnakeTrainer.traffic()` counts) and, separately, the bytes the
    traced copies moved and their time. They differ where no copy is needed: on a CPU
    device parameters, gradients and checkpoints in CPU memory are used where they are."""

    def __init__(self, max_spans: int = 20_000) -> None:
        self._t0 = time.perf_counter()
        self.spans: deque[Span] = deque(maxlen=max_spans)
        self._tracks: dict[str, int] = {}
        self.last_end_s = 0.0  # when the last span ended: progress, for the stall watchdog
        self._last_s = 0.0  # the latest end of any span (spans are added in no particular order)
        self.last_progress_s = 0.0  # progress inside one long piece of work (`progress`)
        self.recorded = 0  # spans recorded (the oldest beyond max_spans are not kept)
        self._first_s: float | None = None
        self._busy: dict[str, float] = defaultdict(float)
        self._copies: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # link: [bytes, busy s]
        self._moved: dict[str, int] = defaultdict(int)
        # the event loop's own CPU (its thread's clock) and wall time over run() calls
        self.loop_cpu_s = 0.0
        self.loop_wall_s = 0.0
        # per thread group: [seconds on a CPU, seconds runnable but waiting for one] over run()
        self._threads: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])

    @contextmanager
    def loop_clock(self) -> Iterator[None]:
        """Around a run on the event loop's thread: adds that thread's CPU time and the wall
        time. The loop is the scheduler every actor message goes through; its CPU share says
        whether it keeps up (everything else on the same loop is counted too). Where the OS
        tells (Linux), also each thread's CPU and run-queue time (`thread_times`)."""
        cpu0, wall0, threads0 = time.thread_time(), time.perf_counter(), thread_times()
        try:
            yield
        finally:
            self.loop_cpu_s += time.thread_time() - cpu0
            self.loop_wall_s += time.perf_counter() - wall0
            for group, run_s, wait_s in _thread_deltas(threads0, thread_times()):
                acc = self._threads[group]
                acc[0] += run_s
                acc[1] += wait_s

    def event_loop(self) -> dict[str, float] | None:
        if self.loop_wall_s <= 0:
            return None
        return {"cpu_s": self.loop_cpu_s, "run_wall_s": self.loop_wall_s,
                "cpu_fraction": self.loop_cpu_s / self.loop_wall_s}

    def threads(self) -> dict[str, dict[str, float]] | None:
        """Per thread group over run(): CPU seconds, seconds waiting on the run queue (ready
        but no core free), and both as fractions of run()'s wall time. On a CPU device the
        kernels' own team ("snake-compute" and its "native" OpenMP workers) shares the cores
        with every other group; a group's CPU there is time the kernels do not get."""
        if self.loop_wall_s <= 0 or not self._threads:
            return None
        w = self.loop_wall_s
        return {g: {"cpu_s": c, "runqueue_wait_s": q, "cpu_fraction": c / w, "runqueue_fraction": q / w}
                for g, (c, q) in sorted(self._threads.items(), key=lambda kv: -kv[1][0])}

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def progress(self) -> None:
        """Any thread: a long piece of work (the resident step on SSD, chunk by chunk) has
        made progress; the stall watchdog counts it as an actor's work ending."""
        self.last_progress_s = self.now()

    @contextmanager
    def span(self, actor: str, name: str, *, link: str | None = None, bytes: int = 0) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.add(actor, name, start, self.now(), link=link, bytes=bytes)

    def add(
        self, actor: str, name: str, start_s: float, end_s: float, *, link: str | None = None, bytes: int = 0
    ) -> None:
        if actor not in self._tracks:
            self._tracks[actor] = len(self._tracks) + 1
        self.last_end_s = end_s
        self._last_s = max(self._last_s, end_s)
        self.spans.append(Span(actor, name, start_s, end_s, link, int(bytes)))
        self.recorded += 1
        self._first_s = start_s if self._first_s is None else min(self._first_s, start_s)
        self._busy[actor] += max(end_s - start_s, 0.0)
        if link and not actor.startswith(LINK_TRACK):  # a copy (not an emulated link's wait)
            c = self._copies[link]
            c[0] += bytes
            c[1] += max(end_s - start_s, 0.0)

    def moved(self, link: str, nbytes: int) -> None:
        """The schedule moved `nbytes` across `link` ("cpu->gpu", ...), copied or not."""
        self._moved[link] += int(nbytes)

    def totals(self) -> dict[str, Any]:
        """Whole-run totals (JSON): what `summarize` reads beyond the spans kept."""
        return {
            "spans_recorded": self.recorded, "spans_kept": len(self.spans),
            "first_s": self._first_s or 0.0, "last_s": self._last_s,
            "busy_s": dict(self._busy),
            "copies": {k: {"bytes": v[0], "busy_s": v[1]} for k, v in self._copies.items()},
            "moved": dict(self._moved),
        }

    def chrome(self) -> dict[str, Any]:
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "snake"}}
        ]
        for actor, tid in self._tracks.items():
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": actor}})
            events.append(
                {"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid, "args": {"sort_index": tid}}
            )
        for s in self.spans:
            events.append(
                {
                    "name": s.name,
                    "ph": "X",
                    "pid": 1,
                    "tid": self._tracks[s.actor],
                    "ts": s.start_s * 1e6,
                    "dur": max(s.end_s - s.start_s, 0.0) * 1e6,
                    "args": s.args,
                }
            )
        out: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
        other = {k: v for k, v in (("snake_event_loop", self.event_loop()), ("snake_threads", self.threads()))
                 if v is not None}
        other["snake_totals"] = self.totals()
        out["otherData"] = other
        return out

    def save(self, path: str | Path) -> None:
        """Write the trace as strict JSON (a non-finite number, which JSON has not, raises)."""
        Path(path).write_text(json.dumps(self.chrome(), allow_nan=False))

    def summary(self) -> dict[str, Any]:
        return summarize([], totals=self.totals(), event_loop=self.event_loop(), threads=self.threads())


def summarize(
    spans: list[Span], *, totals: dict[str, Any] | None = None, event_loop: dict[str, float] | None = None,
    threads: dict[str, dict[str, float]] | None = None,
) -> dict[str, Any]:
    """Busy fraction per actor over the traced wall time; per link (`src->dst`) the bytes
    moved, the bytes copied, the copies' bandwidth while busy and the moved bytes averaged
    over the wall time; how many spans were recorded and kept. From `totals`
    (`Tracer.totals`: the whole run) where given, else from `spans` (a trace without
    them: what it kept). With `event_loop`, the event loop thread's CPU over the runs
    (`Tracer.loop_clock`); with `threads`, each thread group's CPU and run-queue time over
    them (`Tracer.threads`)."""
    out = _summarize_totals(totals if totals is not None else _totals_of(spans))
    if event_loop is not None:
        out["event_loop"] = dict(event_loop)
    if threads is not None:
        out["threads"] = {g: dict(v) for g, v in threads.items()}
    return out


def thread_times() -> dict[int, tuple[str, float, float]]:
    """Each OS thread of this process: (group, seconds on a CPU, seconds runnable but waiting
    for a CPU), from /proc/self/task/<tid>/schedstat; {} where the OS does not provide it.
    Call it on the event loop's thread. Groups: "event loop" (the calling thread), a snake
    thread's name without its index ("snake-io"), "other Python threads", and "native"
    (threads Python did not start: OpenMP workers, the CUDA driver's)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    names = {t.native_id: t.name for t in threading.enumerate()}
    me = threading.get_native_id()
    out = {}
    for entry in tids:
        tid = int(entry)
        try:
            with open(f"/proc/self/task/{entry}/schedstat") as f:
                run_ns, wait_ns = (int(x) for x in f.read().split()[:2])
        except (OSError, ValueError):
            continue  # the thread exited meanwhile, or no schedstat
        name = names.get(tid)
        if tid == me:
            group = "event loop"
        elif name is None:
            group = "native"
        elif name.startswith("snake-"):
            group = name.rsplit("_", 1)[0]
        else:
            group = "other Python threads"
        out[tid] = (group, run_ns / 1e9, wait_ns / 1e9)
    return out


def _thread_deltas(
    before: dict[int, tuple[str, float, float]], after: dict[int, tuple[str, float, float]]
) -> Iterator[tuple[str, float, float]]:
    """(group, CPU s, run-queue s) of each thread alive at the end, since the start (or since
    it began). A thread that ended in between is not counted."""
    for tid, (group, run_s, wait_s) in after.items():
        _, run0, wait0 = before.get(tid, (group, 0.0, 0.0))
        yield group, run_s - run0, wait_s - wait0


def _totals_of(spans: list[Span]) -> dict[str, Any]:
    """`Tracer.totals` as far as the spans tell (no bytes moved without a copy)."""
    t = Tracer()
    for s in sorted(spans, key=lambda s: s.end_s):
        t.add(s.actor, s.name, s.start_s, s.end_s, link=s.link, bytes=s.nbytes)
    out = t.totals()
    out["moved"] = {k: v["bytes"] for k, v in out["copies"].items()}
    # busy as the time covered by an actor's spans: another tool's nest (a profiler's
    # call inside a call), where adding them up counted the inner ones' time again
    by_actor: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_actor[s.actor].append(s)
    out["busy_s"] = {a: _covered(ss) for a, ss in by_actor.items()}
    return out


def _covered(spans: list[Span]) -> float:
    """The time the union of the spans covers."""
    total, end = 0.0, -math.inf
    for s in sorted(spans, key=lambda s: s.start_s):
        if s.end_s > end:
            total += s.end_s - max(s.start_s, end)
            end = s.end_s
    return total


def _summarize_totals(totals: dict[str, Any]) -> dict[str, Any]:
    recorded, kept = int(totals["spans_recorded"]), int(totals["spans_kept"])
    spans = {"recorded": recorded, "kept": kept, "dropped": recorded - kept}
    if not recorded:
        return {"wall_s": 0.0, "actors": {}, "links": {}, "spans": spans}
    wall = max(float(totals["last_s"]) - float(totals["first_s"]), 1e-9)
    busy, copies, moved = totals["busy_s"], totals["copies"], totals["moved"]
    links = {}
    for k in sorted(set(copies) | set(moved)):
        c = copies.get(k, {"bytes": 0.0, "busy_s": 0.0})
        b = float(moved.get(k, c["bytes"]))
        links[k] = {
            "bytes": b,
            "copied_bytes": float(c["bytes"]),
            "busy_bytes_per_s": c["bytes"] / c["busy_s"] if c["busy_s"] > 0 else 0.0,
            "avg_bytes_per_s": b / wall,
        }
    return {
        "wall_s": wall,
        "actors": {a: {"busy_s": b, "busy_fraction": min(b / wall, 1.0)} for a, b in sorted(busy.items())},
        "links": links,
        "spans": spans,
    }


_NOT_SNAKES = "pass the trace.json that `snake train` or `trainer.trace.save()` wrote"


def load_trace(path: str | Path) -> tuple[list[Span], dict[str, Any]]:
    """A trace written by `Tracer.save`, read once: its spans, and the keyword arguments of
    `summarize` its records give (`totals`, `event_loop`, `threads`: those it has). A file
    that is not one raises ValueError naming the event or record and the field."""
    text = Path(path).read_text(errors="replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as bad:
        # the text ended before the JSON did (inside a string: where that string began)
        cut = bad.pos >= len(text.rstrip()) or bad.msg.startswith("Unterminated string")
        raise ValueError(("a trace cut short (its JSON ends early: a copy interrupted, a disk that "
                          "filled); " if cut else f"not JSON ({bad}); ") + _NOT_SNAKES) from None
    if isinstance(data, list):  # Chrome's other form: the events alone
        data = {"traceEvents": data}
    if (not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list)
            or not all(isinstance(e, dict) for e in data["traceEvents"])):
        raise ValueError(f"not a trace (no list of trace events); {_NOT_SNAKES}")
    names: dict[Any, str] = {}
    spans = []
    for i, e in enumerate(data["traceEvents"]):
        where = f"traceEvents[{i}]"
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            args = e.get("args")
            if not isinstance(args, dict) or not isinstance(args.get("name"), str) or "tid" not in e:
                raise ValueError(f"{where}: a thread_name record needs a tid and args.name (the track's "
                                 f"name); {_NOT_SNAKES}")
            names[e["tid"]] = args["name"]
        elif e.get("ph") == "X":
            args = e.get("args", {})
            if not isinstance(args, dict) or "tid" not in e:
                raise ValueError(f"{where}: a span needs a tid and args as an object; {_NOT_SNAKES}")
            ts, dur = _number(e, "ts", where), _number(e, "dur", where)
            nbytes = _number(args, "bytes", f"{where}.args", 0)
            if dur < 0 or nbytes < 0:
                raise ValueError(f"{where}: dur={dur!r} and args.bytes={nbytes!r} must be >= 0; {_NOT_SNAKES}")
            spans.append((e["tid"], str(e.get("name", "")), ts, dur, args.get("link"), int(nbytes)))
    out = [Span(names.get(tid, str(tid)), name, ts / 1e6, (ts + dur) / 1e6, link if isinstance(link, str) else None,
                nbytes) for tid, name, ts, dur, link, nbytes in spans]
    other = data.get("otherData", {})
    if not isinstance(other, dict):
        raise ValueError(f"otherData must be an object; {_NOT_SNAKES}")
    if not out and not any(k.startswith("snake_") for k in other):  # nothing snake reads: not a summary of 0 s
        phases = sorted({str(e.get("ph")) for e in data["traceEvents"] if e.get("ph") != "M"})
        raise ValueError(f"no complete spans (\"X\" events; this trace has {phases or 'none'}); {_NOT_SNAKES}")
    records: dict[str, Any] = {}
    if "snake_totals" in other:
        records["totals"] = _checked_totals(other["snake_totals"])
    if "snake_event_loop" in other:
        records["event_loop"] = _numbers(other["snake_event_loop"], "otherData.snake_event_loop",
                                         ("cpu_s", "run_wall_s", "cpu_fraction"))
    if "snake_threads" in other:
        threads = other["snake_threads"]
        if not isinstance(threads, dict):
            raise ValueError(f"otherData.snake_threads must be an object; {_NOT_SNAKES}")
        records["threads"] = {str(g): _numbers(v, f"otherData.snake_threads[{g!r}]",
                                               ("cpu_s", "runqueue_wait_s", "cpu_fraction", "runqueue_fraction"))
                              for g, v in threads.items()}
    return out, records


def _number(record: dict[str, Any], key: str, where: str, default: float | None = None) -> float:
    """record[key] as a finite float, else a ValueError naming `where` and `key`."""
    value = record.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where}: {key}={value!r} must be a finite number; {_NOT_SNAKES}")
    return float(value)


def _numbers(record: Any, where: str, keys: tuple[str, ...]) -> dict[str, float]:
    if not isinstance(record, dict):
        raise ValueError(f"{where} must be an object; {_NOT_SNAKES}")
    return {k: _number(record, k, where) for k in keys}


def _checked_totals(totals: Any) -> dict[str, Any]:
    """A trace's `snake_totals` record (`Tracer.totals`), every field checked."""
    where = "otherData.snake_totals"
    out: dict[str, Any] = _numbers(totals, where, ("spans_recorded", "spans_kept", "first_s", "last_s"))
    for key in ("busy_s", "moved"):
        if not isinstance(totals.get(key), dict):
            raise ValueError(f"{where}: {key} must be an object; {_NOT_SNAKES}")
        out[key] = {str(k): _number(totals[key], k, f"{where}.{key}") for k in totals[key]}
    if not isinstance(totals.get("copies"), dict):
        raise ValueError(f"{where}: copies must be an object; {_NOT_SNAKES}")
    out["copies"] = {str(k): _numbers(v, f"{where}.copies[{k!r}]", ("bytes", "busy_s"))
                     for k, v in totals["copies"].items()}
    return out


class Traffic:
    """Bytes moved per (src tier, dst tier, kind), attributed to the iteration an operation
    belongs to. `last()` is the last finished iteration's counts. With a tracer, every
    count goes to its per-link totals too (`Tracer.moved`)."""

    def __init__(self, tracer: Tracer | None = None) -> None:
        self._by_iter: dict[int, dict[tuple[str, str, str], int]] = defaultdict(lambda: defaultdict(int))
        self._last: dict[tuple[str, str, str], int] = {}
        self._tracer = tracer

    def add(self, iteration: int, src: str, dst: str, kind: str, nbytes: int) -> None:
        assert src in TIERS and dst in TIERS and kind in KINDS, (src, dst, kind)
        if nbytes:
            self._by_iter[iteration][(src, dst, kind)] += int(nbytes)
            if self._tracer is not None:
                self._tracer.moved(f"{src}->{dst}", nbytes)

    def finish(self, iteration: int) -> None:
        """Iteration `iteration` is done: keep its counts as `last()` and drop older ones."""
        self._last = dict(self._by_iter.pop(iteration, {}))
        for t in [t for t in self._by_iter if t < iteration]:
            del self._by_iter[t]

    def last(self) -> dict[tuple[str, str, str], int]:
        return dict(self._last)
