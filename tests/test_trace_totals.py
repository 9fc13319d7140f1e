"""The trace summary covers the whole run and agrees with the traffic counters: per link
the bytes the schedule moved (what `traffic()` counts, copied or not) next to the bytes
the traced copies moved; a tracer that keeps only its newest spans still sums all of them;
`snake trace` refuses what it cannot read or write in one line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from snake import Placement, SnakeConfig, SnakeTrainer
from snake.cli import main
from snake.trace import Tracer, load_trace, summarize
from tests.helpers import batches, tiny_gpt

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_link_bytes_are_what_traffic_counts(tmp_path, schedule):
    """On a CPU device a vertical run hands gradients and in-memory checkpoints over without a
    copy: the summary's gpu->cpu bytes were those of the copies only (a tenth of what
    `traffic()` counts in this configuration), and its cpu->gpu bytes a fifth short."""
    cfg = SnakeConfig(micro_batches=2, placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.0,
                      device="cpu", offload_dir=tmp_path, schedule=schedule)
    async with SnakeTrainer(tiny_gpt(n_layer=3), data=batches(1, 4), config=cfg) as t:
        await asyncio.wait_for(t.run(1), 60)
        want: dict[str, int] = defaultdict(int)
        for (src, dst, _kind), n in t.traffic().items():
            want[f"{src}->{dst}"] += n
        links = t.trace.summary()["links"]
    assert {k: v["bytes"] for k, v in links.items()} == want
    for v in links.values():
        assert 0 <= v["copied_bytes"] <= v["bytes"]
    if schedule == "vertical":  # the gradients are stepped from their slots: no copy
        assert links["gpu->cpu"]["copied_bytes"] < links["gpu->cpu"]["bytes"]


def _spans(tracer: Tracer, n: int) -> None:
    for i in range(n):
        tracer.add("compute", f"fwd L{i % 4}", i * 0.01, i * 0.01 + 0.006)
        tracer.add("d2h", f"ckpt L{i % 4}", i * 0.01 + 0.006, i * 0.01 + 0.009, link="gpu->cpu", bytes=1000)
        tracer.moved("gpu->cpu", 1000)
        tracer.moved("cpu->gpu", 500)  # moved by reference: no span


def test_a_tracer_that_keeps_its_newest_spans_sums_all_of_them(tmp_path, capsys):
    """Past max_spans the oldest spans are dropped from the file; the summary used to cover
    only those kept (the last 77 % of a 130-step run, with its wall time), silently."""
    full, short = Tracer(), Tracer(max_spans=50)
    _spans(full, 300)
    _spans(short, 300)
    assert len(short.spans) == 50 and short.recorded == 600
    want, got = full.summary(), short.summary()
    assert got["spans"] == {"recorded": 600, "kept": 50, "dropped": 550}
    assert got["wall_s"] == pytest.approx(want["wall_s"]) == pytest.approx(2.999)
    assert got["actors"] == want["actors"]
    assert got["links"] == want["links"]
    assert got["links"]["gpu->cpu"]["bytes"] == 300_000 and got["links"]["cpu->gpu"]["copied_bytes"] == 0
    # the file keeps the totals: `snake trace summarize` reads the whole run from it
    path = tmp_path / "trace.json"
    short.save(path)
    spans, records = load_trace(path)
    assert len(spans) == 50
    assert summarize(spans, **records)["actors"] == want["actors"]
    assert main(["trace", "summarize", str(path)]) == 0
    assert "600 recorded, the newest 50 kept" in capsys.readouterr().out
    assert main(["trace", "plot", str(path), "-o", str(tmp_path / "t.png")]) == 0


def test_a_trace_without_totals_is_summarized_from_its_spans(tmp_path):
    """Traces written before the totals (and Chrome's plain array of events) still read."""
    t = Tracer()
    _spans(t, 10)
    events = t.chrome()["traceEvents"]
    path = tmp_path / "array.json"
    path.write_text(json.dumps(events))
    spans, records = load_trace(path)
    s = summarize(spans, **records)
    assert s["spans"]["recorded"] == 20 and s["links"]["gpu->cpu"]["bytes"] == 10_000
    assert "cpu->gpu" not in s["links"]  # moved by reference: only the totals knew


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["plot", "{trace}", "-o", "{tmp}/no/such/dir/t.png"], "which is not a directory; create it first"),
        (["plot", "{trace}", "-o", "{tmp}/t.txt"], "must name a .png file"),
        (["plot", "{trace}", "--last", "0"], "0 must be more than 0 seconds"),
        (["plot", "{trace}", "--last", "-5"], "-5 must be more than 0 seconds"),
        (["summarize", "{tmp}/report.json"], "not a trace (no list of trace events)"),
        (["summarize", "{tmp}/numbers.json"], "not a trace (no list of trace events)"),
    ],
)
def test_trace_mistakes_are_one_line_errors(tmp_path, capsys, argv, says):
    t = Tracer()
    _spans(t, 5)
    t.save(tmp_path / "trace.json")
    (tmp_path / "report.json").write_text(json.dumps({"steps": [], "config": {}}))
    (tmp_path / "numbers.json").write_text("[1, 2]")
    args = [a.format(trace=tmp_path / "trace.json", tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit) if "--last" in argv else _nothing():
        assert main(["trace", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) <= 3


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_summarize_into_a_closed_pipe_is_quiet(tmp_path):
    t = Tracer()
    for i in range(400):  # many tracks: more output than a pipe takes at once
        t.add(f"actor {i}", "x", i, i + 1)
    t.save(tmp_path / "trace.json")
    done = subprocess.run(f"{sys.executable} -m snake.cli trace summarize {tmp_path / 'trace.json'} | head -1",
                          shell=True, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("traced wall time")
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
