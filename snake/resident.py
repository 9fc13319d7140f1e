"""The optimizer state of the parameters held on the device (pre/post's: the embedding and
the head; the blocks' parameters kept in float32): their fp32 master weights and AdamW
moments, as flat CPU tensors, or (`SnakeConfig.resident_optimizer="ssd"`) in chunks of a
store on SSD, stepped a chunk at a time through two staging buffers while the next chunk is
read and the last one written. The device copies and gradient accumulators are the
kernels' (`Kernels.res_dev`, `res_grad`); the step updates the copies from the masters.
Every method blocks: the compute actor's thread runs the step, a save or load its own."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Executor, Future
from pathlib import Path

import torch

from snake.buffers import HostBuffer, alloc_host, alloc_host_tensor
from snake.config import AdamW
from snake.errors import Stopped, StorageError
from snake.memory import resident_chunk
from snake.optim import adamw_step
from snake.stores import TierStore, Unit


class ResidentState:
    def __init__(
        self, names: list[str], params: list[torch.Tensor], *, on_ssd: bool, opt: AdamW, decay: list[bool],
        dev: list[torch.Tensor], grad: list[torch.Tensor], device: torch.device, pin: bool,
    ) -> None:
        """`names` ("model."-prefixed) and `params`: the resident parameters, whose values are
        the initial masters; `dev`, `grad`: their device copies and fp32 gradient
        accumulators (the kernels'), updated and read by the step. Nothing here refers back
        to the kernels: a reference cycle kept a planner probe's kernels (and their copies
        of the embedding and head) alive until the cyclic collector ran, 110 MiB of RSS at
        a 16k vocabulary (tests/test_memory_budget.py)."""
        self.names = names
        self.shapes = [p.shape for p in params]
        self.opt, self.decay, self.dev, self.grad = opt, decay, dev, grad
        # set when the run is being torn down (cancelled, or another actor failed): a chunked
        # step stops at its next chunk (the engine's `stop`)
        self.stop: threading.Event | None = None
        # the fp32 masters and moments: flat CPU tensors here, or with the state on SSD
        # chunks of a store (`use_store`), where these lists stay empty; read and written
        # through `components` / `set`
        self.on_ssd = on_ssd
        self.store: TierStore | None = None
        self.units: list[list[Unit]] = []  # per parameter, its chunks in the store
        self.stages: list[HostBuffer] = []  # two chunks' master, m and v (the step's pipeline)
        self.stage: HostBuffer | None = None  # the first of them (saves, loads)
        self.io: Executor | None = None  # the SSD threads the step's transfers run on (the engine's)
        self.progress: Callable[[], None] | None = None  # called per chunk (the stall watchdog's)
        self.now: Callable[[], float] = time.perf_counter  # the tracer's clock (the engine's)
        # the step's SSD transfers, (actor, label, start, end, link, bytes) each, for the
        # trace: taken on the loop (`take_transfers`)
        self.transfers: list[tuple[str, str, float, float, str, int]] = []
        # one chunk's gradient on the host: the state on SSD, or in CPU memory with a GPU
        self.gstage: torch.Tensor | None = None
        self._initial = list(params) if on_ssd else []  # written to the store once
        self.master = [] if on_ssd else [p.detach().to("cpu", torch.float32).clone().reshape(-1) for p in params]
        total = sum(s.numel() for s in self.shapes)
        if not on_ssd and device.type != "cpu" and total:
            self.gstage = alloc_host_tensor(resident_chunk(total), torch.float32, pin=pin)
        self.m = [torch.zeros_like(p) for p in self.master]
        self.v = [torch.zeros_like(p) for p in self.master]

    def _check_stop(self) -> None:
        if self.stop is not None and self.stop.is_set():
            raise Stopped("the resident step stopped part-way: the run is being cancelled or has failed")

    def step(self, on: list[int], step: int, skips: list[int]) -> int:
        """AdamW on the parameters `on` (their gradients in `grad`), each at step count
        `step` less the steps it missed (`skips`), and their device copies from the new
        masters. Returns the SSD bytes read and written."""
        if self.store is None and self.gstage is None:  # a CPU device: the gradients are host memory
            adamw_step([self.master[i] for i in on], [self.grad[i] for i in on], [self.m[i] for i in on],
                       [self.v[i] for i in on], step=[step - skips[i] for i in on], opt=self.opt,
                       lr=self.opt.lr_at(step), decay=[self.decay[i] for i in on])
            with torch.no_grad():
                for dev, master, shape in zip(self.dev, self.master, self.shapes, strict=True):
                    dev.copy_(master.view(shape))
            return 0
        if self.store is None:
            self._step_staged(on, step, skips)
            return 0
        return self._step_ssd(on, step, skips)

    def _step_staged(self, on: list[int], step: int, skips: list[int]) -> None:
        """The resident step with the state in CPU memory and the gradients on a GPU: each
        parameter a chunk at a time through one pinned gradient buffer (a chunk's gradient
        in, its master back out), not a pageable host copy of every gradient each iteration."""
        gbuf = self.gstage
        assert gbuf is not None
        c = gbuf.numel()
        with torch.no_grad():
            for i in on:
                n = self.shapes[i].numel()
                dev = self.dev[i].view(-1)
                for a in range(0, n, c):
                    self._check_stop()
                    b = min(n, a + c)
                    g = gbuf[: b - a]
                    g.copy_(self.grad[i][a:b])
                    master = self.master[i][a:b]
                    adamw_step([master], [g], [self.m[i][a:b]], [self.v[i][a:b]],
                               step=step - skips[i], opt=self.opt, lr=self.opt.lr_at(step),
                               decay=[self.decay[i]])
                    dev[a:b].copy_(master)

    def _step_ssd(self, on: list[int], step: int, skips: list[int]) -> int:
        """The resident step with the state on SSD, chunk after chunk of the parameters `on`,
        pipelined over two staging buffers: the next chunk is read (on `io`, the SSD
        threads) while this one is stepped, and each chunk is written back while the next
        is stepped. Every transfer has ended when it returns or raises."""
        store, gbuf = self.store, self.gstage
        chunks = [(i, u, a) for i in on for u, a in self._chunks(i)]
        if not chunks:
            return 0
        assert store is not None and gbuf is not None and self.io is not None
        io, bufs = self.io, self.stages
        writes: list[Future[None] | None] = [None, None]  # the last write from each buffer
        pending: list[Future[None]] = []

        def timed(write: bool, u: Unit, buf: HostBuffer) -> None:
            start = self.now()
            try:
                (store.write_tail if write else store.read_tail)(u, buf)
            finally:
                self.transfers.append(("ssd_write" if write else "ssd_read", "resident opt", start, self.now(),
                                       "cpu->ssd" if write else "ssd->cpu", store.tail_bytes(u)))

        try:
            read = io.submit(timed, False, chunks[0][1], bufs[0])
            pending.append(read)
            with torch.no_grad():
                for j, (i, u, a) in enumerate(chunks):
                    self._check_stop()
                    buf = bufs[j % 2]
                    read.result()
                    if j + 1 < len(chunks):  # the next chunk into the other buffer, once its write is done
                        other = writes[(j + 1) % 2]
                        if other is not None:
                            other.result()
                        read = io.submit(timed, False, chunks[j + 1][1], bufs[(j + 1) % 2])
                        pending.append(read)
                    t = store.tail(u, buf)
                    g = gbuf[: u.n]
                    g.copy_(self.grad[i][a : a + u.n])
                    adamw_step([t[0]], [g], [t[1]], [t[2]], step=step - skips[i], opt=self.opt, lr=self.opt.lr_at(step),
                               decay=[self.decay[i]])
                    self.dev[i].view(-1)[a : a + u.n].copy_(t[0])
                    writes[j % 2] = w = io.submit(timed, True, u, buf)
                    pending.append(w)
                    if self.progress is not None:  # a long step is not a stall
                        self.progress()
            for f in pending:
                f.result()
        finally:  # a failure: the other transfers end before the buffers are used again
            futures.wait(pending)
        return 2 * sum(store.tail_bytes(u) for _, u, _ in chunks)

    def take_transfers(self) -> list[tuple[str, str, float, float, str, int]]:
        """The SSD transfers of the steps since the last call (the trace's spans)."""
        out, self.transfers = self.transfers, []
        return out

    def sizes(self) -> list[tuple[tuple[str, int], int]]:
        """The resident-on-SSD store's units: each resident parameter in chunks of
        `resident_chunk` elements, keyed (name, chunk)."""
        total = sum(s.numel() for s in self.shapes)
        c = resident_chunk(total)
        return [((name, j), min(c, s.numel() - j * c))
                for name, s in zip(self.names, self.shapes, strict=True)
                for j in range(-(-s.numel() // c))]

    def use_store(self, store: TierStore, *, pin: bool, stop: threading.Event | None = None) -> None:
        """Blocking: keep the resident optimizer state in `store` (every unit of
        `sizes` on SSD): the model's values as masters, m and v zero. Raises Stopped
        before the next parameter once `stop` is set (the engine's build was cancelled)."""
        total = sum(s.numel() for s in self.shapes)
        c = resident_chunk(total)
        self.units = [[store.unit((name, j)) for j in range(-(-s.numel() // c))]
                      for name, s in zip(self.names, self.shapes, strict=True)]
        if total:  # (every resident parameter frozen: nothing to stage)
            self.stages = [alloc_host(3 * c * 4, pin=pin) for _ in range(2)]
            self.stage = self.stages[0]
            self.gstage = alloc_host_tensor(c, torch.float32, pin=pin, stop=stop)
        self.store = store
        for i, p in enumerate(self._initial):
            if stop is not None and stop.is_set():
                raise Stopped("writing the resident optimizer state cancelled part-way")
            master = p.detach().reshape(-1)
            self._write(i, master, None, None)
        self._initial = []

    def _chunks(self, i: int) -> Iterator[tuple[Unit, int]]:
        """Resident parameter i's units with their first element's offset."""
        a = 0
        for u in self.units[i]:
            yield u, a
            a += u.n

    def _write(self, i: int, master: torch.Tensor, m: torch.Tensor | None, v: torch.Tensor | None) -> None:
        store, buf = self.store, self.stage
        assert store is not None and buf is not None
        with torch.no_grad():
            for u, a in self._chunks(i):
                t = store.tail(u, buf)
                for c, src in enumerate((master, m, v)):
                    if src is None:
                        t[c].zero_()
                    else:
                        t[c].copy_(src[a : a + u.n])
                store.write_tail(u, buf)

    def components(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Resident parameter i's fp32 master, m and v, flat on the CPU: snake's own tensors
        (do not change them), or read from the SSD into new ones."""
        if self.store is None:
            return self.master[i], self.m[i], self.v[i]
        store, buf = self.store, self.stage
        assert buf is not None
        n = self.shapes[i].numel()
        master, m, v = (torch.empty(n, dtype=torch.float32) for _ in range(3))
        for u, a in self._chunks(i):
            store.read_tail(u, buf)
            t = store.tail(u, buf)
            for c, dst in enumerate((master, m, v)):
                dst[a : a + u.n].copy_(t[c])
        return master, m, v

    def set(self, i: int, read: Callable[[int, int, int], torch.Tensor]) -> None:
        """Blocking: resident parameter i's optimizer state from `read(c, a, b)`, elements
        [a, b) of its flat fp32 master (c = 0), m (1) or v (2); with the state on SSD a chunk
        at a time. Its device copy follows the master; its gradient accumulator is cleared."""
        n = self.shapes[i].numel()
        dev = self.dev[i].view(-1)
        with torch.no_grad():
            if self.store is None:
                for c, dst in enumerate((self.master[i], self.m[i], self.v[i])):
                    dst.copy_(read(c, 0, n))
                dev.copy_(self.master[i])
            else:
                store, buf = self.store, self.stage
                assert buf is not None
                for u, a in self._chunks(i):
                    t = store.tail(u, buf)
                    for c in range(3):
                        t[c].copy_(read(c, a, a + u.n))
                    store.write_tail(u, buf)
                    dev[a : a + u.n].copy_(t[0])
            self.grad[i].zero_()

    def snapshot(self, directory: Path) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Blocking, with the state on SSD: every resident parameter's master, m and v (flat
        fp32) read into a shared mapping of a scratch file in `directory`, unlinked at once:
        pages the kernel writes back and may drop, so a save does not hold the whole state
        in the process's own memory. The mapping lives as long as the tensors."""
        store, buf = self.store, self.stage
        assert store is not None
        total = sum(s.numel() for s in self.shapes)
        if not total:  # every resident parameter frozen: nothing stored
            return [(e, e, e) for e in (torch.empty(0),) * len(self.shapes)]
        assert buf is not None
        path = directory / "resident-save.bin"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, 3 * total * 4)  # the blocks now: no SIGBUS on a full disk later
            finally:
                os.close(fd)
            flat = torch.from_file(str(path), shared=True, size=3 * total, dtype=torch.float32)
        except OSError as e:
            raise StorageError(
                e.errno or errno.EIO,
                f"save: the scratch file {path} for the resident optimizer state could not be made ({e}); "
                "free space in the offload_dir",
            ) from e
        finally:
            path.unlink(missing_ok=True)
        out = []
        off = 0
        for i, s in enumerate(self.shapes):
            n = s.numel()
            comps = tuple(flat[off + c * n : off + (c + 1) * n] for c in range(3))
            for u, a in self._chunks(i):
                store.read_tail(u, buf)
                t = store.tail(u, buf)
                for c in range(3):
                    comps[c][a : a + u.n].copy_(t[c])
            out.append(comps)
            off += 3 * n
        return out  # type: ignore[return-value]

    def index(self) -> dict[str, int]:
        """Each resident parameter's index (for `master_of`) by its name without the
        'model.' prefix."""
        return {n[len("model.") :]: i for i, n in enumerate(self.names)}

    def master_of(self, i: int) -> torch.Tensor:
        """Blocking: resident parameter i's fp32 master weights in its shape, in a tensor of
        its own (read from the SSD a chunk at a time where the state is there)."""
        s = self.shapes[i]
        if self.store is None:
            return self.master[i].view(s).clone()
        store, buf = self.store, self.stage
        assert buf is not None
        master = torch.empty(s.numel(), dtype=torch.float32)
        for u, a in self._chunks(i):
            store.read_tail(u, buf)
            master[a : a + u.n].copy_(store.tail(u, buf)[0])
        return master.view(s)
