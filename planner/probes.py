"""Timed probes behind `measure_profile`: block compute, copies, SSD, CPU AdamW.

Each probe warms up (WARMUP runs), then repeats for about `seconds` (at least 2 runs) and returns the
median. Everything it allocates is freed when it returns; the SSD probe removes its file.
"""

from __future__ import annotations

import copy
import dataclasses
import mmap
import os
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from snake.adapters import (
    ModelParts,
    call_block,
    describe,
    frozen_named,
    hidden_size,
    layer_kinds,
    lowest_backward,
    materialize_block,
    trained,
    vocab_size,
)
from snake.config import AdamW, SnakeConfig
from snake.device import pin_host_memory, synchronize
from snake.errors import Stopped
from snake.io import open_storage
from snake.io.base import TokenBucket
from snake.kernels import TORCH_DTYPES, Kernels
from snake.models.gpt import GPT, Block
from snake.optim import adamw_step

MiB = 1 << 20
SSD_CHUNK = 8 * MiB
COPY_BYTES = 64 * MiB  # larger than caches, so a CPU "copy" measures memory bandwidth
SSD_SECONDS = 2.0  # at most this long per direction
WARMUP = 2  # untimed runs before the timed ones
MAX_BLOCK_PASSES = 6  # block probe passes at most, while the backward reads <= 0
# glibc's mmap threshold starts at 128 KiB and rises to the size of a freed mmapped chunk, at
# most this (the dynamic ceiling of M_MMAP_THRESHOLD on 64-bit); the trim threshold to twice it
MMAP_THRESHOLD_MAX = 32 * MiB
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_stop(stop: threading.Event | None) -> None:
    """Stopped once `stop` is set: the planning that waits for the probes was cancelled
    (a cancelled first run()); they stop at their next round rather than run for seconds."""
    if stop is not None and stop.is_set():
        raise Stopped("measuring the machine's profile cancelled part-way (nothing was cached)")


def _median_seconds(
    run: Callable[[], object], device: torch.device, seconds: float, prepare=None
) -> float:
    """Median wall time of `run()` (after `prepare()`, untimed), repeated for ~seconds."""
    times: list[float] = []
    start = time.perf_counter()
    for i in range(50):
        if prepare is not None:
            prepare()
        synchronize(device)
        t0 = time.perf_counter()
        run()
        synchronize(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
        if len(times) >= 2 and time.perf_counter() - start > seconds:
            break
    return statistics.median(times)


def settle_allocator() -> None:
    """Put glibc's allocator in the state a training process reaches after its first steps.

    A fresh process serves large allocations with mmap and gives them back when freed, so
    every backward's multi-MB gradient temporaries fault their pages in again: measured on
    the 8 x 512 model, ~2,500 page faults per timed backward and a backward 1.3-1.6x slower
    (11.4-12.1 ms per block against 7-9) in the first probe of a process, while the runtime's
    steady state (and any later probe) faults almost never. Allocating and freeing one chunk
    at glibc's dynamic threshold ceiling raises the mmap and trim thresholds to where a
    warmed-up process has them. Harmless elsewhere (one 32 MiB allocation)."""
    chunk = torch.empty(MMAP_THRESHOLD_MAX - 4096, dtype=torch.uint8)
    chunk.fill_(0)  # touch it, so the allocator really maps it
    del chunk


def block_seconds(
    cfg, mb: int, seq: int, device: torch.device, dtype, seconds: float, *, parts: ModelParts | None = None,
    kind_counts: list[int] | None = None, stop: threading.Event | None = None,
):
    """(forward, recompute, backward) seconds of one Block on one micro-batch.

    parts: time that model's own blocks (copies of them; any described model) instead of
    fresh built-in GPT Blocks of `cfg`; where its layers are of several kinds (dense and
    mixture-of-experts, say) each kind is timed on its own and the times are averaged over
    the layers (what a layer costs on average, as an iteration adds them up). Cycles through
    enough distinct blocks to overflow the CPU's caches (up to 8, ~64 MiB of weights), as
    training does: each stage brings another layer's weights. Timing one block over and
    over keeps its weights in cache and under-reports by up to ~2x on a CPU. kind_counts:
    the layers of each kind in the whole model, where `parts` holds a sample of its layers
    with every kind in it (`snake plan`'s Hugging Face models). stop: `check_stop`."""
    if parts is None:
        gpt = describe(GPT(dataclasses.replace(cfg, n_layer=1)))
        return _kind_seconds(gpt, [0], lambda i: Block(cfg), cfg.n_embd, mb, seq, device, dtype, seconds, stop)
    kinds, firsts = layer_kinds(parts.blocks)
    hidden = hidden_size(parts)
    timed = []
    for kind in range(len(firsts)):
        layers = [i for i, k in enumerate(kinds) if k == kind]
        timed.append((len(layers), _kind_seconds(
            parts, layers, lambda i: _copy_block(parts, i), hidden, mb, seq, device, dtype,
            seconds / len(firsts), stop)))
    if kind_counts is not None:
        if len(kind_counts) != len(timed):
            raise ValueError(f"kind_counts: {len(kind_counts)} counts for a model of {len(timed)} layer kinds")
        timed = [(count, t) for count, (_, t) in zip(kind_counts, timed, strict=True)]
        with_bwd = [count for count, _ in timed]
    else:  # the layers below the lowest that trains anything run no backward (lowest_backward)
        lowest = lowest_backward(parts)
        with_bwd = [sum(1 for i, k in enumerate(kinds) if k == kind and i >= lowest) for kind in range(len(firsts))]
    n = sum(count for count, _ in timed)
    # per layer, over all n: the forward of every layer, the recompute and backward of those with one
    weights = ([count for count, _ in timed], with_bwd, with_bwd)
    return tuple(sum(w * t[j] for w, (_, t) in zip(weights[j], timed, strict=True)) / n for j in range(3))


def _copy_block(parts: ModelParts, layer: int) -> torch.nn.Module:
    """A copy of layer `layer`'s block with its own weights (read where they are on the meta
    device, `ModelParts.weights`)."""
    block = copy.deepcopy(parts.blocks[layer])
    materialize_block(parts, layer, block)
    return block


def _kind_seconds(
    parts: ModelParts, layers: list[int], new_block: Callable[[int], torch.nn.Module], hidden: int,
    mb: int, seq: int, device: torch.device, dtype, seconds: float, stop: threading.Event | None = None,
) -> tuple[float, float, float]:
    """(forward, recompute, backward) seconds of `parts`' layers `layers` (one kind), cycling
    through copies of up to 8 of them (`new_block(layer)`)."""
    per_block = sum(p.numel() for p in parts.blocks[layers[0]].parameters()) * torch.empty((), dtype=dtype).element_size()
    # (a block without parameters: one copy)
    n_blocks = 1 if device.type == "cuda" or not per_block else max(1, min(8, -(-64 * MiB // per_block)))
    cycle = [layers[i % len(layers)] for i in range(n_blocks)]
    blocks = [new_block(layer).to(device=device, dtype=dtype) for layer in cycle]
    turn = [0]

    def next_block() -> tuple[torch.nn.Module, int]:
        turn[0] = (turn[0] + 1) % len(blocks)
        return blocks[turn[0]], cycle[turn[0]]

    # the hidden state as the runtime stores it (float32 for a model that keeps it so)
    x = torch.randn(mb, seq, hidden, device=device, dtype=torch.float32 if parts.hidden_fp32 is not None else dtype)
    xr = x.clone().requires_grad_(True)
    grad_out = torch.randn_like(x)

    # the runtime's own kernels (the shell block bound to a device slot, RNG seeding, fp32
    # gradient accumulation), so the profile includes what the compute actor really pays
    kernels = _kernels(parts, device, dtype)
    # as the device mover fills them: the trained parameters, then the streamed frozen ones
    slots = [torch.cat([p.detach().reshape(-1) for p in [*trained(b), *(q for _, q in frozen_named(b))]]
                       or [torch.empty(0, device=device, dtype=dtype)])
             for b in blocks]
    acc = torch.zeros(kernels.layer_params, dtype=torch.float32, device=device)

    def next_slot() -> tuple[torch.Tensor, int]:
        turn[0] = (turn[0] + 1) % len(slots)
        return slots[turn[0]], cycle[turn[0]]

    def fwd() -> None:
        slot, layer = next_slot()
        kernels.block_fwd(slot, x, 0, layer, 0)

    def recompute() -> None:
        block, layer = next_block()
        with torch.enable_grad():
            call_block(parts, block, xr, layer)

    def bwd_total() -> None:
        slot, layer = next_slot()
        kernels.block_bwd(slot, x, grad_out, acc, t=0, layer=layer, m=0, accumulate=True)

    def build() -> None:
        pass

    def bwd() -> None:
        bwd_total()

    def measure() -> tuple[float, float, float]:
        # interleaved rounds after a shared warm-up, the median of each: a load spike then
        # inflates none of them more than the others, and all three see the same warm state
        for _ in range(WARMUP):
            fwd()
            build()
            bwd()
        times: list[list[float]] = [[], [], []]
        start = time.perf_counter()
        while len(times[0]) < 3 or (time.perf_counter() - start < 3 * seconds and len(times[0]) < 50):
            check_stop(stop)
            for i, (run, prep) in enumerate(((fwd, None), (recompute, None), (bwd, build))):
                if prep is not None:
                    prep()
                synchronize(device)
                t0 = time.perf_counter()
                run()
                synchronize(device)
                times[i].append(time.perf_counter() - t0)
        f, r, total = (statistics.median(ts) for ts in times)
        return f, r, total

    def measure_passes() -> tuple[float, float, float]:
        # at least two passes; more (up to MAX_BLOCK_PASSES) while the recompute does not
        # come out shorter than recompute + backward
        passes = [measure(), measure()]
        while (out := combine_block_passes(passes)) is None and len(passes) < MAX_BLOCK_PASSES:
            passes.append(measure())
        if out is None:
            raise RuntimeError(
                f"block probe: in {len(passes)} passes the recompute alone never timed shorter than "
                f"recompute + backward (median seconds per pass {passes}): the machine's load swamps the "
                "measurement; profile on a quieter machine, or give placement, alpha and micro_batches "
                "in SnakeConfig so that no profile is needed")
        return out

    # on a worker thread, as the runtime's compute actor runs its kernels
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="snake-probe") as ex:
            return ex.submit(measure_passes).result()
    finally:
        kernels.restore_modes()  # Kernels put the model in train mode


def _kernels(parts: ModelParts, device: torch.device, dtype) -> Kernels:
    name = next(k for k, v in TORCH_DTYPES.items() if v == dtype)
    config = SnakeConfig(offload_dir=".", micro_batches=1, dtype=name)  # type: ignore[arg-type]
    kernels = Kernels(parts, config, device, 1, frozen_copies=False)  # its slots hold the frozen parameters
    kernels.watch_gradients = False  # timings, not training: no warning about unused parameters
    return kernels


def combine_block_passes(passes: list[tuple[float, float, float]]) -> tuple[float, float, float] | None:
    """(forward, recompute, backward) from passes of median (forward, recompute, recompute +
    backward) seconds: the lowest of each over the passes (on a shared CPU the error is
    one-sided: the first pass in a fresh process measured the backward up to 1.5x slow, every
    later one agreed), the backward as the difference of the lowest two. Taking the lowest
    difference instead read 0 on a noisy VM whenever one pass's recompute came out slower than
    its whole backward (2 of 12 probes), and the profile was refused. None while the lowest
    recompute is not shorter than the lowest total: measure again."""
    f, r, total = (min(p[i] for p in passes) for i in range(3))
    if not total > r:
        return None
    return min(f, r), r, total - r


def pre_post_seconds(
    cfg, mb: int, seq: int, device: torch.device, dtype, seconds: float, *, parts: ModelParts | None = None
) -> float:
    """Embedding + final norm + tied head + cross-entropy, forward and backward. parts: that
    model's pre and post through the runtime's kernels (embedding forward, head and loss
    forward and backward, embedding recompute and backward), where `cfg` is not used."""
    if parts is not None:
        return _parts_pre_post_seconds(parts, mb, seq, device, dtype, seconds)
    model = GPT(dataclasses.replace(cfg, n_layer=0)).to(device=device, dtype=dtype)
    idx = torch.randint(0, cfg.vocab_size, (mb, seq), device=device)
    targets = torch.randint(0, cfg.vocab_size, (mb * seq,), device=device)

    def step() -> None:
        logits = model(idx)
        loss = F.cross_entropy(logits.float().view(-1, cfg.vocab_size), targets)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return _median_seconds(step, device, seconds)


def _parts_pre_post_seconds(parts: ModelParts, mb: int, seq: int, device: torch.device, dtype,
                            seconds: float) -> float:
    vocab = vocab_size(parts)
    kernels = _kernels(parts, device, dtype)
    idx = torch.randint(0, vocab, (mb, seq), device=device)
    targets = torch.randint(0, vocab, (mb, seq), device=device)

    def step() -> None:
        h = kernels.pre(idx, 0, 0)
        _, gh = kernels.head(h, targets, 0, 0)
        kernels.pre_bwd(idx, gh, 0, 0)

    try:
        return _median_seconds(step, device, seconds)
    finally:
        kernels.restore_modes()


def copy_bytes_per_s(device: torch.device, nbytes: int, seconds: float) -> tuple[float, float]:
    """(host->device, device->host) bytes/s; on CPU both are a memcpy between tensors."""
    pin = pin_host_memory(device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = _median_seconds(lambda: dev.copy_(host, non_blocking=pin), device, seconds / 2)
    d2h = _median_seconds(lambda: host.copy_(dev, non_blocking=pin), device, seconds / 2)
    return nbytes / h2d, nbytes / d2h


def adam_elems_per_s(seconds: float, n: int = 1 << 22) -> float:
    """Elements per second of the runtime's AdamW step (torch's fused CPU kernel, through
    `snake.optim.adamw_step`) on CPU fp32 tensors. Not through `torch.optim.AdamW`: its first
    step imports torch._dynamo (829 modules, +75 MiB of RSS that stayed in the process)."""
    p, g, m, v = torch.zeros(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    opt = AdamW(lr=1e-4, weight_decay=0.1)
    steps = iter(range(1, 1 << 30))
    return n / _median_seconds(
        lambda: adamw_step([p], [g], [m], [v], step=next(steps), opt=opt, lr=opt.lr), torch.device("cpu"), seconds
    )


def _transfer(f, op: str, total: int, threads: int, stop: threading.Event | None = None) -> float:
    """Bytes/s of `op` ("pread"/"pwrite") over [0, total) in SSD_CHUNK pieces on `threads`
    threads, stopping after SSD_SECONDS (Stopped once `stop` is set)."""
    done = [0] * threads
    deadline = time.monotonic() + SSD_SECONDS
    offsets = list(range(0, total, SSD_CHUNK))

    def worker(i: int) -> None:
        with mmap.mmap(-1, SSD_CHUNK) as buf:
            buf.write(os.urandom(SSD_CHUNK))
            view = memoryview(buf)
            try:
                for off in offsets[i::threads]:
                    getattr(f, op)(view, off)
                    done[i] += SSD_CHUNK
                    if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                        break
            finally:
                view.release()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads, thread_name_prefix="ssd-probe") as pool:
        for fut in [pool.submit(worker, i) for i in range(threads)]:
            fut.result()
    check_stop(stop)
    return sum(done) / (time.perf_counter() - t0)


def ssd_bytes_per_s(
    offload_dir: Path, io_bytes: int, cap: float | None, threads: int = 2, stop: threading.Event | None = None
) -> tuple[float, float]:
    """(read, write) bytes/s through open_storage (O_DIRECT where the file system allows),
    with the token-bucket cap when given. Writes io_bytes, then reads them back."""
    offload_dir.mkdir(parents=True, exist_ok=True)
    total = max(SSD_CHUNK * threads, io_bytes // SSD_CHUNK * SSD_CHUNK)
    if cap is not None:  # keep a capped probe near SSD_SECONDS per direction
        total = min(total, max(SSD_CHUNK * threads, int(cap * SSD_SECONDS) // SSD_CHUNK * SSD_CHUNK))
    path = offload_dir / f".snake-profile-{os.getpid()}-{threading.get_ident()}.bin"
    f = open_storage(path, total, bucket=TokenBucket(cap) if cap is not None else None)
    try:
        write = _transfer(f, "pwrite", total, threads, stop)
        read = _transfer(f, "pread", total, threads, stop)
    finally:
        f.close()
        path.unlink(missing_ok=True)
    return read, write


def measure_all(
    cfg, *, micro_batch_size: int, seq_len: int, device: str, dtype: str, offload_dir: Path,
    cap: float | None, io_bytes: int, seconds: float, parts: ModelParts | None = None,
    kind_counts: list[int] | None = None, stop: threading.Event | None = None,
) -> dict[str, float]:
    """Every measured field of a MachineProfile (memory excluded), as a dict. parts: time
    that model's blocks and pre/post (`cfg` unused), else built-in GPT ones of `cfg`. stop:
    once set, Stopped at the next round of a probe (`check_stop`)."""
    dev = torch.device(device)
    tdtype = _DTYPES[dtype]
    settle_allocator()
    fwd, rec, bwd = block_seconds(cfg, micro_batch_size, seq_len, dev, tdtype, seconds, parts=parts,
                                  kind_counts=kind_counts, stop=stop)
    check_stop(stop)
    h2d, d2h = copy_bytes_per_s(dev, COPY_BYTES, seconds)
    read, write = ssd_bytes_per_s(offload_dir, io_bytes, cap, stop=stop)
    pre_post = pre_post_seconds(cfg, micro_batch_size, seq_len, dev, tdtype, seconds, parts=parts)
    check_stop(stop)
    return {
        "fwd_seconds": fwd,
        "recompute_seconds": rec,
        "bwd_seconds": bwd,
        "pre_post_seconds": pre_post,
        "h2d_bytes_per_s": h2d,
        "d2h_bytes_per_s": d2h,
        "ssd_read_bytes_per_s": read,
        "ssd_write_bytes_per_s": write,
        "adam_elems_per_s": adam_elems_per_s(seconds),
    }
