"""Algorithm 1 (search) and the roofline on synthetic profiles."""

from __future__ import annotations

import pytest
from conftest import GiB, synthetic_profile

from planner import Infeasible, Plan, roofline, search
from planner.search import ALPHAS, best_alpha

ROW_KEYS = {
    "n",
    "compute_roofline_tokens_per_s",
    "io_roofline_tokens_per_s",
    "vertical_tokens_per_s",
    "horizontal_tokens_per_s",
}


def test_search_stops_at_saturation_and_matches_best_alpha():
    p = synthetic_profile()
    plan = search(p)
    assert isinstance(plan, Plan) and 1 < plan.n_micro < 64
    again = best_alpha(p, plan.n_micro, alphas=ALPHAS)
    assert again == plan
    nxt = best_alpha(p, plan.n_micro + 1, alphas=ALPHAS)
    assert nxt.predicted_tokens_per_s < 1.01 * plan.predicted_tokens_per_s
    assert plan.alpha in ALPHAS


def test_compute_bound_machine_needs_one_micro_batch():
    plan = search(synthetic_profile(cpu_memory_bytes=512 * GiB))
    assert plan.n_micro == 1 and plan.alpha == 0.0


def test_patience_and_max_n_bound_the_search():
    p = synthetic_profile()
    assert search(p, max_n=3).n_micro <= 3
    assert search(p, patience=1).n_micro <= search(p, patience=3).n_micro


def test_search_infeasible_at_one_micro_batch():
    r = search(synthetic_profile(cpu_memory_bytes=2 * GiB))
    assert isinstance(r, Infeasible) and r.resource == "cpu_memory" and "n=1" in r.message


def test_search_with_fixed_fields():
    p = synthetic_profile()
    plan = search(p, n_micro=5, alphas=(0.3,))
    assert plan.n_micro == 5 and plan.alpha == 0.3


def test_horizontal_search_uses_no_delay_and_is_slower():
    p = synthetic_profile()
    h, v = search(p, schedule="horizontal"), search(p)
    assert h.schedule == "horizontal" and h.alpha == 0.0
    assert h.predicted_tokens_per_s < v.predicted_tokens_per_s


def test_more_ssd_bandwidth_never_lowers_searched_throughput():
    prev = 0.0
    for bw in (1e8, 5e8, 2e9, 8e9):
        plan = search(synthetic_profile(ssd_read_bytes_per_s=bw, ssd_write_bytes_per_s=bw))
        assert plan.predicted_tokens_per_s >= prev * 0.99  # stops within 1 % of saturation
        prev = plan.predicted_tokens_per_s


def test_roofline_shape():
    p = synthetic_profile()
    ns = [1, 2, 4, 8, 16, 4096]
    rows = roofline(p, ns)
    assert [r["n"] for r in rows] == ns
    assert all(set(r) == ROW_KEYS for r in rows)
    compute = {r["compute_roofline_tokens_per_s"] for r in rows}
    assert len(compute) == 1
    per_n = [r["io_roofline_tokens_per_s"] / r["n"] for r in rows]
    assert per_n == pytest.approx([per_n[0]] * len(ns))
    for r in rows[:-1]:
        assert r["vertical_tokens_per_s"] <= r["compute_roofline_tokens_per_s"] * (1 + 1e-9)
        assert r["horizontal_tokens_per_s"] <= r["vertical_tokens_per_s"] * (1 + 1e-9)
    assert rows[-1]["vertical_tokens_per_s"] is None  # 4096 micro-batches do not fit in 16 GiB
    assert rows[3]["vertical_tokens_per_s"] > rows[0]["vertical_tokens_per_s"]


@pytest.mark.parametrize("device", ["cuda", "cpu"], ids=["gpu-profile", "cpu-profile"])
def test_no_alpha_above_one_half_predicts_more_throughput(device):
    """Why ALPHAS stops at 0.5 (the paper's alpha is in [0, 1]): a layer's forward stage
    carries no more of any resource than its backward stage (compute, copies, SSD), so
    moving more than half of the step into the forward only lengthens it. Fails when the
    time model changes so that a larger alpha could win: the grid must then grow."""
    up_to_one = tuple(i / 20 for i in range(21))
    seen = 0
    for mem, ssd, adam, n in [
        (8, 0.3e9, 0.5e9, 1), (16, 2e9, 1.9e9, 4), (32, 0.3e9, 6e9, 16), (64, 6e9, 0.5e9, 2),
        (128, 1e9, 1.9e9, 8), (16, 0.3e9, 0.5e9, 16),
    ]:
        p = synthetic_profile(device=device, cpu_memory_bytes=mem * GiB, ssd_read_bytes_per_s=ssd,
                              ssd_write_bytes_per_s=0.75 * ssd, adam_elems_per_s=adam)
        capped, full = best_alpha(p, n, alphas=ALPHAS), best_alpha(p, n, alphas=up_to_one)
        if isinstance(capped, Infeasible):
            assert isinstance(full, Infeasible)
            continue
        seen += 1
        assert isinstance(full, Plan) and full.alpha <= 0.5
        assert full.predicted_tokens_per_s <= capped.predicted_tokens_per_s * (1 + 1e-9)
    assert seen >= 4
