"""`measure_all` settles glibc's allocator before it times the block.

What settling does is glibc's and per process, and how many page faults an unsettled fresh
process takes depends on what it allocated before (measured 79,000-380,000 around one
block probe at width 512, against ~65,000 settled; BENCHMARKS.md section 5): too variable for
an assertion here, so this checks the order of the calls."""

from __future__ import annotations

import pytest

from planner import probes
from snake.models.gpt import GPTConfig


def test_measure_all_settles_the_allocator_before_timing(monkeypatch, tmp_path) -> None:
    calls: list[str] = []
    monkeypatch.setattr(probes, "settle_allocator", lambda: calls.append("settle"))

    def block_seconds(*a, **k):
        calls.append("block")
        raise RuntimeError("stop here")

    monkeypatch.setattr(probes, "block_seconds", block_seconds)
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=64, vocab_size=128, block_size=16)
    with pytest.raises(RuntimeError, match="stop here"):
        probes.measure_all(cfg, micro_batch_size=1, seq_len=16, device="cpu", dtype="float32",
                           offload_dir=tmp_path, cap=None, io_bytes=1 << 20, seconds=0.01)
    assert calls == ["settle", "block"]
