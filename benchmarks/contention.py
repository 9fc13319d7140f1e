"""What snake's own threads cost the compute kernels when the "device" is the CPU.

    python benchmarks/contention.py        # ~3 min on 2 cores
    python benchmarks/contention.py --op-cost 5 [--op-cost-m 8]   # part 3 only, ~1.5 min
    python benchmarks/contention.py --slope 1.62 --m 8 --budget-mib 330 --cap-mb 650 --name contention_b
        # part 2 only, at throughput.py's setting B crossing point (~2.5 min)
    python benchmarks/contention.py --slope 1.62 --ab inline --m 16 --micro-batch-size 2 --budget-mib 420 \
        --cap-mb 150 --link-mb 600 --name contention_link_inline
        # part 2 only, in the link setting of BENCHMARKS.md section 10, inline stores on / off
    python benchmarks/contention.py --io-cost 150 --m 8 --micro-batch-size 2 --rounds 8
        # part 4 only, ~3 min: what SSD traffic at 150 MB/s costs the kernels (link setting, M = 8)
    python benchmarks/contention.py --io-cost 150 --io-pieces-mib 0,4 --m 8 --micro-batch-size 2 --rounds 6
        # the same with the capped storage's tokens taken whole and in 4 MiB pieces (~5 min)

On a CPU device the compute kernels' OpenMP team (the compute thread and its workers) is
the device, and snake's other threads (the event loop, copies, SSD I/O, the CPU optimizer)
run on the same cores. Part 1 measures what a given amount of other CPU work costs the
plain PyTorch + checkpointing loop: a side thread takes a set share of one core (either
holding the GIL or not) while the loop trains; slowdown per share of a core. Part 2 reads
each of snake's thread groups' CPU time (`trainer.trace.threads()`: the scheduler's per-thread
statistics; "native" is the compute thread's OpenMP workers) while the runtime trains at the compute-bound point of throughput.py (8 x 512,
M = 16, the planned placement under the same 345 MiB budget and 300 MB/s SSD cap) and with
everything in CPU memory, next to the PyTorch + checkpointing loop in alternating pairs, and
compares the measured ratio with the one part 1's slope predicts from the helpers' share.
Part 3 (--op-cost) measures what one SSD operation costs (the planner's per-operation
constants, planner/model.py). Part 4 (--io-cost) measures what SSD traffic alone costs the
kernels: the PyTorch + checkpointing loop while a side thread reads, writes, or does both
through snake's own storage backend (O_DIRECT, aligned buffers, the token-bucket cap) at a set
rate, against the loop alone, in alternating rounds. Where the SSD and the compute roofs meet,
the SSD is busy the whole iteration, so 1 / this slowdown bounds what the runtime can reach of
the compute roofline there. Writes benchmarks/results/contention.json (part 3:
contention_op_cost[_mM].json; part 4: contention_io_cost.json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

from common import (  # type: ignore[import-not-found]
    SCRATCH,
    gpt_config,
    machine,
    make_batches,
    make_model,
    on_worker,
    planner_budget,
    save,
    torch_loop,
)

from planner import Infeasible, measure_profile, search
from planner.integrate import with_budgets
from snake import Placement, SnakeConfig, SnakeTrainer
from snake.actors import compute
from snake.buffers import alloc_host
from snake.engine import Engine
from snake.io import open_storage
from snake.io.base import Throttled, TokenBucket

# what --ab turns off for the "before" variants of part 2: (variant suffix, how, how to undo)
AB = {
    "inline": ("_d2h_copies", lambda: setattr(Engine, "inline_stores", False),
               lambda: setattr(Engine, "inline_stores", True)),
    "group": ("_one_per_job", lambda: setattr(compute, "CPU_GROUP", 1),
              lambda: setattr(compute, "CPU_GROUP", GROUP)),
    "optimizer": ("_optimizer_threads", lambda: setattr(Engine, "optimizer_on_compute", False),
                  lambda: setattr(Engine, "optimizer_on_compute", True)),
    "grads": ("_grad_copies", lambda: setattr(Engine, "grads_in_slots", False),
              lambda: setattr(Engine, "grads_in_slots", True)),
    "views": ("_views_each_use", lambda: setattr(Engine, "keep_unit_views", False),
              lambda: setattr(Engine, "keep_unit_views", True)),
    "chunk": ("_whole_transfers", lambda: setattr(Throttled, "CHUNK", 1 << 62),
              lambda: setattr(Throttled, "CHUNK", CHUNK)),
    "reads": ("_fifo", lambda: (setattr(Throttled, "CHUNK", 1 << 62), setattr(TokenBucket, "reads_first", False)),
              lambda: (setattr(Throttled, "CHUNK", CHUNK), setattr(TokenBucket, "reads_first", True))),
}
GROUP = compute.CPU_GROUP
CHUNK = Throttled.CHUNK

CAP = 300e6
BUDGET_MIB = 345  # throughput.py's budget
_CHUNK = b"x" * 16384


def burner(kind: str, share: float, stop: threading.Event, cpu: list[float]) -> None:
    """Busy for 250 us, then asleep, so that it takes `share` of one core; "gil": a Python
    loop (holds the GIL), "nogil": sha256 of 16 KiB chunks (releases it). Records its CPU."""
    busy = 250e-6
    c0 = time.thread_time()
    while not stop.is_set():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < busy:
            if kind == "nogil":
                hashlib.sha256(_CHUNK).digest()
        time.sleep(busy * (1 - share) / share)
    cpu.append(time.thread_time() - c0)


def torch_with_burner(cfg, kind: str, share: float, m: int, steps: int) -> dict:
    stop, cpu = threading.Event(), []
    side = threading.Thread(target=burner, args=(kind, share, stop, cpu)) if share > 0 else None
    if side:
        side.start()
    t0 = time.perf_counter()
    r = on_worker(lambda: torch_loop(cfg, micro_batches=m, micro_batch_size=1, seq=32, steps=steps,
                                     activation_checkpointing=True))
    wall = time.perf_counter() - t0
    stop.set()
    if side:
        side.join()
    return {"seconds": r["iteration_seconds"]["median"], "side_share_measured": cpu[0] / wall if cpu else 0.0}


def part1(rounds: int) -> dict:
    cfg = gpt_config(4, 512, 32)
    variants = [("none", 0.0), ("nogil", 0.1), ("gil", 0.1), ("nogil", 0.2), ("gil", 0.2)]
    rows: dict[str, list[dict]] = {f"{k}_{s}": [] for k, s in variants}
    for rnd in range(rounds):
        for kind, share in (variants if rnd % 2 == 0 else variants[::-1]):
            rows[f"{kind}_{share}"].append(torch_with_burner(cfg, kind, share, 8, 5))
        print("part 1 round", rnd, {k: round(v[-1]["seconds"], 3) for k, v in rows.items()}, flush=True)
    base = statistics.median(r["seconds"] for r in rows["none_0.0"])
    out = {}
    for key, rs in rows.items():
        sec = statistics.median(r["seconds"] for r in rs)
        share = statistics.median(r["side_share_measured"] for r in rs)
        out[key] = {"seconds": sec, "slowdown": sec / base, "side_share_measured": share,
                    "slowdown_per_share": (sec / base - 1) / share if share > 0 else None}
    slopes = [v["slowdown_per_share"] for v in out.values() if v["slowdown_per_share"] is not None]
    return {"model": "GPT 4 x 512, 8 micro-batches of 1 x 32 tokens, PyTorch + checkpointing",
            "rows": rows, "summary": out, "slope_median": statistics.median(slopes)}


def cpu_delta(a: dict | None, b: dict | None, wall: float) -> dict[str, dict[str, float]]:
    """Per thread group, cores used and run-queue wait over the timed run: the difference of
    two `trainer.trace.threads()` records (cumulative over run() calls) over its wall time."""
    a, b = a or {}, b or {}
    return {g: {"cores": (v["cpu_s"] - a.get(g, {}).get("cpu_s", 0.0)) / wall,
                "runqueue_wait": (v["runqueue_wait_s"] - a.get(g, {}).get("runqueue_wait_s", 0.0)) / wall}
            for g, v in b.items()}


_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def proc_stat() -> list[int]:
    """The machine's CPU time so far, per /proc/stat field (clock ticks, all cores)."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:1 + len(_STAT_FIELDS)]]


def stat_delta(a: list[int], b: list[int], wall: float) -> dict[str, float]:
    """Cores spent per /proc/stat field between two readings: where the machine's time went
    that no thread of ours is charged with (softirq: I/O completions; steal: the hypervisor)."""
    import os

    hz = os.sysconf("SC_CLK_TCK")
    return {f: (y - x) / hz / wall for f, x, y in zip(_STAT_FIELDS, a, b, strict=True)}


async def snake_measured(cfg, m: int, placement: Placement, alpha: float, cap: float | None,
                         budget: int | None, steps: int, off: str | None = None, *, mbs: int = 1,
                         link: float | None = None) -> dict:
    if off is not None:
        AB[off][1]()
    model, data = on_worker(lambda: (make_model(cfg), make_batches(cfg, m * mbs, 32, steps + 1)))
    with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
        conf = SnakeConfig(micro_batches=m, offload_dir=d, placement=placement, alpha=alpha, schedule="vertical",
                           device="cpu", ssd_bandwidth_bytes_per_s=cap, cpu_memory_bytes=budget,
                           device_link_bytes_per_s=link)
        async with SnakeTrainer(model, data=data, config=conf) as t:
            await t.run(1)  # warm-up
            a, w0, s0, st0 = t.trace.threads(), time.perf_counter(), t.trace.now(), proc_stat()
            rep = await t.run(steps)
            wall = time.perf_counter() - w0
            b, st1 = t.trace.threads(), proc_stat()
            kernels = sum(s.end_s - s.start_s for s in t.trace.spans if s.actor == "compute" and s.start_s >= s0)
            gaps = compute_thread_gaps(t, s0)
            ops = sum(1 for s in t.trace.spans if s.start_s >= s0)
            ssd_ops = sum(1 for s in t.trace.spans if s.start_s >= s0 and s.actor in ("ssd_read", "ssd_write"))
    if off is not None:
        AB[off][2]()
    return {"seconds": statistics.median(s.seconds for s in rep.steps), "threads": cpu_delta(a, b, wall),
            "traced_operations_per_iteration": ops / steps, "ssd_operations_per_iteration": ssd_ops / steps,
            "cpu_s_per_iteration": {g: v["cores"] * wall / steps for g, v in cpu_delta(a, b, wall).items()},
            "machine_cores": stat_delta(st0, st1, wall),
            "compute_busy_s_per_iteration": kernels / steps,
            "compute_thread_idle_s_per_iteration": sum(gaps) / steps,
            "compute_thread_gaps_over_2ms_per_iteration": sum(g > 2e-3 for g in gaps) / steps}


def compute_thread_gaps(t: SnakeTrainer, s0: float) -> list[float]:
    """Idle stretches of the compute thread after trace time s0: between consecutive spans
    of the work it runs (compute jobs, and AdamW where it runs there)."""
    e = t.engine
    assert e is not None
    on_compute = e.optimizer_runs_on_compute()
    spans = sorted((s.start_s, s.end_s) for s in t.trace.spans if s.start_s >= s0 and (
        s.actor == "compute" or (on_compute and s.actor.startswith("optimizer"))))
    gaps, end = [], None
    for a, b in spans:
        if end is not None and a > end:
            gaps.append(a - end)
        end = b if end is None else max(end, b)
    return gaps


def part2(pairs: int, slope: float, ab: str | None, m: int = 16, budget_mib: float = BUDGET_MIB,
          cap: float = CAP, mbs: int = 1, link: float | None = None) -> dict:
    """`mbs` sequences per micro-batch; `link`: an emulated host<->device link (bytes/s per
    direction, both snake settings; throughput.py --link-mb)."""
    cfg = gpt_config(8, 512, 32)
    budget = int(budget_mib * 2**20)
    SCRATCH.mkdir(parents=True, exist_ok=True)
    prof = on_worker(measure_profile, cfg, micro_batch_size=mbs, seq_len=32, device="cpu", offload_dir=SCRATCH,
                     ssd_bandwidth_bytes_per_s=cap, cache=False, io_bytes=192 << 20)
    budget = planner_budget(budget, prof)  # as stated (budget_mib) plus what the model counts since
    plan = search(with_budgets(prof, SnakeConfig(offload_dir=SCRATCH, cpu_memory_bytes=budget,
                                                 device_link_bytes_per_s=link)),
                  schedule="vertical", n_micro=m)
    if isinstance(plan, Infeasible):
        raise SystemExit(plan.message)
    settings = {
        "capped_planned": (plan.placement, plan.alpha, cap, budget, None),
        "all_cpu": (Placement.all_cpu(), 0.0, None, None, None),
    }
    if ab is not None:  # the same with one of the runtime's CPU-device shortcuts off
        settings |= {k + AB[ab][0]: (*v[:4], ab) for k, v in settings.items()}
    rows: dict[str, list[dict]] = {k: [] for k in (*settings, "torch_ckpt")}
    for rnd in range(pairs):
        order = list(rows) if rnd % 2 == 0 else list(rows)[::-1]
        for key in order:
            if key == "torch_ckpt":
                st0, w0 = proc_stat(), time.perf_counter()
                r = on_worker(lambda: torch_loop(cfg, micro_batches=m, micro_batch_size=mbs, seq=32, steps=4,
                                                 activation_checkpointing=True))
                rows[key].append({"seconds": r["iteration_seconds"]["median"],
                                  "fwd_bwd_seconds": r["fwd_bwd_seconds"]["median"],
                                  "machine_cores": stat_delta(st0, proc_stat(), time.perf_counter() - w0)})
            else:
                placement, alpha, cap, bud, off = settings[key]
                rows[key].append(asyncio.run(snake_measured(cfg, m, placement, alpha, cap, bud, 3, off,
                                                            mbs=mbs, link=link)))
        print("part 2 round", rnd, {k: round(v[-1]["seconds"], 3) for k, v in rows.items()}, flush=True)
    out: dict = {"model": f"GPT 8 x 512, {m} micro-batches of {mbs} x 32 tokens", "budget_mib": budget_mib,
                 "cap_bytes_per_s": cap, "device_link_bytes_per_s": link, "plan": {
        "placement": {k: getattr(plan.placement, k) for k in ("param", "ckpt", "opt")}, "alpha": plan.alpha},
        "rows": rows, "summary": {}}
    for key in settings:
        ratios = [t["seconds"] / s["seconds"] for s, t in zip(rows[key], rows["torch_ckpt"], strict=True)]
        groups = sorted({g for r in rows[key] for g in r["threads"]})
        threads = {g: {f: statistics.median(r["threads"].get(g, {}).get(f, 0.0) for r in rows[key])
                       for f in ("cores", "runqueue_wait")} for g in groups}
        helpers = sum(v["cores"] for g, v in threads.items() if g not in ("snake-compute", "native"))
        kernels = [t["fwd_bwd_seconds"] / s["compute_busy_s_per_iteration"]
                   for s, t in zip(rows[key], rows["torch_ckpt"], strict=True)]
        out["summary"][key] = {
            "torch_over_snake_per_pair": ratios, "torch_over_snake_median": statistics.median(ratios),
            "torch_fwd_bwd_over_snake_compute_busy": statistics.median(kernels),
            "traced_operations_per_iteration": statistics.median(r["traced_operations_per_iteration"] for r in rows[key]),
            "compute_thread_idle_s_per_iteration": statistics.median(
                r["compute_thread_idle_s_per_iteration"] for r in rows[key]),
            "compute_thread_gaps_over_2ms_per_iteration": statistics.median(
                r["compute_thread_gaps_over_2ms_per_iteration"] for r in rows[key]),
            "snake_compute_busy_fraction": statistics.median(
                r["compute_busy_s_per_iteration"] / r["seconds"] for r in rows[key]),
            "threads": threads, "helper_cores": helpers,
            "machine_cores": _median_fields([r["machine_cores"] for r in rows[key]]),
            "predicted_torch_over_snake": 1 / (1 + slope * helpers),
        }
    out["summary"]["torch_ckpt"] = {"machine_cores": _median_fields([r["machine_cores"] for r in rows["torch_ckpt"]])}
    return out


def op_cost(pairs: int, m: int) -> dict:
    """Part 3: what one SSD operation costs on a CPU device. The capped setting at M
    micro-batches (16: the compute-bound point; 8: I/O-bound) with the same placement except
    the checkpoints: all in CPU memory, or all on SSD (2 x M x 8 more SSD operations per
    iteration, 64 KiB each), in alternating pairs. Per extra SSD operation: the CPU seconds
    of snake's threads other than compute, and the iteration and compute-thread seconds it
    added (these two include the kernels' slowdown, or the SSD's time)."""
    cfg = gpt_config(8, 512, 32)
    SCRATCH.mkdir(parents=True, exist_ok=True)
    settings = {"ckpt_cpu": Placement(param=1.0, ckpt=1.0, opt=0.3),
                "ckpt_ssd": Placement(param=1.0, ckpt=0.0, opt=0.3)}
    rows: dict[str, list[dict]] = {k: [] for k in settings}
    for rnd in range(pairs):
        for key in (list(settings) if rnd % 2 == 0 else list(settings)[::-1]):
            rows[key].append(asyncio.run(snake_measured(cfg, m, settings[key], 0.0, CAP, None, 3)))
        print("part 3 round", rnd, {k: round(v[-1]["seconds"], 3) for k, v in rows.items()}, flush=True)

    def helpers(r: dict) -> float:
        return sum(v for g, v in r["cpu_s_per_iteration"].items() if g not in ("snake-compute", "native"))

    per_pair = []
    for a, b in zip(rows["ckpt_cpu"], rows["ckpt_ssd"], strict=True):
        ops = b["ssd_operations_per_iteration"] - a["ssd_operations_per_iteration"]
        per_pair.append({"extra_ssd_operations": ops,
                         "helper_cpu_s_per_op": (helpers(b) - helpers(a)) / ops,
                         "iteration_s_per_op": (b["seconds"] - a["seconds"]) / ops,
                         "compute_busy_s_per_op": (b["compute_busy_s_per_iteration"]
                                                   - a["compute_busy_s_per_iteration"]) / ops})
    summary = {f: statistics.median(p[f] for p in per_pair) for f in per_pair[0]}
    summary["thread_cpu_s_per_op"] = {
        g: statistics.median((b["cpu_s_per_iteration"].get(g, 0.0) - a["cpu_s_per_iteration"].get(g, 0.0))
                             / p["extra_ssd_operations"]
                             for a, b, p in zip(rows["ckpt_cpu"], rows["ckpt_ssd"], per_pair, strict=True))
        for g in sorted({g for r in rows["ckpt_ssd"] for g in r["cpu_s_per_iteration"]})}
    return {"model": f"GPT 8 x 512, {m} micro-batches of 1 x 32 tokens, 300 MB/s cap, opt 0.3 in CPU memory",
            "rows": rows, "per_pair": per_pair, "summary": summary}


IO_KINDS = ("read", "write", "mixed")


def io_burner(kind: str, rate: float, op_bytes: int, path: str, stop: threading.Event, out: list[dict]) -> None:
    """Moves `op_bytes` per operation through snake's storage backend, capped at `rate`
    bytes/s: reads, writes, or the two alternating (one bucket, as the runtime shares it)
    until `stop`. Records its CPU time and bytes moved."""
    slots = 4
    f = open_storage(path, op_bytes * slots, bucket=TokenBucket(rate))
    buf = alloc_host(op_bytes, pin=False)
    view = memoryview(buf.data.numpy()).cast("B")
    try:
        f.pwrite(view, 0)  # every slot readable (fallocate'd extents read as zeros without I/O)
        for i in range(1, slots):
            f.pwrite(view, i * op_bytes)
        c0, moved, i = time.thread_time(), 0, 0
        while not stop.is_set():
            write = kind == "write" or (kind == "mixed" and i % 2 == 1)
            (f.pwrite if write else f.pread)(view, (i % slots) * op_bytes)
            moved += op_bytes
            i += 1
        out.append({"cpu_s": time.thread_time() - c0, "bytes": moved})
    finally:
        f.close()


@contextlib.contextmanager
def _restore_chunk() -> Iterator[None]:
    try:
        yield
    finally:
        Throttled.CHUNK = CHUNK


def io_cost(rounds: int, rates: list[float], m: int, mbs: int, op_bytes: int, pieces: list[int] | None = None) -> dict:
    """Part 4: the PyTorch + checkpointing loop (8 x 512, `m` micro-batches of `mbs` x 32
    tokens, 4 iterations, 1 not timed) alone, and with a side thread moving SSD traffic at each
    rate (read, write, mixed), in alternating rounds. `pieces`: the capped storage's token
    pieces to compare (bytes; 0: a whole transfer's tokens at once), the runtime's by default."""
    cfg = gpt_config(8, 512, 32)
    SCRATCH.mkdir(parents=True, exist_ok=True)
    pieces = pieces or [CHUNK]
    variants = [("none", 0.0, CHUNK)] + [(k, r, p) for r in rates for k in IO_KINDS for p in pieces]
    rows: dict[str, list[dict]] = {
        (f"{k}_{r / 1e6:g}" + (f"_p{p / 2**20:g}" if len(pieces) > 1 else "")) if r else k: [] for k, r, p in variants}
    on_worker(lambda: torch_loop(cfg, micro_batches=m, micro_batch_size=mbs, seq=32, steps=2,
                                 activation_checkpointing=True))  # the process's first loop pays its page faults
    for rnd in range(rounds):
        for (kind, rate, piece), key in (zip(variants, rows, strict=True) if rnd % 2 == 0
                                         else list(zip(variants, rows, strict=True))[::-1]):
            Throttled.CHUNK = piece or 1 << 62
            stop, out = threading.Event(), []
            with tempfile.TemporaryDirectory(dir=SCRATCH) as d, _restore_chunk():
                side = None if kind == "none" else threading.Thread(
                    target=io_burner, args=(kind, rate, op_bytes, f"{d}/io.bin", stop, out))
                if side:
                    side.start()
                    time.sleep(0.2)  # past the file's first writes
                st0, w0 = proc_stat(), time.perf_counter()
                r = on_worker(lambda: torch_loop(cfg, micro_batches=m, micro_batch_size=mbs, seq=32, steps=4,
                                                 activation_checkpointing=True))
                wall = time.perf_counter() - w0
                st1 = proc_stat()
                stop.set()
                if side:
                    side.join()
            rows[key].append({"seconds": r["iteration_seconds"]["median"], "fwd_bwd_seconds": r["fwd_bwd_seconds"]["median"],
                              "machine_cores": stat_delta(st0, st1, wall),
                              "io_thread_cores": out[0]["cpu_s"] / wall if out else 0.0,
                              "io_bytes_per_s": out[0]["bytes"] / wall if out else 0.0})
        print("part 4 round", rnd, {k: round(v[-1]["seconds"], 3) for k, v in rows.items()}, flush=True)
    summary = {}
    for key, rs in rows.items():
        # per round against the same round's loop alone (the VM drifts over minutes)
        per_round = [b["seconds"] / a["seconds"] for a, b in zip(rows["none"], rs, strict=True)]
        summary[key] = {"seconds": statistics.median(r["seconds"] for r in rs),
                        "slowdown_per_round": per_round, "slowdown": statistics.median(per_round),
                        "io_thread_cores": statistics.median(r["io_thread_cores"] for r in rs),
                        "io_bytes_per_s": statistics.median(r["io_bytes_per_s"] for r in rs),
                        "machine_cores": _median_fields([r["machine_cores"] for r in rs])}
    return {"model": f"GPT 8 x 512, {m} micro-batches of {mbs} x 32 tokens, PyTorch + checkpointing",
            "op_bytes": op_bytes, "rates_bytes_per_s": rates, "token_pieces_bytes": pieces, "rows": rows,
            "summary": summary}


def _median_fields(rows: list[dict[str, float]]) -> dict[str, float]:
    return {f: statistics.median(r[f] for r in rows) for f in _STAT_FIELDS}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds of part 1")
    ap.add_argument("--pairs", type=int, default=4, help="alternating rounds of part 2")
    ap.add_argument("--slope", type=float, default=None, help="skip part 1, use this slope")
    ap.add_argument("--ab", choices=sorted(AB), default=None,
                    help="part 2 also with a CPU-device shortcut off, in the same pairs: inline (the compute "
                         "thread stores activations itself), group (several micro-batches per compute job) or "
                         "optimizer (AdamW on the compute thread), grads (vertical's optimizer steps from the gradient "
                         "slot instead of a copy), views (store-unit views made once, not per use) or chunk (a capped "
                         "SSD's transfers take their tokens in 4 MiB pieces, not all at once) or reads (those pieces and "
                         "reads first, against whole transfers in the order they came)")
    ap.add_argument("--op-cost", type=int, default=0, metavar="PAIRS",
                    help="only part 3: the CPU cost of one SSD operation, from this many alternating pairs")
    ap.add_argument("--op-cost-m", type=int, default=16, metavar="M", help="micro-batches for part 3")
    ap.add_argument("--io-cost", default=None, metavar="MB/S,...",
                    help="only part 4: what SSD traffic at these rates (MB/s, comma-separated) costs the "
                         "PyTorch + checkpointing loop (--m, --micro-batch-size, --rounds)")
    ap.add_argument("--io-op-mib", type=float, default=32, help="part 4's bytes per SSD operation (MiB)")
    ap.add_argument("--io-pieces-mib", default=None, metavar="MIB,...",
                    help="part 4: compare the capped storage taking its tokens in these pieces (MiB; 0: a whole "
                         f"transfer's at once); default the runtime's {CHUNK >> 20} MiB only")
    ap.add_argument("--m", type=int, default=16, help="micro-batches for parts 2 and 4")
    ap.add_argument("--budget-mib", type=float, default=BUDGET_MIB, help="part 2's CPU memory budget")
    ap.add_argument("--cap-mb", type=float, default=CAP / 1e6, help="part 2's SSD cap (MB/s)")
    ap.add_argument("--micro-batch-size", type=int, default=1, help="part 2's sequences per micro-batch")
    ap.add_argument("--link-mb", type=float, default=None,
                    help="part 2: emulate a host<->device link of this many MB/s per direction (throughput.py --link-mb)")
    ap.add_argument("--name", default="contention", help="results file (benchmarks/results/NAME.json)")
    args = ap.parse_args()
    if args.m < 1 or not args.budget_mib > 0 or not args.cap_mb > 0:
        raise SystemExit("--m must be >= 1, --budget-mib and --cap-mb > 0")
    if args.micro_batch_size < 1 or (args.link_mb is not None and not args.link_mb > 0):
        raise SystemExit("--micro-batch-size must be >= 1 and --link-mb > 0 (MB/s)")
    rates, pieces = [], None
    if args.io_pieces_mib is not None:
        try:
            pieces = [int(float(x) * 2**20) // 4096 * 4096 for x in args.io_pieces_mib.split(",")]
        except ValueError:
            pieces = [-1]
        if not pieces or any(p < 0 for p in pieces) or args.io_cost is None:
            raise SystemExit(f"--io-pieces-mib {args.io_pieces_mib!r} must be sizes in MiB >= 0 (0: whole transfers), "
                             "comma-separated, with --io-cost")
    if args.io_cost is not None:
        try:
            rates = [float(x) * 1e6 for x in args.io_cost.split(",")]
        except ValueError:
            rates = []
        if not rates or not all(r > 0 for r in rates) or not args.io_op_mib * 2**20 >= 4096 or args.rounds < 1:
            raise SystemExit(f"--io-cost {args.io_cost!r} must be rates in MB/s > 0, comma-separated (e.g. 150,300), "
                             "--io-op-mib at least 4 KiB (0.004) and --rounds >= 1")
    t0 = time.perf_counter()
    if rates:
        p4 = io_cost(args.rounds, rates, args.m, args.micro_batch_size, int(args.io_op_mib * 2**20) // 4096 * 4096,
                     pieces)
        for key, v in p4["summary"].items():
            mc = v["machine_cores"]
            print(f"{key:12s} {v['seconds']:.3f} s/it  slowdown {v['slowdown']:.3f} (rounds "
                  f"{', '.join(f'{x:.2f}' for x in v['slowdown_per_round'])})  I/O thread "
                  f"{v['io_thread_cores']:.3f} of a core at {v['io_bytes_per_s'] / 1e6:.0f} MB/s; machine: system "
                  f"{mc['system']:.3f}, steal {mc['steal']:.3f}, softirq {mc['softirq']:.3f} cores")
        print(save("contention_io_cost", {"machine": machine(), "part4": p4, "seconds_total": time.perf_counter() - t0}))
        return
    if args.op_cost:
        p3 = op_cost(args.op_cost, args.op_cost_m)
        s = p3["summary"]
        print(f"M = {args.op_cost_m}: per extra SSD operation (median of {args.op_cost} pairs, "
              f"{s['extra_ssd_operations']:.0f} extra per "
              f"iteration): helper CPU {s['helper_cpu_s_per_op'] * 1e6:.0f} us, iteration "
              f"{s['iteration_s_per_op'] * 1e6:.0f} us, compute busy {s['compute_busy_s_per_op'] * 1e6:.0f} us")
        for g, v in sorted(s["thread_cpu_s_per_op"].items(), key=lambda kv: -kv[1]):
            print(f"    {g:32s} {v * 1e6:.0f} us")
        name = "contention_op_cost" if args.op_cost_m == 16 else f"contention_op_cost_m{args.op_cost_m}"
        print(save(name, {"machine": machine(), "part3": p3,
                                          "seconds_total": time.perf_counter() - t0}))
        return
    p1 = part1(args.rounds) if args.slope is None else {"summary": {}, "slope_median": args.slope}
    for k, v in p1["summary"].items():
        print(f"{k:10s} {v['seconds']:.3f} s/it  slowdown {v['slowdown']:.3f}  side thread "
              f"{v['side_share_measured']:.3f} of a core", flush=True)
    print(f"slowdown per share of one core taken (median): {p1['slope_median']:.2f}", flush=True)
    p2 = part2(args.pairs, p1["slope_median"], args.ab, args.m, args.budget_mib, args.cap_mb * 1e6,
               args.micro_batch_size, None if args.link_mb is None else args.link_mb * 1e6)
    for key, v in p2["summary"].items():
        print(f"{key}: machine cores by /proc/stat field " + ", ".join(
            f"{f} {c:.3f}" for f, c in v["machine_cores"].items() if f != "nice"))
        if key == "torch_ckpt":
            continue
        print(f"{key}: PyTorch+ckpt / snake {v['torch_over_snake_median']:.2f} (per pair "
              f"{', '.join(f'{x:.2f}' for x in v['torch_over_snake_per_pair'])}); snake's threads other than "
              f"compute {v['helper_cores']:.3f} of a core, {v['traced_operations_per_iteration']:.0f} traced "
              f"operations per iteration -> predicted {v['predicted_torch_over_snake']:.2f}; "
              f"compute busy {v['snake_compute_busy_fraction']:.2f} of the iteration, PyTorch fwd+bwd / snake's "
              f"compute busy time {v['torch_fwd_bwd_over_snake_compute_busy']:.2f}; compute thread idle "
              f"{v['compute_thread_idle_s_per_iteration'] * 1e3:.0f} ms per iteration, "
              f"{v['compute_thread_gaps_over_2ms_per_iteration']:.0f} gaps over 2 ms")
        for g, c in sorted(v["threads"].items(), key=lambda kv: -kv[1]["cores"]):
            print(f"    {g:32s} {c['cores']:.3f} cores, run-queue wait {c['runqueue_wait']:.3f}")
    result = {"machine": machine(), "part1": p1, "part2": p2, "seconds_total": time.perf_counter() - t0}
    print(save(args.name, result))


if __name__ == "__main__":
    if not sys.platform.startswith("linux"):
        raise SystemExit("contention.py reads /proc/self/task (Linux)")
    main()
