"""The compute actor's work on the device: pre, block forward, head + loss, block recompute
+ backward, pre backward, and the resident (pre/post) optimizer step. Every function here
blocks: the compute actor runs them on its executor thread, never on the event loop. On
CUDA they queue their kernels on the current stream and return without waiting for them
(but `resident_step`, which ends the iteration): whoever reads the results on the host or
on another stream waits first (the compute actor: a mark at the end of each job).

Dropout masks are reproducible: each (iteration, layer, micro-batch) forks the RNG with its
own seed, so the backward's recompute and the other schedule see the same masks.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from snake.adapters import (
    ModelParts,
    flat_named,
    frozen_in_files,
    frozen_named,
    held_named,
    kept_fp32,
    layer_kinds,
    layer_values,
    materialize_block,
    resident_named_params,
    takes_layer,
)
from snake.buffers import alloc_host_tensor
from snake.clip import scale
from snake.config import DynamicLossScale, SnakeConfig
from snake.data import IGNORE_INDEX
from snake.device import pin_host_memory, synchronize
from snake.errors import GradientOverflow, Stopped, StorageError
from snake.model_features import layer_output, reentrant_error
from snake.optim import decay_flags
from snake.resident import ResidentState
from snake.scaler import LossScaler
from snake.shells import (
    _ABSENT,
    _keep_fp32,
    _layer_attrs,
    _layer_buffers,
    _mapping_of,
    _param_sites,
    _share_frozen,
    _shell,
)

log = logging.getLogger("snake")
_F32_MAX = float(torch.finfo(torch.float32).max)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Call(nn.Module):
    def __init__(self, model: nn.Module, fn) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(self.model, *args)


class _BlockCall(nn.Module):
    def __init__(self, block: nn.Module, fn) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.block = block
        self.fn = fn
        self.with_layer = takes_layer(fn)

    def forward(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        if self.with_layer:
            return self.fn(self.block, x, layer=layer)
        return self.fn(self.block, x)


class Kernels:
    def __init__(
        self, parts: ModelParts, config: SnakeConfig, device: torch.device, n_micro: int, *, frozen_copies: bool = True
    ) -> None:
        """frozen_copies=False (the planner's probes, whose slots hold every parameter): no
        CPU copy of the layers' frozen parameters (`frozen_host`)."""
        self.device = device
        self.dtype = TORCH_DTYPES[config.dtype]
        # the hidden state between layers (checkpoints, their gradients): float32 for a model
        # that keeps it so whatever it computes in (Mamba's `residual_in_fp32`), as plain
        # PyTorch has it there; the first layer still gets its input in the dtype the
        # embedding gave it (`layer_input`), exactly: float32 holds every value of it
        self.hidden_dtype = torch.float32 if parts.hidden_fp32 is not None else self.dtype
        # float16's loss scale: static, or the dynamic one's current value (`scale`)
        self.scaler = LossScaler(config.dynamic_scale) if config.dynamic_scale is not None else None
        static = config.loss_scale
        self._static_scale = float(static) if config.dtype == "float16" and not isinstance(static, DynamicLossScale) else 1.0
        # float16 at a static scale: every gradient is checked before its step can take it
        # (`check_finite`), where plain PyTorch would put an overflow into the weights
        self.checks_overflow = config.dtype == "float16" and not isinstance(static, DynamicLossScale)
        self.seed = config.seed
        self.n_micro = n_micro
        # the generator dropout draws from on the device: on CUDA the device's alone. torch's
        # global CPU generator is the one a data source's torch.randint (or a DataLoader's
        # shuffle) draws from on the data thread while this one seeds it: on CUDA it is left
        # alone; on a CPU device, where dropout draws from it, `rng_lock` keeps the data's
        # next() out of the seeded stretches (`rng`)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.generators: list[torch.Generator] = [torch.cuda.default_generators[index]]
        else:
            self.generators = [torch.default_generator]
        self.rng_lock: threading.Lock | None = threading.Lock() if device.type == "cpu" else None
        self.opt = config.optimizer
        self.parts = parts
        # which trained parameters take weight decay (`AdamW.no_decay`): per layer one flag
        # per parameter of its flat state (None: all), per resident parameter one
        self.layer_decay, self.res_decay = decay_flags(parts, config.optimizer)
        self._build_layers(parts, device, frozen_copies)
        self._build_resident(parts, config, device)

    def _build_layers(self, parts: ModelParts, device: torch.device, frozen_copies: bool) -> None:
        """Per layer kind, its shell on the device and what the kind's layers differ in; per layer,
        its frozen parameters (held on the device, or a CPU copy that streams with it); the
        sizes of the gradient buffers and the device slots."""
        # one device "shell" block per layer kind (a copy of the kind's first block): its
        # own weights are never used, each layer's arrive in a slot
        blocks = list(parts.blocks)
        self.kinds, firsts = layer_kinds(blocks)
        self.calls: list[_BlockCall] = []
        self.kind_sites: list[list[list[tuple[nn.Module, str]]]] = []
        self.kind_shapes: list[list[torch.Size]] = []
        self.kind_numels: list[list[int]] = []
        self.kind_names: list[list[str]] = []
        # trained block parameters without a gradient: per (iteration, layer), the
        # micro-batches each parameter (by index) had none in (`_no_gradient`); one with none
        # in all is not stepped that iteration, as torch.optim.AdamW leaves a parameter whose
        # .grad stays None (`take_skipped`), and counts one step fewer from then on
        # (`layer_skips`: per layer, steps missed by parameter index; `res_skips` for pre/post)
        self.watch_gradients = True  # log each such parameter once (off in the planner's probes)
        self._none_counts: dict[tuple[int, int], dict[int, int]] = {}
        self._logged: set[tuple[int, int]] = set()
        self.layer_skips: list[dict[int, int]] = [{} for _ in blocks]
        # per layer, the scalar attributes and the buffers to set on its kind's shell where
        # the layers of the kind differ (`_layer_attrs`, `_layer_buffers`)
        self.layer_attrs: list[list[tuple[nn.Module, str, object]]] = [[] for _ in blocks]
        self.layer_buffers: list[list[tuple[nn.Module, str, torch.Tensor]]] = [[] for _ in blocks]
        # per layer, its frozen parameters kept in float32 (requires_grad=False, `kept_fp32`:
        # on the device all run long, never stepped) at their places in its kind's shell
        self.layer_frozen: list[list[tuple[list[tuple[nn.Module, str]], torch.Tensor]]] = [[] for _ in blocks]
        # the other frozen parameters stream with the layer (`frozen_named`): per kind their
        # places, shapes and sizes; per layer one flat copy in CPU memory in the compute dtype
        # (pinned on CUDA), which the device mover copies into the layer's device slot after
        # its trained parameters (`frozen_views`)
        self.kind_frozen_sites: list[list[list[tuple[nn.Module, str]]]] = []
        self.kind_frozen_shapes: list[list[torch.Size]] = []
        self.kind_frozen_numels: list[list[int]] = []
        self.frozen_host: list[torch.Tensor | None] = [None for _ in blocks]
        # a streamed model's frozen parameters still in its files: each layer's flat copy in
        # the compute dtype is written to a file of snake's own and mapped (`map_frozen`), so
        # the kernel's page cache holds them, not the process (a LoRA-style fine-tune of a
        # model larger than CPU memory)
        self.frozen_mapped = frozen_copies and frozen_in_files(parts, self.dtype)
        # per layer, its trained parameters kept in float32 (`kept_fp32`: a router's gate in
        # a bfloat16 model), at their places in its kind's shell, by index into the resident
        # lists (they are held on the device and stepped with pre/post's)
        self.layer_held: list[list[tuple[list[tuple[nn.Module, str]], int]]] = [[] for _ in blocks]
        held_index = {n: i for i, (n, _) in enumerate(resident_named_params(parts))}
        for kind, first in enumerate(firsts):
            shell = _shell(blocks[first]).to(device=device, dtype=self.dtype)
            kept = kept_fp32(blocks[first])
            _keep_fp32(shell, blocks[first], kept, device)
            shell.train()
            self.calls.append(_BlockCall(shell, parts.block_fn))
            spec = flat_named(blocks[first])
            self.kind_sites.append(_param_sites(shell, [n for n, _ in spec]))
            self.kind_shapes.append([p.shape for _, p in spec])
            self.kind_numels.append([p.numel() for _, p in spec])
            self.kind_names.append([n for n, _ in spec])
            mine = [i for i, k in enumerate(self.kinds) if k == kind]
            for i, attrs in zip(mine, _layer_attrs(shell, [blocks[i] for i in mine]) or [[]] * len(mine), strict=True):
                self.layer_attrs[i] = attrs
            for i, bufs in zip(mine, _layer_buffers(shell, [blocks[i] for i in mine], device), strict=True):
                self.layer_buffers[i] = bufs
            held = [n for n, _ in held_named(blocks[first])]
            if held:
                sites = _param_sites(shell, held)
                for i in mine:
                    self.layer_held[i] = [
                        (where, held_index[f"{parts.blocks_prefix}.{i}.{n}"]) for n, where in zip(held, sites, strict=True)
                    ]
            # held: those kept in float32, and those that are not floating point (an index)
            frozen = [n for n, p in blocks[first].named_parameters()
                      if not p.requires_grad and (n in kept or not p.is_floating_point())]
            if frozen:
                sites = _param_sites(shell, frozen)
                for i in mine:
                    own = dict(blocks[i].named_parameters())
                    self.layer_frozen[i] = [(where, own[n].detach().to(device).clone()) for n, where in zip(frozen, sites, strict=True)]
            streamed = frozen_named(blocks[first])
            self.kind_frozen_sites.append(_param_sites(shell, [n for n, _ in streamed]))
            self.kind_frozen_shapes.append([p.shape for _, p in streamed])
            self.kind_frozen_numels.append([p.numel() for _, p in streamed])
            if streamed and frozen_copies and not self.frozen_mapped:
                for i in mine:
                    # read now where on the meta device (a streamed model of another dtype):
                    # the model holds them too, as a model loaded whole would
                    materialize_block(parts, i, blocks[i], [n for n, _ in streamed])
                    own = dict(blocks[i].named_parameters())
                    flat = alloc_host_tensor(sum(p.numel() for _, p in streamed), self.dtype, pin=device.type == "cuda")
                    torch.cat([own[n].detach().reshape(-1).to("cpu", self.dtype) for n, _ in streamed], out=flat)
                    self.frozen_host[i] = flat
                    _share_frozen(flat, [own[n] for n, _ in streamed])
        self.kind_params = [sum(n) for n in self.kind_numels]
        self.kind_frozen = [sum(n) for n in self.kind_frozen_numels]
        # the largest layer's trained elements: the size of the gradient buffers (a smaller
        # kind's gradients take their first elements)
        self.layer_params = max(self.kind_params)
        # the size of the device slots every layer passes through: its trained parameters,
        # then its streamed frozen ones; on a CPU device the frozen ones are used where they
        # are (`frozen_views`), so the slots hold the trained ones only (but in the planner's
        # probes, whose slots hold everything)
        in_place = device.type == "cpu" and frozen_copies
        self.slot_params = max(p + (0 if in_place else f) for p, f in zip(self.kind_params, self.kind_frozen, strict=True))

    def _build_resident(self, parts: ModelParts, config: SnakeConfig, device: torch.device) -> None:
        """pre/post and the parameters held on the device: their device copies, gradient
        accumulators, optimizer state (`ResidentState`), buffers and frozen parameters."""
        # resident pre/post: device copies in compute dtype, fp32 master + Adam state on CPU
        model = parts.model
        # training mode for pre/post (dropout) while the engine lives; the user's modes come
        # back at close (restore_modes)
        self.user_modes = [(mod, mod.training) for mod in model.modules()]
        model.train()
        self.pre_mod = _Call(model, parts.pre)
        self.post_mod = _Call(model, parts.post)
        res = resident_named_params(parts)
        prefix = parts.blocks_prefix + "."
        # pre/post's own come first; the blocks' parameters kept in float32 follow
        self.n_outer = sum(1 for n, _ in res if not n.startswith(prefix))
        outer_kept = kept_fp32(model, skip=prefix)
        self.res_names = ["model." + n for n, _ in res]
        self.res_shapes = [p.shape for _, p in res]
        # set when the run is being torn down (cancelled, or another actor failed): a wait for
        # `rng_lock` and the chunked resident step stop (the engine's)
        self.stop: threading.Event | None = None
        self.res_dev = [
            p.detach().to(device=device, dtype=torch.float32 if i >= self.n_outer or n in outer_kept else self.dtype)
            .clone().requires_grad_(True)
            for i, (n, p) in enumerate(res)
        ]
        self.res_grad = [torch.zeros(p.numel(), dtype=torch.float32, device=device) for _, p in res]
        # their fp32 master weights and AdamW moments, in CPU memory or on SSD
        self.resident = ResidentState(
            self.res_names, [p for _, p in res], on_ssd=config.resident_optimizer == "ssd", opt=self.opt,
            decay=self.res_decay, dev=self.res_dev, grad=self.res_grad, device=device,
            pin=pin_host_memory(device),
        )
        self.res_got = [False] * len(res)  # got a gradient this iteration
        self.res_skips = [0] * len(res)  # iterations without a gradient: steps missed
        self._changed_warned: set[tuple[str, str]] = set()  # `outer_as_computed`'s warnings, once each
        self.res_buffers = {
            "model." + n: b.to(device)
            for n, b in model.named_buffers()
            if not n.startswith(prefix)
        }
        # frozen pre/post parameters (requires_grad=False): as they are, in compute dtype
        # (but those kept in float32)
        self.res_buffers.update({
            "model." + n: p.detach().to(
                device=device, dtype=self.dtype if p.is_floating_point() and n not in outer_kept else p.dtype
            ).clone()
            for n, p in resident_named_params(parts, trained=False)
        })

    def frozen_files(self) -> dict[str, int]:
        """The files `map_frozen` writes, by name, and their bytes (none where the frozen
        parameters are held in CPU memory, or already mapped by an earlier trainer)."""
        if not self.frozen_mapped:
            return {}
        esize = torch.empty((), dtype=self.dtype).element_size()
        return {_frozen_file(i): self.kind_frozen[self.kinds[i]] * esize for i, b in enumerate(self.parts.blocks)
                if _mapping_of(frozen_named(b), self.dtype) is None}

    def map_frozen(self, directory: Path, stop: threading.Event | None = None) -> None:
        """Blocking: each layer's streamed frozen parameters, read from the model's files,
        written to `directory`/frozen-<layer>.bin in the compute dtype and mapped as
        `frozen_host[layer]` (the file unlinked at once: its pages live as long as the
        mapping); a layer an earlier trainer mapped keeps its mapping. The model's parameters
        of the compute dtype are pointed at the mappings once every layer is mapped (a
        failure part-way leaves the model as it was, as does Stopped, raised before the next
        layer once `stop` is set); those of another dtype stay in their files (on the meta
        device), where a second trainer reads them again."""
        if not self.frozen_mapped:
            return
        blocks = list(self.parts.blocks)
        swaps: list[tuple[nn.Module, list[tuple[str, nn.Parameter]], torch.Tensor]] = []
        hosts: dict[int, torch.Tensor] = {}
        for layer, block in enumerate(blocks):
            if stop is not None and stop.is_set():
                raise Stopped("mapping the frozen layer weights cancelled part-way; the model is as it was")
            named = frozen_named(block)
            if not named:
                continue
            earlier = _mapping_of(named, self.dtype)
            if earlier is not None:
                hosts[layer] = earlier
                continue
            values = layer_values(self.parts, layer, named)
            flat = torch.cat([v.reshape(-1).to(self.dtype) for v in values])
            del values
            path = directory / _frozen_file(layer)
            try:
                with open(path, "wb") as f:
                    f.write(flat.view(torch.uint8).numpy().data)
                mapped = torch.from_file(str(path), shared=False, size=flat.numel(), dtype=self.dtype)
            except OSError as e:
                raise StorageError(
                    e.errno or errno.EIO,
                    f"writing {path.name}, layer {layer}'s frozen weights to map, failed ({e}); nothing "
                    "was changed: free space in the offload_dir or point it at another disk",
                ) from e
            finally:
                path.unlink(missing_ok=True)
            del flat
            hosts[layer] = mapped
            if all(p.dtype == self.dtype for _, p in named):
                swaps.append((block, named, mapped))
        for layer, host in hosts.items():
            self.frozen_host[layer] = host
        for block, named, mapped in swaps:
            mods = dict(block.named_modules())
            off = 0
            for name, p in named:
                mod_name, _, attr = name.rpartition(".")
                new = nn.Parameter(mapped[off : off + p.numel()].view(p.shape), requires_grad=False)
                new.snake_read = True  # type: ignore[attr-defined]
                new.snake_mapped = True  # type: ignore[attr-defined]
                mods[mod_name]._parameters[attr] = new
                off += p.numel()

    def restore_modes(self) -> None:
        """Put the user's model back in the train/eval modes it had when the engine was built."""
        for mod, training in self.user_modes:
            mod.training = training

    # -- helpers ----------------------------------------------------------------------
    def seed_for(self, t: int, layer: int, m: int) -> int:
        return ((self.seed * 1_000_003 + t) * 65_537 + (layer + 1)) * 4_099 + m

    @contextlib.contextmanager
    def rng(self, t: int, layer: int, m: int) -> Iterator[None]:
        """Seed the generator dropout draws from (the CPU's, or on CUDA the device's) for
        this (iteration, layer, micro-batch), and put its state back afterwards; on a CPU
        device holding `rng_lock` throughout, which a sync data source's next() takes too
        (`DataSource.rng_lock`): its draws from the same generator (torch.randint without a
        generator, a shuffling DataLoader) came out of the seeded states at times, so the
        batches depended on timing, and a draw between the seeding and the dropout changed
        the forward's mask from the recompute's. Works on the
        generators directly: `torch.random.fork_rng` + `torch.manual_seed` cost 0.1-1 ms per
        call (the latter queues a lazy CUDA seeding with a formatted stack trace), a third of
        a small micro-batch's block forward on a CPU."""
        seed = self.seed_for(t, layer, m) % (2**63)
        lock = self.rng_lock
        if lock is not None:  # a data source's draws wait (see `generators`), and it for them
            while not lock.acquire(timeout=0.05):
                self._check_stop()  # a next() that does not return holds no torn-down run up
        try:
            states = [g.get_state() for g in self.generators]
            for g in self.generators:
                g.manual_seed(seed)
            try:
                yield
            finally:
                for g, state in zip(self.generators, states, strict=True):
                    g.set_state(state)
        finally:
            if lock is not None:
                lock.release()

    def bind(self, tensors: list[torch.Tensor], layer: int, frozen: Sequence[torch.Tensor] = ()) -> nn.Module:
        """The shell block of `layer`'s kind as layer `layer`: `tensors` as its trained
        parameters (in `named_parameters` order), `frozen` as its streamed frozen ones
        (`frozen_views`), those it holds (kept in float32), and that layer's own
        values of the buffers and scalar attributes in which the layers of its kind differ
        (`_layer_buffers`, `_layer_attrs`). Sets the parameters straight
        into the submodules' parameter dicts: `functional_call` walks and swaps the module
        tree on every call (~0.4 ms per block call on a CPU)."""
        kind = self.kinds[layer]
        for sites, tensor in zip(self.kind_sites[kind], tensors, strict=True):
            for module, attr in sites:
                module._parameters[attr] = tensor  # type: ignore[assignment]
        for sites, tensor in zip(self.kind_frozen_sites[kind], frozen, strict=True):
            for module, attr in sites:
                module._parameters[attr] = tensor  # type: ignore[assignment]
        for module, attr, buf in self.layer_buffers[layer]:
            module._buffers[attr] = buf
        for where, kept in self.layer_frozen[layer]:
            for module, attr in where:
                module._parameters[attr] = kept  # type: ignore[assignment]
        for where, i in self.layer_held[layer]:
            for module, attr in where:
                module._parameters[attr] = self.res_dev[i]  # type: ignore[assignment]
        for module, attr, value in self.layer_attrs[layer]:
            if value is _ABSENT:
                module.__dict__.pop(attr, None)
            else:
                module.__dict__[attr] = value
        return self.calls[kind]

    def views(self, flat: torch.Tensor, layer: int) -> list[torch.Tensor]:
        """`layer`'s parameters as views of its flat slot (the first elements of it)."""
        kind = self.kinds[layer]
        pieces = flat[: self.kind_params[kind]].split(self.kind_numels[kind])
        return [v.view(s) for v, s in zip(pieces, self.kind_shapes[kind], strict=True)]

    def trained(self, flat: torch.Tensor, layer: int) -> list[torch.Tensor]:
        """`views` that require a gradient, as a model's trained parameters do, for every call
        of a block (forward, recompute, evaluation), with autograd on or off. Some kernels are
        picked by it, not by the grad mode: torch.matmul folds a 3-d input whose leading
        dimensions are not contiguous into one matrix product (copying it) for a weight that
        requires a gradient, where without one it runs a batched product (`should_fold`). On
        an AMD EPYC VM the two round differently in bfloat16 (Mamba's out_proj: its layer's
        output 1e-3 off PyTorch's), so a forward with plain views stored checkpoints that were
        not the outputs the recompute and PyTorch's training step compute."""
        return [v.detach().requires_grad_(True) for v in self.views(flat, layer)]

    def frozen_views(self, slot: torch.Tensor, layer: int) -> list[torch.Tensor]:
        """`layer`'s streamed frozen parameters: views of the slot after its trained ones,
        where the device mover copied them, or of their CPU copy where the slot is shorter (a
        view of the CPU store on a CPU device: nothing was copied)."""
        kind = self.kinds[layer]
        p, f = self.kind_params[kind], self.kind_frozen[kind]
        if not f:
            return []
        host = self.frozen_host[layer]
        if host is not None and self.device.type == "cpu":
            flat = host  # nothing to copy to a CPU device (`DeviceMover._params`)
        elif slot.numel() >= p + f:
            flat = slot[p : p + f]
        else:
            assert host is not None
            flat = host
        return [v.view(s) for v, s in zip(flat.split(self.kind_frozen_numels[kind]), self.kind_frozen_shapes[kind],
                                          strict=True)]

    @property
    def scale(self) -> float:
        """The loss scale of the iteration in progress (1 but in float16)."""
        return self.scaler.scale if self.scaler is not None else self._static_scale

    def outer_as_computed(self, name: str, live: torch.Tensor, what: str) -> torch.Tensor | None:
        """The trainer's copy of pre/post's frozen parameter or buffer `name` (as
        `model.state_dict()` names it) in `live`'s dtype on the CPU, where the model's, `live`,
        no longer holds what the trainer computes with (changed in place after the trainer
        was built, which it does not see), with a warning naming it (`what`: what the caller
        does about it); else None."""
        copy = self.res_buffers.get("model." + name)
        if copy is None or _same_values(live, copy):
            return None
        if (name, what) not in self._changed_warned:
            self._changed_warned.add((name, what))
            warnings.warn(
                f"snake: the model's {name} was changed in place after the trainer was built; the trainer "
                f"computes with the value it had then (changes to the model are not seen): {what}",
                stacklevel=4,
            )
        return copy.to("cpu", live.dtype)

    def _res_dict(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """pre/post's parameters (`tensors`) and buffers by name, for functional_call."""
        d = dict(zip(self.res_names[: self.n_outer], tensors, strict=True))
        d.update(self.res_buffers)
        return d

    @property
    def outer_dev(self) -> list[torch.Tensor]:
        """pre/post's trained parameters on the device."""
        return self.res_dev[: self.n_outer]

    def check_finite(self, grads: Sequence[torch.Tensor], where: str, t: int) -> None:
        """Blocking, with `checks_overflow`: raise GradientOverflow unless every element of
        `grads` (fp32 gradients about to be stepped) is finite. One sum per tensor: a sum
        of finite fp32 gradients of float16 values cannot overflow, and an inf or nan in
        any element makes it inf or nan."""
        if not self.checks_overflow or not grads:
            return
        total = torch.stack([g.sum(dtype=torch.float32) for g in grads]).sum()
        if not math.isfinite(float(total)):
            raise GradientOverflow(where, t, self._static_scale)

    def _accumulate_resident(self, grads: Sequence[torch.Tensor | None], at: Sequence[int] | None = None) -> None:
        """Add resident gradients (pre/post's in order, or those of the resident indices
        `at`: a block's parameters kept in float32) into their fp32 accumulators."""
        for i, g in zip(range(len(grads)) if at is None else at, grads, strict=True):
            a = self.res_grad[i]
            if g is not None:
                self.unscale_into(a, g, accumulate=True)
                self.res_got[i] = True

    def unscale_into(self, a: torch.Tensor, g: torch.Tensor, *, accumulate: bool) -> None:
        """`a` (+)= g / scale, in float32. A scale backed off below what float32's reciprocal
        holds (subnormal, or 0) gives inf, as GradScaler's unscale does: the gradient is not
        finite (0 * inf is nan), so the step is skipped as an overflow's."""
        inv = 1.0 / self.scale if self.scale else math.inf
        if inv > _F32_MAX:
            u = g.reshape(-1).float() * torch.tensor(math.inf, dtype=torch.float32, device=g.device)
            if accumulate:
                a.add_(u)
            else:
                a.copy_(u)
        elif accumulate:
            a.add_(g.reshape(-1).float(), alpha=inv)
        else:
            torch.mul(g.reshape(-1).float(), inv, out=a)

    # -- forward ----------------------------------------------------------------------
    def pre(self, idx: torch.Tensor, t: int, m: int) -> torch.Tensor:
        with torch.no_grad(), self.rng(t, -1, m):
            h = functional_call(self.pre_mod, self._res_dict(self.outer_dev), (idx,))
        # detached: a hook can mark the embedding's output as needing gradients even under
        # no_grad (transformers' gradient_checkpointing_enable), and the copy of such a leaf
        # into the checkpoint buffers would pull them into autograd
        return h.detach().to(self.hidden_dtype).contiguous()

    def layer_input(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """A layer's input as plain PyTorch gives it: the first layer's in the compute dtype
        (the embedding's output, stored wider where the hidden state is float32), the
        others' as the layer before made it."""
        return x.to(self.dtype) if layer == 0 else x

    def block_fwd(self, slot: torch.Tensor, x: torch.Tensor, t: int, layer: int, m: int) -> torch.Tensor:
        if self.parts.forward_with_grad:
            # as the backward's recompute (and PyTorch's training step) runs it: the layer's
            # kernels pick their algorithm by requires_grad (CPU SDPA: flash unless its mask, a
            # learned bias, needs a gradient); the graph is freed on return
            with torch.enable_grad(), self.rng(t, layer, m):
                y = self.bind(self.trained(slot, layer), layer, self.frozen_views(slot, layer))(
                    self.layer_input(x, layer).detach().requires_grad_(True), layer)
            return layer_output(y, x, layer).detach().to(self.hidden_dtype).contiguous()
        with torch.no_grad(), self.rng(t, layer, m):
            y = self.bind(self.trained(slot, layer), layer, self.frozen_views(slot, layer))(
                self.layer_input(x, layer), layer)
        return layer_output(y, x, layer).to(self.hidden_dtype).contiguous()

    def head(
        self, h: torch.Tensor, targets: torch.Tensor, t: int, m: int, *, trained: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head + loss forward and backward for one micro-batch. Accumulates the resident
        gradients; returns (loss share of this micro-batch, gradient into the last block).
        The shares add up to the mean cross-entropy over the global batch's targets: with
        none ignored each micro-batch's mean / M; with some -100 (`trained`: the global
        batch's other targets) each micro-batch's sum / trained, so a micro-batch weighs by
        its targets trained on, as in one big batch."""
        h = h.detach().requires_grad_(True)
        with torch.enable_grad(), self.rng(t, 10**6, m):
            logits = functional_call(self.post_mod, self._res_dict(self.outer_dev), (h,))
            # the fp32 logits are not bound to a name: autograd keeps the log-softmax, and a
            # name would keep a second fp32 copy of the logits alive through the backward
            # (18 instead of 14 bytes per logit in bfloat16)
            if trained is None:
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
                loss = loss / self.n_micro
            else:
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                       ignore_index=IGNORE_INDEX, reduction="sum") / trained
            grads = torch.autograd.grad(loss * self.scale, [h, *self.outer_dev], allow_unused=True)
        self._accumulate_resident(grads[1:])
        gh = grads[0]
        assert gh is not None
        return loss.detach(), gh.to(self.hidden_dtype).contiguous()

    # -- evaluation (forward only, dropout off) ----------------------------------------
    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        """The model's modules and the blocks' shells in eval mode (dropout off), and back in
        training mode, as the engine keeps them, afterwards."""
        shells = [call.block for call in self.calls]
        for mod in (self.parts.model, *shells):
            mod.eval()
        try:
            yield
        finally:
            for mod in (self.parts.model, *shells):
                mod.train()

    def eval_block(self, slot: torch.Tensor, x: torch.Tensor, layer: int) -> torch.Tensor:
        """One layer's forward for evaluation: `slot` holds its parameters as a load put
        them there (the device mover's layout), no autograd."""
        with torch.no_grad():
            y = self.bind(self.trained(slot, layer), layer, self.frozen_views(slot, layer))(
                self.layer_input(x, layer), layer)
        return y.to(self.hidden_dtype).contiguous()

    def eval_head(self, h: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
        """The head's cross-entropy summed over this micro-batch's targets trained on (not
        IGNORE_INDEX), and how many those are."""
        with torch.no_grad():
            logits = functional_call(self.post_mod, self._res_dict(self.outer_dev), (h,))
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
            return float(loss), int((targets != IGNORE_INDEX).sum())

    # -- backward ---------------------------------------------------------------------
    def block_bwd(
        self,
        slot: torch.Tensor,
        x: torch.Tensor,
        gy: torch.Tensor,
        acc: torch.Tensor,
        *,
        t: int,
        layer: int,
        m: int,
        accumulate: bool,
        input_grad: bool = True,
    ) -> torch.Tensor | None:
        """Recompute the block from its input checkpoint, backprop `gy`; add (or copy) the
        fp32 parameter gradient into `acc`; return the gradient into the block's input, or
        None without `input_grad` (the lowest layer with a backward, where nothing below
        trains: not computed)."""
        params = self.trained(slot, layer)
        # requiring grad whether or not its gradient is asked for, as in the forward
        # (`block_fwd`): a kernel may pick its algorithm by requires_grad
        x = self.layer_input(x, layer).detach().requires_grad_(True)
        held = [i for _, i in self.layer_held[layer]]
        wrt = [*([x] if input_grad else []), *params, *(self.res_dev[i] for i in held)]
        if not wrt:  # nothing to differentiate (no block trains anything): no recompute
            return None
        with torch.enable_grad(), self.rng(t, layer, m):
            y = self.bind(params, layer, self.frozen_views(slot, layer))(x, layer)
            try:
                got = torch.autograd.grad(y, wrt, grad_outputs=gy, allow_unused=True)
            except RuntimeError as e:
                clear = reentrant_error(e, layer)
                if clear is None:
                    raise
                raise clear from e
        grads: tuple[torch.Tensor | None, ...] = got if input_grad else (None, *got)
        if held:
            self._accumulate_resident(grads[len(grads) - len(held):], held)
            grads = grads[: len(grads) - len(held)]
        kind = self.kinds[layer]
        n = self.kind_params[kind]
        if not accumulate and 0 < n < acc.numel():  # a smaller kind's slot: no stale rest (none read of an empty one)
            acc[n:].zero_()
        for i, (a, g) in enumerate(zip(acc[:n].split(self.kind_numels[kind]), grads[1:], strict=True)):
            if g is None:
                self._no_gradient(t, layer, i)
                if not accumulate:
                    a.zero_()
            else:
                self.unscale_into(a, g, accumulate=accumulate)
        gx = grads[0]
        if not input_grad:
            return None
        assert gx is not None
        return gx.to(self.hidden_dtype).contiguous()

    def _no_gradient(self, t: int, layer: int, i: int) -> None:
        """Parameter `i` of `layer` got no gradient in a micro-batch of iteration `t`. Counted
        per (t, layer) until the layer's optimizer step takes it (`take_skipped`); counts of
        iterations two back are dropped (left by a cancelled run)."""
        key = (t, layer)
        counts = self._none_counts.get(key)
        if counts is None:
            # list(): the event loop's thread pops entries (take_skipped) meanwhile; a copy
            # of the keys is taken at once, where iterating the dict could see it change size
            for old in [k for k in list(self._none_counts) if k[0] < t - 1]:
                self._none_counts.pop(old, None)
            counts = self._none_counts[key] = {}
        counts[i] = counts.get(i, 0) + 1

    def take_skipped(self, t: int, layer: int) -> tuple[int, ...]:
        """The parameters of `layer` (by index) that got no gradient in any micro-batch of
        iteration `t`, once its backward is done: torch.optim.AdamW leaves them that step.
        Counts each as a missed step in `layer_skips` and logs each parameter the first
        time (a log record: on the compute thread a warning filter set to "error" would stop
        the run)."""
        counts = self._none_counts.pop((t, layer), {})
        skipped = tuple(sorted(i for i, c in counts.items() if c >= self.n_micro))
        missed = self.layer_skips[layer]
        for i in skipped:
            missed[i] = missed.get(i, 0) + 1
            if self.watch_gradients and (layer, i) not in self._logged:
                self._logged.add((layer, i))
                name = f"{self.parts.blocks_prefix}.{layer}.{self.kind_names[self.kinds[layer]][i]}"
                log.info(
                    "snake: parameter %r got no gradient in iteration %d (its block did not use it, "
                    "e.g. an expert no token was routed to): not stepped then, as torch.optim.AdamW "
                    "leaves it (logged once per parameter)", name, t,
                )
        return skipped

    def miss_step(self, layer: int, skipped: tuple[int, ...]) -> None:
        """`layer`'s step of an iteration whose steps are skipped (a dynamic loss scale's
        overflow): every parameter counts a missed step, as `take_skipped` counted those
        `skipped` for want of a gradient already."""
        missed, off = self.layer_skips[layer], set(skipped)
        for i in range(len(self.kind_numels[self.kinds[layer]])):
            if i not in off:
                missed[i] = missed.get(i, 0) + 1

    def layer_steps(self, layer: int, step: int, skipped: tuple[int, ...]) -> list[int | None] | None:
        """Per parameter of `layer`, the AdamW step count its step `step` applies (step
        minus the steps it missed), None for one `skipped` now; None when every parameter
        takes `step` (the common case)."""
        missed = self.layer_skips[layer]
        if not missed:
            return None
        n = len(self.kind_numels[self.kinds[layer]])
        off = set(skipped)
        return [None if i in off else step - missed.get(i, 0) for i in range(n)]

    def pre_bwd(self, idx: torch.Tensor, gh: torch.Tensor, t: int, m: int) -> None:
        with torch.enable_grad(), self.rng(t, -1, m):
            h = functional_call(self.pre_mod, self._res_dict(self.outer_dev), (idx,))
            if not self.outer_dev or not h.requires_grad:  # pre trains no parameter (a frozen embedding)
                return
            grads = torch.autograd.grad(h.to(self.dtype), self.outer_dev, grad_outputs=gh.to(self.dtype),
                                        allow_unused=True)
        self._accumulate_resident(grads)

    # -- resident optimizer step --------------------------------------------------------
    def resident_step(
        self, step: int, clip: Callable[[list[torch.Tensor]], tuple[torch.Tensor | None, bool]] | None = None
    ) -> int:
        """AdamW on pre/post, step count `step` for each parameter less the iterations it had
        no gradient in; one without a gradient this iteration is left, as torch.optim.AdamW
        leaves it. With the state on SSD, chunk by chunk: read, step, write back, and the
        chunk's master to the device copy. `clip`: with clipping or a dynamic loss scale,
        takes the resident gradients' norms and gives the iteration's coefficient, which
        scales them first, and whether the iteration's steps are skipped (`GradClip.finish`):
        then no parameter is stepped. Returns the SSD bytes read and written."""
        skip = False
        self.check_finite([g for g, got in zip(self.res_grad, self.res_got, strict=True) if got],
                          "the resident parameters (embeddings, head)", step - 1)
        if clip is not None:
            coef, skip = clip([torch.linalg.vector_norm(g) for g in self.res_grad])
            if not skip:
                scale(self.res_grad, coef)
        on = [i for i, got in enumerate(self.res_got) if got and not skip]
        for i, got in enumerate(self.res_got):
            if skip or not got:
                self.res_skips[i] += 1
        # none on: an overflow, or no resident parameter got a gradient: nothing changes
        moved = self.resident.step(on, step, self.res_skips) if on else 0
        self.res_got = [False] * len(self.res_got)
        for g in self.res_grad:
            g.zero_()
        synchronize(self.device)
        return moved

    def _check_stop(self) -> None:
        if self.stop is not None and self.stop.is_set():
            raise Stopped("the run is being cancelled or has failed")


def _same_values(live: torch.Tensor, copy: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """Does `live` (the model's tensor, on the CPU) hold `copy`'s values (the trainer's, on
    the device, in its dtype)? Compared `chunk` elements at a time, so that a frozen
    embedding of gigabytes takes no copy of itself on a device that has no room for one."""
    if live.shape != copy.shape:
        return False
    a, b = live.detach().reshape(-1), copy.reshape(-1)
    return all(torch.equal(a[i : i + chunk].to(b.device, b.dtype), b[i : i + chunk]) for i in range(0, b.numel(), chunk))


def _frozen_file(layer: int) -> str:
    """The name of the file `map_frozen` writes layer `layer`'s frozen weights to."""
    return f"frozen-{layer:05d}.bin"
