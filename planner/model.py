"""The per-layer time model shared by the LP (`solve`) and the fixed-placement predictions.

A schedule is a list of phases per layer and iteration (vertical: one forward stage and one
backward stage covering all n micro-batches; horizontal: per-micro-batch stages). A phase
lasts as long as its slowest resource (compute, CPU Adam, host->device, device->host, SSD),
all assumed to overlap (GreedySnake 4.5), except on a CPU device, where the first four
share the cores and add up, together with the CPU the runtime's threads spend per SSD
operation (HOST_SECONDS_PER_SSD_OP). Each resource gives a lower bound on the phase time
that is linear in the CPU shares x = (param, ckpt, opt, grad):

    t_phase >= seconds + sum_k per_share[k] * x_k

SSD bounds have negative per_share: every byte moved to CPU memory is a byte less of SSD
traffic. Reads and writes share one channel (seconds = read_bytes / read_bw + write_bytes /
write_bw), which is also what the runtime's token-bucket cap does (one bucket, both ways).
"""

from __future__ import annotations

from dataclasses import dataclass

from snake.memory import OPT_BYTES_PER_ELEM, grad_share_in_effect

KINDS = ("param", "ckpt", "opt", "grad")  # grad: the delayed gradients (vertical, alpha > 0)
GRAD_BYTES_PER_ELEM = 4  # fp32 gradients
# What one SSD read or write costs the kernels on a CPU device: snake's threads (event
# loop, I/O, copies) spend ~660 us of CPU on it, which on this 2-core machine is ~330 us of
# both cores; the iteration grew 339 us per operation (benchmarks/contention.py --op-cost,
# BENCHMARKS.md section 7).
HOST_SECONDS_PER_SSD_OP = 3.3e-4
# What one checkpoint read or write costs the SSD channel on a CPU device beyond its bytes:
# at the I/O-bound point (300 MB/s, M = 8) checkpoints on SSD (64 KiB units) made the
# iteration 1.9 ms longer per operation (1.75-2.57 ms in 5 of 5 pairs), where their bytes
# take 0.22 ms: the channel idles between them (same benchmark, --op-cost-m 8). Charged to
# checkpoint operations only: the large units' predictions fit their bytes (BENCHMARKS.md
# section 7). Not measured on a GPU.
SSD_SECONDS_PER_OP_CPU_DEVICE = 1.9e-3


@dataclass(frozen=True, slots=True)
class Bound:
    """t_phase >= seconds + sum(per_share[k] * x_k), k over KINDS. Named `<resource>_<phase>`."""

    name: str
    seconds: float
    per_share: tuple[float, ...] = (0.0,) * len(KINDS)

    def at(self, x: tuple[float, ...]) -> float:
        return self.seconds + sum(a * xi for a, xi in zip(self.per_share, x, strict=True))


@dataclass(frozen=True, slots=True)
class Traffic:
    """Bytes one phase moves for one layer. ssd_read / ssd_write: bytes of each kind that
    would move if that kind lived entirely on SSD (scaled by 1 - x_k). ssd_ops: how many
    SSD reads and writes of each kind that takes (a unit is one operation each way: a
    layer's checkpoints are n small ones, its optimizer states one large one, two with a
    delayed share; the delayed gradients one unit per layer; checked against a traced run in
    tests/test_planned.py)."""

    compute_seconds: float
    adam_elems: float
    h2d_bytes: float
    d2h_bytes: float
    ssd_read: tuple[float, ...]
    ssd_write: tuple[float, ...]
    ssd_ops: tuple[float, ...]
    # bytes read from the SSD whatever the shares: a streamed model's mapped frozen weights
    # where the page cache cannot hold them (`frozen_from_disk`)
    ssd_fixed_read: float = 0.0


@dataclass(frozen=True, slots=True)
class Phase:
    """A stage of one layer that occurs `count` times per iteration."""

    name: str
    count: int
    traffic: Traffic
    bounds: tuple[Bound, ...]

    def ssd_bytes_at(self, x: tuple[float, ...]) -> float:
        t = self.traffic
        return t.ssd_fixed_read + sum(
            (rb + wb) * (1 - xi) for rb, wb, xi in zip(t.ssd_read, t.ssd_write, x, strict=True)
        )

    def seconds_at(self, x: tuple[float, ...]) -> float:
        return max(b.at(x) for b in self.bounds)


def ssd_seconds_per_kind(profile, t: Traffic) -> tuple[float, ...]:
    """Seconds of SSD traffic per kind when that kind lives entirely on SSD."""
    r, w = profile.ssd_read_bytes_per_s, profile.ssd_write_bytes_per_s
    return tuple(rb / r + wb / w for rb, wb in zip(t.ssd_read, t.ssd_write, strict=True))


def phase(profile, name: str, count: int, t: Traffic) -> Phase:
    """The resource bounds of one phase: compute, CPU Adam, host->device, device->host, SSD;
    on a CPU device also `host`, their sum: there the kernels, AdamW and the copies run on
    the same cores (each was measured with all of them), so they add up instead of
    overlapping, and each SSD operation adds HOST_SECONDS_PER_SSD_OP (fewer with every share
    kept in CPU memory) there, and each checkpoint operation SSD_SECONDS_PER_OP_CPU_DEVICE to
    the SSD bound."""
    ssd = list(ssd_seconds_per_kind(profile, t))
    if profile.device == "cpu":  # measured for checkpoint units; large units cost their bytes
        ssd[1] += SSD_SECONDS_PER_OP_CPU_DEVICE * t.ssd_ops[1]
    cpu_work = (
        t.compute_seconds,
        t.adam_elems / profile.adam_elems_per_s,
        t.h2d_bytes / profile.h2d_bytes_per_s,
        t.d2h_bytes / profile.d2h_bytes_per_s,
    )
    ops = tuple(HOST_SECONDS_PER_SSD_OP * o for o in t.ssd_ops)
    shared = ((Bound(f"host_{name}", sum(cpu_work) + sum(ops), tuple(-o for o in ops)),)
              if profile.device == "cpu" else ())
    link = profile.device_link_bytes_per_s or float("inf")  # a capped link: its time, not CPU work
    return Phase(
        name=name,
        count=count,
        traffic=t,
        bounds=(
            Bound(f"compute_{name}", cpu_work[0]),
            Bound(f"adam_{name}", cpu_work[1]),
            Bound(f"h2d_{name}", t.h2d_bytes / min(profile.h2d_bytes_per_s, link)),
            Bound(f"d2h_{name}", t.d2h_bytes / min(profile.d2h_bytes_per_s, link)),
            Bound(f"ssd_{name}", sum(ssd) + t.ssd_fixed_read / profile.ssd_read_bytes_per_s, tuple(-v for v in ssd)),
            *shared,
        ),
    )


def _units(shape) -> tuple[float, float, float, float, float]:
    """Per layer: trained elements, their bytes, a checkpoint's bytes, the optimizer state's
    bytes, and the bytes of a parameter load to the device (the streamed frozen parameters
    too, from CPU memory)."""
    p = shape.layer_params
    pb = p * shape.dtype_bytes
    return p, pb, shape.ckpt_elems * shape.ckpt_bytes, p * OPT_BYTES_PER_ELEM, pb + shape.layer_frozen_params * shape.dtype_bytes


def mapped_frozen_bytes(shape) -> float:
    """Bytes of a streamed model's frozen layer weights that the runtime maps from a file
    of its own (`ModelShape.layer_frozen_in_files`), which the page cache holds if it can."""
    return shape.n_layers * shape.layer_frozen_params * shape.dtype_bytes if shape.layer_frozen_in_files else 0.0


def vertical_phases(profile, n: int, alpha: float, frozen_from_disk: bool = False) -> tuple[Phase, ...]:
    """Layer-major (GreedySnake): one forward and one backward stage per layer.

    Forward: params in; n-1 checkpoints in (the snake order carries one on the device; none
    into layer 0, whose inputs are the embedding's) and n out; the SSD share of the output checkpoints written (the next stage gets its inputs
    from the CPU copies of those writes, never read back from SSD); the
    delayed alpha share of the optimizer step (opt read + written, param tail written, its
    gradient's SSD share read). Backward: params, n checkpoints and n-1 inter-layer gradients
    in; n-1 gradients and the fp32 layer gradient (once) out; the (1 - alpha) share of the
    optimizer step; the SSD share of the delayed alpha gradient written. frozen_from_disk: the
    layer's mapped frozen weights are read from the SSD at each of its loads (the page cache
    cannot hold them: a cyclic pass over more than it holds keeps next to nothing of it)."""
    p, pb, cb, ob, lb = _units(profile.shape)
    fz = (lb - pb) if frozen_from_disk else 0.0
    a = alpha
    # SSD operations: with a delayed share (0 < alpha < 1) params and optimizer states are
    # two units per layer (the step's now and delayed parts), each loaded and written on its
    # own; alpha = 1 leaves only the delayed one
    split = 1 + (0 < a < 1)
    # the delayed gradient: written after the backward, read for its step; but layer 0's
    # stays in its staging buffer (its delayed step comes next, snake.plans.grad_stays):
    # its bytes, and its operations where it trains (the layers below the lowest trained
    # one have no gradient)
    shape = profile.shape
    first = shape.layer_params if shape.first_layer_params is None else shape.first_layer_params
    gb = a * GRAD_BYTES_PER_ELEM * max(shape.n_layers * p - first, 0.0) / shape.n_layers
    moved = (round(shape.bwd_share * shape.n_layers) - (first > 0)) / shape.n_layers
    # the share of the layers with a backward (`ModelShape.bwd_share`): the layers below run
    # none, so load neither their frozen weights nor their checkpoints for it, and their
    # checkpoints go on to the next forward stage unwritten (the trained elements' means, p,
    # count theirs as none already; the profile's recompute and backward seconds are per
    # layer over all of them)
    f = profile.shape.bwd_share
    fwd = Traffic(
        compute_seconds=n * profile.fwd_seconds,
        adam_elems=a * p,
        # layer 0's forward loads no checkpoint (its inputs are the embedding's, on the device)
        h2d_bytes=lb + (n - 1) * cb * (shape.n_layers - 1) / shape.n_layers,
        d2h_bytes=(n - (1 - f)) * cb,  # below, the one carried on the device is not stored
        ssd_read=(pb, 0.0, a * ob, gb),
        ssd_write=(a * pb, f * n * cb, a * ob, 0.0),
        ssd_ops=(split + (a > 0), f * n, 2 * (a > 0), (a > 0) * moved),
        ssd_fixed_read=fz,
    )
    bwd = Traffic(
        compute_seconds=n * (profile.recompute_seconds + profile.bwd_seconds),
        adam_elems=(1 - a) * p,
        h2d_bytes=pb + f * (lb - pb + n * cb + (n - 1) * cb),
        d2h_bytes=f * (n - 1) * cb + GRAD_BYTES_PER_ELEM * p,
        ssd_read=(pb, f * n * cb, (1 - a) * ob, 0.0),
        ssd_write=((1 - a) * pb, 0.0, (1 - a) * ob, gb),
        ssd_ops=(split + (a < 1), f * n, 2 * (a < 1), (a > 0) * moved),
        ssd_fixed_read=f * fz,
    )
    return phase(profile, "fwd", 1, fwd), phase(profile, "bwd", 1, bwd)


def horizontal_phases(profile, n: int, alpha: float, frozen_from_disk: bool = False) -> tuple[Phase, ...]:
    """Micro-batch-major (ZeRO-Infinity): per micro-batch and layer, params loaded for the
    forward and again for the backward; the output checkpoint stays on the device for the
    next layer and is offloaded once; fp32 gradients go to CPU memory every micro-batch (4P
    bytes) and are accumulated there. The optimizer step of a layer overlaps only the last
    micro-batch's backward; its delayed alpha share the first micro-batch's forward.
    frozen_from_disk: as `vertical_phases`, at every load."""
    p, pb, cb, ob, lb = _units(profile.shape)
    fz = (lb - pb) if frozen_from_disk else 0.0
    a = alpha
    f, rb = profile.fwd_seconds, profile.recompute_seconds + profile.bwd_seconds
    grads = GRAD_BYTES_PER_ELEM * p

    split = 1 + (0 < a < 1)  # units per layer of params and optimizer states (vertical_phases)
    share = profile.shape.bwd_share  # the layers with a backward (vertical_phases)

    def fwd(first: bool) -> Traffic:  # the delayed gradients wait in the accumulators: no grad traffic
        s = a if first else 0.0
        ops = (split + (s > 0), share, 2 * (s > 0), 0)
        # below the lowest layer with a backward the output stays on the device, unstored
        return Traffic(f, s * p, lb, share * cb, (pb, 0.0, s * ob, 0.0), (s * pb, share * cb, s * ob, 0.0), ops, fz)

    def bwd(last: bool) -> Traffic:
        s = 1 - a if last else 0.0
        ops = (split + (s > 0), share, 2 * (s > 0), 0)
        return Traffic(rb, s * p, pb + share * (lb - pb + cb), grads, (pb, share * cb, s * ob, 0.0),
                       (s * pb, 0.0, s * ob, 0.0), ops, share * fz)

    phases = (
        phase(profile, "fwd_first", 1, fwd(True)),
        phase(profile, "fwd", n - 1, fwd(False)),
        phase(profile, "bwd", n - 1, bwd(False)),
        phase(profile, "bwd_last", 1, bwd(True)),
    )
    return tuple(ph for ph in phases if ph.count > 0)


def phases_for(profile, n: int, alpha: float, schedule: str, frozen_from_disk: bool = False) -> tuple[Phase, ...]:
    if schedule == "vertical":
        return vertical_phases(profile, n, alpha, frozen_from_disk)
    if schedule == "horizontal":
        return horizontal_phases(profile, n, alpha, frozen_from_disk)
    raise ValueError(f"schedule={schedule!r} must be 'vertical' or 'horizontal'")


def shares(placement, shape, alpha: float, schedule: str) -> tuple[float, float, float, float]:
    """A placement's shares x in KINDS order, the grad share as the runtime keeps it: at
    least what the CPU-resident delayed parameters' memory holds (`LinearMemory.shares`)."""
    if not (schedule == "vertical" and alpha > 0):  # no gradient waits outside an accumulator
        return (placement.param, placement.ckpt, placement.opt, 1.0)
    grad = grad_share_in_effect(placement.grad, placement.param, shape.dtype_bytes / 4)
    return (placement.param, placement.ckpt, placement.opt, grad)


def layer_seconds(phases: tuple[Phase, ...], x: tuple[float, ...]) -> float:
    """Seconds per layer and iteration at CPU shares x."""
    return sum(ph.count * ph.seconds_at(x) for ph in phases)


def ssd_bytes(phases: tuple[Phase, ...], x: tuple[float, ...]) -> float:
    """SSD bytes (read + written) per layer and iteration at CPU shares x."""
    return sum(ph.count * ph.ssd_bytes_at(x) for ph in phases)
