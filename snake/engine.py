"""Everything a run needs that outlives one `run()` call: stores, pools, executors,
kernels, ledger, counters. Built once, from the model, the config and the first batch,
before any actor starts; sized so that memory does not grow step over step."""

from __future__ import annotations

import asyncio
import shutil
import threading
import warnings
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import torch

from snake.adapters import ModelParts, flat_named, layer_values, lowest_backward, pre_trains
from snake.blocking import name_native_thread
from snake.buffers import BufferPool, HostBuffer, alloc_host, alloc_host_tensor
from snake.channels import Ledger
from snake.clip import GradClip
from snake.config import Placement, SnakeConfig
from snake.device import helper_thread_init, pin_host_memory, stream_marks
from snake.errors import ConfigError, Stopped
from snake.io.base import TokenBucket
from snake.io.kvikio_file import kvikio_usable
from snake.io.posix import o_direct_works
from snake.kernels import Kernels
from snake.memory import PoolSizes, fmt_size
from snake.offload_dir import FrozenFromDiskWarning, InMemoryOffloadWarning, memory_fs
from snake.plans import DELAYED, Plans
from snake.schedule import build_schedule, stored_outputs
from snake.stores import TierStore, Unit, scatter, tail_file_bytes
from snake.trace import LINK_TRACK, Tracer, Traffic


def _split_parts(sizes: list[int], alpha: float) -> list[tuple[int, int]]:
    """Per layer of `sizes` elements: (now-step, delayed-step) elements, alpha of each
    layer delayed. An alpha so small (or so near 1) that a part would round to no elements
    delays none (or all but one); layers of several kinds delay some elements in every
    layer or in none (the plans step a delayed part of every layer), but a layer of no
    elements (it streams nothing it trains) has two empty parts. Alpha = 1 delays every
    element of every layer (no now-step elements: each step can wait for the whole
    iteration's gradient)."""
    if alpha >= 1.0:
        return [(0, p) for p in sizes]
    delayed = [min(int(round(alpha * p)), p - 1) if p else 0 for p in sizes]
    if any(delayed):
        trains = [p for p in sizes if p]
        delayed = [max(d, 1) if p else 0 for p, d in zip(sizes, delayed, strict=True)] \
            if all(p > 1 for p in trains) else [0] * len(sizes)
    return [(p - d, d) for p, d in zip(sizes, delayed, strict=True)]


class Engine:
    # inline_store in use (benchmarks/contention.py turns it off to measure what it saves)
    inline_stores = True
    # AdamW on the compute thread on a CPU device (optimizer_runs_on_compute; the same
    # benchmark turns it off)
    optimizer_on_compute = True
    # vertical on a CPU device: the optimizer steps from the gradient slot itself
    # (slot_grads; the same benchmark turns it off)
    grads_in_slots = True
    # no backward below the lowest layer that trains anything (lowest_backward;
    # benchmarks/frozen_bottom.py turns it off to measure what it saves)
    skip_frozen_backward = True
    # store-unit views made once and kept (unit_views; the same benchmark turns it off)
    keep_unit_views = True

    def __init__(
        self,
        parts: ModelParts,
        config: SnakeConfig,
        device: torch.device,
        *,
        ckpt_shape: torch.Size,
        input_shape: torch.Size,
        offload_dir: Path,
        tracer: Tracer,
        data_executor: ThreadPoolExecutor,
        stop: threading.Event | None = None,
    ) -> None:
        """Blocking: allocates the stores (zeroing their CPU memory), their files and the
        pools. `stop` (the engine's `stop` from then on): set, the build raises Stopped at
        its next piece (a layer, a buffer, a chunk of zeroing), having closed and removed
        what it made (the trainer's build was cancelled)."""
        assert config.micro_batches is not None and config.alpha is not None and config.placement is not None
        self.config = config
        self.device = device
        self.M = config.micro_batches
        self.alpha = config.alpha
        self.placement: Placement = config.placement
        self.vertical = config.schedule == "vertical"
        self.workers = config.optimizer_workers
        self.pin = pin_host_memory(device)
        self.tracer = tracer
        self.offload_dir = offload_dir
        # set when the build is cancelled, or by an actor whose blocking work is cancelled
        # (the run is being torn down): long work on the threads stops early instead of
        # holding either up
        self.stop = stop if stop is not None else threading.Event()
        self.traffic = Traffic(tracer)
        self.ledger = Ledger()
        self.kernels = k = Kernels(parts, config, device, self.M)
        self._layout(parts, config)
        self.ckpt_shape = ckpt_shape
        self.input_shape = input_shape
        self.ckpt_elems = int(torch.Size(ckpt_shape).numel())
        self.next_t = 0  # next iteration to run
        self.tail_s = 0.0  # the last run's time after its last step's end (its last on_step)
        self.first_delayed = 0  # delayed steps are due from this iteration on
        self.flush_partial = False  # flush_delayed stopped with some layers stepped, some not
        # per layer, the parameters (by index) its pending delayed step leaves: those without
        # a gradient in the iteration its gradient is of (Kernels.take_skipped)
        self.delayed_skips: dict[int, tuple[int, ...]] = {}
        # the SSD parts of delayed gradients kept in their staging buffers (Plans.grad_stays)
        self.held_grads: dict[int, HostBuffer] = {}
        # clipping by the global gradient norm (AdamW.max_grad_norm, at alpha = 1), or with
        # max_grad_norm=inf only the norm, and float16's dynamic loss scale (at alpha = 1):
        # the norms, coefficients and skipped steps of the iterations in flight
        mg = config.optimizer.max_grad_norm
        self.scaler = k.scaler
        self.clip = GradClip(mg, parts, k.scaler, lowest=self.lowest) if mg is not None or k.scaler is not None else None
        self.failed = False
        self.fault_hook = None  # tests: async (actor, label) -> None before each piece of work
        self._build(config, device, offload_dir, data_executor)

    def _layout(self, parts: ModelParts, config: SnakeConfig) -> None:
        """The layers' sizes and how they split into now/delayed parts, and the schedule:
        its stages, the outputs it stores and the actors' plans."""
        k = self.kernels
        self.N = len(parts.blocks)
        # elements of each layer (of its kind: layers of several kinds differ), and of the
        # largest: the size of the device slots and gradient buffers any layer passes through
        self.layer_P = [k.kind_params[kind] for kind in k.kinds]
        self.P = k.layer_params
        self.dtype = k.dtype
        self.hidden_dtype = k.hidden_dtype  # checkpoints and their gradients
        # no backward below the lowest layer that trains anything where the embedding trains
        # nothing (frozen bottom layers: autograd runs none there either)
        self.pre_trains = pre_trains(parts)
        self.lowest = lowest_backward(parts, self.pre_trains) if self.skip_frozen_backward else 0
        self.stages = build_schedule(self.N, self.M, config.schedule, self.lowest)
        # the outputs a later stage loads, and so stores: below the lowest layer with a
        # backward, a checkpoint that stays on the device for the next stage is not stored
        self.stored = stored_outputs(self.stages, self.N)
        self.S = len(self.stages)
        self.layer_parts = _split_parts(self.layer_P, self.alpha)
        self.delayed = any(n_del for _n_now, n_del in self.layer_parts)
        self.plans = Plans(self.stages, self.N, delayed=self.delayed)

    def _build(self, config: SnakeConfig, device: torch.device, offload_dir: Path,
               data_executor: ThreadPoolExecutor) -> None:
        """Blocking: the tiers' files and stores, the pools, gradient buffers and executors;
        on failure what was made is closed and the model's modes given back."""
        k, tracer = self.kernels, self.tracer
        bucket = TokenBucket(config.ssd_bandwidth_bytes_per_s) if config.ssd_bandwidth_bytes_per_s else None
        link = config.device_link_bytes_per_s  # an emulated host<->device link: one bucket per direction
        self.links = {d: TokenBucket(link) for d in ("cpu->gpu", "gpu->cpu")} if link else {}
        use_gds = device.type == "cuda"
        store_kw: dict[str, Any] = dict(directory=offload_dir, pin=self.pin, bucket=bucket, use_gds=use_gds,
                                        backend=config.storage_backend, stop=self.stop)
        # a layer that trains nothing it streams (all it trains is held on the device, or
        # it is frozen) has units of no elements: its loads, steps and saves move nothing
        parts_units = [((layer, p), n) for layer in range(self.N) for p, n in enumerate(self.layer_parts[layer])
                       if n or not self.layer_P[layer]]
        ckpt_units = [((layer, m), self.ckpt_elems) for layer in range(self.N) for m in range(self.M)]
        self._preflight(offload_dir, parts_units, ckpt_units)
        try:
            k.map_frozen(offload_dir, stop=self.stop)
        except BaseException:
            k.restore_modes()
            raise
        self._make_stores(store_kw, parts_units, ckpt_units)
        try:
            self._make_pools()
            self._make_grads()
            self._make_executors(device, config, data_executor)
        except BaseException:  # e.g. no memory for the pools: close what was opened
            for name, ex in getattr(self, "executors", {}).items():
                if name != "data":  # the trainer's, and this runs on its thread
                    ex.shutdown(wait=False)
            self.close_files()
            self.kernels.restore_modes()
            raise
        self._warn_frozen_from_disk()
        k.resident.io = self.executors["io"]  # the resident state's transfers, where it is on SSD
        k.resident.progress = tracer.progress
        k.resident.now = tracer.now
        k.stop = k.resident.stop = self.stop
        self.marks = stream_marks(device)

    def _make_stores(self, store_kw: dict[str, Any], parts_units: Sequence[tuple[Hashable, int]],
                     ckpt_units: Sequence[tuple[Hashable, int]]) -> None:
        """Blocking: the tier stores (parameters, optimizer state, checkpoints, activation
        gradients; the delayed gradients' and the resident optimizer state's where they are on
        SSD), their files made; on failure those made are closed and the model's modes given
        back."""
        k = self.kernels
        self.stores: dict[str, TierStore] = {}
        # views of store units made once and kept across runs (`inline_store`, h2d's aliases):
        # a unit's place in its store never moves
        self.unit_views: dict[tuple[str, str, Hashable], torch.Tensor | None] = {}
        try:
            self.stores["param"] = TierStore("param", self.dtype, parts_units, cpu_share=self.placement.param, **store_kw)
            # the CPU optimizer's alone (masters, moments): it never crosses to the device, so
            # it is not page-locked (its CPU share of a 13B model is tens of GB)
            self.stores["opt"] = TierStore(
                "opt", torch.float32, parts_units, cpu_share=self.placement.opt, comps=3, **{**store_kw, "pin": False}
            )
            self.stores["ckpt"] = TierStore(
                "ckpt", self.hidden_dtype, ckpt_units, cpu_share=self.placement.ckpt, whole_units=True, **store_kw
            )
            ag = sorted({self.unit_key(kind, lay, m) for kind, lay, m in self.stored if kind == "act_grad"})
            self.stores["act_grad"] = TierStore(
                "act_grad", self.hidden_dtype, [(u, self.ckpt_elems) for u in ag], cpu_share=1.0, pin=self.pin,
                stop=self.stop,
            )
            if self.vertical and any(n_del for _n_now, n_del in self.layer_parts):
                self.stores["grad"] = self._grad_store(store_kw)
            if k.resident.on_ssd:  # the resident optimizer state: wholly on SSD, in chunks
                self.stores["resident"] = TierStore(
                    "resident", torch.float32, k.resident.sizes(), cpu_share=0.0, comps=3, **store_kw)
                k.resident.use_store(self.stores["resident"], pin=self.pin, stop=self.stop)
        except BaseException:
            self.close_files()
            self.kernels.restore_modes()
            raise

    def _make_executors(self, device: torch.device, config: SnakeConfig, data_executor: ThreadPoolExecutor) -> None:
        init = helper_thread_init(device)  # on a CPU device: one intra-op thread outside compute
        copy = ThreadPoolExecutor(1, thread_name_prefix="snake-copy", initializer=init)
        compute = ThreadPoolExecutor(1, thread_name_prefix="snake-compute", initializer=name_native_thread)
        self.executors = {
            "compute": compute,
            # device -> host ("copy") and host -> device ("h2d"): one thread on a CPU device,
            # where a copy is a memcpy on the kernels' cores; on CUDA one each, so that a
            # layer's parameter load does not queue behind a gradient's copy and CPU add
            # (horizontal on an H100: 0.25-0.27 s per extra micro-batch with one thread,
            # about the h2d and d2h actors' busy times added up, BENCHMARKS.md section 8)
            "copy": copy,
            "h2d": copy if device.type == "cpu" else ThreadPoolExecutor(
                1, thread_name_prefix="snake-h2d", initializer=init),
            "io": ThreadPoolExecutor(config.io_threads, thread_name_prefix="snake-io", initializer=init),
            "optimizer": compute if self.optimizer_runs_on_compute() else ThreadPoolExecutor(
                self.workers, thread_name_prefix="snake-optimizer", initializer=init),
            "data": data_executor,
            # waits for the compute stream's marks (CUDA; no thread starts until first used)
            "sync": ThreadPoolExecutor(1, thread_name_prefix="snake-sync", initializer=init),
        }

    def optimizer_runs_on_compute(self) -> bool:
        """On a CPU device AdamW runs on the compute thread, between jobs and on every core.
        On its own thread it took one of the two cores from the kernels' thread team for a
        whole layer's step, at one thread's speed: all in CPU memory, M = 4, PyTorch +
        checkpointing / snake 0.90 with it against 0.81 (4 pairs, every pair better; M = 16:
        1.05 / 0.99; BENCHMARKS.md section 9). And it stalled the kernels at every backward
        stage's end: the step started there on a third runnable thread while the kernels'
        OpenMP worker spun, the event loop waited for a core holding the GIL, and the compute
        thread waited 3-7 ms for the GIL (BENCHMARKS.md section 12). Where a step's output
        goes to the SSD it waits behind a compute job; section 9 measured that 2-3 % slower at
        an I/O-bound point, section 12 no slower at the link setting's I/O-bound M = 4 and
        faster where the SSD meets the compute (M = 8)."""
        return self.optimizer_on_compute and self.device.type == "cpu"

    async def link_wait(self, link: str, nbytes: int) -> None:
        """With `device_link_bytes_per_s`: wait until `nbytes` may cross the host<->device
        link ("cpu->gpu" / "gpu->cpu"), also for a transfer a CPU device makes by reference."""
        bucket = self.links.get(link)
        if bucket is not None:
            wait = bucket.reserve(nbytes)
            if wait > 0:  # drawn on its own track ("link cpu->gpu"), so the trace shows the wait
                with self.tracer.span(f"{LINK_TRACK}{link}", "wait", link=link, bytes=nbytes):
                    await asyncio.sleep(wait)

    def _preflight(self, offload_dir: Path, parts_units: list, ckpt_units: list) -> None:
        """Before any file is made: can the asked storage backend run here, and does the SSD
        tier fit on the offload_dir's disk?"""
        backend = self.config.storage_backend
        if backend == "kvikio" and not (self.device.type == "cuda" and kvikio_usable()):
            raise ConfigError(
                "storage_backend", backend, "needs a CUDA device, its driver and the kvikio package",
                "use 'auto' (kvikio where it works) or 'posix'; pip install the kvikio matching your CUDA",
            )
        if backend == "posix" and not o_direct_works(offload_dir):
            raise ConfigError(
                "storage_backend", backend, f"needs O_DIRECT, which the file system of {offload_dir} refuses (tmpfs?)",
                "put offload_dir on a local SSD, or use 'auto' or 'buffered'",
            )
        esize = torch.empty((), dtype=self.dtype).element_size()
        hsize = torch.empty((), dtype=self.hidden_dtype).element_size()
        files = {  # the tier files this build makes, by name, and their bytes
            "param.bin": tail_file_bytes(parts_units, cpu_share=self.placement.param, comps=1, esize=esize),
            "opt.bin": tail_file_bytes(parts_units, cpu_share=self.placement.opt, comps=3, esize=4),
            "ckpt.bin": tail_file_bytes(ckpt_units, cpu_share=self.placement.ckpt, comps=1, esize=hsize, whole_units=True),
        }
        if self.vertical:  # the delayed gradients' SSD share (at most: less where the parameters' memory holds them)
            files["grad.bin"] = tail_file_bytes([((layer, DELAYED), n) for layer, (_n, n) in enumerate(self.layer_parts)
                                                 if n], cpu_share=self.placement.grad, comps=1, esize=4)
        if self.kernels.resident.on_ssd:
            files["resident.bin"] = tail_file_bytes(self.kernels.resident.sizes(), cpu_share=0.0, comps=3, esize=4)
        tiers = sum(files.values())
        mapped = self.kernels.frozen_files()  # a streamed model's frozen weights, mapped
        frozen = sum(mapped.values())
        # a file of the same name left by a killed run is written over: the blocks it holds
        # are room (up to this one's size); any other file there is not
        free = shutil.disk_usage(offload_dir).free + sum(
            min(_allocated(offload_dir / name), n) for name, n in {**files, **mapped}.items())
        if tiers + frozen > free:
            what = f"the SSD tier needs {fmt_size(tiers)}" + (
                f" and the frozen layer weights' mapped files {fmt_size(frozen)} (whatever the shares)" if frozen else "")
            stale = sorted(f.name for f in offload_dir.glob("*.bin") if f.name not in files and f.name not in mapped)
            raise ConfigError(
                "offload_dir", str(offload_dir), f"has {fmt_size(free)} free but {what}",
                "free space there" + (f" (files an earlier run left that this one does not use: {', '.join(stale[:4])}"
                                      f"{' ...' if len(stale) > 4 else ''})" if stale else "")
                + ", point offload_dir at a bigger disk"
                + (", or raise the placement shares to keep more in CPU memory" if tiers else ""),
            )
        fs = memory_fs(offload_dir)
        if fs is not None and tiers + frozen:
            warnings.warn(
                f"offload_dir {offload_dir} is on {fs}, in memory: its SSD tier ({fmt_size(tiers)})"
                + (f" and the mapped frozen layer weights ({fmt_size(frozen)})" if frozen else "")
                + " take CPU memory (the memory check and the planner count them so), none of which a "
                "share on SSD spares; put offload_dir on a disk (an SSD) for the memory the placement promises",
                InMemoryOffloadWarning,
                stacklevel=2,
            )

    def _warn_frozen_from_disk(self) -> None:
        """FrozenFromDiskWarning where a streamed model's mapped frozen weights
        (`Kernels.map_frozen`) are more than the memory available once snake's tiers and
        buffers are allocated (the page cache they are in counts as available)."""
        k = self.kernels
        if not k.frozen_mapped:
            return
        mapped = sum(h.numel() * h.element_size() for h in k.frozen_host if h is not None)
        available = _available_memory()
        if mapped <= available:
            return
        warnings.warn(
            f"the frozen layer weights snake maps from offload_dir take {fmt_size(mapped)}, more than the "
            f"{fmt_size(available)} of memory available with snake's tiers allocated: the page cache cannot "
            "hold them, so every pass over the layers reads them from the disk again (vertical: twice an "
            f"iteration, {fmt_size(2 * mapped)}; horizontal: twice a micro-batch), which the planner does not "
            f"count; leave the page cache {fmt_size(mapped - available)} more (a lower cpu_memory_bytes or "
            "lower placement shares) to keep them in memory",
            FrozenFromDiskWarning,
            stacklevel=2,
        )

    def inline_store(self, kind: str, layer: int, micro_batch: int) -> torch.Tensor | None:
        """Where the compute thread writes an activation itself: the flat CPU memory of its
        store unit, on a CPU device, when the unit lives wholly in CPU memory. There the
        device-to-host "copy" is a memcpy of a few KiB; made on the compute thread right after
        the kernel, it saves a hop through the copy thread and two trips through the event
        loop per micro-batch, which on a CPU device take cores from the kernels. With a
        metered link (`device_link_bytes_per_s`) d2h still charges the link's time before the
        unit counts as stored. None otherwise (d2h copies it)."""
        if not self.inline_stores or self.device.type != "cpu":
            return None
        key = ("inline", kind, self.unit_key(kind, layer, micro_batch))
        if key in self.unit_views:
            return self.unit_views[key]
        store = self.stores[kind]
        u = store.unit(key[2])
        view = None if u.tail_n else store.head(u)[0]
        if self.keep_unit_views:
            self.unit_views[key] = view
        return view

    @staticmethod
    def unit_key(kind: str, layer: int, micro_batch: int) -> tuple[int, int]:
        """Store unit of an activation. Inter-layer gradients live only from the backward
        stage that writes them to the next one that reads them: two layers' worth of slots
        (layer parity) serve them all. Checkpoints: one unit per layer and micro-batch."""
        return (layer % 2, micro_batch) if kind == "act_grad" else (layer, micro_batch)

    # -- setup ------------------------------------------------------------------------
    def _make_pools(self) -> None:
        sizes = PoolSizes()
        st = self.stores

        def host_pool(name: str, store: TierStore, count: int, pin: bool = True) -> BufferPool[HostBuffer] | None:
            """`pin=False`: a pool only the CPU optimizer and the SSD use (never the link)."""
            if store.max_tail_bytes == 0:
                return None
            return BufferPool(name, [self._alloc(store.max_tail_bytes, pin=pin) for _ in range(count)])

        def grad_slot() -> torch.Tensor:
            if self.device.type == "cpu":  # host memory: zeroed a chunk at a time (`stop`)
                return alloc_host_tensor(self.P, torch.float32, pin=False, stop=self.stop)
            return torch.zeros(self.P, dtype=torch.float32, device=self.device)

        self.pools = {
            "param_in": host_pool("param_in", st["param"], sizes.param_tails),
            "param_out": host_pool("param_out", st["param"], self.workers, pin=False),
            "ckpt_in": host_pool("ckpt_in", st["ckpt"], self.ckpt_ssd_per_layer() + sizes.ckpt_in_extra),
            "ckpt_out": host_pool("ckpt_out", st["ckpt"], self.ckpt_ssd_per_layer() + sizes.ckpt_out_extra),
            "opt": host_pool("opt", st["opt"], sizes.opt_tails(self.workers, self.delayed), pin=False),
        }
        if "grad" in st:  # the delayed gradients' SSD parts: written by the now-steps, read for the delayed ones
            self.pools["grad_out"] = host_pool("grad_out", st["grad"], self.workers, pin=False)
            self.pools["grad_in"] = host_pool("grad_in", st["grad"], sizes.grad_in_tails, pin=False)
        self.param_slots: BufferPool[torch.Tensor] = BufferPool(
            "device_params",
            # a layer's trained parameters, then its streamed frozen ones (Kernels.slot_params)
            [torch.empty(self.kernels.slot_params, dtype=self.dtype, device=self.device)
             for _ in range(sizes.device_param_slots)],
        )
        # vertical on a CPU device: the host gradient buffers' memory serves as more slots
        n_grad = 2 + (sizes.grad_buffers if self.slot_grads() else 0)
        self.grad_slots: BufferPool[torch.Tensor] = BufferPool(
            "device_grads", [grad_slot() for _ in range(n_grad)]
        )
        self._all_pools = [p for p in self.pools.values() if p is not None] + [self.param_slots, self.grad_slots]

    def _alloc(self, nbytes: int, pin: bool = True) -> HostBuffer:
        """A staging buffer, unless the build has been cancelled (pinning one takes a while);
        page-locked with CUDA unless `pin=False` (one the link never reads)."""
        if self.stop.is_set():
            raise Stopped("building the engine cancelled part-way")
        return alloc_host(nbytes, pin=self.pin and pin)

    def slot_grads(self) -> bool:
        """Vertical on a CPU device: a layer's accumulated gradient goes to its optimizer
        worker in the gradient slot it was accumulated in, and the slot comes back when the
        step has read it. The slot is CPU memory there, so d2h's copy into a host buffer
        was a 4-bytes-per-parameter memcpy per layer and iteration on the cores the kernels
        run on (BENCHMARKS.md section 12). With a metered link d2h still charges the link's
        time before the optimizer gets it."""
        return self.grads_in_slots and self.vertical and self.device.type == "cpu"

    def ckpt_ssd_per_layer(self) -> int:
        """The most checkpoint units of one layer that live on SSD (whole units, so at most
        ceil((1 - share) x micro_batches)): what a stage moves through the staging pools."""
        st = self.stores["ckpt"]
        return max(sum(st.has_tail((layer, m)) for m in range(self.M)) for layer in range(self.N))

    def _make_grads(self) -> None:
        """Gradients reach CPU memory. Vertical: a pool of whole-layer fp32 buffers for the
        now-step (on a CPU device the gradient slots themselves, `slot_grads`), plus room per
        layer for the delayed (alpha) share until the next iteration's forward
        (`_delayed_room`; what placement.grad leaves out of it waits on SSD, `delayed_tail`). Horizontal: an fp32 accumulator per layer
        (ZeRO-Infinity style; the delayed share stays in it until it is stepped). On CUDA,
        horizontal also has one pinned layer buffer (`grad_staging`) that each micro-batch's
        gradient crosses on the copy stream before it is added to the accumulator."""
        if self.vertical:
            self.grad_host: BufferPool[torch.Tensor] | None = None  # the slots serve (`slot_grads`)
            if not self.slot_grads():
                self.grad_host = BufferPool("host_grads", [
                    alloc_host_tensor(self.P, torch.float32, pin=self.pin, stop=self.stop)
                    for _ in range(PoolSizes().grad_buffers)
                ])
                self._all_pools.append(self.grad_host)
            self.delayed_grads = [self._delayed_room(layer, self.layer_parts[layer][DELAYED]) for layer in range(self.N)]
            self.accumulators: list[torch.Tensor] = []
        else:
            self.grad_host = None
            self.delayed_grads = []
            self.accumulators = [alloc_host_tensor(n, torch.float32, pin=self.pin, stop=self.stop) for n in self.layer_P]
        # a pageable `.to("cpu")` of each micro-batch's gradient allocated (and faulted in)
        # 4 bytes per parameter on every call and ran on the compute stream: horizontal on
        # an H100 spent ~1.6 s per extra micro-batch there (BENCHMARKS.md section 8)
        self.grad_staging: torch.Tensor | None = (
            alloc_host_tensor(self.P, torch.float32, pin=True, stop=self.stop) if self.pin and not self.vertical else None
        )

    def _reused(self, layer: int, n: int) -> tuple[torch.Tensor | None, int]:
        """fp32 room in the CPU head of the layer's delayed parameter share, reinterpreted
        (GreedySnake 4.4: once the layer's backward is done, those parameters are stale until
        the delayed step rewrites them from the fp32 master, so their memory can hold the
        gradient meanwhile): its view and how many of the `n` delayed gradient elements fit."""
        store = self.stores["param"]
        u = store.unit((layer, DELAYED))
        start = -(-u.head_offset * store.esize // 4) * 4  # first 4-byte-aligned byte of the head
        stop = (u.head_offset + u.k) * store.esize
        reused = min(n, max(0, (stop - start) // 4))
        view = store.cpu.view(torch.uint8)[start : start + 4 * reused].view(torch.float32) if reused else None
        return view, reused

    def _grad_store(self, store_kw: dict[str, Any]) -> TierStore:
        """The delayed gradients beyond what the stale delayed parameters' memory holds
        (`_reused`): per layer one unit, its head in CPU memory and its tail on SSD. The
        layer keeps max(grad share x its delayed elements, what is reused) in CPU memory, so
        the stale memory, which costs nothing, is always used first."""
        share = self.placement.grad
        units, heads = [], []
        for layer, (_n_now, n) in enumerate(self.layer_parts):
            if not n:
                continue
            reused = self._reused(layer, n)[1]
            units.append(((layer, DELAYED), n - reused))
            heads.append(max(n if share >= 1.0 else int(round(share * n)), reused) - reused)
        return TierStore("grad", torch.float32, units, cpu_share=share, heads=heads, **{**store_kw, "pin": False})

    def _delayed_room(self, layer: int, n: int) -> list[torch.Tensor]:
        """fp32 room in CPU memory for the delayed gradient elements of `layer`, as
        consecutive pieces: the stale delayed parameters' memory (`_reused`), then the head
        of its unit in the grad store. The unit's tail (`delayed_tail`) follows them on SSD."""
        if not n:
            return []
        view, _reused = self._reused(layer, n)
        room = [view] if view is not None else []
        u = self.stores["grad"].unit((layer, DELAYED))
        if u.k:
            room.append(self.stores["grad"].head(u)[0])
        return room

    def release_held_grads(self) -> None:
        """On the event loop, after flush_delayed applied the steps they were kept for."""
        pool = self.pools.get("grad_out")
        for layer in list(self.held_grads):
            buf = self.held_grads.pop(layer)
            if pool is not None:
                pool.release(buf)

    def delayed_tail(self, layer: int) -> Unit | None:
        """The grad store's unit of `layer` where part of it lives on SSD, else None."""
        st = self.stores.get("grad")
        if st is None or not st.has_tail((layer, DELAYED)):
            return None
        return st.unit((layer, DELAYED))

    def load_initial_weights(self, stop: threading.Event | None = None) -> None:
        """Blocking: write every block's weights into the param and opt stores (fp32 master,
        zero Adam moments). Called once, before the first run. Raises Stopped before the
        next layer once `stop` is set (its task was cancelled)."""
        parts = self.kernels.parts
        scratch = alloc_host(max(self.stores["param"].max_tail_bytes, self.stores["opt"].max_tail_bytes, 1), pin=False)
        for layer, block in enumerate(parts.blocks):
            if stop is not None and stop.is_set():
                raise Stopped("writing the initial weights cancelled part-way")
            values = layer_values(parts, layer, flat_named(block))  # read now where on the meta device
            flat = torch.cat([p.reshape(-1).to(torch.float32) for p in values] or [torch.empty(0)])
            del values
            off = 0
            for part, n in enumerate(self.layer_parts[layer]):
                if not n:
                    continue
                master = flat[off : off + n]
                off += n
                for kind, comps in (("opt", [master, None, None]), ("param", [master])):
                    store = self.stores[kind]
                    u = store.unit((layer, part))
                    head = store.head(u)
                    tail = store.tail(u, scratch) if u.tail_n else None
                    for c, src in enumerate(comps):
                        h = head[c]
                        if src is None:
                            h.zero_()
                            if tail is not None:
                                tail[c].zero_()
                        else:
                            scatter([src], [h] + ([tail[c]] if tail is not None else []))
                    if tail is not None:
                        store.write_tail(u, scratch)

    # -- reading state back -------------------------------------------------------------
    def layer_master(self, layer: int, scratch: HostBuffer | None) -> torch.Tensor:
        """Blocking: `layer`'s fp32 master weights, flat, in a tensor of its own (pending
        delayed steps must have been flushed): its CPU heads and its SSD tails, read through
        `scratch` (an optimizer-state staging buffer, idle outside a run)."""
        store = self.stores["opt"]
        out = torch.empty(self.layer_P[layer], dtype=torch.float32)
        off = 0
        for part, n in enumerate(self.layer_parts[layer]):
            if not n:
                continue
            u = store.unit((layer, part))
            out[off : off + u.k].copy_(store.head(u)[0])
            if u.tail_n:
                assert scratch is not None
                store.read_tail(u, scratch)
                out[off + u.k : off + u.n].copy_(store.tail(u, scratch)[0])
            off += u.n
        assert off == out.numel(), "a layer's parts cover its parameters"
        return out

    # -- end of run -------------------------------------------------------------------
    def check_pools(self) -> None:
        held = self.pools.get("grad_out")  # its buffers that hold layer 0's gradient for the next run
        for p in self._all_pools:
            p.check_all_returned(len(self.held_grads) if p is held else 0)

    def shutdown_executors(self) -> None:
        """Every executor but the data thread's, which the trainer owns (and may not be able
        to wait for: the user's next() runs there)."""
        for ex in dict.fromkeys(v for k, v in self.executors.items() if k != "data"):  # shared ones once
            ex.shutdown(wait=True, cancel_futures=True)

    def close_files(self) -> None:
        for s in getattr(self, "stores", {}).values():
            s.close()

    def close(self) -> None:
        self.shutdown_executors()
        self.close_files()
        self.kernels.restore_modes()

    def offload_bytes(self) -> int:
        return sum(s.file_bytes for s in self.stores.values())

    def cpu_store_bytes(self) -> int:
        return sum(s.cpu_bytes() for s in self.stores.values())


def _available_memory() -> int:
    """The host memory available now (the page cache counts as available)."""
    return int(psutil.virtual_memory().available)


def _allocated(path: Path) -> int:
    """Bytes of disk `path` holds (its blocks: a sparse file holds less than its size), 0
    where there is no such file."""
    try:
        return path.stat().st_blocks * 512
    except FileNotFoundError:
        return 0
