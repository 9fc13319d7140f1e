"""Mistakes and interruptions at the command line: a --checkpoint or --hf path that cannot be
written is refused up front in one line; SIGINT / SIGTERM stop `snake train` in one line and
leave no temporary offload directory; report.json's config holds JSON values; load_hf on a
directory with a config but no weights; `snake plan` without --seq-len for an hf: model."""

from __future__ import annotations

import contextlib
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
import transformers

from snake import cli
from snake.errors import ModelError

SMALL = ["--layers", "2", "--embd", "32", "--heads", "2", "--seq", "16", "--batch", "4", "--micro-batches", "2"]
REPO = Path(__file__).resolve().parents[1]
# the child imports this checkout's snake
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}


def _main(capsys, *argv: str) -> tuple[int, str]:
    """Exit status and stderr of `snake ...` run in this process."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = int(e.code or 0)
    return rc, capsys.readouterr().err


@contextlib.contextmanager
def _unwritable_dir(path: Path):
    """`path`, a directory in which mkdir fails, or None where this machine cannot make one
    (root on a file system without `chattr +i`)."""
    path.mkdir()
    path.chmod(0o555)
    immutable = (os.geteuid() == 0 and shutil.which("chattr") is not None
                 and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0)
    try:
        try:
            (path / "x").mkdir()
        except OSError:
            yield path
        else:
            (path / "x").rmdir()
            yield None
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        path.chmod(0o755)


def test_checkpoint_that_cannot_be_created_is_refused_before_training(tmp_path, capsys):
    # os.access says both are fine (as root it says so of /sys/kernel too); mkdir says not:
    # save's temporary .NAME.tmp-<12 hex> is over 255 bytes, and a directory that refuses mkdir
    with _unwritable_dir(tmp_path / "ro") as ro:
        paths = [tmp_path / ("c" * 250)] + ([ro / "ck"] if ro is not None else [])
        for ck in paths:
            rc, err = _main(capsys, "train", *SMALL, "--steps", "1", "--out", str(tmp_path / "out"),
                            "--offload-dir", str(tmp_path / "off"), "--checkpoint", str(ck))
            assert rc == 2
            assert err.startswith(f"snake train: --checkpoint='{ck}' cannot be created in {ck.parent} (")
            assert len(err.splitlines()) == 1, err
            assert not (tmp_path / "out").exists()  # refused before training: --out is made after
            assert not ck.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro"]  # the probe left nothing
    # a name past the file system's limit was an OSError traceback from Path.exists
    ck = tmp_path / ("c" * 300)
    rc, err = _main(capsys, "train", *SMALL, "--steps", "1", "--out", str(tmp_path / "out"),
                    "--offload-dir", str(tmp_path / "off"), "--checkpoint", str(ck))
    assert rc == 2 and err.startswith(f"snake train: --checkpoint='{ck}' cannot be used (File name too long)"), err


def test_train_writes_json_values_in_report_config(tmp_path, capsys):
    out, off, ck = tmp_path / "out", tmp_path / "off", tmp_path / "ck"
    assert cli.main(["train", *SMALL, "--steps", "1", "--alpha", "0.25", "--out", str(out),
                     "--offload-dir", str(off), "--checkpoint", str(ck)]) == 0
    config = json.loads((out / "report.json").read_text())["config"]
    assert config["micro_batches"] == 2 and type(config["micro_batches"]) is int
    assert config["alpha"] == 0.25
    assert config["device"] is None
    assert config["offload_dir"] == str(off)
    assert config["placement"] == {"param": 0.5, "ckpt": 0.5, "opt": 0.5, "grad": 1.0}
    assert config["optimizer"] == {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1,
                                   "lr_schedule": None, "no_decay": None, "max_grad_norm": None}
    assert config["stall_timeout_s"] == 300.0 and config["ssd_bandwidth_bytes_per_s"] is None
    printed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("config: "))
    assert json.loads(printed.removeprefix("config: ")) == config
    assert (ck / "manifest.json").is_file()  # the up-front check let a good --checkpoint through
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no probe left


@pytest.mark.parametrize(("signum", "rc"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_train_in_one_line_and_removes_its_offload_dir(tmp_path, signum, rc):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    err_path = tmp_path / "stderr.txt"
    env = {**CHILD_ENV, "TMPDIR": str(tmp)}
    argv = [sys.executable, "-m", "snake.cli", "train", *SMALL, "--steps", "500", "--out", str(tmp_path / "out")]
    with err_path.open("w") as err_file:
        child = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err_file)
        try:
            deadline = time.monotonic() + 60
            while "loss=" not in err_path.read_text() and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)  # until the first step's progress line
            assert child.poll() is None, err_path.read_text()
            assert len(list(tmp.glob("snake-offload-*"))) == 1  # the run's own, under TMPDIR
            child.send_signal(signum)
            assert child.wait(timeout=60) == rc
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    err = err_path.read_text()
    assert "Traceback" not in err, err
    name = signal.Signals(signum).name
    assert re.fullmatch(rf"snake train: interrupted \({name}\) after \d+ steps", err.splitlines()[-1]), err
    assert list(tmp.glob("snake-offload-*")) == []


@pytest.mark.parametrize(("signum", "rc"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_before_the_event_loop_removes_the_offload_dir(tmp_path, monkeypatch, capsys, signum, rc):
    """A signal after the temporary offload directory is made but before the event loop
    takes the signals over: SIGTERM ended the process there (the directory stayed) and
    SIGINT was a traceback. Now both are the same one line, and the directory is gone."""
    monkeypatch.setattr(cli.tempfile, "tempdir", str(tmp_path))
    made = []

    def config_then_signal(args, offload_dir):
        made.append(Path(offload_dir))
        os.kill(os.getpid(), signum)
        return None

    monkeypatch.setattr(cli, "_snake_config", config_then_signal)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    rc_got, err = _main(capsys, "train", *SMALL, "--steps", "1", "--out", str(tmp_path / "out"))
    assert rc_got == rc, err
    assert err.strip() == f"snake train: interrupted ({signal.Signals(signum).name}) after 0 steps"
    assert made and made[0].name.startswith("snake-offload-") and not made[0].exists()
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # put back


def test_signal_leaves_a_given_offload_dir(tmp_path):
    off = tmp_path / "off"
    argv = [sys.executable, "-m", "snake.cli", "train", *SMALL, "--steps", "500", "--out", str(tmp_path / "out"),
            "--offload-dir", str(off)]
    child = subprocess.Popen(argv, cwd=tmp_path, env=CHILD_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(off.glob("*")) and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # until the run has files in it
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 143, err
    assert off.is_dir()


def test_export_to_a_file_is_refused_in_one_line(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    missing = tmp_path / "no-checkpoint"  # --hf is checked first, before the checkpoint is read
    for hf, says in [(afile, "exists and is not a directory"), (afile / "sub", f"cannot be created: {afile} is a file")]:
        rc, err = _main(capsys, "export", str(missing), "--hf", str(hf))
        assert rc == 2
        assert err.startswith(f"snake export: --hf='{hf}' {says} (")
        assert len(err.splitlines()) == 1, err
    assert afile.read_text() == "x"


def test_load_hf_on_a_config_without_weights_says_how_to_build_fresh(tmp_path):
    from snake.hf import load_hf

    d = tmp_path / "llama"
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             vocab_size=100, max_position_embeddings=32).save_pretrained(d)
    with pytest.raises(ModelError) as info:
        load_hf(d)
    msg = str(info.value)
    assert f"{str(d)!r} has a config.json but no *.safetensors weights" in msg
    assert f"load_hf(transformers.AutoConfig.from_pretrained({str(d)!r}))" in msg
    model = load_hf(transformers.AutoConfig.from_pretrained(str(d)))  # what it suggests works
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 1


def test_plan_hf_without_seq_len_names_no_value(tmp_path, capsys):
    d = tmp_path / "llama"
    transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             vocab_size=100, max_position_embeddings=32).save_pretrained(d)
    rc, err = _main(capsys, "plan", "--model", f"hf:{d}", "--micro-batch-size", "1",
                    "--offload-dir", str(tmp_path / "o"))
    assert rc == 2
    assert err == ("snake plan: --seq-len is required with an hf: model "
                   "(give the sequence length you will train on, e.g. --seq-len 2048)\n")


def test_eval_batches_and_a_sequence_too_long_for_the_held_out_text_are_refused(tmp_path, capsys):
    rc, err = _main(capsys, "train", "--eval-batches", "-1", "--out", str(tmp_path / "o"))
    assert rc == 2 and "--eval-batches" in err and "must be an integer >= 0" in err
    rc, err = _main(capsys, "train", "--eval-batches", "two", "--out", str(tmp_path / "o"))
    assert rc == 2 and "is not an integer" in err
    # longer than the held-out tail (5 % of the text), shorter than the training part
    rc, err = _main(capsys, "train", "--seq", "30000", "--embd", "32", "--heads", "2", "--layers", "1", "--batch", "1",
                    "--micro-batches", "1", "--out", str(tmp_path / "o"))
    assert rc == 2 and "--seq=30000" in err and "held-out" in err and "--eval-batches 0" in err
    assert not (tmp_path / "o").exists()


def test_resume_from_no_checkpoint_or_another_model_is_refused(tmp_path, capsys):
    rc, err = _main(capsys, "train", "--resume", str(tmp_path), "--out", str(tmp_path / "o"), *SMALL)
    assert rc == 2 and "--resume=" in err and "not a snake checkpoint" in err
    ck = tmp_path / "ck"
    assert cli.main(["train", "--steps", "1", "--checkpoint", str(ck), "--eval-batches", "0", "--out",
                     str(tmp_path / "a"), "--offload-dir", str(tmp_path / "off-a"), *SMALL]) == 0
    capsys.readouterr()
    other = [SMALL[0], "3", *SMALL[2:]]  # --layers 3, not 2
    rc, err = _main(capsys, "train", "--resume", str(ck), "--out", str(tmp_path / "b"), "--offload-dir",
                    str(tmp_path / "off-b"), *other)
    assert rc == 2 and "snake train:" in err and "Traceback" not in err


def test_save_every_without_a_checkpoint_is_refused(tmp_path, capsys):
    rc, err = _main(capsys, "train", "--save-every", "2", "--out", str(tmp_path / "o"), *SMALL)
    assert rc == 2 and "--save-every=2 needs --checkpoint DIR" in err
    assert not (tmp_path / "o").exists()


def test_an_interrupted_run_says_which_step_its_last_checkpoint_holds(tmp_path):
    """--save-every: SIGINT after a checkpoint was written names it and its step, and that
    checkpoint is whole (its manifest's step is the one named)."""
    ck = tmp_path / "ck"
    err_path = tmp_path / "stderr.txt"
    argv = [sys.executable, "-m", "snake.cli", "train", *SMALL, "--steps", "500", "--save-every", "2",
            "--checkpoint", str(ck), "--eval-batches", "0", "--out", str(tmp_path / "out"),
            "--offload-dir", str(tmp_path / "off")]
    with err_path.open("w") as err_file:
        child = subprocess.Popen(argv, cwd=tmp_path, env=CHILD_ENV, stdout=subprocess.DEVNULL, stderr=err_file)
        try:
            deadline = time.monotonic() + 60
            while not (ck / "manifest.json").is_file() and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert child.poll() is None, err_path.read_text()
            child.send_signal(signal.SIGINT)
            assert child.wait(timeout=60) == 130
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    last = err_path.read_text().splitlines()[-1]
    found = re.fullmatch(rf"snake train: interrupted \(SIGINT\) after \d+ steps; the checkpoint in {re.escape(str(ck))} "
                         rf"holds step (\d+) \(--resume {re.escape(str(ck))} to go on\)", last)
    assert found, last
    assert json.loads((ck / "manifest.json").read_text())["step"] == int(found.group(1))
