"""One LP per (n, alpha): the CPU shares that minimise the per-layer iteration time.

Variables: x = (param, ckpt, opt) CPU shares in [0, 1] and one time per phase of the
schedule (vertical: t_f, t_b). Rows: host memory (`snake.memory.host_memory`, exactly what
the runtime allocates) <= the CPU budget less `off_budget`, and every resource bound of `planner.model`
(compute, CPU Adam, host<->device, SSD) per phase. Objective: per-layer time plus a small
penalty on SSD traffic, so that spare CPU memory still takes traffic off the SSD; in that
penalty each SSD operation also counts OP_SECONDS, so that between placements of equal
time and equal SSD bytes (checkpoints and optimizer states both move two bytes per byte
kept on SSD) the one with fewer, larger operations wins: the runtime's threads spend a
fixed CPU cost per operation. On a CPU device that cost comes out of the kernels' cores,
so there the time model itself charges it (`planner.model.HOST_SECONDS_PER_SSD_OP`).
Device memory does not depend on x: it is checked before the LP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import highspy
import numpy as np

from planner.model import (
    KINDS,
    Phase,
    layer_seconds,
    mapped_frozen_bytes,
    phases_for,
    shares,
    ssd_bytes,
)
from planner.profile import MachineProfile
from snake.config import Placement
from snake.memory import (
    OPT_BYTES_PER_ELEM,
    RUNTIME_OVERHEAD_BYTES,
    LinearMemory,
    device_memory,
    host_memory,
    off_budget_bytes,
    resident_host_bytes,
)

GiB = float(1 << 30)
SSD_PENALTY = 1e-4  # objective weight of SSD seconds relative to iteration seconds
OP_SECONDS = 2e-4  # SSD seconds one operation counts as in that penalty (BENCHMARKS.md section 7)
TIGHT = 1e-6  # relative slack under which a row counts as binding


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A resolved configuration and what the model predicts for it.

    placement: CPU shares (rest on SSD). layer_seconds: per phase name, seconds of one
    occurrence of that phase for one layer. binding: rows that are tight at the optimum
    (`cpu_memory`, `compute_fwd`, `ssd_bwd`, `adam_bwd`, `h2d_fwd`, ...).
    host_memory_bytes: what the runtime will allocate in host memory.
    ssd_bytes_per_iteration: SSD reads + writes per iteration, all layers (and the resident
    optimizer state where it is on SSD). resident_optimizer: where the resident (pre/post)
    optimizer state lives, "cpu" or "ssd". frozen_from_disk: see below."""

    schedule: str
    n_micro: int
    alpha: float
    placement: Placement
    predicted_iteration_seconds: float
    predicted_tokens_per_s: float
    binding: tuple[str, ...]
    layer_seconds: dict[str, float]
    host_memory_bytes: float
    ssd_bytes_per_iteration: float
    resident_optimizer: str = "cpu"
    # a streamed model's mapped frozen weights are more than the page cache holds beside the
    # placement: every load reads them from the SSD (`planner.model.vertical_phases`)
    frozen_from_disk: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Infeasible:
    """No placement fits: `resource` ("cpu_memory" or "device_memory") is short by
    `short_by` `unit`s. `message` says so in words (`need`), with a fix (`fix`)."""

    resource: str
    short_by: float
    unit: str
    need: str
    fix: str

    @property
    def message(self) -> str:
        return f"{self.need} (use {self.fix})"

    def __str__(self) -> str:
        return self.message


def fmt_bytes(n: float) -> str:
    """1.50 GiB, 12.0 MiB, 3.0 KiB."""
    for unit, size in (("GiB", GiB), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if abs(n) >= size:
            return f"{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n:.0f} B"


def _check(alpha: float, n_micro: int, schedule: str) -> None:
    if not isinstance(n_micro, int) or n_micro < 1:
        raise ValueError(f"n_micro={n_micro!r} must be an integer >= 1")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r} must be in [0, 1] (delayed optimizer share)")
    if schedule not in ("vertical", "horizontal"):
        raise ValueError(f"schedule={schedule!r} must be 'vertical' or 'horizontal'")


def off_budget(profile: MachineProfile, n_micro: int) -> float:
    """Host bytes the placement cannot use: the runtime's overhead (threads, lazily imported
    modules, allocator slack: `RUNTIME_OVERHEAD_BYTES`) and, on a CPU device, the device's
    working set, which is host memory there."""
    return off_budget_bytes(profile.shape, n_micro=n_micro, device_type=profile.device)


def host_budget(profile: MachineProfile, n_micro: int) -> tuple[float, float]:
    """(host bytes the placement may use, device bytes): the CPU budget less `off_budget`."""
    dev = device_memory(profile.shape, n_micro=n_micro, device_type=profile.device)
    return profile.cpu_memory_bytes - off_budget(profile, n_micro), dev


def memory_check(
    profile: MachineProfile, mem: LinearMemory, n_micro: int, placement: Placement | None,
    hint_ssd: bool = False,
) -> Infeasible | None:
    """Infeasible when even the smallest host footprint (or the fixed placement) is over.
    hint_ssd: the resident optimizer state was in CPU memory, and SSD was not tried: the fix
    names resident_optimizer='ssd'."""
    budget, dev = host_budget(profile, n_micro)
    if profile.device == "cuda" and dev > profile.device_memory_bytes:
        short = dev - profile.device_memory_bytes
        return Infeasible(
            resource="device_memory", short_by=short, unit="bytes",
            need=f"device memory: need {fmt_bytes(dev)} at n={n_micro}, have {fmt_bytes(profile.device_memory_bytes)}",
            fix="fewer micro-batches or a smaller micro-batch",
        )
    if placement is None:
        need = mem.smallest()
        what, fix = "for buffers", "fewer micro-batches, a smaller micro-batch"
    else:
        need = mem.at(placement.param, placement.ckpt, placement.opt, placement.grad)
        what = (f"for placement param={placement.param:g} ckpt={placement.ckpt:g} opt={placement.opt:g}"
                f" grad={placement.grad:g}")
        fix = "smaller CPU shares (placement), fewer micro-batches"
    if need <= budget:
        return None
    extra = f" + {fmt_bytes(dev)} device working set on the CPU" if profile.device == "cpu" else ""
    extra += f" + {fmt_bytes(RUNTIME_OVERHEAD_BYTES)} runtime overhead"
    resident = resident_host_bytes(profile.shape.resident_params, False, staged_grads=profile.device == "cuda")
    if hint_ssd and resident and not profile.offload_in_memory:
        fix += f", resident_optimizer='ssd' (the embeddings' and head's optimizer state, {fmt_bytes(resident)} here)"
    if profile.offload_in_memory:
        fix = (f"offload_dir on a disk: it is in memory (tmpfs), so its SSD tier takes CPU memory too; or {fix}")
    return Infeasible(
        resource="cpu_memory", short_by=need - budget, unit="bytes",
        need=f"CPU memory: need {fmt_bytes(need)} {what} at n={n_micro}{extra}, have "
        f"{fmt_bytes(profile.cpu_memory_bytes)}",
        fix=f"{fix} or give more CPU memory",
    )


def _lp(
    phases: tuple[Phase, ...], mem: LinearMemory, budget: float, placement, *, ckpt_in_cpu: bool = False
) -> highspy.HighsLp:
    """Columns: x_param, x_ckpt, x_opt, x_grad, then one time per phase (scaled by t0).
    ckpt_in_cpu: x_ckpt is fixed at 1 (the model `mem` holds only there). With delayed
    gradients (`mem.grad_room`) a row keeps x_grad >= grad_room x x_param, where `mem` is
    exact (the runtime keeps that much in the stale delayed parameters' memory); without
    them x_grad is 1 (it places nothing)."""
    t0 = max(max(b.seconds for ph in phases for b in ph.bounds), 1e-12)
    nx, nt = len(KINDS), len(phases)
    cost = np.zeros(nx + nt)
    starts, index, value, lower, upper = [0], [], [], [], []
    for j, ph in enumerate(phases):
        cost[nx + j] = ph.count
        for k in range(nx):  # every share kept in CPU memory is that share of operations less
            cost[k] -= SSD_PENALTY * ph.count * OP_SECONDS * ph.traffic.ssd_ops[k] / t0
        for b in ph.bounds:
            cols = [nx + j] + [k for k in range(nx) if b.per_share[k] != 0.0]
            vals = [1.0] + [-b.per_share[k] / t0 for k in cols[1:]]
            if b.name.startswith("ssd_"):
                for k in cols[1:]:
                    cost[k] += SSD_PENALTY * ph.count * b.per_share[k] / t0
            index += cols
            value += vals
            starts.append(len(index))
            lower.append(b.seconds / t0)
            upper.append(highspy.kHighsInf)
    index += list(range(nx))
    value += [mem.per_share[k] / budget for k in KINDS]
    starts.append(len(index))
    lower.append(-highspy.kHighsInf)
    upper.append((budget - mem.fixed_bytes) / budget)
    g = KINDS.index("grad")
    if mem.grad_room:
        index += [KINDS.index("param"), g]
        value += [mem.grad_room, -1.0]
        starts.append(len(index))
        lower.append(-highspy.kHighsInf)
        upper.append(0.0)

    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = nx + nt, len(lower)
    lp.col_cost_ = cost
    fixed = None if placement is None else list(mem.shares(placement.param, placement.ckpt, placement.opt,
                                                            placement.grad).values())
    lo, hi = fixed or [0.0] * nx, fixed or [1.0] * nx
    if fixed is None and ckpt_in_cpu:
        lo[KINDS.index("ckpt")] = 1.0
    if fixed is None and not mem.grad_room:
        lo[g] = 1.0
    lp.col_lower_ = np.array(lo + [0.0] * nt)
    lp.col_upper_ = np.array(hi + [highspy.kHighsInf] * nt)
    lp.row_lower_, lp.row_upper_ = np.array(lower), np.array(upper)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(value)
    return lp


@contextlib.contextmanager
def _c_stdout_to_devnull() -> Iterator[None]:
    """Send file descriptor 1 to /dev/null meanwhile. The first `highspy.Highs()` of a process
    prints HiGHS' banner there, before output_flag can be turned off, and it would land in
    front of `snake plan --json`'s output."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout at all: nothing to keep clean
        saved = -1
    if saved < 0:
        yield
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 1)
        finally:
            os.close(devnull)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _run(lp: highspy.HighsLp) -> list[float] | None:
    with _c_stdout_to_devnull():
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.passModel(lp)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    return list(h.getSolution().col_value[: len(KINDS)])


def resident_ssd_seconds(profile: MachineProfile) -> float:
    """Seconds per iteration of the resident optimizer state on SSD: its master, m and v read
    and written back once, at the iteration's end, on the compute actor's time."""
    b = profile.shape.resident_params * OPT_BYTES_PER_ELEM
    return b / profile.ssd_read_bytes_per_s + b / profile.ssd_write_bytes_per_s


def make_plan(
    profile: MachineProfile, phases, mem: LinearMemory, budget: float,
    x: tuple[float, ...], *, n_micro: int, alpha: float, schedule: str, resident_on_ssd: bool = False,
) -> Plan:
    """Evaluate the time model at x and name the tight rows."""
    shape = profile.shape
    layer = layer_seconds(phases, x)
    iteration = shape.n_layers * layer + n_micro * profile.pre_post_seconds
    if resident_on_ssd:
        iteration += resident_ssd_seconds(profile)
    binding = []
    host = mem.at(*x)
    if host >= budget * (1 - 1e-5):
        binding.append("cpu_memory")
    for ph in phases:
        t = ph.seconds_at(x)
        binding += [b.name for b in ph.bounds if b.at(x) >= t * (1 - TIGHT) and t > 0]
    return Plan(
        schedule=schedule, n_micro=n_micro, alpha=alpha,
        placement=Placement(param=x[0], ckpt=x[1], opt=x[2], grad=x[3]),
        predicted_iteration_seconds=iteration,
        predicted_tokens_per_s=n_micro * shape.tokens_per_micro / iteration,
        binding=tuple(binding),
        layer_seconds={ph.name: ph.seconds_at(x) for ph in phases},
        host_memory_bytes=host,
        ssd_bytes_per_iteration=shape.n_layers * ssd_bytes(phases, x)
        + (2 * shape.resident_params * OPT_BYTES_PER_ELEM if resident_on_ssd else 0),
        resident_optimizer="ssd" if resident_on_ssd else "cpu",
    )


def solve(
    profile: MachineProfile,
    *,
    n_micro: int,
    alpha: float,
    schedule: str = "vertical",
    workers: int = 2,
    placement: Placement | None = None,
    resident: str | None = "cpu",
) -> Plan | Infeasible:
    """Best placement for n_micro micro-batches and delayed-step share alpha.

    workers: CPU optimizer workers (they size the runtime's staging pools). placement: fix
    the shares instead of choosing them (the LP then only predicts and checks memory).
    resident: where the resident optimizer state lives ("cpu", "ssd"); None: both are
    solved and the faster plan kept (in CPU memory where they tie). On SSD it frees CPU
    memory for the layers' shares and costs its reads and writes at each iteration's end."""
    _check(alpha, n_micro, schedule)
    if resident not in ("cpu", "ssd", None):
        raise ValueError(f"resident={resident!r} must be 'cpu', 'ssd' or None")
    if resident is not None:  # a short plan with the state in memory suggests SSD
        return _solve(profile, n_micro=n_micro, alpha=alpha, schedule=schedule, workers=workers,
                      placement=placement, resident_on_ssd=resident == "ssd", hint=resident == "cpu")
    cpu, ssd = (_solve(profile, n_micro=n_micro, alpha=alpha, schedule=schedule, workers=workers,
                       placement=placement, resident_on_ssd=on, hint=False) for on in (False, True))
    if isinstance(cpu, Infeasible):
        return ssd if isinstance(ssd, Plan) or ssd.short_by < cpu.short_by else cpu
    if isinstance(ssd, Plan) and ssd.predicted_iteration_seconds < cpu.predicted_iteration_seconds * (1 - 1e-9):
        return ssd
    return cpu


def _solve(
    profile: MachineProfile, *, n_micro: int, alpha: float, schedule: str, workers: int,
    placement: Placement | None, resident_on_ssd: bool, hint: bool,
) -> Plan | Infeasible:
    """`_solve_at`, and where a streamed model's mapped frozen weights (which the memory
    model leaves to the page cache) do not fit in the budget the plan leaves: the faster of
    the plan that leaves them room (the budget less their bytes) and the plan that reads
    them from the SSD at every load."""
    kw: dict[str, Any] = dict(n_micro=n_micro, alpha=alpha, schedule=schedule, workers=workers, placement=placement,
                              resident_on_ssd=resident_on_ssd, hint=hint)
    plan = _solve_at(profile, **kw)
    mapped = mapped_frozen_bytes(profile.shape)
    if not mapped or isinstance(plan, Infeasible) or mapped <= host_budget(profile, n_micro)[0] - plan.host_memory_bytes:
        return plan
    roomy = _solve_at(dataclasses.replace(profile, cpu_memory_bytes=profile.cpu_memory_bytes - mapped), **kw)
    disk = _solve_at(profile, frozen_from_disk=True, **kw)
    options = [p for p in (roomy, disk) if isinstance(p, Plan)]
    if not options:
        return plan
    return min(options, key=lambda p: round(p.predicted_iteration_seconds, 9))


def _solve_at(
    profile: MachineProfile, *, n_micro: int, alpha: float, schedule: str, workers: int,
    placement: Placement | None, resident_on_ssd: bool, hint: bool, frozen_from_disk: bool = False,
) -> Plan | Infeasible:
    staging = profile.device == "cuda"  # horizontal's pinned gradient staging buffer
    in_memory = profile.offload_in_memory
    mem = host_memory(profile.shape, n_micro=n_micro, alpha=alpha, schedule=schedule, workers=workers,
                      grad_staging=staging, resident_on_ssd=resident_on_ssd, offload_in_memory=in_memory)
    # Checkpoints are whole units (snake.stores.cpu_units): with all of them in CPU memory
    # there are no checkpoint staging pools, which the general (linear) model cannot drop at
    # share 1, so that case is solved with its own exact model and the better plan is kept.
    mem_ckpt = host_memory(profile.shape, n_micro=n_micro, alpha=alpha, schedule=schedule, workers=workers,
                           ckpt_in_cpu=True, grad_staging=staging, resident_on_ssd=resident_on_ssd,
                           offload_in_memory=in_memory)
    budget, _ = host_budget(profile, n_micro)
    phases = phases_for(profile, n_micro, alpha, schedule, frozen_from_disk)

    def solved(m: LinearMemory, fixed: Placement | None, ckpt_in_cpu: bool) -> Plan | None:
        sol = _run(_lp(phases, m, budget, fixed, ckpt_in_cpu=ckpt_in_cpu))
        if sol is None:
            return None
        x = tuple(min(1.0, max(0.0, v)) for v in sol)
        plan = make_plan(profile, phases, m, budget, x, n_micro=n_micro, alpha=alpha, schedule=schedule,
                         resident_on_ssd=resident_on_ssd)
        return dataclasses.replace(plan, frozen_from_disk=frozen_from_disk)

    def needed(plan: Plan | None) -> Plan:
        if plan is None:  # the memory check before it is exact: this would be a numerical failure
            raise RuntimeError(f"HiGHS found no optimum for n={n_micro} alpha={alpha} ({schedule})")
        return plan

    if placement is not None:
        m = mem_ckpt if placement.ckpt >= 1.0 else mem
        short = memory_check(profile, m, n_micro, placement, hint)
        return short if short is not None else needed(solved(m, placement, False))
    short = memory_check(profile, mem, n_micro, None, hint)
    if short is not None and short.resource != "cpu_memory":
        return short
    plans = [needed(solved(mem, None, False))] if short is None else []
    smallest = mem_ckpt.smallest({"ckpt": 1.0})
    if smallest <= budget:  # every checkpoint in CPU memory fits: its exact model's plan too
        plans.append(needed(solved(mem_ckpt, None, True)))
    if not plans:
        assert short is not None
        return short
    # the faster plan; between equal ones, checkpoints in CPU memory (fewer SSD operations)
    return min(plans, key=lambda p: (round(p.predicted_iteration_seconds, 9), -p.placement.ckpt))


def predict(
    profile: MachineProfile, n_micro: int, placement: Placement, alpha: float, schedule: str,
    resident: str = "cpu",
) -> float:
    """Predicted iteration seconds of a fixed configuration (no memory check); resident:
    where the resident optimizer state lives ("cpu", "ssd")."""
    _check(alpha, n_micro, schedule)
    x = shares(placement, profile.shape, alpha, schedule)
    layer = layer_seconds(phases_for(profile, n_micro, alpha, schedule), x)
    extra = resident_ssd_seconds(profile) if resident == "ssd" else 0.0
    return profile.shape.n_layers * layer + n_micro * profile.pre_post_seconds + extra


def predict_horizontal(
    profile: MachineProfile, n_micro: int, placement: Placement, alpha: float = 0.0, resident: str = "cpu"
) -> float:
    """Iteration seconds of the horizontal (ZeRO-Infinity) schedule at a fixed placement:
    params loaded 2n times per layer, fp32 gradients to CPU every micro-batch, optimizer
    overlapped only with the last micro-batch's backward (alpha: with the first forward)."""
    return predict(profile, n_micro, placement, alpha, "horizontal", resident)
