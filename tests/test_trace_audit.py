"""An audit of the trace tools as a user meets them: `snake trace plot` of spans whose names
have no colour of their own, trace files that are cut short or not snake's (each refused
in one line naming the event and field), and a summary whose wall time is the run's even
when the span that ended last was not kept."""

from __future__ import annotations

import json

import pytest

from snake.cli import main
from snake.timeline import plot_timeline
from snake.trace import Span, Tracer, load_trace, summarize

PNG = b"\x89PNG\r\n\x1a\n"


def _trace(tmp_path, names: list[str]):
    t = Tracer()
    for i, name in enumerate(names):
        t.add("compute", name, i * 0.01, i * 0.01 + 0.008)
    path = tmp_path / "trace.json"
    t.save(path)
    return path


def test_plot_of_spans_without_a_colour_of_their_own(tmp_path, capsys):
    """The legend had a column per known colour: none known (the last seconds of a run are
    its resident step and loss, or a trace of one's own) gave matplotlib ncol=0 and a
    traceback. Unknown names are grey, and the legend says so."""
    path = _trace(tmp_path, ["resident step", "loss"] * 5)
    assert main(["trace", "plot", str(path), "-o", str(tmp_path / "a.png")]) == 0
    assert (tmp_path / "a.png").read_bytes()[:8] == PNG
    # a window that holds only such spans, in a run with known ones before it
    path = _trace(tmp_path, ["fwd L0 mb0"] * 5 + ["resident step", "loss"])
    assert main(["trace", "plot", str(path), "-o", str(tmp_path / "b.png"), "--last", "0.012"]) == 0
    assert (tmp_path / "b.png").read_bytes()[:8] == PNG
    assert "Traceback" not in capsys.readouterr().err


def _event(**kw):
    return {"name": "fwd L0", "ph": "X", "pid": 1, "tid": 1, "ts": 5.0, "dur": 2.0, **kw}


BAD = [
    # (file content, what the error names)
    ({"traceEvents": [{"name": "fwd L0", "ph": "X", "pid": 1, "tid": 1, "ts": 5}]}, "traceEvents[0]"),
    ({"traceEvents": [_event(), _event(dur=-3.0)]}, "traceEvents[1]"),
    ({"traceEvents": [_event(ts="5")]}, "traceEvents[0]"),
    ({"traceEvents": [_event(args=None)]}, "traceEvents[0]"),
    ({"traceEvents": [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 1}, _event()]}, "traceEvents[0]"),
    ({"traceEvents": [_event()], "otherData": {"snake_totals": {"spans_recorded": 1}}}, "snake_totals"),
    ({"traceEvents": [_event()], "otherData": {"snake_event_loop": {"cpu_s": "x"}}}, "snake_event_loop"),
]


@pytest.mark.parametrize(("content", "names"), BAD)
@pytest.mark.parametrize("what", ["summarize", "plot"])
def test_a_malformed_trace_is_refused_naming_the_event(tmp_path, capsys, content, names, what):
    """A trace not written by snake (or edited) used to give a bare KeyError ("'dur'"), a
    traceback (a totals record without a field; a negative duration in the plot), or a
    summary of nan/negative busy time; now one line that names the event and field."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps(content))
    argv = ["trace", what, str(path)] + (["-o", str(tmp_path / "t.png")] if what == "plot" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert names in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(ValueError, match=r"snake train|trace\.save"):
        load_trace(path)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_trace_with_non_finite_times_is_refused(tmp_path, capsys, value):
    """Python's json reads NaN and Infinity: the summary printed "busy nan%" and the plot
    raised inside matplotlib."""
    path = tmp_path / "t.json"
    event = '{"name": "a", "ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": ' + value + "}"
    path.write_text('{"traceEvents": [' + event + "]}")
    for argv in (["summarize", str(path)], ["plot", str(path), "-o", str(tmp_path / "t.png")]):
        assert main(["trace", *argv]) == 2
        err = capsys.readouterr().err
        assert "traceEvents[0]" in err and "dur" in err and "Traceback" not in err, err


def test_a_trace_cut_short_says_so(tmp_path, capsys):
    """A trace.json cut short (a disk that filled, a copy interrupted) said only "Unterminated
    string starting at: line 1 column 6395"."""
    t = Tracer()
    for i in range(50):
        t.add("compute", f"fwd L{i % 4}", i * 0.01, i * 0.01 + 0.005)
    t.save(tmp_path / "full.json")
    text = (tmp_path / "full.json").read_text()
    (tmp_path / "cut.json").write_text(text[: len(text) // 2])
    assert main(["trace", "summarize", str(tmp_path / "cut.json")]) == 2
    err = capsys.readouterr().err
    assert "cut short" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_the_summary_wall_ends_with_the_span_that_ended_last(tmp_path):
    """Spans arrive in the order their work is reported, not the order it ended (the compute
    actor adds a queued job's spans when the job is done). Past max_spans the wall time ended
    at the last span added: 2 s where the run's work went on to 10 s, its busy fraction
    clamped to 100 %."""
    t = Tracer(max_spans=1)
    t.add("optimizer[0]", "adamw L0", 0.0, 10.0)
    t.add("compute", "fwd L0", 1.0, 2.0)
    s = t.summary()
    assert s["wall_s"] == pytest.approx(10.0)
    assert s["actors"]["optimizer[0]"]["busy_fraction"] == pytest.approx(1.0)
    assert s["actors"]["compute"]["busy_fraction"] == pytest.approx(0.1)
    t.save(tmp_path / "t.json")
    spans, records = load_trace(tmp_path / "t.json")
    assert summarize(spans, **records) == s


def test_plot_timeline_names_unknown_spans_other(tmp_path, monkeypatch):
    """The grey of a span with no colour of its own is in the legend as "other"."""
    import matplotlib.axes

    labels: list[str] = []
    real = matplotlib.axes.Axes.legend

    def legend(self, *args, handles=(), **kw):  # type: ignore[no-untyped-def]
        labels.extend(h.get_label() for h in handles)
        return real(self, *args, handles=handles, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "legend", legend)
    spans = [Span("compute", "fwd L0", 0.0, 1.0), Span("compute", "loss", 1.0, 1.1)]
    plot_timeline(spans, tmp_path / "t.png")
    assert labels == ["fwd", "other"]
