"""The device mover, one actor per direction (GreedySnake 4.2-4.3).

h2d
| consumes  | its plan (snake.plans.h2d_plan), TailOnHost (param, ckpt) from ssd_read |
| produces  | ParamsOnDevice, ActivationOnDevice -> compute                          |
| waits for | the clock (one stage ahead), the ledger (unit written), a device slot  |
| unblocked | by compute (publishes stages, returns param slots), ssd_read, d2h      |

d2h
| consumes  | ActivationProduced, GradsProduced from compute                          |
| produces  | WriteTail -> ssd_write; GradsOnHost -> optimizer[layer % workers]       |
| waits for | a staging buffer (ckpt tails), a host gradient buffer (vertical)        |
| unblocked | by ssd_write (returns tail buffers), optimizer (returns grad buffers)   |

CPU<->device moves whole units here; on CUDA on a copy stream with pinned host buffers.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from snake.actors.base import Actor
from snake.channels import Mailbox, StageClock
from snake.clip import layer_norms
from snake.device import Copier
from snake.engine import Engine
from snake.messages import (
    ActivationOnDevice,
    ActivationProduced,
    GradsOnHost,
    GradsProduced,
    ParamsOnDevice,
    Stop,
    TailOnHost,
    WriteTail,
)
from snake.plans import H2DOp, Idle


def alias(base: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over `base`'s memory at element `offset`, contiguous, with a version counter
    of its own: the store's other units are written while this one is in use, and autograd
    must not take those writes for changes to this one."""
    stride = []
    acc = 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    out = torch.empty(0, dtype=base.dtype, device=base.device)
    return out.set_(base.untyped_storage(), base.storage_offset() + offset, shape, tuple(reversed(stride)))


class HostToDevice(Actor):
    name = "h2d"

    def __init__(self, engine: Engine, *, inbox: Mailbox, compute: Mailbox, clock: StageClock) -> None:
        super().__init__(engine.tracer)
        self.e = engine
        self.inbox = inbox
        self.compute = compute
        self.clock = clock
        self.copier = Copier(engine.device)

    def _alias(self, kind: str, key: Hashable, base: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        """`alias` of a store unit, made on first use and kept (`Engine.unit_views`): a
        unit's place in its store never moves, and each tensor made on the event loop cost
        it ~40-50 us (two thirds of the loop's torch calls per iteration were these on a
        2-core VM, BENCHMARKS.md section 12)."""
        views = self.e.unit_views
        view = views.get(("h2d", kind, key))
        if view is None:
            view = alias(base, offset, shape)
            if self.e.keep_unit_views:
                views[("h2d", kind, key)] = view
        return view

    async def run(self) -> None:
        for op in self.e.plans.h2d_plan(self.clock.iterations()):
            if isinstance(op, Idle):
                self.at(op.t)
                await self.clock.begun(op.t)
                continue
            self.at(op.t, op.load.layer, op.load.micro_batch if op.load.micro_batch >= 0 else None)
            if not await self.clock.reach(op.start, op.t):
                continue  # the run stopped before this iteration (the data, or a stop asked for)
            if op.load.kind == "param":
                await self._params(op)
            else:
                await self._activation(op)

    async def _params(self, op: H2DOp) -> None:
        e, layer = self.e, op.load.layer
        store = e.stores["param"]
        view = self._cpu_view(layer)
        if view is not None:
            for part, n in enumerate(e.layer_parts[layer]):
                if n:
                    await e.ledger.wait_for(("param", layer, part), op.t)
            moved = e.layer_P[layer] * store.esize + self._frozen_in_place(layer)
            await e.link_wait("cpu->gpu", moved)
            e.traffic.add(op.t, "cpu", "gpu", "param", moved)
            await self.compute.put(ParamsOnDevice(op.t, op.g, layer, view, pooled=False))
            return
        slot = await e.param_slots.acquire()
        try:
            pairs, tails = [], []
            off = 0
            for part, n in enumerate(e.layer_parts[layer]):
                if not n:
                    continue
                u = store.unit((layer, part))
                await e.ledger.wait_for(("param", layer, part), op.t)
                pairs.append((slot[off : off + u.k], store.head(u)[0]))
                if u.tail_n:
                    msg: TailOnHost = await self.inbox.take(("tail", "param", (layer, part), op.g))
                    tails.append(msg)
                    pairs.append((slot[off + u.k : off + n], store.tail(u, msg.buf)[0]))
                off += n
            frozen = e.kernels.frozen_host[layer]
            if frozen is not None and e.device.type != "cpu":  # the layer's streamed frozen parameters, after
                pairs.append((slot[off : off + frozen.numel()], frozen))  # its trained ones (a CPU device
                off += frozen.numel()  # reads them where they are: `Kernels.frozen_views`)
            nbytes = off * store.esize  # copied
            moved = nbytes + self._frozen_in_place(layer)
            try:
                await e.link_wait("cpu->gpu", moved)
                await self.work(e.executors["h2d"], f"param L{layer}", self.copier.copy, pairs, link="cpu->gpu", bytes=nbytes)
            finally:
                for m in tails:
                    m.pool.release(m.buf)
            e.traffic.add(op.t, "cpu", "gpu", "param", moved)
        except BaseException:
            e.param_slots.release(slot)
            raise
        await self.compute.put(ParamsOnDevice(op.t, op.g, layer, slot))

    def _frozen_in_place(self, layer: int) -> int:
        """Bytes of the layer's streamed frozen parameters that a CPU device reads where they
        are: moved by the schedule as a GPU's copy moves them (the traffic, the emulated
        link, the planner's count), though nothing is copied."""
        frozen = self.e.kernels.frozen_host[layer]
        if frozen is None or self.e.device.type != "cpu":
            return 0
        return frozen.numel() * frozen.element_size()

    def _cpu_view(self, layer: int) -> torch.Tensor | None:
        """When the device is the CPU and the layer lives wholly in CPU memory, its flat
        parameters are a view of the store: nothing to copy. Safe because the optimizer
        rewrites them only after the backward is done with them, and the next load waits
        for that (the ledger)."""
        e = self.e
        if e.device.type != "cpu":
            return None
        store = e.stores["param"]
        units = [store.unit((layer, p)) for p, n in enumerate(e.layer_parts[layer]) if n or not e.layer_P[layer]]
        if any(u.tail_n for u in units):
            return None
        return self._alias("param", layer, store.cpu, units[0].head_offset, (e.layer_P[layer],))

    async def _activation(self, op: H2DOp) -> None:
        e, ld = self.e, op.load
        store = e.stores[ld.kind]
        u = store.unit(e.unit_key(ld.kind, ld.layer, ld.micro_batch))
        await e.ledger.wait_for((ld.kind, ld.layer, ld.micro_batch), op.t + 1)
        tail = None
        if u.tail_n:
            tmsg: TailOnHost = await self.inbox.take(("tail", ld.kind, (ld.layer, ld.micro_batch), op.g))
            tail = tmsg.buf
        nbytes = u.n * store.esize
        if tail is None and e.device.type == "cpu":  # the CPU copy is the device copy
            await e.link_wait("cpu->gpu", nbytes)
            e.traffic.add(op.t, "cpu", "gpu", ld.kind, nbytes)
            key = e.unit_key(ld.kind, ld.layer, ld.micro_batch)
            dev_view = self._alias(ld.kind, key, store.cpu, u.head_offset, tuple(e.ckpt_shape))
            await self.compute.put(ActivationOnDevice(ld.kind, op.t, op.g, ld.layer, ld.micro_batch, dev_view))
            return

        def load() -> torch.Tensor:
            dev = self.copier.empty(e.ckpt_shape, store.dtype)
            flat = dev.view(-1)
            pairs = [(flat[: u.k], store.head(u)[0])]
            if tail is not None:
                pairs.append((flat[u.k :], store.tail(u, tail)[0]))
            self.copier.copy(pairs)
            return dev

        try:
            label = f"{ld.kind} L{ld.layer} mb{ld.micro_batch}"
            await e.link_wait("cpu->gpu", nbytes)
            dev = await self.work(e.executors["h2d"], label, load, link="cpu->gpu", bytes=nbytes)
        finally:
            if tail is not None:
                tmsg.pool.release(tail)
        e.traffic.add(op.t, "cpu", "gpu", ld.kind, nbytes)
        await self.compute.put(ActivationOnDevice(ld.kind, op.t, op.g, ld.layer, ld.micro_batch, dev))


class DeviceToHost(Actor):
    name = "d2h"

    def __init__(self, engine: Engine, *, inbox: Mailbox, ssd_write: Mailbox, optimizers: list[Mailbox]) -> None:
        super().__init__(engine.tracer)
        self.e = engine
        self.inbox = inbox
        self.ssd_write = ssd_write
        self.optimizers = optimizers
        self.copier = Copier(engine.device)

    async def run(self) -> None:
        while True:
            msg = await self.inbox.get()
            match msg:
                case Stop():
                    await self.ssd_write.put(Stop(self.name))
                    return
                case ActivationProduced():
                    await self._activation(msg)
                case GradsProduced():
                    await self._grads(msg)
                case _:
                    raise TypeError(f"d2h: unexpected message {type(msg).__name__}")

    async def _activation(self, msg: ActivationProduced) -> None:
        e = self.e
        self.at(msg.t, msg.layer, msg.micro_batch)
        store = e.stores[msg.kind]
        u = store.unit(e.unit_key(msg.kind, msg.layer, msg.micro_batch))
        if msg.tensor is None:  # already in CPU memory (Engine.inline_store): the link's time only
            await e.link_wait("gpu->cpu", u.n * store.esize)
            e.traffic.add(msg.t, "gpu", "cpu", msg.kind, u.n * store.esize)
            await e.ledger.mark((msg.kind, msg.layer, msg.micro_batch), msg.t + 1)
            return
        flat = msg.tensor.reshape(-1)
        pool = e.pools["ckpt_out"] if u.tail_n else None
        buf = await pool.acquire() if pool is not None else None
        pairs = [(store.head(u)[0], flat[: u.k])]
        if buf is not None:
            pairs.append((store.tail(u, buf)[0], flat[u.k :]))
        nbytes = u.n * store.esize
        try:
            label = f"{msg.kind} L{msg.layer} mb{msg.micro_batch}"
            await e.link_wait("gpu->cpu", nbytes)
            await self.work(e.executors["copy"], label, self.copier.copy, pairs, link="gpu->cpu", bytes=nbytes)
        except BaseException:
            if buf is not None and pool is not None:
                pool.release(buf)
            raise
        e.traffic.add(msg.t, "gpu", "cpu", msg.kind, nbytes)
        key = (msg.kind, msg.layer, msg.micro_batch)
        if buf is not None and pool is not None:
            need = e.plans.fwd_ckpt_need.get((msg.layer, msg.micro_batch)) if msg.kind == "ckpt" else None
            forward = None if need is None else ("tail", "ckpt", (msg.layer, msg.micro_batch), msg.t * e.S + need)
            # a checkpoint no backward reads (below the lowest layer with one) only goes on to
            # the forward stage that takes it
            read_back = msg.kind != "ckpt" or msg.layer >= e.lowest
            await self.ssd_write.put(WriteTail(msg.t, store, u, buf, pool, key, msg.t + 1, forward, read_back))
        else:
            await e.ledger.mark(key, msg.t + 1)

    async def _grads(self, msg: GradsProduced) -> None:
        e = self.e
        self.at(msg.t, msg.layer, msg.micro_batch if msg.micro_batch >= 0 else None)
        n = e.layer_P[msg.layer]  # the layer's part of the slot (a smaller kind's is shorter)
        nbytes = n * 4
        label = f"grads L{msg.layer}" + (f" mb{msg.micro_batch}" if msg.micro_batch >= 0 else "")
        dest = self.optimizers[msg.layer % len(self.optimizers)]
        if e.slot_grads():  # vertical, CPU device: the optimizer steps from the slot itself
            try:
                await self._norms(msg.t, msg.layer, msg.buf)
                await e.link_wait("gpu->cpu", nbytes)
            except BaseException:
                e.grad_slots.release(msg.buf)
                raise
            e.traffic.add(msg.t, "gpu", "cpu", "grad", nbytes)
            await dest.put(GradsOnHost(msg.t, msg.layer, msg.buf))
            return
        if e.grad_host is not None:  # vertical: the whole accumulated gradient, once
            host = await e.grad_host.acquire()
            try:
                await e.link_wait("gpu->cpu", nbytes)
                await self.work(e.executors["copy"], label, self.copier.copy, [(host[:n], msg.buf[:n])], link="gpu->cpu",
                                bytes=nbytes)
            except BaseException:
                e.grad_host.release(host)
                raise
            finally:
                e.grad_slots.release(msg.buf)
            try:
                await self._norms(msg.t, msg.layer, host)
            except BaseException:
                e.grad_host.release(host)
                raise
            e.traffic.add(msg.t, "gpu", "cpu", "grad", nbytes)
            await dest.put(GradsOnHost(msg.t, msg.layer, host))
            return
        acc = e.accumulators[msg.layer][:n]
        grad = msg.buf[:n]
        staging = e.grad_staging[:n] if e.grad_staging is not None else None  # one: the copy executor has one thread

        def accumulate() -> None:
            if msg.first:
                self.copier.copy([(acc, grad)])
            elif staging is None:  # CPU device: the gradient is in host memory already
                acc.add_(grad)
            else:
                self.copier.copy([(staging, grad)])
                acc.add_(staging)

        try:
            await e.link_wait("gpu->cpu", nbytes)
            await self.work(e.executors["copy"], label, accumulate, link="gpu->cpu", bytes=nbytes)
        finally:
            e.grad_slots.release(msg.buf)
        e.traffic.add(msg.t, "gpu", "cpu", "grad", nbytes)
        if msg.last:
            await self._norms(msg.t, msg.layer, e.accumulators[msg.layer])
            await dest.put(GradsOnHost(msg.t, msg.layer, None))

    async def _norms(self, t: int, layer: int, flat: torch.Tensor) -> None:
        """A layer's complete gradient (in host memory), before the optimizer that takes it
        has it: float16 at a static loss scale checks that it is finite (GradientOverflow
        otherwise: the run fails before any step of it, `Kernels.check_finite`); with
        clipping or a dynamic scale, its norms. On the copy thread, which on a GPU mostly
        waits for its copies, not on the optimizer's."""
        e = self.e
        k = e.kernels
        if k.checks_overflow:
            await self.work(e.executors["copy"], f"grad check L{layer}", k.check_finite,
                            [flat[: e.layer_P[layer]]], f"layer {layer}", t)
        if e.clip is None:
            return
        norms = await self.work(e.executors["copy"], f"grad norm L{layer}", layer_norms, flat,
                                k.kind_numels[k.kinds[layer]])
        e.clip.add_layer(t, layer, norms)
