"""Configuration: frozen dataclasses validated on construction.

`None` in `micro_batches`, `placement` or `alpha` means "the planner chooses"; the trainer
resolves it with `dataclasses.replace` before any actor starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from snake.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
SCHEDULES = ("vertical", "horizontal")
STORAGE_BACKENDS = ("auto", "posix", "buffered", "kvikio")
RESIDENT_TIERS = ("cpu", "ssd")
Dtype = Literal["float32", "bfloat16", "float16"]
Schedule = Literal["vertical", "horizontal"]


MAX_IO_THREADS = 64
_FLOAT32_TINY = 2.0**-126  # float32's smallest normal number (torch.finfo(torch.float32).tiny)
_FLOAT32_MAX = (2 - 2.0**-23) * 2.0**127  # float32's largest (torch.finfo(torch.float32).max)
MIN_SSD_BANDWIDTH = 1_000_000  # bytes/s: a cap below 1 MB/s makes setup's first writes take hours
MAX_SEED = 2**63 - 1  # torch.manual_seed's range for a non-negative seed


def _number(value: object) -> bool:
    """An int or a float, not a bool (True is an int to Python, not a number to a user)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _share(name: str, value: float) -> None:
    if not _finite(value):
        raise ConfigError(name, value, "must be a number in [0, 1]", "CPU share; the rest goes to SSD")
    if not 0.0 <= value <= 1.0:
        raise ConfigError(name, value, "must be in [0, 1]", "CPU share; the rest goes to SSD")


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """CPU-memory share of each offloaded kind, in [0, 1]; the rest lives on SSD.

    param: compute-dtype layer parameters. ckpt: per-layer input activation checkpoints.
    opt: fp32 master weights plus Adam m and v. grad: the fp32 gradients that wait for a
    delayed step (the alpha share of every layer: with clipping or a dynamic loss scale
    every layer's whole gradient) from the layer's backward to its step in the next
    iteration; whatever fits in the memory of the layer's CPU-resident delayed parameters
    (stale meanwhile) stays there at no cost whatever the share. The gradients of the step
    taken at once always go to CPU memory, and so do all of horizontal's (it adds every
    micro-batch's gradient into a per-layer accumulator there, where the delayed share
    waits too: grad places nothing there, nor at alpha = 0).
    """

    param: float = 1.0
    ckpt: float = 1.0
    opt: float = 1.0
    grad: float = 1.0

    def __post_init__(self) -> None:
        for name in SHARES:
            _share(f"placement.{name}", getattr(self, name))

    @classmethod
    def all_cpu(cls) -> Placement:
        return cls(param=1.0, ckpt=1.0, opt=1.0, grad=1.0)

    @classmethod
    def all_ssd(cls) -> Placement:
        return cls(param=0.0, ckpt=0.0, opt=0.0, grad=0.0)


SHARES = ("param", "ckpt", "opt", "grad")  # Placement's fields


@dataclass(frozen=True, kw_only=True, slots=True)
class DynamicLossScale:
    """float16's loss scale adjusted as `torch.amp.GradScaler` adjusts it (its arguments and
    defaults): an iteration whose gradients hold an inf or NaN takes no optimizer step and
    multiplies the scale by `backoff_factor`; after `growth_interval` iterations in a row
    without one the scale is multiplied by `growth_factor`. The gradients' finiteness is
    only known once the whole backward is done, so every step waits for it: alpha=1.0
    (snake.scaler)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not (_finite(self.init_scale) and _FLOAT32_TINY <= self.init_scale <= _FLOAT32_MAX):
            # the scale is float32, as GradScaler's: below its smallest normal number its
            # reciprocal is not a float32, above its largest it is inf
            raise ConfigError("loss_scale.init_scale", self.init_scale,
                              f"must be a number float32 holds, in [{_FLOAT32_TINY:.3g}, {_FLOAT32_MAX:.3g}]",
                              "GradScaler's default is 2.0**16")
        if not (_finite(self.growth_factor) and self.growth_factor > 1):
            raise ConfigError("loss_scale.growth_factor", self.growth_factor, "must be a finite number > 1",
                              "GradScaler's default is 2.0")
        if not (_finite(self.backoff_factor) and 0 < self.backoff_factor < 1):
            raise ConfigError("loss_scale.backoff_factor", self.backoff_factor, "must be in (0, 1)",
                              "GradScaler's default is 0.5")
        gi = self.growth_interval
        if not isinstance(gi, int) or isinstance(gi, bool) or gi < 1:
            raise ConfigError("loss_scale.growth_interval", gi, "must be an integer >= 1",
                              "iterations without an overflow before the scale grows; GradScaler's default is 2000")


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamW:
    """AdamW with the semantics (and defaults) of `torch.optim.AdamW`."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    # the factor of lr at each iteration's 0-based index, as LambdaLR takes it (snake.lr:
    # WarmupConstant, WarmupLinear, WarmupCosine, or any callable); None: lr throughout
    lr_schedule: Callable[[int], float] | None = None
    # which trained parameters take no weight decay: called once per parameter with its name
    # in the model and the parameter (a meta tensor where the layer is still in its files);
    # True: none. None: every one takes it, as one torch.optim.AdamW group. The two groups
    # of torch's usual recipe: snake.optim.biases_and_norms
    no_decay: Callable[[str, Any], bool] | None = None
    # clip the gradients by their global 2-norm before each step, as
    # torch.nn.utils.clip_grad_norm_(params, max_grad_norm) does (snake.clip); needs
    # alpha = 1 (every step waits for the whole iteration's gradient). math.inf: only
    # measure the norm (StepReport.grad_norm), at any alpha. None: neither
    max_grad_norm: float | None = None

    @property
    def clips(self) -> bool:
        """Whether the gradients are clipped (a finite max_grad_norm)."""
        return self.max_grad_norm is not None and math.isfinite(self.max_grad_norm)

    def lr_at(self, step: int) -> float:
        """The rate of AdamW step count `step` (1-based): lr times the schedule's factor at
        index step - 1, computed as LambdaLR computes it."""
        if self.lr_schedule is None:
            return float(self.lr)
        return float(self.lr * self.lr_schedule(step - 1))

    def __post_init__(self) -> None:
        if not (_finite(self.lr) and self.lr >= 0):
            raise ConfigError("optimizer.lr", self.lr, "must be a finite number >= 0")
        if (
            not isinstance(self.betas, tuple | list)
            or len(self.betas) != 2
            or not all(_number(b) and 0.0 <= b < 1.0 for b in self.betas)
        ):
            raise ConfigError("optimizer.betas", self.betas, "must be two numbers in [0, 1)")
        if not (_finite(self.eps) and self.eps > 0):
            raise ConfigError("optimizer.eps", self.eps, "must be a finite number > 0", "torch's default is 1e-8")
        if not (_finite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError("optimizer.weight_decay", self.weight_decay, "must be a finite number >= 0")
        g = self.max_grad_norm
        if g is not None and not (_number(g) and g > 0):
            raise ConfigError("optimizer.max_grad_norm", g, "must be a number > 0, math.inf or None",
                              "the largest global gradient norm a step takes, e.g. 1.0; math.inf measures "
                              "the norm without clipping")
        if self.no_decay is not None and not callable(self.no_decay):
            raise ConfigError(
                "optimizer.no_decay", self.no_decay, "must be a callable or None",
                "a function of (name, parameter) that is True for those without weight decay, "
                "e.g. snake.optim.biases_and_norms",
            )
        if self.lr_schedule is not None and not callable(self.lr_schedule):
            raise ConfigError(
                "optimizer.lr_schedule", self.lr_schedule, "must be a callable or None",
                "a function of the 0-based step index returning lr's factor, e.g. snake.lr.WarmupCosine(...)",
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class SnakeConfig:
    """Everything a training run needs besides the model and the data.

    micro_batches: M, micro-batches per iteration; a global batch is split along dim 0.
    offload_dir: directory of the SSD tier (created with mode 0700).
    placement: CPU share of param / ckpt / opt / grad (the delayed gradients); the default
        keeps everything in CPU memory; None: the planner chooses.
    alpha: fraction of each layer's optimizer step delayed into the next forward, in [0, 1];
        None: the planner chooses. Clipping (optimizer.max_grad_norm) and a dynamic loss scale
        need 1.
    dtype: compute dtype; master weights and gradient accumulation are fp32.
    device: "cpu", "cuda", "cuda:N"; None: CUDA if present, else CPU.
    schedule: "vertical" (layer-major, snake order) or "horizontal" (ZeRO-Infinity order).
    cpu_memory_bytes / device_memory_bytes: memory budgets; None: what the machine has.
        cpu_memory_bytes bounds the process's growth while training: placed data, a CPU
        device's working set and the runtime's overhead (`snake.memory`). The planner plans
        within them (when any of micro_batches / placement / alpha is None); a plan you fix
        is checked against them before anything is allocated (ConfigError naming what
        to change).
    ssd_bandwidth_bytes_per_s: cap on SSD reads+writes (token bucket), for experiments; at
        least 1 MB/s; None: no cap.
    device_link_bytes_per_s: cap on host<->device transfers, each direction its own token
        bucket (a full-duplex PCIe link), for experiments: on a CPU device it charges the
        bytes a GPU would move, also where the CPU run moves none (a view of host memory); at
        least 1 MB/s.
    loss_scale: float16's loss scale: a number, static (ignored with other dtypes; a step
        whose gradient overflowed fails the run with GradientOverflow before it is taken,
        where plain PyTorch with a fixed scale puts inf or nan into the weights), or a
        DynamicLossScale (float16 only, alpha 1), which skips the steps of iterations whose
        gradients overflow and adjusts the scale as torch.amp.GradScaler does.
    optimizer_workers: CPU optimizer threads (one actor each).
    io_threads: threads doing blocking SSD reads and writes.
    storage_backend: how the SSD tier's files are read and written: "auto" (kvikio on CUDA
        when it and the CUDA driver are there, else O_DIRECT, else buffered I/O with a
        warning), "posix" (O_DIRECT, an error where the file system refuses it), "buffered"
        (the page cache) or "kvikio" (needs CUDA, its driver and the kvikio package).
    stall_timeout_s: when no actor finishes any work for this long, run() fails with
        ActorFailed naming the stalled actor (None: wait forever).
    resident_optimizer: where the fp32 master weights and Adam m and v of the resident
        parameters (embeddings, final norm, head: those not in the streamed layers) live.
        "cpu": in CPU memory, 12 bytes per parameter (fp32 master, m, v) and a chunk of
        gradient staging. "ssd":
        in a file in offload_dir, read, stepped and written back in chunks at each
        iteration's end (24 bytes of SSD traffic per parameter and iteration, on the
        compute actor's time; host memory: two chunk buffers, `snake.memory`). None: the
        planner chooses, with micro_batches / placement / alpha. The device copy and the
        gradient accumulator stay on the device either way.
    """

    micro_batches: int | None = 1
    offload_dir: str | Path
    placement: Placement | None = field(default_factory=Placement)
    alpha: float | None = 0.0
    optimizer: AdamW = field(default_factory=AdamW)
    dtype: Dtype = "float32"
    device: str | None = None
    schedule: Schedule = "vertical"
    seed: int = 0
    cpu_memory_bytes: int | None = None
    device_memory_bytes: int | None = None
    ssd_bandwidth_bytes_per_s: float | None = None
    device_link_bytes_per_s: float | None = None
    loss_scale: float | DynamicLossScale = 1024.0
    optimizer_workers: int = 2
    io_threads: int = 2
    storage_backend: str = "auto"
    stall_timeout_s: float | None = 300.0
    resident_optimizer: str | None = "cpu"

    def __post_init__(self) -> None:
        m = self.micro_batches
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ConfigError("micro_batches", m, "must be an integer >= 1", "None lets the planner choose")
        if not isinstance(self.offload_dir, str | Path) or str(self.offload_dir) == "":
            raise ConfigError("offload_dir", self.offload_dir, "must be a directory path", "pass a path on a local SSD")
        if self.placement is not None and not isinstance(self.placement, Placement):
            raise ConfigError("placement", self.placement, "must be a snake.Placement or None")
        a = self.alpha
        if a is not None and (
            not isinstance(a, int | float) or isinstance(a, bool) or not math.isfinite(a) or not 0.0 <= a <= 1.0
        ):
            raise ConfigError("alpha", a, "must be in [0, 1]", "delayed share of the optimizer step; None lets the planner choose")
        if not isinstance(self.optimizer, AdamW):
            raise ConfigError("optimizer", self.optimizer, "must be a snake.AdamW")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", self.dtype, f"must be one of {DTYPES}")
        ls = self.loss_scale
        if isinstance(ls, DynamicLossScale):
            if self.dtype != "float16":
                raise ConfigError("loss_scale", "DynamicLossScale(...)", f"is for float16 only, not dtype={self.dtype!r}",
                                  "float32 and bfloat16 need no loss scale: leave loss_scale out")
        elif not (_finite(ls) and ls >= _FLOAT32_TINY):  # below, float32 cannot hold it
            raise ConfigError("loss_scale", ls, f"must be a finite number >= {_FLOAT32_TINY:.3g} or a snake.DynamicLossScale",
                              "float16's static loss scale, e.g. 1024, or DynamicLossScale() as torch.amp.GradScaler")
        if self.steps_wait and a is not None and a != 1.0:
            what = (f"optimizer.max_grad_norm={self.optimizer.max_grad_norm}" if self.optimizer.clips
                    else "a dynamic loss_scale")
            raise ConfigError(
                "alpha", a, f"must be 1.0 (or None) with {what}",
                "every step needs the whole iteration's gradient first (its norm, or whether it overflowed): "
                "alpha=1.0 delays every step into the next iteration",
            )
        if self.schedule not in SCHEDULES:
            raise ConfigError("schedule", self.schedule, f"must be one of {SCHEDULES}")
        if self.device is not None:
            d = self.device
            if not isinstance(d, str) or not (d == "cpu" or d == "cuda" or (d.startswith("cuda:") and d[5:].isascii() and d[5:].isdigit())):
                raise ConfigError("device", d, "must be 'cpu', 'cuda' or 'cuda:N'", "None picks CUDA if present, else CPU")
        seed = self.seed
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
            raise ConfigError("seed", seed, f"must be an integer in [0, 2**63 - 1 = {MAX_SEED}]", "torch.manual_seed's range")
        for name in ("cpu_memory_bytes", "device_memory_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ConfigError(name, v, "must be a positive integer number of bytes or None")
        bw = self.ssd_bandwidth_bytes_per_s
        if bw is not None and not _finite(bw):
            raise ConfigError("ssd_bandwidth_bytes_per_s", bw, "must be a finite number of bytes/s", "use None for no cap")
        if bw is not None and not bw >= MIN_SSD_BANDWIDTH:
            raise ConfigError(
                "ssd_bandwidth_bytes_per_s", bw, f"must be >= {MIN_SSD_BANDWIDTH} bytes/s (1 MB/s)",
                "a lower cap makes setup's first writes take hours; use None for no cap",
            )
        link = self.device_link_bytes_per_s
        if link is not None and (
            not isinstance(link, int | float) or isinstance(link, bool) or not math.isfinite(link) or not link > 0
        ):
            raise ConfigError("device_link_bytes_per_s", link, "must be > 0 bytes/s or None (no cap)")
        if link is not None and link < MIN_SSD_BANDWIDTH:
            raise ConfigError(
                "device_link_bytes_per_s", link, f"must be >= {MIN_SSD_BANDWIDTH} bytes/s (1 MB/s)",
                "a lower cap makes each layer's copy take minutes (1 byte/s stalled the run); use None for no cap",
            )
        st = self.stall_timeout_s
        if st is not None and (not _number(st) or not st > 0):
            raise ConfigError("stall_timeout_s", st, "must be > 0 seconds or None (no watchdog)")
        if self.storage_backend not in STORAGE_BACKENDS:
            raise ConfigError("storage_backend", self.storage_backend, f"must be one of {STORAGE_BACKENDS}",
                              "'auto' picks the best one this machine has")
        if self.resident_optimizer is not None and self.resident_optimizer not in RESIDENT_TIERS:
            raise ConfigError(
                "resident_optimizer", self.resident_optimizer, f"must be one of {RESIDENT_TIERS} or None",
                "'ssd' when the embeddings' and head's optimizer state does not fit in CPU memory; "
                "None lets the planner choose",
            )
        for name in ("optimizer_workers", "io_threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(name, v, "must be an integer >= 1")
        if self.io_threads > MAX_IO_THREADS:
            raise ConfigError(
                "io_threads", self.io_threads, f"must be <= {MAX_IO_THREADS}",
                "more threads do not make one SSD faster; 2 to 8 is typical",
            )

    @property
    def dynamic_scale(self) -> DynamicLossScale | None:
        """The dynamic loss scale in effect (float16 with a DynamicLossScale), else None."""
        return self.loss_scale if isinstance(self.loss_scale, DynamicLossScale) else None

    @property
    def steps_wait(self) -> bool:
        """Whether every optimizer step waits for the whole iteration's gradient: clipping
        (its global norm) or a dynamic loss scale (whether any gradient overflowed). Both
        need alpha = 1."""
        return self.optimizer.clips or self.dynamic_scale is not None


def tiny_cpu(offload_dir: str | Path) -> SnakeConfig:
    """A preset for a quick CPU run: 2 micro-batches, half of the parameters, checkpoints
    and optimizer states on SSD (the delayed gradients in CPU memory), alpha 0.25."""
    return SnakeConfig(
        micro_batches=2,
        offload_dir=offload_dir,
        placement=Placement(param=0.5, ckpt=0.5, opt=0.5),
        alpha=0.25,
        optimizer=AdamW(lr=3e-4, weight_decay=0.1),
    )
