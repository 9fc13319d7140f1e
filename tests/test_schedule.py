"""The schedule is pure: stage order, snake order, carried inputs, leads."""

import pytest

from snake.plans import Plans
from snake.schedule import build_schedule, carries, device_loads, stored_outputs


def test_vertical_is_layer_major_and_snakes():
    s = build_schedule(3, 3, "vertical")
    assert [(x.phase, x.layer) for x in s] == [("fwd", 0), ("fwd", 1), ("fwd", 2), ("bwd", 2), ("bwd", 1), ("bwd", 0)]
    assert [x.micro_batches for x in s] == [(0, 1, 2), (2, 1, 0), (0, 1, 2), (2, 1, 0), (0, 1, 2), (2, 1, 0)]
    # each stage's last micro-batch is the next one's first: it stays on the device
    assert all(p.carry_in for p in carries(s, 3)[1:])


def test_horizontal_is_micro_batch_major():
    s = build_schedule(2, 2, "horizontal")
    assert [(x.phase, x.layer, x.micro_batches) for x in s] == [
        ("fwd", 0, (0,)), ("fwd", 1, (0,)), ("bwd", 1, (0,)), ("bwd", 0, (0,)),
        ("fwd", 0, (1,)), ("fwd", 1, (1,)), ("bwd", 1, (1,)), ("bwd", 0, (1,)),
    ]


@pytest.mark.parametrize("n,m", [(1, 1), (4, 1), (4, 3), (5, 4)])
def test_loads_count(n, m):
    v = device_loads(build_schedule(n, m, "vertical"), n)
    h = device_loads(build_schedule(n, m, "horizontal"), n)
    assert sum(ld.kind == "param" for ld in v) == 2 * n
    assert sum(ld.kind == "param" for ld in h) == 2 * n * m
    # vertical forward reloads all but the carried checkpoint for layers after the first
    assert sum(ld.kind == "ckpt" for ld in v) == (n - 1) * (m - 1) + n * m
    assert sum(ld.kind == "act_grad" for ld in v) == n * (m - 1)
    assert not any(ld.kind == "act_grad" for ld in h)
    stored = stored_outputs(build_schedule(n, m, "vertical"), n)
    assert sum(k == "ckpt" for k, _, _ in stored) == n * m


def test_reads_respect_leads_and_dependencies():
    s = build_schedule(4, 2, "vertical")
    plans = Plans(s, 4, delayed=True)
    ops = list(plans.read_plan(range(0, 3), lambda kind, unit: True, 0))
    starts = [op.sort for op in ops]
    assert starts == sorted(starts)
    for op in ops:
        if op.kind == "param":
            g = op.tag[3]
            assert op.start <= g - 1  # at least one stage ahead of the need
    # a forward param read of iteration t comes after the optimizer-state reads of the steps
    # that produce it (now-step of t-1 and delayed step of t), never before
    index = {(op.kind, op.unit, op.tag[-2] if op.kind == "opt" else op.tag[3], op.tag[-1] if op.kind == "opt" else None): i for i, op in enumerate(ops)}
    S = plans.S
    for t in (1, 2):
        for layer in range(4):
            g = t * S + plans.fwd[layer]
            read = index[("param", (layer, 0), g, None)]
            assert index[("opt", (layer, 0), t - 1, "now")] < read
            assert index[("opt", (layer, 1), t, "delayed")] < read


def test_bad_arguments():
    with pytest.raises(ValueError):
        build_schedule(0, 1, "vertical")
    with pytest.raises(ValueError):
        build_schedule(2, 2, "diagonal")
