"""An audit of the trace tools as a user meets them: `snake trace plot` of spans whose names
have no colour of their own, trace files that are cut short or not snake's (each refused
in one line naming the event and field), and a summary whose wall time is the run's even
when the span that ended last was not kept. Beyond the trace module: evaluate()'s loads
counted as moved (a link's copied bytes never exceed its moved ones), `snake train`'s trace
of a run that failed or was interrupted, and report.json as strict JSON when the loss is nan."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal

import pytest

from snake import Placement, SnakeConfig, SnakeTrainer
from snake.cli import main
from snake.errors import DataError
from snake.timeline import plot_timeline
from snake.trace import Span, Tracer, load_trace, summarize
from tests.helpers import batches, tiny_gpt

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


async def _eval_link_growth(tmp_path, param: float) -> dict[str, tuple[float, float]]:
    """Per link, the (moved, copied) bytes one evaluation of 2 passes added to the summary."""
    cfg = SnakeConfig(micro_batches=2, placement=Placement(param=param, ckpt=0.5, opt=0.5), alpha=0.0,
                      device="cpu", offload_dir=tmp_path / str(param))
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(1, 4), config=cfg) as t:
        await asyncio.wait_for(t.run(1), 60)
        before = t.trace.summary()["links"]
        await asyncio.wait_for(t.evaluate(batches(2, 4, seed=2), batches_per_pass=1), 60)
        after = t.trace.summary()["links"]
    for v in after.values():
        assert v["copied_bytes"] <= v["bytes"]
    zero = {"bytes": 0.0, "copied_bytes": 0.0}
    return {k: (v["bytes"] - before.get(k, zero)["bytes"], v["copied_bytes"] - before.get(k, zero)["copied_bytes"])
            for k, v in after.items()}


@pytest.mark.asyncio
async def test_evaluate_counts_the_bytes_it_moves(tmp_path):
    """evaluate()'s loads were traced as copies but not counted as moved: after `snake train`
    with its evaluations, cpu->gpu had 12.7 MiB moved and 14.7 MiB copied. Each load is moved
    as training counts it: what it copies, and on a CPU device also a layer used in place."""
    ssd = await _eval_link_growth(tmp_path, 0.5)  # the layers' SSD parts: read, then copied
    assert ssd["ssd->cpu"][0] == ssd["ssd->cpu"][1] > 0
    assert ssd["cpu->gpu"][0] == ssd["cpu->gpu"][1] > 0
    cpu = await _eval_link_growth(tmp_path, 1.0)  # all in CPU memory: used in place, no copy
    assert cpu["cpu->gpu"][1] == 0
    assert cpu["cpu->gpu"][0] == ssd["cpu->gpu"][0]  # the same layers crossed the link


SMALL = ["--layers", "2", "--embd", "32", "--heads", "2", "--seq", "16", "--batch", "4", "--micro-batches", "2"]


def _train(tmp_path, *argv: str) -> int:
    return main(["train", *SMALL, "--eval-batches", "0", "--out", str(tmp_path / "out"),
                 "--offload-dir", str(tmp_path / "off"), *argv])


def _data_then(monkeypatch, then, at: int = 10) -> None:  # type: ignore[no-untyped-def]
    """`snake train`'s data calls `then()` before its batch `at`, once a step is done (its
    progress bar moved): the data actor may read ahead of the steps by more than `at`
    batches while the first one is slow (under load it had, and the trace held no step)."""
    import threading

    import snake.cli
    import snake.corpus

    real, stepped = snake.corpus.random_windows, threading.Event()

    class Bar(snake.cli.tqdm):  # type: ignore[misc,name-defined]
        def update(self, n=1):  # type: ignore[no-untyped-def]
            stepped.set()
            return super().update(n)

    def windows(*args, **kwargs):  # type: ignore[no-untyped-def]
        for i, item in enumerate(real(*args, **kwargs)):
            if i == at:
                assert stepped.wait(60), "no step in 60 s"  # on the data thread: the steps go on
                then()
            yield item

    monkeypatch.setattr(snake.corpus, "random_windows", windows)
    monkeypatch.setattr(snake.cli, "tqdm", Bar)


def _sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def test_a_run_that_fails_writes_its_trace(tmp_path, capsys, monkeypatch):
    """A failed run wrote no trace.json: the one file that says what it was doing. The data
    failing (its next() raised) stops the run cleanly: its steps are saved to --checkpoint,
    and the error (a bug in the data's code) keeps its traceback."""

    def broken() -> None:
        raise RuntimeError("the loader's disk went away")

    _data_then(monkeypatch, broken)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(DataError, match="the loader's disk went away") as e:
        _train(tmp_path, "--steps", "20", "--checkpoint", str(ckpt))
    assert isinstance(e.value.__cause__, RuntimeError)
    err = capsys.readouterr().err
    out = tmp_path / "out"
    assert re.search(rf"snake train: the run failed after \d+ steps; wrote its trace.json and timeline.png to {out}",
                     err), err
    saved = re.search(rf"snake train: the data stopped the run after (\d+) steps; saved them to {ckpt}", err)
    assert saved, err
    assert json.loads((ckpt / "manifest.json").read_text())["step"] == int(saved[1]) == 10
    spans, _ = load_trace(out / "trace.json")
    # (one run of the suite under -n 2 found no span it looked for here, which reruns did not
    # repeat: each asked apart, and of any track, to say which next time)
    assert any(s.actor == "data" for s in spans), sorted({s.actor for s in spans})
    assert any(s.actor.startswith("compute") for s in spans), sorted({s.actor for s in spans})
    assert (out / "timeline.png").read_bytes()[:8] == PNG
    assert not (out / "report.json").exists()


def test_an_interrupted_run_writes_its_trace_and_exits(tmp_path, capsys, monkeypatch):
    """SIGTERM (or Ctrl-C) mid-run: the trace is written, said before the one line that
    says the run was interrupted, and the command ends at once (not after 10,000 steps)."""
    _data_then(monkeypatch, _sigterm)
    assert _train(tmp_path, "--steps", "10000") == 143
    lines = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(r"snake train: interrupted \(SIGTERM\) after \d+ steps", lines[-1]), lines
    assert re.fullmatch(r"snake train: the run was interrupted after \d+ steps; wrote its trace.json and "
                        rf"timeline.png to {tmp_path / 'out'}", lines[-2]), lines
    spans, _ = load_trace(tmp_path / "out" / "trace.json")
    assert any(s.name.startswith("fwd") for s in spans)


def test_a_signal_stops_the_run_after_the_steps_in_flight_and_saves_them(tmp_path, capsys, monkeypatch):
    """SIGTERM mid-run (a preempted machine): the run stops after the steps in flight
    (trainer.stop()), and --checkpoint gets what they trained: the last line names it and
    its step, the steps the run trained. Before, the run was cancelled and the trainer
    closed: every step since the last --save-every checkpoint was lost (here all of them)."""
    _data_then(monkeypatch, _sigterm)
    ck = tmp_path / "ck"
    assert _train(tmp_path, "--steps", "10000", "--checkpoint", str(ck)) == 143
    lines = capsys.readouterr().err.strip().splitlines()
    assert "snake train: SIGTERM: stopping after the steps in flight (again to stop at once)" in lines, lines
    found = re.fullmatch(rf"snake train: interrupted \(SIGTERM\) after (\d+) steps; the checkpoint in "
                         rf"{re.escape(str(ck))} holds step (\d+) \(--resume {re.escape(str(ck))} to go on\)", lines[-1])
    assert found, lines
    # the signal came as batch 10 was read, once compute had taken batch 8: step 9 begun or not
    assert int(found[1]) == int(found[2]) in (9, 10)
    assert json.loads((ck / "manifest.json").read_text())["step"] == int(found[1])


@pytest.mark.asyncio
async def test_a_second_signal_cancels_the_run(capsys):
    """The first SIGINT/SIGTERM asks the run to stop after its steps in flight (where one is
    training and says it will); a second cancels it at once; later ones are ignored, so the
    cleanup is not cut short. Without a run to stop (setting up, evaluating, saving) the
    first cancels."""
    from snake.cli import _Signals

    async def forever() -> None:
        await asyncio.sleep(3600)

    task = asyncio.ensure_future(forever())
    signals = _Signals(task)
    asked = []
    signals.graceful = lambda: asked.append(True) or True
    signals.on_signal(signal.SIGTERM)
    await asyncio.sleep(0)
    assert asked == [True] and not task.done()
    assert "SIGTERM: stopping after the steps in flight (again to stop at once)" in capsys.readouterr().err
    signals.on_signal(signal.SIGINT)
    signals.on_signal(signal.SIGINT)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert asked == [True] and signals.caught == [signal.SIGTERM, signal.SIGINT, signal.SIGINT]
    assert task.cancelling() == 1  # once

    task = asyncio.ensure_future(forever())
    signals = _Signals(task)
    signals.graceful = lambda: False  # no run in progress to stop
    signals.on_signal(signal.SIGINT)
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_trace_that_cannot_be_saved_does_not_hide_why_the_run_stopped(tmp_path, capsys, monkeypatch):
    def full(self, path):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Tracer, "save", full)
    _data_then(monkeypatch, _sigterm)
    assert _train(tmp_path, "--steps", "10000") == 143
    lines = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(r"snake train: interrupted \(SIGTERM\) after \d+ steps", lines[-1]), lines
    assert lines[-2].startswith("snake train: could not save the interrupted run's trace.json to "), lines
    assert "No space left on device" in lines[-2] and "Traceback" not in "\n".join(lines)


def test_report_json_is_strict_json_when_the_loss_is_nan(tmp_path):
    """`--lr 1e6` makes the loss nan: report.json said `"loss": NaN`, which strict JSON
    readers (JavaScript's JSON.parse, jq) refuse; now "nan", as grad_norm is written."""
    assert _train(tmp_path, "--steps", "6", "--lr", "1e6", "--eval-batches", "1") == 0

    def refuse(name: str) -> None:
        raise ValueError(f"{name} in report.json")

    report = json.loads((tmp_path / "out" / "report.json").read_text(), parse_constant=refuse)
    assert report["steps"][-1]["loss"] == "nan" and report["val_loss"]["after"] == "nan"
    json.loads((tmp_path / "out" / "trace.json").read_text(), parse_constant=refuse)


def test_a_trace_is_saved_as_strict_json(tmp_path):
    t = Tracer()
    t.add("compute", "fwd L0", 0.0, math.nan)
    with pytest.raises(ValueError, match="not JSON compliant"):
        t.save(tmp_path / "t.json")
