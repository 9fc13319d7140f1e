"""The LP on synthetic profiles: placements, monotonicity, infeasibility, Plan fields."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
from conftest import GiB, synthetic_profile

from planner import Infeasible, Plan, model, predict, predict_horizontal, search, solve
from planner.model import phases_for
from planner.profile import MachineProfile
from planner.search import ALPHAS, best_alpha
from snake.config import Placement
from snake.memory import RUNTIME_OVERHEAD_BYTES, ModelShape, host_memory

LP = importlib.import_module("planner.solve")  # the module (the package exports its function)
RESOURCES = ("compute", "adam", "h2d", "d2h", "ssd")


def test_ample_cpu_memory_puts_everything_on_cpu():
    p = synthetic_profile(cpu_memory_bytes=512 * GiB)
    plan = solve(p, n_micro=4, alpha=0.1)
    assert isinstance(plan, Plan)
    assert plan.placement == Placement.all_cpu()
    assert plan.ssd_bytes_per_iteration == 0
    assert set(plan.binding) == {"compute_fwd", "compute_bwd"}


def test_tiny_ssd_bandwidth_favours_kinds_with_most_traffic_per_byte():
    # per byte of CPU memory and iteration: param 3 (read fwd, read bwd, write), ckpt 2
    # (write, read for recompute: the next forward stage gets it from the CPU copy of the
    # write), opt 2 (read, write): params go to CPU first, the rest shares what is left
    p = synthetic_profile(ssd_read_bytes_per_s=1e7, ssd_write_bytes_per_s=1e7)
    plan = solve(p, n_micro=8, alpha=0.0)
    assert isinstance(plan, Plan)
    x = plan.placement
    assert x.param == 1.0
    assert min(x.ckpt, x.opt) < 0.99
    assert "cpu_memory" in plan.binding


@pytest.mark.parametrize("n", [1, 4, 16])
@pytest.mark.parametrize("alpha", [0.0, 0.25])
def test_more_ssd_bandwidth_never_lowers_throughput(n, alpha):
    prev = 0.0
    for bw in (1e7, 1e8, 5e8, 1e9, 3e9, 1e10, 1e11):
        p = synthetic_profile(ssd_read_bytes_per_s=bw, ssd_write_bytes_per_s=bw)
        plan = solve(p, n_micro=n, alpha=alpha)
        assert plan.predicted_tokens_per_s >= prev * (1 - 1e-6)
        prev = plan.predicted_tokens_per_s


@pytest.mark.parametrize(
    "changes",
    [{}, {"cpu_memory_bytes": 256 * GiB, "adam_elems_per_s": 1e8}, {"ssd_read_bytes_per_s": 5e8}],
)
def test_more_micro_batches_never_lower_throughput_until_saturation(changes):
    # saturation: the n that Algorithm 1 stops at; beyond it, more checkpoint memory may
    # push optimizer states to SSD and throughput may fall slowly
    p = synthetic_profile(**changes)
    compute = p.shape.tokens_per_micro / (
        p.shape.n_layers * (p.fwd_seconds + p.recompute_seconds + p.bwd_seconds) + p.pre_post_seconds
    )
    saturated = search(p, max_n=32)
    curve = [best_alpha(p, n, alphas=ALPHAS) for n in range(1, 33)]
    tput = [r.predicted_tokens_per_s for r in curve if isinstance(r, Plan)]
    for n in range(1, saturated.n_micro):
        assert tput[n] >= tput[n - 1] * (1 - 1e-6)
    assert saturated.predicted_tokens_per_s >= 0.97 * max(tput)
    assert max(tput) <= compute * (1 + 1e-9)


def test_delayed_step_helps_when_only_adam_binds():
    p = synthetic_profile(cpu_memory_bytes=256 * GiB, adam_elems_per_s=1e8)
    none = solve(p, n_micro=8, alpha=0.0)
    some = solve(p, n_micro=8, alpha=0.3)
    assert "adam_bwd" in none.binding
    assert some.predicted_iteration_seconds < none.predicted_iteration_seconds


def test_infeasible_cpu_memory_names_resource_and_amount():
    p = synthetic_profile(cpu_memory_bytes=1 * GiB)
    r = solve(p, n_micro=1, alpha=0.0)
    assert isinstance(r, Infeasible)
    assert r.resource == "cpu_memory" and r.unit == "bytes" and r.short_by > 0
    assert r.message.startswith("CPU memory: need ") and "n=1" in r.message
    assert "have 1.00 GiB" in str(r)
    assert "runtime overhead" in r.message
    need = host_memory(p.shape, n_micro=1, alpha=0.0, schedule="vertical", workers=2, grad_staging=True)  # CUDA
    assert r.short_by == pytest.approx(need.fixed_bytes + RUNTIME_OVERHEAD_BYTES - 1 * GiB)
    assert "resident_optimizer='ssd'" in r.message  # the state it holds in memory, and where it could go


def test_infeasible_device_memory():
    p = synthetic_profile(device_memory_bytes=0.1 * GiB)
    r = solve(p, n_micro=2, alpha=0.0)
    assert isinstance(r, Infeasible)
    assert r.resource == "device_memory" and r.short_by > 0
    assert r.message.startswith("device memory: need ")


def test_cpu_device_working_set_comes_off_the_host_budget():
    cuda = synthetic_profile(cpu_memory_bytes=12 * GiB)
    cpu = dataclasses.replace(cuda, device="cpu")
    a, b = solve(cuda, n_micro=4, alpha=0.0), solve(cpu, n_micro=4, alpha=0.0)
    assert b.host_memory_bytes < a.host_memory_bytes


@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
def test_cpu_device_adds_compute_adam_and_copies(schedule):
    """On a CPU device the kernels, AdamW and the host<->device copies share the cores: a
    phase with everything in CPU memory (no SSD traffic) lasts their sum, on CUDA the
    slowest of them."""
    from planner.model import phases_for

    cuda = synthetic_profile(cpu_memory_bytes=512 * GiB, h2d_bytes_per_s=2e9, d2h_bytes_per_s=2e9)
    cpu = dataclasses.replace(cuda, device="cpu")
    x = (1.0, 1.0, 1.0, 1.0)
    for ph_cuda, ph_cpu in zip(phases_for(cuda, 4, 0.2, schedule), phases_for(cpu, 4, 0.2, schedule), strict=True):
        parts = [b.at(x) for b in ph_cuda.bounds if not b.name.startswith("ssd_")]
        assert ph_cuda.seconds_at(x) == pytest.approx(max(parts))
        assert ph_cpu.seconds_at(x) == pytest.approx(sum(parts))
        assert sum(parts) > max(parts)
    a, b = solve(cuda, n_micro=4, alpha=0.2, schedule=schedule), solve(cpu, n_micro=4, alpha=0.2, schedule=schedule)
    assert b.predicted_iteration_seconds > a.predicted_iteration_seconds
    assert any(name.startswith("host_") for name in b.binding)


def small_cpu_profile():
    """benchmarks/throughput.py's capped machine (run H's profile, rounded): GPT 8 x 512 on a
    CPU device, 64 KiB checkpoints, a 300 MB/s SSD cap, a 345 MiB budget (as the memory model
    stood then: since round 21 the budget also covers the runtime's overhead, the
    parameter gradients three times and the head's logits, added here so that the room is the same)."""
    shape = ModelShape(n_layers=8, layer_params=3152384, ckpt_elems=16384, resident_params=148480,
                       tokens_per_micro=32, dtype_bytes=4, vocab_size=256)
    since = RUNTIME_OVERHEAD_BYTES + 3 * (shape.layer_params + shape.resident_params) * 4 + shape.tokens_per_micro * 256 * 16
    return MachineProfile(
        fwd_seconds=0.00347, recompute_seconds=0.00347, bwd_seconds=0.00766, pre_post_seconds=0.00092,
        h2d_bytes_per_s=23e9, d2h_bytes_per_s=23e9, ssd_read_bytes_per_s=300e6, ssd_write_bytes_per_s=306e6,
        adam_elems_per_s=1.92e9, cpu_memory_bytes=345 * 2**20 + since, device_memory_bytes=24 * GiB, shape=shape,
        device="cpu",
    )


@pytest.mark.parametrize("n", [16, 32])
def test_equal_time_prefers_fewer_ssd_operations(n, monkeypatch):
    """Compute-bound, with operations not charged as time (as on a GPU), checkpoints and
    optimizer states cost the same time and the same SSD bytes per byte kept in CPU memory;
    the plan keeps the checkpoints (2n small operations per layer) in CPU memory and puts
    optimizer states (one large one) on SSD. Measured there: the runtime's threads other than
    compute 0.17 -> 0.11 of a core (BENCHMARKS.md section 7)."""
    monkeypatch.setattr(model, "HOST_SECONDS_PER_SSD_OP", 0.0)
    monkeypatch.setattr(model, "SSD_SECONDS_PER_OP_CPU_DEVICE", 0.0)
    p = small_cpu_profile()
    plan = solve(p, n_micro=n, alpha=0.0)
    assert isinstance(plan, Plan)
    assert plan.placement.param == 1.0 and plan.placement.ckpt == 1.0
    assert 0.0 < plan.placement.opt < 1.0
    assert any(b.startswith("host_") for b in plan.binding)
    # the general LP (any checkpoint share) on its own: the operation count decides the tie
    mem = host_memory(p.shape, n_micro=n, alpha=0.0, schedule="vertical", workers=2)
    budget, _ = LP.host_budget(p, n)
    phases = phases_for(p, n, 0.0, "vertical")
    assert LP._run(LP._lp(phases, mem, budget, None))[1] == pytest.approx(1.0)
    monkeypatch.setattr(LP, "OP_SECONDS", 0.0)
    assert LP._run(LP._lp(phases, mem, budget, None))[1] < 0.99  # without it: the other vertex
    bytes_only = solve(p, n_micro=n, alpha=0.0)
    assert plan.predicted_iteration_seconds == pytest.approx(bytes_only.predicted_iteration_seconds, rel=1e-9)


def run_p_profile() -> MachineProfile:
    """throughput.py run P's capped profile (rounded) under its 345 MiB budget."""
    return dataclasses.replace(
        small_cpu_profile(), fwd_seconds=0.00312, recompute_seconds=0.00312, bwd_seconds=0.00701,
        pre_post_seconds=0.00077, h2d_bytes_per_s=19.9e9, d2h_bytes_per_s=16.1e9, ssd_read_bytes_per_s=300.6e6,
        ssd_write_bytes_per_s=305.4e6, adam_elems_per_s=1.658e9)


def test_cpu_device_charges_each_ssd_operation(monkeypatch):
    """On a CPU device every SSD read or write costs the kernels HOST_SECONDS_PER_SSD_OP of
    the shared cores and the SSD channel SSD_SECONDS_PER_OP_CPU_DEVICE (both measured:
    benchmarks/contention.py --op-cost); a checkpoint share kept in CPU memory takes its n
    writes (forward) and n reads (backward) per layer off both bounds. On CUDA neither."""
    n = 16
    cpu = small_cpu_profile()
    host_c, ssd_c = model.HOST_SECONDS_PER_SSD_OP, model.SSD_SECONDS_PER_OP_CPU_DEVICE
    assert host_c > 0 and ssd_c > 0
    for ph in phases_for(cpu, n, 0.0, "vertical"):
        host = next(b for b in ph.bounds if b.name.startswith("host_"))
        ssd = next(b for b in ph.bounds if b.name.startswith("ssd_"))
        assert host.at((1.0, 0.0, 0.3, 1.0)) - host.at((1.0, 1.0, 0.3, 1.0)) == pytest.approx(host_c * n)
        assert host.at((1.0, 1.0, 1.0, 1.0)) == pytest.approx(sum(
            b.at((1.0, 1.0, 1.0, 1.0)) for b in ph.bounds if b.name.split("_")[0] in ("compute", "adam", "h2d", "d2h")))
        ckpt_bytes = (ph.traffic.ssd_read[1] / cpu.ssd_read_bytes_per_s
                      + ph.traffic.ssd_write[1] / cpu.ssd_write_bytes_per_s)
        assert ssd.at((1.0, 0.0, 0.3, 1.0)) - ssd.at((1.0, 1.0, 0.3, 1.0)) == pytest.approx(ckpt_bytes + ssd_c * n)
    cuda = dataclasses.replace(cpu, device="cuda")
    for ph in phases_for(cuda, n, 0.0, "vertical"):
        assert not any(b.name.startswith("host_") for b in ph.bounds)
        ssd = next(b for b in ph.bounds if b.name.startswith("ssd_"))
        assert ssd.at((1.0, 1.0, 1.0, 1.0)) == 0.0
    # run P's profile: without the charges the plans at M = 16 (compute-bound) and M = 8
    # (I/O-bound) put checkpoints on SSD, predicted faster; side by side such plans ran 9 %
    # (M = 16) and 21 % (M = 8) slower than with the checkpoints in CPU memory
    p = run_p_profile()
    charged = {m: search(p, schedule="vertical", n_micro=m) for m in (8, 16)}
    assert all(isinstance(r, Plan) and r.placement.ckpt == 1.0 for r in charged.values())
    monkeypatch.setattr(model, "HOST_SECONDS_PER_SSD_OP", 0.0)
    monkeypatch.setattr(model, "SSD_SECONDS_PER_OP_CPU_DEVICE", 0.0)
    for m in (8, 16):
        r = search(p, schedule="vertical", n_micro=m)
        assert isinstance(r, Plan) and r.placement.ckpt < 0.5


@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_operation_count_never_costs_time(schedule, n, monkeypatch):
    """The operation count only breaks ties: predicted time is what the bytes-only LP gives."""
    for p in (synthetic_profile(), small_cpu_profile(), synthetic_profile(ssd_read_bytes_per_s=3e8)):
        for alpha in ((0.0, 0.2) if schedule == "vertical" else (0.0,)):
            with_ops = solve(p, n_micro=n, alpha=alpha, schedule=schedule)
            with monkeypatch.context() as m:
                m.setattr(LP, "OP_SECONDS", 0.0)
                bytes_only = solve(p, n_micro=n, alpha=alpha, schedule=schedule)
            assert with_ops.predicted_iteration_seconds == pytest.approx(
                bytes_only.predicted_iteration_seconds, rel=1e-6)


@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_plan_fields_are_consistent(schedule, n):
    p = synthetic_profile()
    plan = solve(p, n_micro=n, alpha=0.2 if schedule == "vertical" else 0.0, schedule=schedule)
    assert isinstance(plan, Plan)
    assert plan.n_micro == n and plan.schedule == schedule
    for share in (plan.placement.param, plan.placement.ckpt, plan.placement.opt):
        assert 0.0 <= share <= 1.0
    assert plan.binding and all(b == "cpu_memory" or b.split("_")[0] in RESOURCES for b in plan.binding)
    assert plan.host_memory_bytes <= p.cpu_memory_bytes * (1 + 1e-9)
    counts = {"fwd_first": 1, "fwd": n - 1 if schedule == "horizontal" else 1,
              "bwd": n - 1 if schedule == "horizontal" else 1, "bwd_last": 1}
    layer = sum(counts[k] * v for k, v in plan.layer_seconds.items())
    expect = p.shape.n_layers * layer + n * p.pre_post_seconds
    assert plan.predicted_iteration_seconds == pytest.approx(expect)
    assert plan.predicted_tokens_per_s == pytest.approx(n * p.shape.tokens_per_micro / expect)
    again = predict(p, n, plan.placement, plan.alpha, schedule)
    assert again == pytest.approx(plan.predicted_iteration_seconds)


def test_fixed_placement_is_kept_or_reported_infeasible():
    p = synthetic_profile()
    fixed = Placement(param=1.0, ckpt=0.5, opt=0.1)
    plan = solve(p, n_micro=4, alpha=0.1, placement=fixed)
    assert plan.placement == fixed
    r = solve(p, n_micro=4, alpha=0.1, placement=Placement.all_cpu())
    assert isinstance(r, Infeasible) and "placement param=1" in r.message


def test_horizontal_is_not_faster_than_vertical_with_many_micro_batches():
    p = synthetic_profile()
    plan = solve(p, n_micro=8, alpha=0.0)
    assert predict_horizontal(p, 8, plan.placement) > plan.predicted_iteration_seconds


def test_bad_arguments_raise():
    p = synthetic_profile()
    with pytest.raises(ValueError, match="alpha"):
        solve(p, n_micro=1, alpha=1.01)
    with pytest.raises(ValueError, match="n_micro"):
        solve(p, n_micro=0, alpha=0.0)
    with pytest.raises(ValueError, match="schedule"):
        solve(p, n_micro=1, alpha=0.0, schedule="diagonal")


def test_checkpoints_all_in_cpu_use_their_exact_memory_model():
    """Checkpoints are whole units: with all of them in CPU memory there are no checkpoint
    staging pools, which the general model's bound still charges. A budget that fits them
    only without those pools gets the all-in-CPU plan, charged exactly."""
    p = synthetic_profile(ssd_read_bytes_per_s=3e8)  # slow reads: checkpoints on SSD cost time
    n = 1
    general = host_memory(p.shape, n_micro=n, alpha=0.0, schedule="vertical", workers=2, grad_staging=True)
    exact = host_memory(p.shape, n_micro=n, alpha=0.0, schedule="vertical", workers=2, ckpt_in_cpu=True,
                        grad_staging=True)
    assert exact.at(1.0, 1.0, 0.0) < general.at(1.0, 1.0, 0.0)
    room = exact.at(1.0, 1.0, 0.0) + 0.25 * exact.per_share["opt"]  # params, checkpoints, 1/4 of opt
    tight = dataclasses.replace(p, cpu_memory_bytes=room + LP.off_budget(p, n))
    plan = solve(tight, n_micro=n, alpha=0.0)
    assert isinstance(plan, Plan)
    assert plan.placement.ckpt == 1.0 and plan.placement.param == 1.0
    assert plan.placement.opt == pytest.approx(0.25, abs=1e-6)
    assert plan.host_memory_bytes == pytest.approx(exact.at(1.0, 1.0, plan.placement.opt))
    # the general model alone would have had to give checkpoints up to SSD: a slower plan
    budget, _ = LP.host_budget(tight, n)
    phases = phases_for(tight, n, 0.0, "vertical")
    x = LP._run(LP._lp(phases, general, budget, None))
    assert x is not None and x[1] < 1.0 - 1e-6
    only = LP.make_plan(tight, phases, general, budget, tuple(x), n_micro=n, alpha=0.0, schedule="vertical")
    assert only.predicted_iteration_seconds > plan.predicted_iteration_seconds


def test_horizontal_on_cuda_charges_its_gradient_staging_buffer():
    """On CUDA horizontal copies each micro-batch's gradient into one pinned fp32 layer buffer
    before adding it to the layer's accumulator: the memory model and the planner count it,
    on CUDA and for horizontal only. Both schedules stage the resident step's gradients
    through one chunk buffer there."""
    from snake.memory import resident_chunk

    p = synthetic_profile(cpu_memory_bytes=1 * GiB)
    layer_fp32 = p.shape.layer_params * 4
    chunk = resident_chunk(p.shape.resident_params) * 4
    for schedule, extra in (("horizontal", layer_fp32 + chunk), ("vertical", chunk)):
        with_ = host_memory(p.shape, n_micro=2, alpha=0.0, schedule=schedule, workers=2, grad_staging=True)
        without = host_memory(p.shape, n_micro=2, alpha=0.0, schedule=schedule, workers=2)
        assert with_.fixed_bytes - without.fixed_bytes == extra
        assert with_.per_share == without.per_share
    need = host_memory(p.shape, n_micro=1, alpha=0.0, schedule="horizontal", workers=2, grad_staging=True)
    r = solve(p, n_micro=1, alpha=0.0, schedule="horizontal")
    assert isinstance(r, Infeasible)
    assert r.short_by == pytest.approx(need.fixed_bytes + RUNTIME_OVERHEAD_BYTES - 1 * GiB)


def test_gradients_that_wait_go_to_ssd_when_memory_is_short():
    """At alpha = 1 (clipping, a dynamic loss scale) every layer's fp32 gradient waits for
    the next iteration: 4.8 GB for this 1.2 B-parameter model. Where CPU memory cannot hold
    them beside the least of everything else, the planner puts part of them on SSD
    (placement.grad), charges their writes and reads, and keeps to the budget; with room it
    keeps them all in memory."""
    from planner.model import shares, ssd_bytes

    p, n = synthetic_profile(), 4
    mem = host_memory(p.shape, n_micro=n, alpha=1.0, schedule="vertical", workers=2, grad_staging=True)
    least, least_in_memory = mem.smallest(), mem.smallest({"grad": 1.0})
    assert least_in_memory - least > 3e9
    budget = (least + least_in_memory) / 2
    short = dataclasses.replace(p, cpu_memory_bytes=budget + LP.off_budget(p, n))
    fixed = solve(short, n_micro=n, alpha=1.0, placement=Placement(param=0.0, ckpt=0.0, opt=0.0, grad=1.0))
    assert isinstance(fixed, Infeasible) and fixed.resource == "cpu_memory"
    plan = solve(short, n_micro=n, alpha=1.0)
    assert isinstance(plan, Plan), plan
    assert 0.0 < plan.placement.grad < 1.0
    assert plan.host_memory_bytes <= budget * (1 + 1e-9)
    assert plan.host_memory_bytes == pytest.approx(mem.at(*shares(plan.placement, p.shape, 1.0, "vertical")))
    phases = phases_for(short, n, 1.0, "vertical")
    x = shares(plan.placement, p.shape, 1.0, "vertical")
    # written once, read once, but layer 0's, which waits in its staging buffer (its delayed step comes next)
    grads = (p.shape.n_layers - 1) * 2 * 4 * p.shape.layer_params * (1 - x[3])
    in_memory = (*x[:3], 1.0)
    assert plan.ssd_bytes_per_iteration - p.shape.n_layers * ssd_bytes(phases, in_memory) == pytest.approx(grads)
    roomy = solve(dataclasses.replace(p, cpu_memory_bytes=512 * GiB), n_micro=n, alpha=1.0)
    assert isinstance(roomy, Plan) and roomy.placement.grad == 1.0


def test_the_grad_share_is_at_least_what_the_stale_parameters_hold():
    """The runtime keeps in the stale delayed parameters' memory what fits there whatever the
    grad share (param bytes / 4 of the gradient per unit of param share): the memory model
    and the LP count the grad share in effect, and without delayed gradients it is moot."""
    p = synthetic_profile()  # bf16: half a gradient per parameter share
    mem = host_memory(p.shape, n_micro=4, alpha=1.0, schedule="vertical", workers=2, grad_staging=True)
    assert mem.shares(1.0, 1.0, 1.0, 0.0)["grad"] == 0.5
    assert mem.at(1.0, 1.0, 1.0, 0.0) == mem.at(1.0, 1.0, 1.0, 0.5) < mem.at(1.0, 1.0, 1.0, 0.6)
    assert mem.at(0.0, 1.0, 1.0, 0.0) < mem.at(0.0, 1.0, 1.0, 0.5)
    plan = solve(p, n_micro=4, alpha=1.0, placement=Placement(param=1.0, ckpt=0.0, opt=0.0, grad=0.0))
    assert isinstance(plan, Plan)
    assert plan.host_memory_bytes == pytest.approx(mem.at(1.0, 0.0, 0.0, 0.5))
    for alpha, schedule in ((0.0, "vertical"), (1.0, "horizontal")):
        none = host_memory(p.shape, n_micro=4, alpha=alpha, schedule=schedule, workers=2)
        assert none.at(0.5, 1.0, 1.0, 0.0) == none.at(0.5, 1.0, 1.0, 1.0)
        free = solve(p, n_micro=4, alpha=alpha, schedule=schedule)
        assert isinstance(free, Plan) and free.placement.grad == 1.0
