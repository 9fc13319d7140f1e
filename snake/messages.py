"""Messages between actors: frozen facts, each carrying iteration, layer, micro-batch and
the buffer whose ownership travels with it. `key` is what a consumer `take`s it by."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from snake.buffers import BufferPool, HostBuffer
from snake.stores import TierStore, Unit


@dataclass(frozen=True, slots=True)
class BatchReady:
    t: int
    inputs: tuple[torch.Tensor, ...]
    targets: tuple[torch.Tensor, ...]
    tokens: int
    trained: int | None = None  # targets trained on, where some are ignored (-100); None: all

    @property
    def key(self) -> Hashable:
        return ("batch", self.t)


@dataclass(frozen=True, slots=True)
class ParamsOnDevice:
    t: int
    g: int
    layer: int
    slot: torch.Tensor  # flat compute-dtype parameters
    pooled: bool = True  # return `slot` to the device param pool (False: a view of CPU memory)

    @property
    def key(self) -> Hashable:
        return ("param", self.g)


@dataclass(frozen=True, slots=True)
class ActivationOnDevice:
    """A checkpoint (block input) or an inter-layer gradient, loaded for stage g."""

    kind: str  # "ckpt" | "act_grad"
    t: int
    g: int
    layer: int
    micro_batch: int
    tensor: torch.Tensor

    @property
    def key(self) -> Hashable:
        return (self.kind, self.g, self.layer, self.micro_batch)


@dataclass(frozen=True, slots=True)
class ActivationProduced:
    """Compute -> d2h: store this checkpoint / inter-layer gradient in the host tiers.
    `tensor` None: the compute thread already wrote it into CPU memory (Engine.inline_store)
    and a link is metered: d2h charges the link and marks it stored, in order with its copies."""

    kind: str
    t: int
    layer: int
    micro_batch: int
    tensor: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class GradsProduced:
    """Compute -> d2h: a layer's fp32 parameter gradient on the device. Vertical: the
    accumulation over all micro-batches (micro_batch = -1). Horizontal: one micro-batch's,
    to be accumulated on the host; `last` when it completes the layer's gradient."""

    t: int
    layer: int
    micro_batch: int
    buf: torch.Tensor
    first: bool
    last: bool


@dataclass(frozen=True, slots=True)
class GradsOnHost:
    """d2h -> optimizer: layer's gradient is complete in CPU memory (`buf`, or the host
    accumulator when None)."""

    t: int
    layer: int
    buf: torch.Tensor | None

    @property
    def key(self) -> Hashable:
        return ("grads", self.t, self.layer)


@dataclass(frozen=True, slots=True)
class TailOnHost:
    """ssd_read -> consumer: a unit's SSD part, staged in `buf` (owned by the receiver)."""

    tag: tuple[Any, ...]
    buf: HostBuffer
    pool: BufferPool[HostBuffer]  # where the receiver returns `buf`

    @property
    def key(self) -> Hashable:
        return self.tag


@dataclass(frozen=True, slots=True)
class WriteTail:
    """-> ssd_write: write `buf` as the SSD part of `unit`, mark `ledger_key` at `version`,
    then return `buf` to `pool`, or, with `forward`, hand it on to h2d: a checkpoint the next
    forward stage needs is served from CPU memory, not read back (GreedySnake 4.2)."""

    t: int
    store: TierStore
    unit: Unit
    buf: HostBuffer
    pool: BufferPool[HostBuffer]
    ledger_key: Hashable
    version: int
    forward: tuple[Any, ...] | None = None  # after writing, hand `buf` to h2d with this tag
    # False: a checkpoint only the next forward stage reads (no backward below the lowest
    # trained layer, `Engine.lowest`): handed on without being written
    write: bool = True


@dataclass(frozen=True, slots=True)
class Stop:
    sender: str
