"""An audit of snake's other commands as a user runs them: `snake plan` (every documented
option, the table against `--json` against what `SnakeTrainer` accepts, bad values, files a
refused command leaves, `~` in its paths), `snake trace summarize` / `plot` (a real run's
trace against `trainer.trace.summary()`, traces cut short or not snake's, `~`), `snake
export` (`--hf`, `--peft`, both, neither, relative paths, `~`, a target inside the
checkpoint, the checkpoint given as a file), and the help of each command.

Planning here measures nothing: a profile cache written into --offload-dir (as the planner
tests do), or `planner.probes.measure_all` replaced by fixed timings."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
from pathlib import Path

import matplotlib.font_manager  # noqa: F401 - its font cache loaded before a test moves HOME
import pytest
import torch

from planner.cli import parse_model
from planner.profile import _cache_key, cache_path, shape_of
from snake import AdamW, Placement, SnakeConfig, SnakeTrainer
from snake.cli import main
from snake.models import GPT
from tests.helpers import batches, tiny_gpt

REPO = Path(__file__).resolve().parents[1]
# fixed "measured" costs (tests/test_planner_audit.py's): a CPU box with a 200 MB/s SSD
FAKE = dict(fwd_seconds=1e-3, recompute_seconds=1e-3, bwd_seconds=2e-3, pre_post_seconds=1e-3,
            h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10, ssd_read_bytes_per_s=2e8, ssd_write_bytes_per_s=2e8,
            adam_elems_per_s=1e9)
MODEL = "gpt:n_layer=2,n_embd=64,n_head=4,vocab_size=96,block_size=32"
BIG = "gpt:n_layer=8,n_embd=512,n_head=4,vocab_size=96,block_size=32"  # one a small budget splits


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of `snake ...` in this process (argparse exits)."""
    capsys.readouterr()
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = int(e.code or 0)
    got = capsys.readouterr()
    return rc, got.out, got.err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, f"not one line: {err!r}"
    return lines[0]


def _cache(off: Path, model: str = MODEL, mbs: int = 2, seq: int = 32, dtype: str = "float32") -> None:
    """A profile cache in `off` for `snake plan` of `model` (nothing is measured)."""
    off.mkdir(parents=True, exist_ok=True)
    cache_path(off, _cache_key(shape_of(parse_model(model), mbs, seq, dtype), "cpu", dtype, None)).write_text(
        json.dumps(FAKE))


@pytest.fixture
def fake_probes(monkeypatch):
    import planner.probes

    monkeypatch.setattr(planner.probes, "measure_all", lambda *a, **k: dict(FAKE))


def _plan_json(capsys, off: Path, *extra: str, model: str = MODEL) -> dict:
    rc, out, err = _main(capsys, "plan", "--model", model, "--micro-batch-size", "2", "--offload-dir", str(off),
                         "--device-memory", "8GiB", "--json", *extra)
    assert rc == 0, err
    return json.loads(out)


# -- the run whose trace and checkpoint the trace and export tests read --------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """Two steps of a small GPT with half of everything on SSD: its trace.json, the
    trainer's own summary of it, its checkpoint and its trained weights."""
    d = tmp_path_factory.mktemp("run")

    async def go() -> tuple[dict, dict]:
        cfg = SnakeConfig(micro_batches=2, placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.25,
                          device="cpu", offload_dir=d / "off")
        async with SnakeTrainer(tiny_gpt(n_layer=2, n_embd=32), data=batches(2, 4), config=cfg) as t:
            await asyncio.wait_for(t.run(2), 60)
            t.trace.save(d / "trace.json")
            summary = t.trace.summary()
            await t.save(d / "ck")
            return summary, await t.state_dict()

    summary, state = asyncio.run(go())
    return {"dir": d, "trace": d / "trace.json", "summary": summary, "ck": d / "ck", "state": state}


# -- help and unknown commands ----------------------------------------------------------------------


def test_the_top_level_and_trace_help_list_every_command_the_readme_documents(capsys):
    rc, out, _ = _main(capsys, "--help")
    assert rc == 0
    readme = (REPO / "README.md").read_text()
    for cmd in ("train", "plan", "trace", "export"):
        assert f"snake {cmd}" in readme and re.search(rf"\b{cmd}\b", out), (cmd, out)
    rc, out, _ = _main(capsys, "trace", "--help")
    assert rc == 0 and "summarize" in out and "plot" in out, out
    rc, out, _ = _main(capsys, "trace", "summarize", "--help")
    assert rc == 0 and "--json" in out and "trace" in out, out


@pytest.mark.parametrize("argv", [["trace"], ["trace", "bogus", "t.json"], ["trace", "summarize"],
                                  ["plan"], ["export", "--hf", "x"], ["trace", "plot"]])
def test_a_missing_or_unknown_subcommand_is_status_2_without_a_traceback(capsys, argv):
    rc, out, err = _main(capsys, *argv)
    assert rc == 2 and out == "" and "Traceback" not in err and "error:" in err, (argv, err)


# -- snake plan: what it prints ------------------------------------------------------------------


def _table(text: str) -> dict[str, str]:
    rows = {}
    for line in text.splitlines():
        key, value = line[:22].strip(), line[22:].strip()
        if key:
            rows[key] = value
    return rows


@pytest.mark.parametrize("extra", [
    [],
    ["--schedule", "horizontal"],
    ["--alpha", "1"],
    ["--alpha", "0.5", "--max-micro-batches", "3"],
    ["--seq-len", "16", "--dtype", "bfloat16", "--resident-optimizer", "ssd"],
], ids=lambda e: " ".join(e) or "defaults")
def test_plan_json_and_table_say_the_same_and_the_numbers_are_the_models(tmp_path, capsys, extra):
    """Each option's plan: `--json` and the table agree row by row; the parameters are the
    GPT's own, the throughput is the plan's tokens over its iteration, the budget and the
    measured costs are those given (the cached profile), and each option is honoured."""
    given = dict(zip(extra[::2], extra[1::2], strict=True))
    seq, dtype = int(given.get("--seq-len", 32)), given.get("--dtype", "float32")
    off = tmp_path / "off"
    _cache(off, BIG, seq=seq, dtype=dtype)
    budget = "600MiB"
    if "--max-micro-batches" not in given:  # the search of up to 64 takes 15 s here
        extra = [*extra, "--max-micro-batches", "2"]
    d = _plan_json(capsys, off, "--cpu-memory", budget, *extra, model=BIG)
    rc, text, err = _main(capsys, "plan", "--model", BIG, "--micro-batch-size", "2", "--offload-dir", str(off),
                          "--device-memory", "8GiB", "--cpu-memory", budget, *extra)
    assert rc == 0, err
    t = _table(text)
    # the numbers of the model and the machine, computed here
    with torch.device("meta"):  # its parameters counted, none filled
        gpt = GPT(parse_model(BIG))
    assert d["trained_params"] == sum(p.numel() for p in gpt.parameters()) and d["frozen_params"] == 0
    assert d["predicted_tokens_per_s"] == pytest.approx(d["micro_batches"] * 2 * seq / d["predicted_iteration_seconds"])
    assert d["profile"]["cpu_memory_bytes"] == 600 * 2**20 and d["profile"]["device_memory_bytes"] == 8 * 2**30
    assert {k: d["profile"][k] for k in FAKE} == FAKE  # the cached profile, not remeasured
    assert d["host_total_bytes"] <= 600 * 2**20
    assert d["schedule"] == given.get("--schedule", "vertical")
    if "--alpha" in given:
        assert d["alpha"] == float(given["--alpha"])
    assert 1 <= d["micro_batches"] <= int(given.get("--max-micro-batches", 2))
    if "--resident-optimizer" in given:
        assert d["resident_optimizer"] == given["--resident-optimizer"]
    # the table says what the JSON says
    assert t["parameters"] == f"{d['trained_params'] / 1e6:.4g} M trained"
    assert t["schedule"] == d["schedule"] and t["micro-batches"] == str(d["micro_batches"])
    assert t["alpha (delayed step)"] == f"{d['alpha']:.2f}"
    shares = dict(re.findall(r"(\w+) ([0-9.]+)%", t["CPU share"]))
    for kind in ("param", "ckpt", "opt"):
        assert float(shares[kind]) == pytest.approx(100 * d["placement"][kind], abs=0.051), (kind, t["CPU share"])
    assert t["resident optimizer"].startswith(d["resident_optimizer"] + " ")
    assert float(t["iteration"].split()[0]) == pytest.approx(d["predicted_iteration_seconds"], rel=1e-3)
    assert float(t["throughput"].split()[0]) == pytest.approx(d["predicted_tokens_per_s"], rel=1e-3)
    assert t["binding"] == (", ".join(d["binding"]) or "-")
    used, of = (float(x) for x in re.match(r"([0-9.]+) of ([0-9.]+) GiB", t["host memory"]).groups())
    assert used == pytest.approx(d["host_total_bytes"] / 2**30, abs=0.006) and of == pytest.approx(600 / 1024, abs=0.006)
    assert float(t["horizontal, same"].split()[0]) == pytest.approx(
        d["horizontal_iteration_seconds_same_placement"], rel=1e-3)
    if d["schedule"] == "horizontal":  # its own plan is the horizontal one at that placement
        assert d["horizontal_iteration_seconds_same_placement"] == pytest.approx(d["predicted_iteration_seconds"])
    # only the profile cache is left in the offload directory
    assert [p.name for p in off.iterdir() if not p.name.startswith("snake-profile-")] == []


@pytest.mark.parametrize(("extra", "dtype", "schedule", "clip"), [
    (["--dtype", "bfloat16", "--resident-optimizer", "ssd"], "bfloat16", "vertical", False),
    (["--schedule", "horizontal", "--alpha", "1"], "float32", "horizontal", True),
], ids=["bfloat16-resident-ssd", "horizontal-alpha-1-clipping"])
def test_a_plan_of_each_option_is_one_the_trainer_takes_within_the_memory_it_says(tmp_path, capsys, extra, dtype,
                                                                                   schedule, clip):
    """`snake plan --json`'s micro_batches, alpha, placement and resident_optimizer, fixed in
    a trainer of the same model, dtype and schedule (clipping for `--alpha 1`), with
    cpu_memory_bytes the plan's own host_total_bytes: accepted, and it trains a step."""
    off = tmp_path / "off"
    _cache(off, dtype=dtype)
    d = _plan_json(capsys, off, "--cpu-memory", "64GiB", "--max-micro-batches", "2", *extra)
    torch.manual_seed(0)
    model = GPT(parse_model(MODEL))
    cfg = SnakeConfig(offload_dir=off, device="cpu", micro_batches=d["micro_batches"], alpha=d["alpha"], dtype=dtype,
                      schedule=schedule, placement=Placement(**d["placement"]),
                      resident_optimizer=d["resident_optimizer"], cpu_memory_bytes=math.ceil(d["host_total_bytes"]),
                      optimizer=AdamW(max_grad_norm=1.0) if clip else AdamW())

    async def go():
        async with SnakeTrainer(model, data=batches(1, 2 * d["micro_batches"], seq=32), config=cfg) as t:
            return await asyncio.wait_for(t.run(1), 60)

    report = asyncio.run(go())
    assert len(report.steps) == 1 and math.isfinite(report.steps[0].loss)


# -- snake plan: refusals -----------------------------------------------------------------------

PLAN_BAD = [
    (["--micro-batch-size", "0"], "--micro-batch-size"),
    (["--micro-batch-size", "two"], "--micro-batch-size"),
    (["--seq-len", "0"], "--seq-len"),
    (["--seq-len", "33"], "--seq-len"),
    (["--cpu-memory", "lots"], "--cpu-memory"),
    (["--cpu-memory", "-1GiB"], "--cpu-memory"),
    (["--cpu-memory", "1e999"], "--cpu-memory"),
    (["--device-memory", "0.5"], "--device-memory"),
    (["--ssd-bandwidth", "999999"], "--ssd-bandwidth"),
    (["--ssd-bandwidth", "fast"], "--ssd-bandwidth"),
    (["--device", "tpu"], "--device"),
    (["--dtype", "float64"], "--dtype"),
    (["--schedule", "diagonal"], "--schedule"),
    (["--max-micro-batches", "0"], "--max-micro-batches"),
    (["--alpha", "nan"], "--alpha"),
    (["--alpha", "-0.1"], "--alpha"),
    (["--alpha", "half"], "--alpha"),
    (["--resident-optimizer", "disk"], "--resident-optimizer"),
    (["--lora", "4"], "--lora"),
    (["--lora-targets", "q_proj"], "--lora-targets"),
    (["--stream"], "--stream"),
    (["--plot", "{tmp}"], "--plot"),
    (["--plot", "{tmp}/r.docx"], "--plot"),
    (["--plot", "{tmp}/no/such/dir/r.png"], "--plot"),
    (["--model", "gpt:n_layer=2,n_layer=3"], "--model"),
    (["--model", "gpt:n_embd=30,n_head=4"], "--model"),
    (["--model", "gpt:width=3"], "--model"),
]


@pytest.mark.parametrize(("extra", "flag"), PLAN_BAD, ids=[" ".join(e) for e, _ in PLAN_BAD])
def test_a_bad_plan_value_is_refused_naming_the_option_and_leaves_nothing(tmp_path, capsys, fake_probes, extra, flag):
    """Exit 2, nothing on stdout, the last line of stderr names the option (argparse's usage
    above it, or snake's one line alone), no traceback; neither --offload-dir nor --plot made."""
    extra = [e.format(tmp=tmp_path) for e in extra]
    argv = ["--model", MODEL, "--micro-batch-size", "2", "--offload-dir", str(tmp_path / "off"),
            "--plot", str(tmp_path / "r.png")]
    for i in range(0, len(extra), 2):  # replace the option where it is given, else add it
        if extra[i] in argv:
            argv[argv.index(extra[i]) + 1] = extra[i + 1]
        else:
            argv += extra[i:i + 2]
    rc, out, err = _main(capsys, "plan", *argv)
    assert rc == 2 and out == "" and "Traceback" not in err, (rc, out, err)
    last = err.strip().splitlines()[-1]
    assert last.startswith("snake plan: ") and flag in last, err
    if not last.startswith("snake plan: error: "):  # snake's own refusal: one line
        _one_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], f"a refused plan left {list(tmp_path.iterdir())}"


def test_an_empty_offload_dir_is_refused_not_taken_as_the_current_directory(tmp_path, capsys, monkeypatch,
                                                                             fake_probes):
    """`--offload-dir ""` (`--offload-dir "$SSD"` with the variable unset): SnakeConfig refuses
    offload_dir='' by name and `snake train` uses a temporary directory; `snake plan` should
    not measure its SSD (up to 256 MiB of probe files) in whatever directory it runs from."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    rc, out, err = _main(capsys, "plan", "--model", MODEL, "--micro-batch-size", "2", "--offload-dir", "",
                         "--json")
    left = sorted(p.name for p in cwd.iterdir())
    assert rc == 2 and "offload" in err and out == "", (
        f"snake plan --offload-dir '' was not refused (status {rc}): it took the current directory as the SSD tier, "
        f"left {left} there, and printed a plan")
    assert left == []


def test_plan_offload_dir_with_a_tilde_is_measured_and_cached_where_it_was_checked(tmp_path, capsys, monkeypatch,
                                                                                   fake_probes):
    """`--offload-dir=~/off` (the shell leaves a `~` after `=` as it is): snake expands it to
    check and create the directory, so the probes and the profile cache must go there too,
    not into a directory named `~` under the current one."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    rc, out, err = _main(capsys, "plan", "--model", MODEL, "--micro-batch-size", "2", "--offload-dir=~/off",
                         "--cpu-memory", "2GiB", "--json")
    assert rc == 0, err
    stray = sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*"))
    cached = sorted(p.name for p in (home / "off").iterdir()) if (home / "off").is_dir() else None
    assert not stray and cached and all(n.startswith("snake-profile-") for n in cached), (
        f"--offload-dir=~/off: checked and created as {home / 'off'} (holding {cached}), but the profile went to "
        f"{cwd}/~/off ({stray}): planner/cli.py passes args.offload_dir unexpanded to measure_profile")


def test_plan_plot_with_a_tilde_is_written_where_it_was_checked(tmp_path, capsys, monkeypatch):
    """`--plot=~/r.png`: checked with `~` expanded (its directory exists), then written with
    the `~` as it is: into ./~/ where that exists, else a FileNotFoundError traceback after
    the plan was printed."""
    import planner.cli

    home, cwd, off = tmp_path / "home", tmp_path / "cwd", tmp_path / "off"
    home.mkdir()
    cwd.mkdir()
    _cache(off)
    real = planner.cli.roofline  # the plot's points: two micro-batch counts, not 16 (seconds of LPs)
    monkeypatch.setattr(planner.cli, "roofline", lambda profile, ns: real(profile, list(ns)[:2]))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    try:
        rc, _, err = _main(capsys, "plan", "--model", MODEL, "--micro-batch-size", "2", "--offload-dir", str(off),
                           "--cpu-memory", "2GiB", "--plot=~/r.png")
    except OSError as e:
        pytest.fail(f"snake plan --plot=~/r.png accepted the path (it checked {home}/r.png) and then raised "
                    f"{type(e).__name__}: {e}: planner/cli.py gives plot_roofline args.plot unexpanded")
    assert rc == 0, err
    assert (home / "r.png").read_bytes()[:4] == b"\x89PNG" and not (cwd / "~").exists()


# -- snake trace summarize -------------------------------------------------------------------------


def test_summarize_of_a_real_runs_trace_is_the_trainers_summary(run, capsys):
    """`--json` of the saved trace is `trainer.trace.summary()` of the same run, key for key;
    the table shows the same numbers."""
    rc, out, err = _main(capsys, "trace", "summarize", "--json", str(run["trace"]))
    assert rc == 0 and err == "", err
    got, want = json.loads(out), json.loads(json.dumps(run["summary"]))
    assert got == want, {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}
    rc, text, err = _main(capsys, "trace", "summarize", str(run["trace"]))
    assert rc == 0 and err == "", err
    lines = text.splitlines()
    assert lines[0] == f"traced wall time: {want['wall_s']:.3f} s"
    for actor, v in want["actors"].items():
        row = next(line for line in lines if line.split()[:1] == [actor])
        busy, pct = row.split()[1:3]
        assert float(busy) == pytest.approx(v["busy_s"], abs=6e-4) and float(pct[:-1]) == pytest.approx(
            100 * v["busy_fraction"], abs=0.06), row
    assert {"ssd->cpu", "cpu->ssd", "cpu->gpu"} <= set(want["links"])
    for link, v in want["links"].items():
        row = next(line for line in lines if line.split()[:1] == [link]).split()
        assert float(row[1]) == pytest.approx(v["bytes"] / 2**20, abs=0.06), row
        assert float(row[2]) == pytest.approx(v["copied_bytes"] / 2**20, abs=0.06), row
    loop = want["event_loop"]
    assert f"event loop CPU: {loop['cpu_s']:.3f} s in {loop['run_wall_s']:.3f} s of run()" in text


def _cut_at(text: str, where: str) -> int:
    """Where to cut a saved trace: nothing left, inside a span's name (a string), inside a
    number, just after a comma between events, or before its last byte."""
    middle = len(text) // 2
    if where == "inside-a-string":
        return text.index('"name": "', middle) + len('"name": "') + 2
    if where == "inside-a-number":
        return text.index('"ts": ', middle) + len('"ts": ') + 2
    if where == "after-a-comma":
        return text.index("}, {", middle) + 3
    return {"empty": 0, "last-byte": len(text) - 1}[where]


@pytest.mark.parametrize("where", ["empty", "inside-a-string", "inside-a-number", "after-a-comma", "last-byte"])
def test_a_real_trace_cut_short_anywhere_says_so_in_one_line(run, tmp_path, capsys, where):
    """README: the summary covers a saved trace; a trace.json cut short (a copy interrupted,
    a disk that filled) is said to be one in one line, status 2, wherever the cut fell."""
    text = run["trace"].read_text()
    cut = tmp_path / "cut.json"
    cut.write_text(text[: _cut_at(text, where)])
    rc, out, err = _main(capsys, "trace", "summarize", str(cut))
    assert rc == 2 and out == "", err
    line = _one_line(err)
    assert line.startswith(f"snake trace: cannot read {cut}: ") and "cut short" in line, (
        f"a trace cut {where} is not said to be cut short: {line!r}; snake/trace.py load_trace takes a cut only "
        "where JSONDecodeError.pos is at the text's end, but an unterminated string reports where it began")


@pytest.mark.parametrize("what", ["directory", "binary", "not-json", "json-number", "missing"])
def test_summarize_of_what_is_not_a_trace_file_is_one_line_status_2(tmp_path, capsys, what):
    path = tmp_path / "t.json"
    if what == "directory":
        path.mkdir()
    elif what == "binary":
        path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe" * 50)
    elif what == "not-json":
        path.write_text("compute 1.2 s\nh2d 0.3 s\n")
    elif what == "json-number":
        path.write_text("42")
    for cmd in (["summarize", str(path)], ["plot", str(path), "-o", str(tmp_path / "t.png")]):
        rc, out, err = _main(capsys, "trace", *cmd)
        assert rc == 2 and out == "", (cmd, err)
        assert _one_line(err).startswith(f"snake trace: cannot read {path}: "), err
    assert not (tmp_path / "t.png").exists()


def _foreign(kind: str) -> dict:
    """A Chrome trace another tool wrote: begin/end pairs (Chrome's duration events), or
    complete events nested on one thread as torch.profiler writes them (an op and the ops
    it calls)."""
    meta = [{"name": "thread_name", "ph": "M", "pid": 7, "tid": 7, "args": {"name": "python"}}]
    if kind == "begin-end":
        return {"traceEvents": [*meta, {"name": "step", "ph": "B", "pid": 7, "tid": 7, "ts": 0},
                                {"name": "step", "ph": "E", "pid": 7, "tid": 7, "ts": 400_000}],
                "displayTimeUnit": "ms"}
    ops = [("aten::linear", 0.0, 1000.0), ("aten::t", 10.0, 50.0), ("aten::addmm", 70.0, 900.0),
           ("aten::copy_", 100.0, 600.0)]
    return {"schemaVersion": 1, "traceEvents": [*meta, *(
        {"ph": "X", "cat": "cpu_op", "name": n, "pid": 7, "tid": 7, "ts": ts, "dur": dur,
         "args": {"External id": i}} for i, (n, ts, dur) in enumerate(ops))], "traceName": "torch.profiler"}


@pytest.mark.parametrize("kind", ["begin-end", "nested"])
def test_a_chrome_trace_of_another_tool_is_refused_or_summarized_truly(tmp_path, capsys, kind):
    """A valid Chrome trace that snake did not write: either refused in one line (status 2),
    as `snake trace plot` refuses one without spans, or a summary whose numbers are that
    trace's. Its thread was busy 0.4 s of 0.4 s (begin-end) and 1.0 ms of 1.0 ms (nested: the
    outer op covers the others)."""
    path = tmp_path / "other.json"
    path.write_text(json.dumps(_foreign(kind)))
    rc, out, err = _main(capsys, "trace", "summarize", "--json", str(path))
    if rc == 2:
        assert out == "" and _one_line(err).startswith("snake trace: "), err
        return
    assert rc == 0, err
    s = json.loads(out)
    busy = {a: v["busy_s"] for a, v in s["actors"].items()}
    if kind == "begin-end":
        assert busy, (f"snake trace summarize of a Chrome trace with a 0.4 s begin/end span exits 0 with an empty "
                      f"summary (wall {s['wall_s']} s, no actor): it reads only complete ('X') events "
                      "(snake/trace.py load_trace), where `snake trace plot` refuses the same file in one line")
    for actor, b in busy.items():
        assert b <= s["wall_s"] * (1 + 1e-9), (
            f"actor {actor!r} busy {b * 1e3:.2f} ms in a trace {s['wall_s'] * 1e3:.2f} ms long (shown as "
            f"{100 * s['actors'][actor]['busy_fraction']:.0f}%): nested spans of one thread are summed "
            "(snake/trace.py Tracer.add `_busy[actor] +=`), and _summarize_totals clamps the fraction to 1")


def test_trace_plot_out_with_a_tilde_is_written_where_it_was_checked(run, tmp_path, capsys, monkeypatch):
    """`--out=~/t.png`: checked with `~` expanded (snake/cli.py _image_path), then written
    with the `~` as it is."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    try:
        rc, out, err = _main(capsys, "trace", "plot", str(run["trace"]), "--out=~/t.png")
    except OSError as e:
        pytest.fail(f"snake trace plot --out=~/t.png passed its check ({home}/t.png can be written) and then raised "
                    f"{type(e).__name__}: {e}: snake/cli.py _trace gives plot_timeline args.out unexpanded")
    assert rc == 0, err
    assert (home / "t.png").read_bytes()[:4] == b"\x89PNG" and not (cwd / "~").exists()


# -- snake export ----------------------------------------------------------------------------------


def _masters_of(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize("argv", [["--hf", "{t}/a", "--peft", "{t}/b"], [], ["--hf"], ["--peft", "{t}/b", "--peft"]],
                         ids=["both", "neither", "hf-without-dir", "peft-twice-without-dir"])
def test_export_needs_exactly_one_of_hf_and_peft(run, tmp_path, capsys, argv):
    rc, out, err = _main(capsys, "export", str(run["ck"]), *[a.format(t=tmp_path) for a in argv])
    assert rc == 2 and out == "" and "Traceback" not in err, err
    assert re.search(r"--hf|--peft", err.strip().splitlines()[-1]), err
    assert list(tmp_path.iterdir()) == []


def test_export_with_relative_paths_writes_the_trained_weights(run, tmp_path, capsys, monkeypatch):
    """From the checkpoint's parent, `snake export ck --hf out/hf`: the GPT-2 it writes holds
    the trained weights (the embedding, the first layer's attention, transposed as GPT-2's
    Conv1D keeps it), and the line on stdout names the directory as given."""
    work = tmp_path / "work"
    shutil.copytree(run["ck"], work / "ck")
    monkeypatch.chdir(work)
    rc, out, err = _main(capsys, "export", "ck", "--hf", "out/hf")
    assert rc == 0, err
    assert out.startswith("wrote out/hf ") and out.count("\n") == 1, out
    got, state = _masters_of(work / "out" / "hf"), run["state"]
    torch.testing.assert_close(got["transformer.wte.weight"], state["wte.weight"], rtol=0, atol=0)
    torch.testing.assert_close(got["transformer.h.0.attn.c_attn.weight"], state["blocks.0.attn.c_attn.weight"].t(),
                               rtol=0, atol=0)
    assert json.loads((work / "out" / "hf" / "config.json").read_text())["n_layer"] == 2


def test_export_to_a_tilde_directory_writes_where_it_was_checked(run, tmp_path, capsys, monkeypatch):
    """`--hf=~/hf`: the target is checked with `~` expanded (snake/cli_args.py
    _check_export_dir), so the model must be written there, not into ./~/hf."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    rc, out, err = _main(capsys, "export", str(run["ck"]), "--hf=~/hf")
    assert rc == 0, err
    stray = sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*"))
    assert (home / "hf" / "config.json").is_file() and not stray, (
        f"snake export --hf=~/hf checked {home}/hf but wrote {stray} under the current directory: snake/cli.py "
        "passes args.hf unexpanded to export_checkpoint_hf (snake/hf/export.py export_hf uses Path(out_dir))")


def test_export_of_the_checkpoints_manifest_file_is_refused_in_one_line(run, tmp_path, capsys):
    """The checkpoint given as a file in it (its manifest.json) rather than its directory."""
    for target in (run["ck"] / "manifest.json", run["ck"] / "layer-00000.safetensors"):
        rc, out, err = _main(capsys, "export", str(target), "--hf", str(tmp_path / "a" / "b" / "hf"))
        assert rc == 2 and out == "", err
        line = _one_line(err)
        assert line.startswith("snake export: ") and str(target) in line, line
    assert list(tmp_path.iterdir()) == []  # not even the parents of --hf


def test_an_export_inside_the_checkpoint_is_refused_or_survives_the_next_save_there(run, tmp_path, capsys):
    """`snake export ck --hf ck/hf`: the next save to `ck` (`snake train --resume ck
    --checkpoint ck`, or a --save-every) replaces the directory whole, as README says a save
    replaces an earlier checkpoint; an export put inside it must be refused, or survive that."""
    ck = tmp_path / "ck"
    shutil.copytree(run["ck"], ck)
    rc, out, err = _main(capsys, "export", str(ck), "--hf", str(ck / "hf"))
    if rc == 2:
        assert _one_line(err).startswith("snake export: --hf=") and not (ck / "hf").exists(), err
        return
    assert rc == 0 and (ck / "hf" / "config.json").is_file(), err
    # the checkpoint is still one: it exports again
    assert _main(capsys, "export", str(ck), "--hf", str(tmp_path / "again"))[0] == 0

    async def save_over() -> None:
        cfg = SnakeConfig(micro_batches=2, placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.25,
                          device="cpu", offload_dir=tmp_path / "off")
        async with SnakeTrainer(tiny_gpt(n_layer=2, n_embd=32), data=batches(4, 4), config=cfg) as t:
            await t.load(ck)
            await t.save(ck)

    asyncio.run(save_over())
    assert (ck / "hf" / "config.json").is_file(), (
        f"snake export {ck} --hf {ck / 'hf'} was accepted (exit 0), and the next save to the checkpoint deleted the "
        "exported model without a word: snake/cli_args.py _check_export_dir does not refuse a target inside "
        "CHECKPOINT (as `snake train --checkpoint` refuses one holding its --offload-dir)")


def test_a_refused_export_leaves_no_directory_behind(tmp_path, capsys):
    """A checkpoint that is none (an empty directory, a PEFT export of a missing one): one
    line, status 2, and neither DIR nor the parents it would have made."""
    (tmp_path / "empty").mkdir()
    for argv, says in (([str(tmp_path / "empty"), "--hf", str(tmp_path / "x" / "y" / "hf")], "not a snake checkpoint"),
                       ([str(tmp_path / "none"), "--peft", str(tmp_path / "x" / "p")], "no checkpoint directory")):
        rc, out, err = _main(capsys, "export", *argv)
        assert rc == 2 and out == "" and says in _one_line(err), err
        assert not (tmp_path / "x").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and os.listdir(tmp_path / "empty") == []
