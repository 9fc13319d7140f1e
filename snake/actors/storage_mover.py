"""The storage mover, one actor per direction: CPU <-> SSD in whole units (GreedySnake 4.1:
layer granularity between CPU memory and SSD).

ssd_read
| consumes  | its plan (snake.plans.read_plan)                                       |
| produces  | TailOnHost -> h2d (param, ckpt), -> optimizer[layer % workers] (opt,   |
|           | grad)                                                                  |
| waits for | the clock (lead stages ahead), the ledger (the version it needs is     |
|           | written), a staging buffer                                             |
| unblocked | by compute (clock), ssd_write / optimizer (ledger), consumers (buffers)|

ssd_write
| consumes  | WriteTail from d2h and the optimizer workers; Stop from each of them   |
| produces  | ledger marks; returns each staging buffer to its pool, or hands a      |
|           | checkpoint the next forward stage needs on to h2d (TailOnHost)         |
"""

from __future__ import annotations

from snake.actors.base import Actor
from snake.channels import Mailbox, StageClock
from snake.engine import Engine
from snake.messages import Stop, TailOnHost, WriteTail
from snake.plans import Idle

READ_POOL = {"param": "param_in", "ckpt": "ckpt_in", "opt": "opt", "grad": "grad_in"}


class SsdRead(Actor):
    name = "ssd_read"

    def __init__(
        self,
        engine: Engine,
        *,
        h2d: Mailbox,
        optimizers: list[Mailbox],
        clock: StageClock,
    ) -> None:
        super().__init__(engine.tracer)
        self.e = engine
        self.h2d = h2d
        self.optimizers = optimizers
        self.clock = clock

    async def run(self) -> None:
        e = self.e
        plan = e.plans.read_plan(self.clock.iterations(), lambda kind, unit: kind in e.stores and e.stores[kind].has_tail(unit),
                                 e.first_delayed)
        for op in plan:
            if isinstance(op, Idle):  # no read in this iteration
                self.at(op.t)
                await self.clock.begun(op.t)
                continue
            self.at(op.t, op.unit[0], op.unit[1] if op.kind == "ckpt" else None)
            if not await self.clock.reach(op.start, op.t):  # type: ignore[arg-type]
                continue  # the run stopped before this iteration (the data, or a stop asked for)
            store = e.stores[op.kind]
            u = store.unit(op.unit)
            await e.ledger.wait_for((op.kind, *op.unit), op.need_version)
            pool = e.pools[READ_POOL[op.kind]]
            assert pool is not None
            buf = await pool.acquire()
            nbytes = store.tail_bytes(u)
            try:
                label = f"{op.kind} L{op.unit[0]}" + (f" mb{op.unit[1]}" if op.kind == "ckpt" else f" part{op.unit[1]}")
                await self.work(e.executors["io"], label, store.read_tail, u, buf, link="ssd->cpu", bytes=nbytes)
            except BaseException:
                pool.release(buf)
                raise
            e.traffic.add(op.t, "ssd", "cpu", op.kind, nbytes)
            dest = self.h2d if op.kind in ("param", "ckpt") else self.optimizers[op.unit[0] % len(self.optimizers)]
            await dest.put(TailOnHost(op.tag, buf, pool))


class SsdWrite(Actor):
    name = "ssd_write"

    def __init__(self, engine: Engine, *, inbox: Mailbox, h2d: Mailbox, producers: int) -> None:
        super().__init__(engine.tracer)
        self.e = engine
        self.inbox = inbox
        self.h2d = h2d
        self.producers = producers

    async def run(self) -> None:
        stops = 0
        while stops < self.producers:
            msg = await self.inbox.get()
            match msg:
                case Stop():
                    stops += 1
                case WriteTail():
                    await self._write(msg)
                case _:
                    raise TypeError(f"ssd_write: unexpected message {type(msg).__name__}")

    async def _write(self, msg: WriteTail) -> None:
        e = self.e
        key = msg.ledger_key
        self.at(msg.t, key[1] if isinstance(key, tuple) else None)
        nbytes = msg.store.tail_bytes(msg.unit)
        if msg.write:
            try:
                label = f"{msg.store.kind} {msg.ledger_key}"
                await self.work(e.executors["io"], label, msg.store.write_tail, msg.unit, msg.buf, link="cpu->ssd",
                                bytes=nbytes)
            except BaseException:
                msg.pool.release(msg.buf)
                raise
            e.traffic.add(msg.t, "cpu", "ssd", msg.store.kind, nbytes)
        await e.ledger.mark(msg.ledger_key, msg.version)
        if msg.forward is None:
            msg.pool.release(msg.buf)
        else:
            await self.h2d.put(TailOnHost(msg.forward, msg.buf, msg.pool))
