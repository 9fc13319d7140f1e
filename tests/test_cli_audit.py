"""An audit of the `snake` command against what README.md promises of it: every flag's bad
value is one line naming the flag, status 2 and nothing written (no --out, no offload
directory, a --resume checkpoint untouched); `--resume` chains and `--save-every`
checkpoints go on as one longer run, bitwise; report.json is strict JSON whose numbers are
the run's; trace.json is a Chrome trace; SIGTERM mid-run stops within about a step and
saves a checkpoint that resumes and exports; `--plan` records its pick and refuses a pinned
field; `snake export` and `snake plan` refuse bad input in one line."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from snake import cli

REPO = Path(__file__).resolve().parents[1]
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
GPT = ["--layers", "2", "--embd", "32", "--heads", "2"]
WINDOWS = ["--seq", "16", "--batch", "4", "--micro-batches", "2"]
SMALL = [*GPT, *WINDOWS]


def _no_constant(name: str) -> None:
    raise AssertionError(f"{name} is not strict JSON")


def _strict(path: Path) -> dict:
    return json.loads(path.read_text(), parse_constant=_no_constant)


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of `snake ...` in this process (argparse exits)."""
    capsys.readouterr()
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = int(e.code or 0)
    got = capsys.readouterr()
    return rc, got.out, got.err


def _train(tmp_path: Path, name: str, *argv: str, steps: int = 2, evals: int = 0) -> dict:
    """A `snake train` run into tmp_path/name (its report.json returned)."""
    out = tmp_path / name
    assert cli.main(["train", *SMALL, "--steps", str(steps), "--eval-batches", str(evals), "--out", str(out),
                     "--offload-dir", str(tmp_path / f"off-{name}"), *argv]) == 0
    return _strict(out / "report.json")


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {f"{f.name}/{k}": v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def _same_tensors(a: Path, b: Path) -> None:
    want, got = _tensors(a), _tensors(b)
    assert want and want.keys() == got.keys()
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, differ[:5]


def _digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A 2-step checkpoint of the small GPT (float32, alpha 0.25, vertical, seed 0)."""
    d = tmp_path_factory.mktemp("ck")
    assert cli.main(["train", *SMALL, "--steps", "2", "--eval-batches", "0", "--out", str(d / "out"),
                     "--offload-dir", str(d / "off"), "--checkpoint", str(d / "ck")]) == 0
    return d / "ck"


# -- --help ------------------------------------------------------------------------------

TRAIN_FLAGS = ["--steps", "--batch", "--seq", "--micro-batches", "--placement", "--alpha", "--dtype", "--loss-scale",
               "--schedule", "--lr-schedule", "--warmup-steps", "--decay-steps", "--checkpoint", "--save-every",
               "--resume", "--plan", "--model", "--stream", "--lora", "--lora-targets", "--text", "--eval-batches",
               "--offload-dir", "--layers", "--embd", "--heads", "--seed", "--max-grad-norm", "--no-decay-norms",
               "--storage-backend", "--resident-optimizer"]
PLAN_FLAGS = ["--model", "--micro-batch-size", "--cpu-memory", "--offload-dir", "--ssd-bandwidth", "--json", "--plot",
              "--seq-len", "--lora", "--lora-targets", "--stream", "--alpha"]


@pytest.mark.parametrize(("argv", "flags"), [(["train"], TRAIN_FLAGS), (["export"], ["--hf", "--peft"]),
                                             (["plan"], PLAN_FLAGS), (["trace", "plot"], ["--last", "-o"])],
                         ids=["train", "export", "plan", "trace-plot"])
def test_help_lists_every_flag_the_readme_names(capsys, argv, flags):
    rc, out, _ = _main(capsys, *argv, "--help")
    assert rc == 0
    missing = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", out)]
    assert not missing, out
    # each README flag is in the README too (this list is the README's)
    readme = (REPO / "README.md").read_text()
    assert all(f in readme for f in flags if f.startswith("--"))


# -- bad values: one line naming the flag, status 2, nothing written -----------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("files")
    (d / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e\n".encode("latin-1") * 200)
    (d / "empty.txt").write_bytes(b"")
    (d / "blank.txt").write_text(" \n\t\n" * 10)
    (d / "afile").write_text("x")
    (d / "short.txt").write_text("tiny\n")
    return {p.name.removesuffix(".txt"): p for p in d.iterdir()}


BAD = [
    (["--text", "{missing}"], "--text"),
    (["--text", "{dir}"], "--text"),
    (["--text", "{latin1}"], "--text"),
    (["--text", "{empty}"], "--text"),
    (["--text", "{blank}"], "--text"),
    (["--text", "{short}"], "--seq"),
    (["--steps", "1.5"], "--steps"),
    (["--steps", "-2"], "--steps"),
    (["--batch", "two"], "--batch"),
    (["--alpha", "nan"], "alpha"),
    (["--alpha", "-0.1"], "alpha"),
    (["--lr", "nan"], "lr"),
    (["--lr", "inf"], "lr"),
    (["--max-grad-norm", "nan"], "max_grad_norm"),
    (["--placement", "nan,0.5,0.5"], "--placement"),
    (["--placement", "a,b,c"], "--placement"),
    (["--save-every", "-1"], "--save-every"),
    (["--eval-batches", "-1"], "--eval-batches"),
    (["--eval-batches", "100000"], "--eval-batches"),
    (["--resume", "{missing}"], "--resume"),
    (["--resume", "{afile}"], "--resume"),
    (["--checkpoint", "{afile}"], "--checkpoint"),
    (["--out", "{afile}"], "--out"),
    (["--out", "/proc/snake-audit-out"], "--out"),
    (["--offload-dir", "{afile}"], "offload_dir"),
    (["--offload-dir", "/proc/snake-audit-off"], "offload_dir"),
    (["--model", "hf:{missing}"], "--model"),
    (["--lora", "4"], "--lora"),
    (["--stream"], "--stream"),
    (["--warmup-steps", "3", "--lr-schedule", "linear"], "--warmup-steps"),
]


@pytest.mark.parametrize(("extra", "flag"), BAD, ids=[" ".join(e) for e, _ in BAD])
def test_a_bad_value_is_one_line_naming_the_flag_and_writes_nothing(tmp_path, capsys, files, extra, flag):
    names = {"missing": str(tmp_path / "missing"), "dir": str(tmp_path), **{k: str(v) for k, v in files.items()}}
    extra = [e.format(**names) for e in extra]
    given = dict(zip(extra[::2], extra[1::2], strict=False))
    out = given.get("--out", str(tmp_path / "out"))
    off = given.get("--offload-dir", str(tmp_path / "off"))
    gpt = [] if "--model" in extra else GPT
    before = _digest(files["afile"].parent)
    rc, _, err = _main(capsys, "train", *gpt, *WINDOWS, "--steps", "2", "--out", str(tmp_path / "out"),
                       "--offload-dir", str(tmp_path / "off"), *extra)
    assert rc == 2, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(("snake train: ", "snake train: error: ")), err
    assert flag in last, err
    if not last.startswith("snake train: error: "):  # ours, not argparse's usage + error
        assert len(err.strip().splitlines()) == 1, err
    # nothing written: neither the run's output directory nor its offload directory
    for path in {out, off, str(tmp_path / "out"), str(tmp_path / "off")}:
        if not Path(path).is_file():
            assert not Path(path).exists(), f"{path} was made by a refused run: {err}"
    assert _digest(files["afile"].parent) == before


def test_unknown_commands_and_flags_are_refused(capsys):
    for argv in (["trian"], ["train", "--n-layer", "2"], ["export", "x"], []):
        rc, _, err = _main(capsys, *argv)
        assert rc == 2 and "Traceback" not in err and "error:" in err, (argv, err)


# -- --resume of another run: refused naming the option, the checkpoint untouched -----------

MISMATCH = [
    (["--dtype", "bfloat16"], "--dtype"),
    (["--dtype", "float16"], "--dtype"),
    (["--schedule", "horizontal"], "--schedule"),
    (["--seed", "1"], "--seed"),
    (["--alpha", "0.5"], "--alpha"),
    (["--micro-batches", "4"], "--micro-batches"),
    (["--heads", "4"], "--heads"),
    (["--layers", "3"], "--layers"),
    (["--batch", "8"], "--batch"),
    (["--seq", "32"], "--seq"),
    (["--text", "{text}"], "--text"),
]


@pytest.mark.parametrize(("extra", "flag"), MISMATCH, ids=[" ".join(e) for e, _ in MISMATCH])
def test_a_resume_of_another_run_is_refused_naming_the_option_and_touches_nothing(tmp_path, capsys, checkpoint,
                                                                                  extra, flag):
    text = tmp_path / "notes.txt"
    text.write_text("snake streams layers through the device, one at a time.\n" * 300)
    extra = [e.format(text=text) for e in extra]
    given = dict(zip(extra[::2], extra[1::2], strict=True))
    argv = [*(a for i, a in enumerate(SMALL) if SMALL[i - 1] not in given and a not in given)]
    before = _digest(checkpoint)
    rc, _, err = _main(capsys, "train", *argv, *extra, "--steps", "1", "--eval-batches", "0", "--resume",
                       str(checkpoint), "--checkpoint", str(checkpoint), "--out", str(tmp_path / "out"),
                       "--offload-dir", str(tmp_path / "off"))
    assert rc == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"snake train: {flag}="), err  # names the option the user gave
    assert _digest(checkpoint) == before
    assert not (tmp_path / "out").exists() and not (tmp_path / "off").exists()


def test_a_resume_of_a_static_scale_float16_checkpoint_goes_on_at_its_scale(tmp_path):
    """A float16 run at a static --loss-scale (alpha 0.25, the default then), resumed with
    --loss-scale left out, goes on at the checkpoint's scale, as --alpha and --micro-batches
    left out are the checkpoint's: the steps of one longer run. Found by this audit (round
    43): the resume took float16's dynamic default and was refused naming `alpha`, which the
    user never gave, asking for alpha 1.0, which the resume then refused too."""
    fp16 = ["--dtype", "float16"]
    whole = _train(tmp_path, "whole", *fp16, "--loss-scale", "512", steps=2)
    _train(tmp_path, "first", *fp16, "--loss-scale", "512", "--checkpoint", str(tmp_path / "ck"), steps=1)
    rest = _train(tmp_path, "rest", *fp16, "--resume", str(tmp_path / "ck"), steps=1)
    assert rest["config"]["loss_scale"] == 512.0
    assert [s["loss"] for s in rest["steps"]] == [s["loss"] for s in whole["steps"][1:]]


def test_a_resume_with_another_dtype_names_dtype_before_what_the_checkpoint_filled_in(tmp_path, capsys):
    """--dtype float16 on the resume of a float32 run at alpha 0.25 (filled in from the
    checkpoint): refused naming --dtype, not the alpha a float16 run's dynamic scale cannot
    take."""
    _train(tmp_path, "first", "--checkpoint", str(tmp_path / "ck"), steps=1)
    rc, _, err = _main(capsys, "train", *SMALL, "--steps", "1", "--dtype", "float16", "--resume", str(tmp_path / "ck"),
                       "--out", str(tmp_path / "out"), "--offload-dir", str(tmp_path / "off"))
    assert rc == 2 and err.startswith("snake train: --dtype='float16' does not match the --resume checkpoint's"), err
    assert not (tmp_path / "out").exists()


def test_a_damaged_resume_checkpoint_is_refused_and_left_as_it_was(tmp_path, capsys, checkpoint):
    ck = tmp_path / "ck"
    shutil.copytree(checkpoint, ck)
    (ck / "layer-00001.safetensors").write_bytes(b"short")
    before = _digest(ck)
    rc, _, err = _main(capsys, "train", *SMALL, "--steps", "1", "--resume", str(ck), "--checkpoint", str(ck),
                       "--out", str(tmp_path / "out"), "--offload-dir", str(tmp_path / "off"))
    assert rc == 2 and err.startswith(f"snake train: --resume='{ck}' is incomplete or damaged"), err
    assert _digest(ck) == before and not (tmp_path / "out").exists()


# -- --resume and --save-every: one longer run, bitwise ------------------------------------

CHAINS = {
    "bf16-horizontal-cosine": ["--dtype", "bfloat16", "--schedule", "horizontal", "--lr-schedule", "cosine",
                               "--warmup-steps", "1", "--decay-steps", "4"],
    "fp16-dynamic": ["--dtype", "float16"],
    "clipped-all-ssd": ["--max-grad-norm", "0.5", "--placement", "0,0,0,0", "--no-decay-norms"],
}


@pytest.mark.parametrize("options", list(CHAINS.values()), ids=list(CHAINS))
def test_a_resumed_chain_is_one_longer_run_bitwise(tmp_path, options):
    straight = _train(tmp_path, "straight", *options, "--checkpoint", str(tmp_path / "ck-straight"), steps=4, evals=1)
    ck = str(tmp_path / "ck")
    parts = [_train(tmp_path, "r0", *options, "--checkpoint", ck, steps=2, evals=1)]
    parts += [_train(tmp_path, f"r{i}", *options, "--checkpoint", ck, "--resume", ck, steps=1, evals=1)
              for i in (1, 2)]
    assert [s["step"] for p in parts for s in p["steps"]] == [0, 1, 2, 3]
    keys = ("loss", "lr", "grad_norm", "loss_scale", "skipped", "tokens")
    assert [[s[k] for k in keys] for p in parts for s in p["steps"]] == [[s[k] for k in keys] for s in straight["steps"]]
    assert parts[-1]["val_loss"]["after"] == straight["val_loss"]["after"]
    # a resumed run's held-out loss before training is the one its checkpoint's run ended with
    assert [p["val_loss"]["before"] for p in parts[1:]] == [p["val_loss"]["after"] for p in parts[:-1]]
    assert [p["resumed_from"] for p in parts] == [None, {"checkpoint": ck, "step": 2}, {"checkpoint": ck, "step": 3}]
    _same_tensors(tmp_path / "ck-straight", tmp_path / "ck")


def test_save_every_checkpoints_each_resume_as_the_one_run(tmp_path, monkeypatch):
    """--save-every 2 over 5 steps: each checkpoint on the way (copied as it is written)
    resumes into the steps and weights of the run that wrote it."""
    real = cli._save
    copies: list[Path] = []

    async def save_and_copy(trainer, directory, record):
        await real(trainer, directory, record)
        copy = tmp_path / f"copy-{trainer.engine.next_t}"
        shutil.copytree(directory, copy)
        copies.append(copy)

    monkeypatch.setattr(cli, "_save", save_and_copy)
    every = _train(tmp_path, "every", "--save-every", "2", "--checkpoint", str(tmp_path / "ck"), steps=5)
    assert [c.name for c in copies] == ["copy-2", "copy-4", "copy-5"]
    monkeypatch.setattr(cli, "_save", real)
    for at in (2, 4):
        again = _train(tmp_path, f"from-{at}", "--resume", str(tmp_path / f"copy-{at}"),
                       "--checkpoint", str(tmp_path / f"ck-{at}"), steps=5 - at)
        assert [(s["step"], s["loss"]) for s in again["steps"]] == [(s["step"], s["loss"]) for s in every["steps"][at:]]
        _same_tensors(tmp_path / "ck", tmp_path / f"ck-{at}")


# -- report.json and trace.json ------------------------------------------------------------

def test_report_json_is_strict_and_its_numbers_are_the_runs(tmp_path, capsys):
    capsys.readouterr()
    r = _train(tmp_path, "out", "--seed", "7", "--alpha", "0.5", "--lr-schedule", "linear", steps=3, evals=2)
    printed = capsys.readouterr().out
    assert {"model", "text", "resumed_from", "config", "steps", "wall_seconds", "tokens_per_s", "val_loss",
            "trace_summary"} <= r.keys()
    assert r["resumed_from"] is None
    assert r["model"]["n_layer"] == 2 and r["model"]["n_embd"] == 32 and r["model"]["block_size"] == 16
    c = r["config"]
    assert (c["micro_batches"], c["alpha"], c["seed"], c["dtype"], c["schedule"]) == (2, 0.5, 7, "float32", "vertical")
    assert c["optimizer"]["lr_schedule"]["kind"] == "linear" and c["optimizer"]["lr_schedule"]["total_steps"] == 3
    assert [s["step"] for s in r["steps"]] == [0, 1, 2]
    assert all(s["tokens"] == 4 * 16 for s in r["steps"])
    assert all(isinstance(s["loss"], float) and 0 < s["loss"] < 10 for s in r["steps"])
    assert r["wall_seconds"] > 0
    assert r["tokens_per_s"] == pytest.approx(3 * 64 / r["wall_seconds"])
    assert set(r["val_loss"]) == {"before", "after"} and all(isinstance(v, float) for v in r["val_loss"].values())
    assert r["text"]["given"] is False and r["text"]["text"].startswith("the Python")
    last = printed.strip().splitlines()[-1]
    assert last.startswith(f"loss {r['steps'][0]['loss']:.4f} -> {r['steps'][-1]['loss']:.4f}")
    assert f"held-out loss {r['val_loss']['before']:.4f} -> {r['val_loss']['after']:.4f}" in last
    assert (tmp_path / "out" / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_whose_loss_is_not_finite_writes_nan_as_strict_json(tmp_path, capsys):
    r = _train(tmp_path, "out", "--lr", "1e30", steps=3, evals=1)
    losses = [s["loss"] for s in r["steps"]]
    assert isinstance(losses[0], float) and losses[1:] == ["nan", "nan"]
    assert r["val_loss"]["after"] == "nan"
    assert "-> nan" in capsys.readouterr().out


def test_trace_json_is_a_chrome_trace(tmp_path, capsys):
    _train(tmp_path, "out", steps=2, evals=1)
    trace = _strict(tmp_path / "out" / "trace.json")
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert isinstance(e["name"], str) and e["ph"] in {"X", "M", "i", "I", "C", "B", "E"}, e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "X":
            assert isinstance(e["ts"], int | float) and e["dur"] >= 0, e
    assert {e["args"]["name"] for e in events if e["name"] == "thread_name"} >= {"compute", "data"}
    rc, out, err = _main(capsys, "trace", "summarize", "--json", str(tmp_path / "out" / "trace.json"))
    assert rc == 0, err
    assert json.loads(out)["actors"]["compute"]["busy_s"] > 0


# -- signals -------------------------------------------------------------------------------

def _start(tmp_path: Path, *argv: str) -> tuple[subprocess.Popen, Path]:
    err_path = tmp_path / "stderr.txt"
    err_file = err_path.open("w")
    # as many kernel threads as this process uses: its checkpoint is compared bitwise with runs here
    env = {**CHILD_ENV, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    child = subprocess.Popen([sys.executable, "-m", "snake.cli", "train", *argv], cwd=tmp_path, env=env,
                             stdout=subprocess.DEVNULL, stderr=err_file)
    err_file.close()
    return child, err_path


def _wait_for_steps(child: subprocess.Popen, err_path: Path, n: int) -> int:
    """Until the progress bar shows >= n steps done; the steps it shows."""
    deadline = time.monotonic() + 90
    while child.poll() is None and time.monotonic() < deadline:
        done = [int(m) for m in re.findall(r"\| *(\d+)/500 ", err_path.read_text())]
        if done and done[-1] >= n:
            return done[-1]
        time.sleep(0.05)
    raise AssertionError(err_path.read_text()[-2000:])


def test_sigterm_mid_run_stops_within_about_a_step_and_saves_a_checkpoint_that_resumes(tmp_path, capsys):
    ck = tmp_path / "ck"
    child, err_path = _start(tmp_path, *SMALL, "--steps", "500", "--eval-batches", "0", "--checkpoint", str(ck),
                             "--out", str(tmp_path / "out"), "--offload-dir", str(tmp_path / "off"))
    try:
        seen = _wait_for_steps(child, err_path, 3)
        t0 = time.monotonic()
        child.send_signal(signal.SIGTERM)
        rc = child.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    err = err_path.read_text()
    assert rc == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    assert "stopping after the steps in flight" in err
    last = err.strip().splitlines()[-1]
    found = re.fullmatch(rf"snake train: interrupted \(SIGTERM\) after (\d+) steps; the checkpoint in "
                         rf"{re.escape(str(ck))} holds step (\d+) \(--resume {re.escape(str(ck))} to go on\)", last)
    assert found, last
    steps, held = int(found.group(1)), int(found.group(2))
    assert steps == held  # the steps in flight are what it saved
    assert seen <= held <= seen + 6, (seen, held)  # within about a step of the signal (a progress bar lags)
    assert took < 30
    assert "wrote its trace.json and timeline.png" in err
    assert _strict(tmp_path / "out" / "trace.json")["traceEvents"]
    assert (tmp_path / "out" / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "off").exists() or not any((tmp_path / "off").iterdir())
    # it resumes as one longer run
    again = _train(tmp_path, "again", "--resume", str(ck), "--checkpoint", str(tmp_path / "ck-again"), steps=2)
    straight = _train(tmp_path, "straight", "--checkpoint", str(tmp_path / "ck-straight"), steps=held + 2)
    assert again["resumed_from"] == {"checkpoint": str(ck), "step": held}
    assert [(s["step"], s["loss"]) for s in again["steps"]] == [(s["step"], s["loss"]) for s in straight["steps"][held:]]
    _same_tensors(tmp_path / "ck-straight", tmp_path / "ck-again")
    # and exports
    rc, out, err = _main(capsys, "export", str(ck), "--hf", str(tmp_path / "hf"))
    assert rc == 0 and (tmp_path / "hf" / "config.json").is_file(), err


def test_a_second_sigterm_stops_at_once_and_leaves_no_broken_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    child, err_path = _start(tmp_path, *SMALL, "--steps", "500", "--eval-batches", "0", "--checkpoint", str(ck),
                             "--save-every", "3", "--out", str(tmp_path / "out"), "--offload-dir",
                             str(tmp_path / "off"))
    try:
        _wait_for_steps(child, err_path, 4)
        child.send_signal(signal.SIGTERM)
        time.sleep(0.01)
        child.send_signal(signal.SIGTERM)
        rc = child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    err = err_path.read_text()
    assert rc == 128 + signal.SIGTERM and "Traceback" not in err, err[-3000:]
    assert re.match(r"snake train: interrupted \(SIGTERM\) after \d+ steps", err.strip().splitlines()[-1]), err
    from snake.train_source import resume_manifest

    assert resume_manifest(str(ck))["step"] >= 3  # whole: the one --save-every wrote, or a later one


# -- snake export --------------------------------------------------------------------------

def test_export_hf_of_a_train_checkpoint_has_the_trained_logits(tmp_path, capsys):
    """The exported GPT-2's held-out loss is the run's own val_loss after training, and its
    logits are those of the GPT rebuilt from the checkpoint's fp32 masters."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from snake.corpus import holdout_windows, pydoc_bytes
    from snake.models import GPT, GPTConfig

    r = _train(tmp_path, "out", "--checkpoint", str(tmp_path / "ck"), steps=3, evals=2)
    rc, out, err = _main(capsys, "export", str(tmp_path / "ck"), "--hf", str(tmp_path / "hf"))
    assert rc == 0, err
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    held = holdout_windows(pydoc_bytes(), batch=4, seq=16, batches=2, holdout=cli.HOLDOUT)
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item() for x, y in held]
    assert sum(losses) / len(losses) == pytest.approx(r["val_loss"]["after"], rel=1e-5)
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=16)).eval()
    masters = {k.removeprefix("master/"): v for f in (tmp_path / "ck").glob("*.safetensors")
               for k, v in load_file(f).items() if k.startswith("master/")}
    missing, unexpected = gpt.load_state_dict(masters, strict=False)
    assert not unexpected and not [k for k in missing if k in dict(gpt.named_parameters())]
    x = held[0][0]
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, gpt(x), rtol=1e-4, atol=1e-5)
    # a second export into the same directory replaces it
    rc, _, err = _main(capsys, "export", str(tmp_path / "ck"), "--hf", str(tmp_path / "hf"))
    assert rc == 0, err


def test_export_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path, capsys, checkpoint):
    afile = tmp_path / "afile"
    afile.write_text("x")
    before = _digest(checkpoint)
    cases = [
        ([str(tmp_path / "missing"), "--hf", str(tmp_path / "hf")], "missing"),
        ([str(afile), "--hf", str(tmp_path / "hf")], "afile"),
        ([str(checkpoint), "--peft", str(tmp_path / "hf")], "--hf"),
        ([str(checkpoint), "--hf", str(checkpoint)], "--hf"),
        ([str(checkpoint), "--hf", str(afile)], "--hf"),
        ([str(checkpoint), "--hf", "/proc/snake-audit-hf"], "--hf"),
    ]
    for argv, says in cases:
        rc, _, err = _main(capsys, "export", *argv)
        assert rc == 2 and "Traceback" not in err, (argv, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("snake export: ") and says in err, (argv, err)
        assert not (tmp_path / "hf").exists()
    assert afile.read_text() == "x" and _digest(checkpoint) == before


# -- --plan and snake plan -----------------------------------------------------------------

def test_plan_records_its_pick_and_refuses_each_pinned_field(tmp_path, capsys):
    argv = ["train", *GPT, "--seq", "16", "--batch", "4", "--steps", "1", "--eval-batches", "0"]
    rc, out, err = _main(capsys, *argv, "--plan", "--out", str(tmp_path / "out"), "--offload-dir",
                         str(tmp_path / "off"))
    assert rc == 0, err
    r = _strict(tmp_path / "out" / "report.json")
    c = r["config"]
    assert c["micro_batches"] in (1, 2, 4) and 0 <= c["alpha"] <= 1
    assert set(c["placement"]) == {"param", "ckpt", "opt", "grad"} and all(
        0 <= v <= 1 for v in c["placement"].values())
    for pinned in (["--placement", "0.5,0.5,0.5"], ["--alpha", "0.25"], ["--micro-batches", "2"]):
        rc, _, err = _main(capsys, *argv, "--plan", *pinned, "--out", str(tmp_path / "o2"), "--offload-dir",
                           str(tmp_path / "off2"))
        assert rc == 2 and err.startswith(f"snake train: {pinned[0]}=") and "--plan" in err, err
        assert len(err.strip().splitlines()) == 1
        assert not (tmp_path / "o2").exists() and not (tmp_path / "off2").exists()


def test_snake_plan_json_is_strict_and_bad_values_are_one_line(tmp_path, capsys):
    model = ["--model", "gpt:n_layer=2,n_embd=32,n_head=2,vocab_size=256,block_size=16", "--micro-batch-size", "2"]
    off = str(tmp_path / "off")
    rc, out, err = _main(capsys, "plan", *model, "--cpu-memory", "2GiB", "--offload-dir", off, "--json")
    assert rc == 0, err
    plan = json.loads(out, parse_constant=_no_constant)
    assert plan["micro_batches"] >= 1 and 0 <= plan["alpha"] <= 1 and set(plan["placement"]) >= {"param", "ckpt", "opt"}
    afile = tmp_path / "afile"
    afile.write_text("x")
    for extra, flag in ([["--cpu-memory", "0"], "--cpu-memory"], [["--cpu-memory", "lots"], "--cpu-memory"],
                        [["--seq-len", "64"], "--seq-len"], [["--alpha", "2"], "--alpha"],
                        [["--plot", str(tmp_path)], "--plot"], [["--plot", str(tmp_path / "r.xyz")], "--plot"],
                        [["--lora", "4"], "--lora"], [["--ssd-bandwidth", "1"], "--ssd-bandwidth"]):
        rc, _, err = _main(capsys, "plan", *model, "--offload-dir", off, *extra)
        assert rc == 2 and "Traceback" not in err and flag in err.strip().splitlines()[-1], (extra, err)
    rc, _, err = _main(capsys, "plan", *model, "--offload-dir", str(afile))
    assert rc == 2 and "offload_dir" in err and afile.read_text() == "x", err
