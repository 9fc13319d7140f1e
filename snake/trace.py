"""Per-actor traces (Chrome / Perfetto JSON, one track per actor) and traffic counters."""

from __future__ import annotations

import json
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TIERS = ("gpu", "cpu", "ssd")
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
    so memory stays bounded on long runs). Times are seconds since the tracer was made."""

    def __init__(self, max_spans: int = 20_000) -> None:
        self._t0 = time.perf_counter()
        self.spans: deque[Span] = deque(maxlen=max_spans)
        self._tracks: dict[str, int] = {}
        self.last_end_s = 0.0  # when the last span ended: progress, for the stall watchdog
        # the event loop's own CPU (its thread's clock) and wall time over run() calls
        self.loop_cpu_s = 0.0
        self.loop_wall_s = 0.0

    @contextmanager
    def loop_clock(self) -> Iterator[None]:
        """Around a run on the event loop's thread: adds that thread's CPU time and the wall
        time. The loop is the scheduler every actor message goes through; its CPU share says
        whether it keeps up (everything else on the same loop is counted too)."""
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        try:
            yield
        finally:
            self.loop_cpu_s += time.thread_time() - cpu0
            self.loop_wall_s += time.perf_counter() - wall0

    def event_loop(self) -> dict[str, float] | None:
        if self.loop_wall_s <= 0:
            return None
        return {"cpu_s": self.loop_cpu_s, "run_wall_s": self.loop_wall_s,
                "cpu_fraction": self.loop_cpu_s / self.loop_wall_s}

    def now(self) -> float:
        return time.perf_counter() - self._t0

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
        self.spans.append(Span(actor, name, start_s, end_s, link, int(bytes)))

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
        loop = self.event_loop()
        if loop is not None:
            out["otherData"] = {"snake_event_loop": loop}
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.chrome()))

    def summary(self) -> dict[str, Any]:
        return summarize(list(self.spans), event_loop=self.event_loop())


def summarize(spans: list[Span], *, event_loop: dict[str, float] | None = None) -> dict[str, Any]:
    """Busy fraction per actor over the traced wall time, and bytes and bandwidth per link
    (`src->dst`: while busy, and averaged over the wall time); with `event_loop`, the event
    loop thread's CPU over the runs (`Tracer.loop_clock`)."""
    out = _summarize_spans(spans)
    if event_loop is not None:
        out["event_loop"] = dict(event_loop)
    return out


def _summarize_spans(spans: list[Span]) -> dict[str, Any]:
    if not spans:
        return {"wall_s": 0.0, "actors": {}, "links": {}}
    t0 = min(s.start_s for s in spans)
    t1 = max(s.end_s for s in spans)
    wall = max(t1 - t0, 1e-9)
    busy: dict[str, float] = defaultdict(float)
    links: dict[str, dict[str, float]] = defaultdict(lambda: {"bytes": 0.0, "busy_s": 0.0})
    for s in spans:
        busy[s.actor] += s.end_s - s.start_s
        if s.link:
            links[s.link]["bytes"] += s.nbytes
            links[s.link]["busy_s"] += s.end_s - s.start_s
    return {
        "wall_s": wall,
        "actors": {a: {"busy_s": b, "busy_fraction": min(b / wall, 1.0)} for a, b in sorted(busy.items())},
        "links": {
            k: {
                "bytes": v["bytes"],
                "busy_bytes_per_s": v["bytes"] / v["busy_s"] if v["busy_s"] > 0 else 0.0,
                "avg_bytes_per_s": v["bytes"] / wall,
            }
            for k, v in sorted(links.items())
        },
    }


def load_trace(path: str | Path) -> tuple[list[Span], dict[str, float] | None]:
    """A trace written by `Tracer.save`, read once: its spans, and the event loop's CPU record
    if it has one."""
    data = json.loads(Path(path).read_text())
    names = {}
    for e in data["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[e["tid"]] = e["args"]["name"]
    spans = [
        Span(
            names.get(e["tid"], str(e["tid"])), e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6,
            e.get("args", {}).get("link"), int(e.get("args", {}).get("bytes", 0)),
        )
        for e in data["traceEvents"]
        if e.get("ph") == "X"
    ]
    loop = data.get("otherData", {}).get("snake_event_loop")
    return spans, ({k: float(v) for k, v in loop.items()} if isinstance(loop, dict) else None)


class Traffic:
    """Bytes moved per (src tier, dst tier, kind), attributed to the iteration an operation
    belongs to. `last()` is the last finished iteration's counts."""

    def __init__(self) -> None:
        self._by_iter: dict[int, dict[tuple[str, str, str], int]] = defaultdict(lambda: defaultdict(int))
        self._last: dict[tuple[str, str, str], int] = {}

    def add(self, iteration: int, src: str, dst: str, kind: str, nbytes: int) -> None:
        assert src in TIERS and dst in TIERS and kind in KINDS, (src, dst, kind)
        if nbytes:
            self._by_iter[iteration][(src, dst, kind)] += int(nbytes)

    def finish(self, iteration: int) -> None:
        """Iteration `iteration` is done: keep its counts as `last()` and drop older ones."""
        self._last = dict(self._by_iter.pop(iteration, {}))
        for t in [t for t in self._by_iter if t < iteration]:
            del self._by_iter[t]

    def last(self) -> dict[tuple[str, str, str], int]:
        return dict(self._last)
