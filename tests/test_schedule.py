"""The schedule is pure: stage order, snake order, carried inputs, leads."""

import itertools

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


@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("first_delayed", [0, 2])
def test_the_read_plan_is_heapq_merges_order_built_an_iteration_at_a_time(schedule, delayed, first_delayed):
    """The read plan is the order heapq.merge gives every iteration's reads (equal keys in
    iteration order), but built as it is taken: its first op comes after two iterations'
    reads are made, not all of a run's (a run(10**6) built 6.7 GB of them before its first
    step, an audit found)."""
    import heapq

    s = build_schedule(4, 3, schedule)
    plans = Plans(s, 4, delayed=delayed)
    tails = lambda kind, unit: True  # noqa: E731
    want = list(heapq.merge(*(plans._reads(t, tails, first_delayed) for t in range(6)), key=lambda op: op.sort))
    assert [(op.t, op.kind, op.unit, op.tag) for op in plans.read_plan(range(6), tails, first_delayed)] == [
        (op.t, op.kind, op.unit, op.tag) for op in want]
    made = []

    def counted():
        for t in range(2000):
            made.append(t)
            yield t

    plan = plans.read_plan(counted(), tails, first_delayed)  # type: ignore[arg-type]
    next(plan)
    assert len(made) <= 3


@pytest.mark.parametrize("mode", ["vertical", "horizontal"])
@pytest.mark.parametrize("delayed", [False, True])
def test_every_plan_is_iteration_major(mode, delayed):
    """No operation of iteration t comes before one of t - 1 in any actor's plan: an actor
    waiting for iteration t's batch (a source slower than the steps, or one blocked) then
    holds nothing of t - 1 back. The read plan interleaved the two at the stage where one
    ends and the other begins, so a blocked source held up the last backward stage's
    checkpoint read behind the next iteration's optimizer-state read, and the step before
    it never finished (a stall)."""
    for n, m, lowest, first_delayed in itertools.product([1, 2, 5], [1, 2, 4], [0, 1], [0, 1, 3]):
        if lowest >= n:
            continue
        plans = Plans(build_schedule(n, m, mode, lowest), n, delayed=delayed)
        reads = list(plans.read_plan(range(5), lambda kind, unit: True, first_delayed))
        h2d = list(plans.h2d_plan(range(5)))
        steps = list(plans.worker_plan(range(5), list(range(n)), first_delayed))
        for name, ops in (("read", reads), ("h2d", h2d), ("optimizer", steps)):
            ts = [op.t for op in ops]
            assert ts == sorted(ts), (name, n, m, lowest, first_delayed)
        for t in range(1, 5):  # and no read of t starts before the last of t - 1
            assert max(op.start for op in reads if op.t == t - 1) <= min(op.start for op in reads if op.t == t)
