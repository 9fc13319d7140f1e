"""The block probe of a fresh process measures the backward the runtime runs in steady state.

Each case runs `probes.measure_all` in a fresh Python process (the state that matters is
glibc's, per process) and counts the process's minor page faults around it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import resource, sys, tempfile
from pathlib import Path
from planner import probes
from snake.models.gpt import GPTConfig
if sys.argv[1] == "unsettled":
    probes.settle_allocator = lambda: None
cfg = GPTConfig(n_layer=2, n_head=8, n_embd=512, vocab_size=256, block_size=32)
with tempfile.TemporaryDirectory() as d:
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    probes.measure_all(cfg, micro_batch_size=1, seq_len=32, device="cpu", dtype="float32",
                       offload_dir=Path(d), cap=None, io_bytes=8 << 20, seconds=0.1)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120, check=True)
    return int(out.stdout.split()[-1])


def test_probe_does_not_fault_its_gradient_temporaries_in_again() -> None:
    # Without settle_allocator, every timed backward of a fresh process maps its multi-MB
    # gradient temporaries anew (~2,500 faults each at width 512, a backward 1.3-1.6x slower
    # than the runtime's); with it, what faults is the probes' own setup (blocks, buffers).
    settled, unsettled = _faults("settled"), _faults("unsettled")
    assert settled < 0.7 * unsettled, (settled, unsettled)
