"""The planner's `cpu_memory_bytes` holds for the real process: a run planned under a budget
grows the process's RSS by no more than the budget (what the memory model counts: placed
data, the CPU device's working set with the head's logits, the runtime's overhead), and
the head's working set per logit is what `snake.memory` says. Fresh processes, so the
growth measured is snake's (tests/budget_child.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from snake.memory import HEAD_FP32_BYTES_PER_LOGIT

ROOT = Path(__file__).resolve().parents[1]
# glibc's keeping of freed temporaries varies run to run: one configuration's steady peak
# moved by up to 60 MiB between runs (snake.memory.RUNTIME_OVERHEAD_BYTES allows for it;
# benchmarks/memory_budget.py: 45-173 MiB to spare over seven configurations)
ALLOCATOR_NOISE = 1.05


def child(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.budget_child", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("args", [
    (),  # GPT 8 x 256: the optimizer states split between CPU memory and SSD
    ("--layers", "4", "--vocab", "16384", "--seq", "64"),  # a head of 128 MiB of logits per micro-batch
], ids=["gpt8x256", "large-vocab"])
def test_planned_run_stays_within_cpu_memory_bytes(args):
    r = child(*args)
    assert 0.0 < r["placement"][2] < 1.0, r  # the budget binds: part of the optimizer states on SSD
    assert r["steady"] <= r["budget"] * ALLOCATOR_NOISE, (
        f"peak RSS growth {r['steady'] / 2**20:.1f} MiB over a budget of {r['budget'] / 2**20:.1f} MiB")


HEAD = """
import sys, torch
from snake import SnakeConfig
from snake.adapters import describe
from snake.kernels import Kernels
from snake.models.gpt import GPT, GPTConfig
def status(k):
    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith(k + ':'))
V, T, dtype, ignore = 8192, int(sys.argv[2]), sys.argv[1], sys.argv[3] == "ignore"
k = Kernels(describe(GPT(GPTConfig(n_layer=1, n_embd=128, n_head=4, vocab_size=V, block_size=T))),
            SnakeConfig(offload_dir=".", micro_batches=1, dtype=dtype), torch.device("cpu"), 1)
h = torch.randn(1, T, 128).to(getattr(torch, dtype))
tg = torch.randint(0, V, (1, T))
if ignore:
    tg[0, ::2] = -100
base = status('VmRSS'); open('/proc/self/clear_refs', 'w').write('5')
k.head(h, tg, 0, 0, trained=int((tg != -100).sum()) if ignore else None)  # the runtime's head
print(status('VmHWM') - base)
"""


def head_peak(dtype: str, tokens: int, targets: str) -> int:
    out = subprocess.run([sys.executable, "-c", HEAD, dtype, str(tokens), targets], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout)


@pytest.mark.parametrize("dtype,size,targets", [("float32", 4, "all"), ("bfloat16", 2, "all"), ("bfloat16", 2, "ignore")])
def test_head_working_set_per_logit(dtype, size, targets):
    """The runtime's head (`Kernels.head`, with and without -100 targets) grows the process
    by `dtype + HEAD_FP32_BYTES_PER_LOGIT` bytes per logit: the slope between two sizes
    (each peak also holds a constant 13-18 MiB: libraries, allocator, the embedding's
    gradient, which the runtime's overhead and resident terms count). A second fp32 copy
    of the logits kept alive by a local name read 18 bytes in bfloat16."""
    small, large = 1024, 3072
    per_logit = (head_peak(dtype, large, targets) - head_peak(dtype, small, targets)) / ((large - small) * 8192)
    model = size + HEAD_FP32_BYTES_PER_LOGIT
    assert 0.95 * model <= per_logit <= 1.05 * model, (per_logit, model)


def _fixed(tmp_path, **kw):
    from snake import Placement, SnakeConfig

    return SnakeConfig(micro_batches=2, placement=Placement(param=1, ckpt=1, opt=1), alpha=0.0, device="cpu",
                       offload_dir=tmp_path / "off", **kw)


@pytest.mark.asyncio
async def test_a_fixed_placement_over_the_memory_is_refused_before_anything_starts(tmp_path, monkeypatch):
    """A placement the user fixes was never checked against the memory: a run that could not
    fit started and failed out of memory part-way (or swapped). It is now refused up front by
    the planner's memory model, against cpu_memory_bytes or else what is available, with the
    numbers and what to change; the same placement with room trains."""
    import asyncio

    import psutil

    from snake import ConfigError, SnakeTrainer
    from tests.helpers import batches, tiny_gpt

    with pytest.raises(ConfigError, match=r"placement=.* needs about .* of CPU memory .* more than "
                                          r"cpu_memory_bytes=100\.0 MiB \(use smaller CPU shares"):
        async with SnakeTrainer(tiny_gpt(n_layer=4, n_embd=256), data=batches(2, 8),
                                config=_fixed(tmp_path, cpu_memory_bytes=100 * 2**20)) as t:
            await asyncio.wait_for(t.run(1), 60)
    assert not any((tmp_path / "off").iterdir()), "nothing may be written before the check"

    class Tight:  # what psutil says when the machine has 150 MiB to give
        available = 150 * 2**20

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tight)
    with pytest.raises(ConfigError, match=r"more than the 150\.0 MiB available now"):
        async with SnakeTrainer(tiny_gpt(n_layer=4, n_embd=256), data=batches(2, 8), config=_fixed(tmp_path)) as t:
            await asyncio.wait_for(t.run(1), 60)
    monkeypatch.undo()

    async with SnakeTrainer(tiny_gpt(n_layer=4, n_embd=256), data=batches(2, 8),
                            config=_fixed(tmp_path, cpu_memory_bytes=400 * 2**20)) as t:
        await asyncio.wait_for(t.run(1), 60)


def test_waiting_gradients_on_ssd_spare_the_memory_the_model_says():
    """Clipping makes every layer's fp32 gradient wait for the next iteration's delayed
    step (alpha 1). With placement.grad 0 they wait on SSD (beyond the staging buffers) and
    the process's steady peak is lower than with grad 1 by what the memory model says:
    measured 149.1 and 150.9 MiB for a model difference of 151.3 MiB (GPT 16 x 512; here
    12 x 512, 96.2 MiB), run-to-run noise ~2 MiB. Two fresh processes, nothing else changed.
    A grad_out pool of a buffer per layer more read -145 MiB."""
    runs = {g: child("--fixed", f"0,1,1,{g}", "--alpha", "1", "--clip", "1.0", "--layers", "12", "--width", "512",
                     "--steps", "2") for g in (1, 0)}
    assert runs[1]["grad_ssd_bytes"] == 0 and runs[0]["grad_ssd_bytes"] > 0
    model = runs[1]["budget"] - runs[0]["budget"]
    measured = runs[1]["steady"] - runs[0]["steady"]
    assert model > 50 * 2**20  # the tier is worth measuring (beyond its staging buffers)
    assert abs(measured - model) <= 0.15 * model, (measured / 2**20, model / 2**20)
