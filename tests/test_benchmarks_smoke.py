"""The benchmark scripts import and their helpers work (the scripts themselves take minutes:
run them by hand, see BENCHMARKS.md)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(autouse=True)
def _bench_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))


@pytest.mark.parametrize(
    "name", ["common", "throughput", "delay_and_ssd", "storage", "overheads", "plan_accuracy", "report", "kernels", "cpu_parity", "budget_tradeoff"]
)
def test_imports(name):
    sys.modules.pop(name, None)
    importlib.import_module(name)


def test_helpers():
    common = importlib.import_module("common")
    throughput = importlib.import_module("throughput")
    t = common.traffic_summary({("ssd", "cpu", "opt"): 10, ("cpu", "ssd", "opt"): 5, ("cpu", "gpu", "param"): 7})
    assert t["ssd_bytes"] == 15 and t["links"]["cpu->gpu"] == 7
    assert throughput.first_at([(1, 10.0), (2, 95.0), (4, 100.0)], 0.9) == 2
    cfg = common.gpt_config(2, 64, 16)
    assert common.model_flops_per_token(cfg, 16) > 6 * 2 * cfg.block_params()
