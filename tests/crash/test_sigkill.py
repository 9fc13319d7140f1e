"""Crash tests: SIGKILL the training process 20 times, at random moments and (every other
kill) right after a `save` has created its temporary directory; each time resuming from the
last checkpoint works, and the final weights equal those of an uninterrupted run, bit for
bit."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
STEPS = 250  # enough that 20 kills 1-3 s after start never reach the end (~70 ms per step + save)


def _start(tmp: Path, name: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.crash.worker", str(tmp / f"off-{name}"), str(tmp / f"ckpt-{name}"),
         str(STEPS), str(tmp / f"{name}.safetensors")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _temporaries(tmp: Path) -> set[Path]:
    return set(tmp.glob(".ckpt-crash.tmp-*"))


def _wait_for_save(tmp: Path, p: subprocess.Popen, stale: set[Path], timeout: float = 30.0) -> None:
    """Return as soon as a save of the crash run has a new temporary directory on disk (or the
    process has exited)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and p.poll() is None:
        if _temporaries(tmp) - stale:
            return
        time.sleep(0.0002)
    raise AssertionError("no save started within the timeout")


@pytest.mark.slow
def test_sigkill_20_times_then_resume_equals_uninterrupted(tmp_path):
    ref = _start(tmp_path, "ref")
    out, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, out
    want = load_file(tmp_path / "ref.safetensors")

    rng = random.Random(1234)
    kills, resumed, mid_save = 0, 0, 0
    while kills < 20:
        stale = _temporaries(tmp_path)  # left by an earlier kill, removed by the next save
        p = _start(tmp_path, "crash")
        # import and set-up take ~1-2 s; steps and saves alternate after that
        time.sleep(rng.uniform(1.0, 3.0))
        if kills % 2:  # aim inside save(): kill as soon as its temporary directory appears
            _wait_for_save(tmp_path, p, stale)
        if p.poll() is not None:  # it finished before the kill
            out = p.communicate()[0]
            assert p.returncode == 0, out
            break
        p.send_signal(signal.SIGKILL)
        out = p.communicate(timeout=60)[0]
        assert p.returncode == -signal.SIGKILL
        assert "Traceback" not in out, out
        resumed += "resumed at" in out
        mid_save += bool(_temporaries(tmp_path) - stale)  # this run's save left its temporary
        kills += 1
    assert kills == 20
    print(f"{kills} kills, {mid_save} during a save, {resumed} restarts resumed")
    assert mid_save >= 5, "the kills aimed at save() must land inside it"
    assert resumed >= 10, "most restarts must have resumed from a checkpoint"
    last = _start(tmp_path, "crash")
    out, _ = last.communicate(timeout=300)
    assert last.returncode == 0, out
    got = load_file(tmp_path / "crash.safetensors")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
