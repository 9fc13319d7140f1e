"""How much host memory the runtime allocates, as a function of the placement shares.

The runtime sizes its stores and buffer pools with these numbers (see `snake/stores.py`),
and the planner's LP uses the same linear model: host bytes = fixed + sum over kinds of
per_share[kind] * placement.<kind>. Tail staging buffers shrink as a kind moves to CPU, so
some coefficients are negative parts folded into fixed. Checkpoints are stored as whole
units (`stores.cpu_units`): their staging pools hold whole units, as many as a layer has on
SSD (at most (1 - share) x micro-batches + 1) plus a few; the model charges that bound, so it
is exact up to those rounding units and never below the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from snake.io.base import ALIGN

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OPT_BYTES_PER_ELEM = 12  # fp32 master + Adam m + v
# The resident (pre/post) optimizer state on SSD (`SnakeConfig.resident_optimizer="ssd"`) is
# stepped in chunks of at most this many elements per parameter: two staging buffers hold a
# chunk's master, m and v each (one read while the other's chunk is stepped and written
# back), a third a chunk's gradient. A multiple of 1024, so every chunk starts at a 4 KiB
# boundary and the fused AdamW's vector remainder falls where it falls for the whole tensor:
# the chunked step is bitwise the whole one (tests/test_resident_ssd.py).
RESIDENT_CHUNK_ELEMS = 2 << 20


def fmt_size(n: float) -> str:
    """Bytes for a message: 1.50 GiB, or 12.0 MiB below a GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def resident_chunk(resident_params: int) -> int:
    """Elements of a resident-on-SSD chunk: RESIDENT_CHUNK_ELEMS, or all the resident
    parameters (rounded up to 1024) where they are fewer."""
    return max(1024, min(RESIDENT_CHUNK_ELEMS, -(-resident_params // 1024) * 1024))


def resident_host_bytes(resident_params: int, on_ssd: bool, staged_grads: bool = True) -> int:
    """Host bytes of the resident optimizer state: in CPU memory its fp32 master, m and v
    (12 bytes per element) and, with `staged_grads` (a GPU: the gradients reach the host a
    chunk at a time), one chunk's gradient buffer; on SSD the staging buffers (two chunks'
    master, m and v, one chunk's gradient)."""
    if not resident_params:
        return 0
    if on_ssd:
        return 7 * resident_chunk(resident_params) * 4
    return resident_params * OPT_BYTES_PER_ELEM + (resident_chunk(resident_params) * 4 if staged_grads else 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """What the memory and time models need to know about a model.

    layer_params: elements of one block (where the blocks are of several kinds, the mean
    over the layers, rounded up: what the layers store and move in all is n_layers times
    it). largest_layer_params: elements of the largest block, where it is larger (what the
    runtime's slots and staging buffers are sized for); None where all are alike.
    ckpt_elems: elements of one block's input for one micro-batch (batch x seq x hidden).
    resident_params: pre/post elements (embeddings, head). tokens_per_micro: target tokens
    of one micro-batch. vocab_size: logits per token of the head (0: a model without
    one). frozen_params: elements of the frozen parameters (requires_grad=False) held on
    the compute device all run long: pre/post's, and the blocks' kept in float32.
    layer_frozen_params: elements of a block's other frozen parameters, which stream with
    its layer from one copy in CPU memory (the mean over the layers);
    largest_slot_params: a layer's trained plus streamed frozen elements at the largest,
    where that is not largest + layer_frozen_params (what the device slots are sized for).
    fp32_params: elements of the resident and frozen parameters held on the device in
    float32 whatever the compute dtype (`snake.adapters.kept_fp32`: a bf16 model's router
    gates), counted in `resident_params` / `frozen_params` too."""

    n_layers: int
    layer_params: int
    ckpt_elems: int
    resident_params: int
    tokens_per_micro: int
    dtype_bytes: int
    vocab_size: int
    largest_layer_params: int | None = None
    frozen_params: int = 0
    fp32_params: int = 0
    layer_frozen_params: int = 0
    largest_slot_params: int | None = None
    # the streamed frozen parameters live in a mapped file (a streamed model's, `frozen_in_files`):
    # pages the kernel may drop, not counted in the process's memory
    layer_frozen_in_files: bool = False
    # bytes per element of the hidden state between layers (checkpoints and their gradients)
    # where it is not dtype_bytes: 4 for a model that keeps it in float32 whatever it
    # computes in (`ModelParts.hidden_fp32`)
    hidden_bytes: int | None = None
    # layers with a backward where fewer than n_layers (`snake.adapters.lowest_backward`: a
    # fine-tune of the top layers runs only the forward below the lowest trained one)
    bwd_layers: int | None = None
    # trained elements of layer 0 where they are not layer_params (a frozen first layer: none),
    # whose delayed gradient stays in its staging buffer (`snake.plans.grad_stays`)
    first_layer_params: int | None = None

    @property
    def bwd_share(self) -> float:
        """The share of the layers that run a backward."""
        return (self.bwd_layers if self.bwd_layers is not None else self.n_layers) / self.n_layers

    @property
    def ckpt_bytes(self) -> int:
        """Bytes per element of a checkpoint (the hidden state between layers)."""
        return self.hidden_bytes or self.dtype_bytes

    @property
    def largest(self) -> int:
        """Trained elements of the largest block."""
        return self.largest_layer_params or self.layer_params

    @property
    def slot(self) -> int:
        """Elements of a device parameter slot: the largest layer's trained and streamed frozen
        parameters."""
        return self.largest_slot_params or self.largest + self.layer_frozen_params


@dataclass(frozen=True, slots=True)
class PoolSizes:
    """Buffer counts of the runtime's fixed pools."""

    param_tails: int = 3
    ckpt_in_extra: int = 1  # backward ckpt reads: micro_batches + this tail buffers
    ckpt_out_extra: int = 2  # ckpt writes (and their hand-on to the next forward stage)
    opt_tails_extra: int = 1  # opt tail buffers = optimizer workers + this (see opt_tails)
    grad_buffers: int = 2  # vertical: whole-layer fp32 gradient buffers in flight
    grad_in_tails: int = 2  # vertical: delayed gradients' SSD parts read for their steps

    def grad_tails(self, workers: int) -> int:
        """Staging buffers of the delayed gradients' SSD parts: one per worker for the
        writes (each worker's now-step fills one, ssd_write frees it), `grad_in_tails` for
        the reads before the delayed steps."""
        return workers + self.grad_in_tails
    device_param_slots: int = 2

    def opt_tails(self, workers: int, delayed: bool) -> int:
        """Optimizer-state tail buffers: one per worker and a spare, and with delayed steps
        at least three. At an iteration's turn the SSD reader takes buffers in plan order
        for layer 0's now-step (the backward's last) and the next iteration's first delayed
        steps, ahead of the checkpoint read that layer's backward needs; with one worker and two buffers the
        third read waited for a buffer only that backward's step would free (a deadlock)."""
        return max(workers + self.opt_tails_extra, 3 if delayed else 0)


def grad_share_in_effect(grad: float, param: float, room: float) -> float:
    """The waiting gradients' CPU share the runtime keeps: at least what the stale delayed
    parameters' memory holds (`room` of them per unit of param share), which costs nothing."""
    return max(grad, min(1.0, room * param))


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearMemory:
    """fixed_bytes + sum(per_share[k] x share_k) over the kinds (param, ckpt, opt, grad).

    grad_room: the delayed gradients' share that the memory of the CPU-resident delayed
    parameters holds per unit of param share (param bytes / 4 vertical with a delayed share,
    else 0). The runtime keeps at least that much of them in CPU memory whatever the grad
    share (it costs nothing there), so the grad share in effect is max(grad, grad_room x
    param) (`shares`), and at it the model is exact."""

    fixed_bytes: float
    per_share: dict[str, float]
    grad_room: float = 0.0

    def shares(self, param: float, ckpt: float, opt: float, grad: float = 1.0) -> dict[str, float]:
        return {"param": param, "ckpt": ckpt, "opt": opt, "grad": grad_share_in_effect(grad, param, self.grad_room)}

    def at(self, param: float, ckpt: float, opt: float, grad: float = 1.0) -> float:
        s = self.shares(param, ckpt, opt, grad)
        return self.fixed_bytes + sum(self.per_share[k] * s[k] for k in s)

    def smallest(self, fixed: dict[str, float] | None = None) -> float:
        """The least bytes over every placement (shares in `fixed` held there): the
        minimum of a linear function over the shares' polytope, at one of its vertices."""
        fixed = fixed or {}
        free = {k: fixed.get(k) for k in ("ckpt", "opt")}
        best = self.fixed_bytes + sum(
            self.per_share[k] * v if v is not None else min(0.0, self.per_share[k]) for k, v in free.items())
        ps = [fixed["param"]] if "param" in fixed else [0.0, 1.0]
        pg = [(p, g) for p in ps for g in ((fixed["grad"],) if "grad" in fixed else (0.0, 1.0))]
        return best + min(self.per_share["param"] * p + self.per_share["grad"] * self.shares(p, 0, 0, g)["grad"]
                          for p, g in pg)


def host_memory(
    shape: ModelShape,
    *,
    n_micro: int,
    alpha: float,
    schedule: str,
    workers: int,
    pools: PoolSizes = PoolSizes(),
    ckpt_in_cpu: bool = False,
    grad_staging: bool = False,
    resident_on_ssd: bool = False,
    offload_in_memory: bool = False,
) -> LinearMemory:
    """Host bytes the runtime holds for a placement, linear in the CPU shares.

    Per kind: the CPU-resident heads (share x total) plus tail staging buffers sized for the
    SSD share ((1 - share) x unit, times the pool count; checkpoints: whole units, their
    count bounded by (1 - share) x n_micro + 1 per pool and stage). Plus kinds that always live in CPU
    memory: inter-layer gradients (vertical: two layers' worth), gradients (vertical: a few whole-layer buffers and the
    delayed alpha share of every layer, partly in the memory of the CPU-resident delayed
    parameters; horizontal: one fp32 accumulator per layer), the
    resident pre/post optimizer state, and the blocks' streamed frozen parameters (one copy
    in the compute dtype). Page padding of tails is ignored (< ALIGN per buffer).

    ckpt_in_cpu: the model for every checkpoint in CPU memory (valid at ckpt share 1 only):
    no checkpoint staging pools, so exact there, where the general model's bound on the
    pools (which a linear model cannot drop at share 1) would still charge a few units.

    grad_staging (a CUDA device): horizontal also holds one pinned fp32 layer buffer that
    each micro-batch's gradient is copied into before it is added to the layer's
    accumulator, and the resident step stages its gradients a chunk at a time.

    resident_on_ssd: the resident optimizer state lives on SSD (`resident_host_bytes`).

    offload_in_memory: offload_dir is on a file system in memory (tmpfs, ramfs): the SSD
    tier's files ((1 - share) x each kind's total, the resident state's where it is there,
    the mapped frozen layer weights) take host memory too, so a share moved to "SSD" spares
    none."""
    n, p, c, db = shape.n_layers, shape.layer_params, shape.ckpt_elems, shape.dtype_bytes
    hb = shape.ckpt_bytes  # the hidden state's element (checkpoints, their gradients)
    big = shape.largest  # staging buffers and gradient buffers: sized for the largest layer
    param_total = n * p * db
    ckpt_total = n * n_micro * c * hb
    opt_total = n * p * OPT_BYTES_PER_ELEM
    param_unit = big * db
    ckpt_unit = c * hb
    opt_unit = big * OPT_BYTES_PER_ELEM
    param_pool = pools.param_tails + workers  # loads + optimizer write-back
    # two pools (reads, writes), each of (a layer's units on SSD <= (1 - share) n_micro + 1)
    # + its extra whole units
    ckpt_fixed = 0 if ckpt_in_cpu else 2 * (n_micro + 1) + pools.ckpt_in_extra + pools.ckpt_out_extra
    opt_pool = pools.opt_tails(workers, alpha > 0)
    per_share: dict[str, float] = {
        "param": param_total - param_pool * param_unit,
        "ckpt": ckpt_total - (0 if ckpt_in_cpu else 2 * n_micro * ckpt_unit),
        "opt": opt_total - opt_pool * opt_unit,
        "grad": 0.0,
    }
    tails: float = param_pool * param_unit + ckpt_fixed * ckpt_unit + opt_pool * opt_unit
    act_grads = (2 * n_micro * c * hb) if schedule == "vertical" else 0  # two layers' slots
    grad_room = 0.0
    if schedule == "vertical":
        # the delayed (alpha) fp32 gradients wait in the memory of the CPU-resident delayed
        # parameters (stale until the delayed step rewrites them: db / 4 of them per unit
        # of param share, `grad_room`), in dedicated memory up to the grad share, and on SSD
        # for the rest, through staging buffers sized for the largest layer's delayed share
        # (`grad_tails`): alpha x n x p x (4 x grad share - db x param share) bytes of their own
        grads: float = pools.grad_buffers * big * 4
        if alpha > 0:
            grad_total, grad_unit = alpha * n * p * 4, alpha * big * 4
            g_pool = pools.grad_tails(workers)
            per_share["grad"] = grad_total - g_pool * grad_unit
            per_share["param"] -= alpha * n * p * db
            tails += g_pool * grad_unit
            grad_room = db / 4
    else:
        grads = (n * p + (big if grad_staging else 0)) * 4
    resident = resident_host_bytes(shape.resident_params, resident_on_ssd, staged_grads=grad_staging)
    # the streamed frozen parameters' CPU copies (none where they are mapped from a file)
    frozen = 0 if shape.layer_frozen_in_files else n * shape.layer_frozen_params * db
    fixed = tails + act_grads + grads + resident + frozen + 16 * ALIGN
    if offload_in_memory:
        totals = {"param": param_total, "ckpt": ckpt_total, "opt": opt_total,
                  "grad": alpha * n * p * 4 if grad_room else 0.0}
        for k, b in totals.items():
            per_share[k] -= b
        fixed += sum(totals.values()) + (shape.resident_params * OPT_BYTES_PER_ELEM if resident_on_ssd else 0)
        fixed += n * shape.layer_frozen_params * db if shape.layer_frozen_in_files else 0
    return LinearMemory(fixed_bytes=float(fixed), per_share=per_share, grad_room=grad_room)


# What the process holds beyond the runtime's data and the compute's working set: the
# runtime's threads, torch modules imported lazily during the first iteration
# (`torch.autograd.grad` with `grad_outputs` imports torch.fx's symbolic shapes and sympy:
# 34 MiB), what glibc keeps of freed temporaries, and what a first planning's probes leave
# behind (after `planner.integrate.trim_heap`). Measured as peak RSS growth minus both
# models: 60-75 MiB for the runtime alone on GPTs of width 256 (placements 0 to 1, M 1-8,
# both schedules, alpha 0 and 0.3, 1-4 optimizer workers); with a planning in the same
# process up to ~110 MiB. glibc keeps up to its trim threshold of freed memory per arena
# (64 MiB once the probes settle it), so one configuration's peak moved by up to 60 MiB
# from run to run (GPT 4 x 512: 375-437 MiB); with 128 MiB one run of seven went 3 MiB
# over. 160 MiB (benchmarks/memory_budget.py, tests/test_memory_budget.py).
RUNTIME_OVERHEAD_BYTES = 160 * 2**20
# The head's peak per logit beyond its parameters: the logits in the compute dtype and, in
# fp32, their log-softmax, its gradient and the logits' gradient. Measured (peak RSS of a
# forward + backward of GPT's head and cross-entropy, 1-2 k tokens, vocab 32 k-50 k):
# 16.2-16.4 bytes per logit in float32, 14.2-14.4 in bfloat16; the slope between 1 k and
# 3 k tokens of an 8 k vocabulary 16.24 and 14.15 (tests/test_memory_budget.py).
HEAD_FP32_BYTES_PER_LOGIT = 12


def device_memory(shape: ModelShape, *, n_micro: int, pools: PoolSizes = PoolSizes(), device_type: str = "cuda") -> float:
    """Device bytes: parameter slots (on a CPU device of the trained parameters alone: the
    streamed frozen ones are used where they are), one fp32 gradient accumulator, resident pre/post with
    fp32 gradients, the frozen parameters (those kept in fp32 at 4 bytes), and the working set of one micro-batch's compute:
    - a few micro-batches' block inputs and the block's internals (~ 16 x the block input
      for a GPT block during recompute + backward);
    - the parameter gradients as autograd returns them (a layer's, and pre/post's: the
      embedding's twice when it is tied to the head), and twice as much again that the
      allocator keeps of such temporaries between calls. Measured on a CPU device, what the
      process held beyond the runtime's constant overhead grew with the layer: 30, 38, 66
      and 226 MiB at widths 512, 768, 1024 and 1536 (3.2-28 M parameters per layer), where
      this term is 36-324 MiB in fp32; and 8 MiB with a 16 k vocabulary;
    - the head's logits (`HEAD_FP32_BYTES_PER_LOGIT`): tokens x vocab x (dtype + 12) bytes,
      the largest single term for a GPT-2 vocabulary (0.8 GiB at 1,024 tokens in float32)."""
    p, c, db = shape.largest, shape.ckpt_elems, shape.dtype_bytes
    head = shape.tokens_per_micro * shape.vocab_size * (db + HEAD_FP32_BYTES_PER_LOGIT)
    return float(
        pools.device_param_slots * (shape.largest if device_type == "cpu" else shape.slot) * db
        + 2 * p * 4
        + shape.resident_params * (db + 4)
        + shape.frozen_params * db
        + shape.fp32_params * (4 - db)
        + (n_micro + 4) * c * shape.ckpt_bytes
        + 16 * c * 4
        + 3 * (p + shape.resident_params) * db
        + head
    )


def off_budget_bytes(shape: ModelShape, *, n_micro: int, device_type: str) -> float:
    """Host bytes beyond the placed data and its buffers (`host_memory`): the runtime's
    overhead and, on a CPU device, the device's working set, which is host memory there."""
    dev = device_memory(shape, n_micro=n_micro, device_type="cpu") if device_type == "cpu" else 0.0
    return dev + RUNTIME_OVERHEAD_BYTES


def placement_bytes(
    shape: ModelShape, *, n_micro: int, alpha: float, schedule: str, workers: int,
    param: float, ckpt: float, opt: float, device_type: str, resident_on_ssd: bool = False,
    offload_in_memory: bool = False, grad: float = 1.0,
) -> float:
    """Host bytes a run with these CPU shares grows the process by (and, offload_in_memory,
    its SSD tier's files in a tmpfs): what the planner holds against `cpu_memory_bytes`
    (`host_memory` at the shares, with its exact model when every checkpoint is in CPU
    memory, plus `off_budget_bytes`)."""
    mem = host_memory(shape, n_micro=n_micro, alpha=alpha, schedule=schedule, workers=workers,
                      ckpt_in_cpu=ckpt >= 1.0, grad_staging=device_type == "cuda",
                      resident_on_ssd=resident_on_ssd, offload_in_memory=offload_in_memory)
    return mem.at(param, ckpt, opt, grad) + off_budget_bytes(shape, n_micro=n_micro, device_type=device_type)
