"""Crash tests: SIGKILL the training process 12 times, at random moments and (every other
kill) right after a `save` has created its temporary directory; each time resuming from the
last checkpoint works, and the final weights equal those of an uninterrupted run, bit for
bit. The kills are timed by the run's own progress (its "saved" lines), not by the clock, so
that a fast machine does not finish the run before the last kill. (20 kills until round 44,
which cut them to 12 for the suite's time: 35 s of its 1,100 s of work.)"""

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
KILLS = 12
STEPS = 150  # 12 kills after 4 new steps each (5 where a kill lands after the next save) never reach the end


def _start(tmp: Path, name: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.crash.worker", str(tmp / f"off-{name}"), str(tmp / f"ckpt-{name}"),
         str(STEPS), str(tmp / f"{name}.safetensors")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _temporaries(tmp: Path) -> set[Path]:
    return set(tmp.glob(".ckpt-crash.tmp-*"))


class _Output:
    """The run's output lines, read on a thread as they come (a hung run fails by timeout)."""

    def __init__(self, p: subprocess.Popen) -> None:
        self.p = p
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.reader = threading.Thread(target=self._read, args=(p,), daemon=True)
        self.reader.start()

    def _read(self, p: subprocess.Popen) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            self.lines.put(line)
        self.lines.put("")  # the run ended

    def until_saves(self, n: int, timeout: float = 60.0) -> None:
        """Wait until the run has printed n more "saved" lines, or ended."""
        while n > 0:
            line = self.lines.get(timeout=timeout)
            if not line:
                self.lines.put("")
                return
            self.seen.append(line)
            n -= line.startswith("saved")

    def rest(self, timeout: float = 60.0) -> str:
        """Everything the run printed; call once it has ended."""
        self.reader.join(timeout)
        assert self.p.stdout is not None
        self.p.stdout.close()
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return "".join(self.seen)


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
def test_sigkill_12_times_then_resume_equals_uninterrupted(tmp_path):
    ref = _start(tmp_path, "ref")
    out, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, out
    want = load_file(tmp_path / "ref.safetensors")

    rng = random.Random(1234)
    kills, resumed, mid_save = 0, 0, 0
    while kills < KILLS:
        stale = _temporaries(tmp_path)  # left by an earlier kill, removed by the next save
        p = _start(tmp_path, "crash")
        output = _Output(p)
        steps = rng.randint(0, 4)
        if steps:  # a few steps in, then somewhere inside a step (or its save)
            output.until_saves(steps)
            time.sleep(rng.uniform(0.0, 0.05))
        else:  # during import, set-up or the load of the checkpoint
            time.sleep(rng.uniform(0.2, 1.5))
        if kills % 2:  # aim inside save(): kill as soon as its temporary directory appears
            _wait_for_save(tmp_path, p, stale)
        if p.poll() is not None:  # it finished before the kill
            out = output.rest()
            assert p.wait() == 0, out
            break
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
        out = output.rest()
        assert p.returncode == -signal.SIGKILL
        assert "Traceback" not in out, out
        resumed += "resumed at" in out
        mid_save += bool(_temporaries(tmp_path) - stale)  # this run's save left its temporary
        kills += 1
    assert kills == KILLS
    print(f"{kills} kills, {mid_save} during a save, {resumed} restarts resumed")
    assert mid_save >= KILLS // 4, "the kills aimed at save() must land inside it"
    assert resumed >= KILLS // 2, "most restarts must have resumed from a checkpoint"
    last = _start(tmp_path, "crash")
    out, _ = last.communicate(timeout=300)
    assert last.returncode == 0, out
    got = load_file(tmp_path / "crash.safetensors")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
