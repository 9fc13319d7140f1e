"""Checkpoints: `await trainer.save(directory)` and `await trainer.load(directory)`.

A checkpoint is a directory of safetensors files and one JSON manifest (no pickle):

  manifest.json            format and version, `step` (optimizer steps applied = the next
                           iteration), `consumed_batches` (global batches taken from the
                           data), the config fields a resume must match, the model's
                           parameter names and shapes, `missed_steps` (the parameters left
                           in some steps for want of a gradient or by a dynamic loss
                           scale's overflow, and how many), `loss_scale` (a dynamic loss
                           scale's state: scale and growth_tracker; absent without one),
                           `frozen_stored` (whether the files hold the frozen parameters;
                           absent in older checkpoints, which do), and the size and sha256
                           of each file
  layer-00000.safetensors  one per block: `master/<name>`, `exp_avg/<name>`,
                           `exp_avg_sq/<name>` (fp32) for each of the block's parameters,
                           named as in `model.state_dict()`, and `frozen/<name>` for each
                           of the block's frozen parameters (requires_grad=False: never
                           stepped; a load checks the model's against their digests, which
                           the manifest holds: not stored by `save(frozen=False)`, nor by
                           default for a PEFT model, whose base is the user's; before round
                           37 in resident.safetensors)
  resident.safetensors     the same for the resident (pre/post) parameters (tied weights once),
                           and `frozen/<name>` for the other frozen parameters,
                           and `buffer/<name>` for every buffer in `model.state_dict()` (a
                           layer's own scale or routing bias: `snake export` rebuilds the
                           model from its config, which does not hold them; a load leaves
                           the model's as they are)
  rng.safetensors          torch's global RNG state(s) as uint8 tensors
  data.safetensors         the tensors of the data's state (a stateful source's: one with
                           `state_dict()` and `load_state_dict()`, torchdata's
                           StatefulDataLoader): the state after the last batch trained on,
                           whose tree is the manifest's `data_state` (`snake.data_state`); a
                           load with such data hands it to `load_state_dict` instead of
                           reading and dropping the batches trained before. Absent (and no
                           `data_state`) where the data has no state.

The manifest's `batch` records the shapes and dtypes of the trainer's batches (inputs and
targets): a load whose data has no batch after the checkpoint's (a run trained to its
data's end) sizes the trainer from it, to evaluate or go on with `run(data=...)`; absent in
checkpoints before round 42 and in one saved before the first run.

Every parameter has had `step` AdamW steps, less its `missed_steps` (iterations in which it
got no gradient, which torch.optim.AdamW skips too): delayed optimizer work (alpha > 0) is
flushed before saving, so a resumed run gives the weights of an uninterrupted one. The
compute-dtype parameters are not stored: `load` derives them from the masters. Dropout
masks derive from (config.seed, iteration, layer, micro-batch), so the step counter and the
seed fix them.

Saving is atomic: the files are written into a temporary sibling directory and fsynced,
then renamed over the target (an existing checkpoint there is renamed aside first and
removed only after the rename), so a crash leaves the previous checkpoint in place. Writes
and reads go one layer at a time, without a copy of the layer's state: safetensors writes
the optimizer state in CPU memory from the store itself, and what lies on SSD passes through
the optimizer's staging buffers (idle between runs); a load maps one layer file and copies
each parameter into its units.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file as st_load_file

from snake.adapters import (
    ModelParts,
    flat_named,
    has_peft_layers,
    layer_specs,
    layer_values,
    resident_named_params,
)
from snake.batch_spec import spec_error, stand_in_batch
from snake.blocking import name_native_thread, run_blocking
from snake.buffers import HostBuffer, alloc_host
from snake.checkpoint_files import (
    _check_replaceable,
    _check_save_space,
    _check_save_target,
    _clean_stale,
    _fsync_dir,
    _publish,
    _resolve,
    _TensorFile,
    _write_file,
    _write_tensors,
    holds,
)
from snake.data_state import Snapshot, check_tree
from snake.device import synchronize
from snake.errors import ConfigError, DataError, DataExhausted, SnakeError, Stopped
from snake.manifest import (
    COMPS,
    DATA,
    FORMAT,
    MANIFEST,
    RESIDENT,
    RNG,
    VERSION,
    check_compatible,
    check_resolved,
    config_record,
    fill_config,
    layer_file,
    missed_steps,
    model_config,
    model_spec,
    peft_record,
    read_manifest,
    trainer_digests,
)

if TYPE_CHECKING:
    from snake.engine import Engine
    from snake.trainer import SnakeTrainer

log = logging.getLogger("snake")


R = TypeVar("R")


# -- public entry points (SnakeTrainer.save / .load call these) -------------------------
async def save_checkpoint(trainer: SnakeTrainer, directory: str | os.PathLike[str], *,
                          frozen: bool | None = None) -> Path:
    """Write the trainer's full training state to `directory` (atomically, replacing a
    checkpoint already there). Works before the first run too (step 0, zero moments).
    `frozen`: store the frozen parameters (default: unless the model is a PEFT model)."""
    trainer._check_usable()
    trainer._check_idle("save")
    if frozen is not None and not isinstance(frozen, bool):
        raise ConfigError("save(frozen=...)", frozen, "must be True, False or None (the default: stored unless the "
                          "model is a PEFT model)")
    store = not has_peft_layers(trainer.parts.model) if frozen is None else frozen
    target = _resolve(directory)
    if holds(target, trainer.offload_dir):  # the checkpoint's rename would take the live tier away
        raise SnakeError(
            f"save: {target} is or holds the trainer's offload_dir {trainer.offload_dir}, whose SSD tier files are "
            "the training's live state: pick a checkpoint path outside it (one inside it is fine)"
        )
    _check_save_target(target)  # before the delayed steps are flushed: a bad path changes nothing
    _check_save_space(trainer, target, store)
    data = _data_state(trainer)
    trainer._begin()
    try:
        e = trainer.engine
        if e is not None:
            await trainer._flush("save")
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "step": e.next_t if e is not None else 0,
            "consumed_batches": trainer.source.consumed,
            "config": config_record(trainer.config),
            # off the event loop: the frozen parameters' digests read them whole
            "model": await _blocking(e, lambda: model_spec(trainer.parts, trainer_digests(trainer))),
            "model_config": model_config(trainer.parts),
            "peft": peft_record(trainer.parts),
            "missed_steps": missed_steps(e) if e is not None else {},
            "frozen_stored": store,
        }
        if e is not None and e.scaler is not None:
            manifest["loss_scale"] = e.scaler.state()
        if data is not None:
            manifest["data_state"] = data.tree
        if trainer._batch_spec is not None:
            manifest["batch"] = trainer._batch_spec
        rng = rng_state()
        stop = threading.Event()  # a cancelled save stops at its next file and removes what it wrote
        with _borrowed(e, "opt", every=True) as bufs:
            await _blocking(e, functools.partial(_save_blocking, e, trainer.parts, manifest, rng, target, bufs, stop,
                                                 data.tensors if data is not None else None),
                            on_cancel=stop.set)
    finally:
        trainer._end()
    return target


async def load_checkpoint(
    trainer: SnakeTrainer, directory: str | os.PathLike[str], *, skip_data: bool = True
) -> None:
    """Restore a checkpoint into a new trainer, before its first run(). Validates the
    manifest against the trainer (ConfigError naming the field), skips the global batches
    the checkpoint consumed (unless skip_data=False: then the data must already start
    after them), builds the engine and overwrites its state."""
    trainer._check_usable()
    if trainer.engine is not None or trainer._running or trainer.source.consumed:
        raise SnakeError(
            "load: a checkpoint can only be loaded into a new trainer, before its first run() "
            "(this one has already run or loaded one); make a new SnakeTrainer and call "
            "load() before run()"
        )
    if not isinstance(skip_data, bool):
        raise ConfigError("load(skip_data=...)", skip_data, "must be True or False")
    target = _resolve(directory)
    trainer._begin()
    try:
        manifest = await _blocking(None, functools.partial(read_manifest, target))
        await _blocking(None, lambda: check_compatible(manifest, trainer.config, trainer.parts,
                                                        trainer_digests(trainer)))
        consumed, left = int(manifest["consumed_batches"]), trainer.source.left()
        restores = skip_data and trainer.source.stateful and "data_state" in manifest
        if skip_data and not restores and left is not None and left < consumed:  # a list: known before it is read
            raise _short_data(consumed, f"data holds {left}")
        # checked before the point of no return below, as the rest of the manifest is
        snap = await _blocking(None, functools.partial(_read_data_state, target, manifest)) if restores else None
        trainer.config = fill_config(trainer.config, manifest)
        # where the data has no batch after the checkpoint's (a run trained to its end), the
        # engine is sized from the batch shapes the checkpoint records
        trainer._stand_in = None
        if "batch" in manifest:
            why = spec_error(manifest["batch"], trainer.config.micro_batches)
            if why is not None:
                raise SnakeError(f"load: {target / MANIFEST} has batch={manifest['batch']!r}, which {why}: the "
                                 "manifest is damaged")
            trainer._stand_in = stand_in_batch(manifest["batch"])
        # from here on the trainer's data and engine change: a failure leaves it unusable
        try:
            await _restore(trainer, target, manifest, skip_data, snap)
        except BaseException as exc:
            trainer._broken = f"load({str(target)!r}) failed: {type(exc).__name__}: {exc}"
            await trainer._shutdown()
            raise
    finally:
        trainer._end()


async def _restore(
    trainer: SnakeTrainer, target: Path, manifest: dict[str, Any], skip_data: bool, snap: Snapshot | None
) -> None:
    """`snap`: the checkpoint's data state, handed to the (stateful) data; else the batches
    it consumed are skipped by reading them (where skip_data)."""
    consumed = int(manifest["consumed_batches"])
    if snap is not None or (skip_data and consumed):
        ex = ThreadPoolExecutor(1, thread_name_prefix="snake-data", initializer=name_native_thread)
        try:
            if snap is not None:
                await trainer.source.restore(snap, consumed, ex)
            else:
                try:
                    for _ in range(consumed):
                        await trainer.source.next(ex)
                except DataError as exc:
                    raise _short_data(consumed, f"data ran out after {trainer.source.consumed}") from exc
        finally:
            # joined unless a cancellation left the user's next() running there (it may block
            # for long, and the load does not wait for it, as run() does not): that thread
            # ends when it returns
            ex.shutdown(wait=not trainer.source.fetching(), cancel_futures=True)
    if not skip_data:  # the data starts after the checkpoint's batches: its own state is not that position
        trainer.source.skipped = consumed
    trainer.source.consumed = consumed
    try:
        await trainer._setup()
    except DataExhausted as exc:  # only without the manifest's `batch` (a checkpoint before round 42)
        raise DataExhausted(
            f"load: the data has no batch after the checkpoint's {consumed}, and the checkpoint records no batch "
            "shapes to size the trainer from (it was saved before its trainer's first run, or by a snake before "
            "round 42): give data with a batch after them, or load(dir, skip_data=False) with the data to go on with"
        ) from exc
    trainer._stand_in = None
    check_resolved(trainer.config, manifest)
    e = trainer.engine
    assert e is not None
    stop = threading.Event()  # a cancelled load stops at its next layer (the trainer closes either way)
    with _borrowed(e, "opt") as obuf, _borrowed(e, "param_in") as pbuf:
        rng = await run_blocking(e.executors["io"], apply_checkpoint, e, trainer.parts, target, manifest,
                                 obuf[0] if obuf else None, pbuf[0] if pbuf else None, stop, on_cancel=stop.set)
    set_rng_state(rng)


def _data_state(trainer: SnakeTrainer) -> Snapshot | None:
    """The state a save stores of the trainer's data (after the last batch it trained on;
    None where the data has none). Where a stateful source's is not known there (its
    state_dict() failed at that batch), a warning: the checkpoint's load reads and drops
    the batches instead, as for data without state."""
    source = trainer.source
    if not source.stateful:
        return None
    snap = source.state()
    if source.state_lost():
        log.warning("save: the data's state after its %d batches trained on is not known (its state_dict() failed "
                    "there): a load of this checkpoint reads and drops those batches instead of restoring the "
                    "state", source.consumed)
    return snap


def _read_data_state(target: Path, manifest: dict[str, Any]) -> Snapshot:
    """Blocking: the data state a checkpoint holds (the manifest's tree, the tensors of
    data.safetensors), checked."""
    tensors: dict[str, torch.Tensor] = {}
    if DATA in manifest["files"]:
        try:
            tensors = st_load_file(str(target / DATA))
        except (SafetensorError, OSError) as exc:
            raise SnakeError(f"load: {target / DATA} is not a valid safetensors file: {exc}") from exc
    why = check_tree(manifest["data_state"], set(tensors))
    if why is not None:
        raise SnakeError(why)
    return Snapshot(manifest["data_state"], tensors)


def _short_data(consumed: int, have: str) -> DataError:
    return DataError(
        f"load: the checkpoint has consumed {consumed} global batches but {have}; pass the data the "
        "checkpoint was trained on (from its start), or load(..., skip_data=False) with data that starts "
        "after them"
    )


@contextlib.contextmanager
def _borrowed(e: Engine | None, pool: str, *, every: bool = False) -> Iterator[list[HostBuffer]]:
    """The engine's staging buffers for `pool`'s tails (one, or every free one), lent to a
    save or load: no run is in flight then, so all are free, and the state passes through
    them rather than through memory of its own. Empty when the store has no tails (or no
    engine)."""
    p = e.pools[pool] if e is not None else None
    bufs: list[HostBuffer] = []
    while p is not None and (every or not bufs):
        buf = p.try_acquire()
        if buf is None:
            break
        bufs.append(buf)
    try:
        yield bufs
    finally:
        for buf in bufs:
            assert p is not None
            p.release(buf)


async def _blocking(e: Engine | None, fn: Callable[[], R], on_cancel: Callable[[], None] | None = None) -> R:
    if e is not None:
        return await run_blocking(e.executors["io"], fn, on_cancel=on_cancel)
    with ThreadPoolExecutor(1, thread_name_prefix="snake-checkpoint", initializer=name_native_thread) as ex:
        return await run_blocking(ex, fn, on_cancel=on_cancel)


def _set_missed_steps(e: Engine, missed: dict[str, int]) -> None:
    k = e.kernels
    res = {name[len("model."):]: i for i, name in enumerate(k.res_names)}
    k.res_skips = [missed.get(name, 0) for name in res]
    for layer in range(e.N):
        head = f"{k.parts.blocks_prefix}.{layer}."
        k.layer_skips[layer] = {
            i: missed[head + n] for i, n in enumerate(k.kind_names[k.kinds[layer]]) if head + n in missed
        }
    k.res_got = [False] * len(k.res_got)
    e.delayed_skips.clear()


# -- RNG --------------------------------------------------------------------------------
def rng_state() -> dict[str, torch.Tensor]:
    out = {"torch/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch/cuda/{i}"] = s
    return out


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch/cpu"])
    cuda = [state[k] for k in sorted(state) if k.startswith("torch/cuda/")]
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)


# -- saving -----------------------------------------------------------------------------
def _save_blocking(
    e: Engine | None, parts: ModelParts, manifest: dict[str, Any], rng: dict[str, torch.Tensor], target: Path,
    bufs: list[HostBuffer] | None = None, stop: threading.Event | None = None,
    data: dict[str, torch.Tensor] | None = None,
) -> None:
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    _check_replaceable(target)
    _clean_stale(target)
    tmp = parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir(mode=0o755)
    try:
        if target.is_dir():  # the checkpoint replaces it: keep the permissions the user gave it
            os.chmod(tmp, stat.S_IMODE(target.stat().st_mode))
        files: dict[str, Any] = {}
        meta = {"format": FORMAT}
        if e is not None:
            read_layer = _engine_layers(e, parts, bufs or [])
        else:
            read_model = _model_layer(parts)
            read_layer = lambda layer: layer_tensors(parts, layer, read_model(layer))  # noqa: E731
        def check_stop() -> None:
            if stop is not None and stop.is_set():
                raise Stopped(f"save to {target} cancelled; nothing was published")

        frozen = manifest["frozen_stored"]
        for layer in range(len(parts.blocks)):
            check_stop()
            # a layer's frozen parameters beside its state: read (where a streamed model left
            # them in its files) a layer at a time
            tensors = {**read_layer(layer), **(layer_frozen(parts, layer) if frozen else {})}
            files[layer_file(layer)] = _write_tensors(tmp / layer_file(layer), tensors, meta)
            del tensors
        check_stop()
        files[RESIDENT] = _write_tensors(tmp / RESIDENT, resident_tensors(e, parts, frozen), meta)
        check_stop()
        files[RNG] = _write_tensors(tmp / RNG, {k: v.contiguous() for k, v in rng.items()}, meta)
        if data is not None:  # the data's state (its tree is the manifest's)
            files[DATA] = _write_tensors(tmp / DATA, data, meta)
        manifest = {**manifest, "files": files}
        _write_file(tmp / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
        _fsync_dir(tmp)
        check_stop()  # the last point at which a cancellation keeps the old checkpoint
        _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _engine_layers(e: Engine, parts: ModelParts, bufs: list[HostBuffer]) -> Callable[[int], dict[str, torch.Tensor]]:
    """A reader of one layer's master, m and v by parameter name, from the optimizer store.
    A parameter that lies in one unit's CPU head is a view of it (no copy: the state in
    CPU memory is written from where it is). What has a part on SSD is copied into `bufs`
    (the optimizer's idle staging buffers: the first takes the tails as read, the others
    the copies) and, for what does not fit there, into a mapping of the save's own."""
    store = e.stores["opt"]
    specs = layer_specs(parts)
    buf = bufs[0] if bufs else (alloc_host(store.max_tail_bytes, pin=False) if store.max_tail_bytes else None)
    # beyond the borrowed buffers: one mapping reused layer to layer (torch.empty per
    # parameter left glibc's arenas holding each layer's copies: +30-60 MiB per layer)
    own: list[HostBuffer] = []

    def place(sizes: list[int]) -> list[torch.Tensor]:
        """fp32 tensors of `sizes` elements in the spare buffers, first fit, else own memory."""
        spare = bufs[1:]
        used = [0] * len(spare)
        where: list[tuple[HostBuffer | None, int]] = []
        extra = 0
        for n in sizes:
            i = next((i for i, b in enumerate(spare) if used[i] + 4 * n <= b.nbytes), None)
            if i is None:
                where.append((None, extra))
                extra += 4 * n
            else:
                where.append((spare[i], used[i]))
                used[i] += 4 * n
        if extra and (not own or own[0].nbytes < extra):
            own[:] = [alloc_host(extra, pin=False)]
        return [
            (hb if hb is not None else own[0]).data[at : at + 4 * n].view(torch.float32)
            for (hb, at), n in zip(where, sizes, strict=True)
        ]

    def read(layer: int) -> dict[str, torch.Tensor]:
        prefix = f"{parts.blocks_prefix}.{layer}."
        units = []  # (first element in the layer, unit)
        off = 0
        for part, n in enumerate(e.layer_parts[layer]):
            if n:
                units.append((off, store.unit((layer, part))))
                off += n
        out: dict[str, torch.Tensor] = {}
        copied: list[tuple[str, torch.Size, int, int]] = []  # parameters not in one head
        a = 0
        for name, shape in specs[layer]:
            b = a + shape.numel()
            home = next(((s0, u) for s0, u in units if s0 <= a and b <= s0 + u.k), None)
            if home is None:
                copied.append((name, shape, a, b))
            else:
                s0, u = home
                for c, comp in enumerate(COMPS):
                    out[f"{comp}/{prefix}{name}"] = store.head(u)[c, a - s0 : b - s0].view(shape)
            a = b
        room = iter(place([b - a for _, _, a, b in copied for _ in COMPS]))
        for name, shape, _, _ in copied:
            for comp in COMPS:
                out[f"{comp}/{prefix}{name}"] = next(room).view(shape)
        for s0, u in units:
            mine = [(name, a, b) for name, _, a, b in copied if a < s0 + u.n and b > s0]
            if not mine:
                continue
            head = store.head(u)
            tail = None
            if u.tail_n:
                assert buf is not None
                store.read_tail(u, buf)
                tail = store.tail(u, buf)
            for name, a, b in mine:
                for c, comp in enumerate(COMPS):
                    dst = out[f"{comp}/{prefix}{name}"].view(-1)
                    lo, hi = max(a, s0), min(b, s0 + u.k)  # the part in the head
                    if lo < hi:
                        dst[lo - a : hi - a] = head[c, lo - s0 : hi - s0]
                    lo, hi = max(a, s0 + u.k), min(b, s0 + u.n)  # the part on SSD
                    if lo < hi:
                        assert tail is not None
                        dst[lo - a : hi - a] = tail[c, lo - s0 - u.k : hi - s0 - u.k]
        return out

    return read


def _model_layer(parts: ModelParts) -> Callable[[int], torch.Tensor]:
    def read(layer: int) -> torch.Tensor:
        params = layer_values(parts, layer, flat_named(parts.blocks[layer]))
        out = torch.zeros(3, sum(p.numel() for p in params), dtype=torch.float32)
        if params:  # a layer that trains nothing (frozen, or its adapters held in fp32) has no state
            torch.cat([p.reshape(-1).to("cpu", torch.float32) for p in params], out=out[0])
        return out

    return read


def layer_tensors(parts: ModelParts, layer: int, stacked: torch.Tensor) -> dict[str, torch.Tensor]:
    """One layer's tensors as views of its (3, P) state: no copy (safetensors takes
    non-overlapping views of one storage)."""
    prefix = f"{parts.blocks_prefix}.{layer}."
    out: dict[str, torch.Tensor] = {}
    for c, comp in enumerate(COMPS):
        off = 0
        for name, shape in layer_specs(parts)[layer]:
            n = shape.numel()
            out[f"{comp}/{prefix}{name}"] = stacked[c, off : off + n].view(shape)
            off += n
    return out


def resident_tensors(e: Engine | None, parts: ModelParts, frozen: bool = True) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    # the state on SSD: read into a mapping of a scratch file, not into the process's memory
    snap = None
    if e is not None and e.kernels.resident.store is not None:
        snap = e.kernels.resident.snapshot(e.offload_dir)
    for i, (name, p) in enumerate(resident_named_params(parts)):
        if snap is not None:
            comps = snap[i]
        elif e is not None:
            comps = e.kernels.resident.components(i)
        else:
            master = p.detach().to("cpu", torch.float32)
            comps = (master, torch.zeros_like(master), torch.zeros_like(master))
        for comp, t in zip(COMPS, comps, strict=True):
            out[f"{comp}/{name}"] = t.view(p.shape)  # each its own tensor: no copy needed
    # frozen parameters outside the layers, as they are, where stored (a load checks the
    # model's against their digests; `snake export` takes them from here)
    prefix = parts.blocks_prefix + "."
    said = "the checkpoint holds the model's changed value, which a trainer that loads it computes with"
    for name, p in parts.model.named_parameters():
        if frozen and not p.requires_grad and not name.startswith(prefix):
            if e is not None:
                e.kernels.outer_as_computed(name, p, said)
            out[f"frozen/{name}"] = p.detach().to("cpu").contiguous()
    for name, t in state_buffers(parts.model).items():
        if e is not None:
            e.kernels.outer_as_computed(name, t, said)
        out[f"buffer/{name}"] = t.detach().to("cpu").contiguous()
    return out


def layer_frozen(parts: ModelParts, layer: int) -> dict[str, torch.Tensor]:
    """Layer `layer`'s frozen parameters as a checkpoint stores them (`frozen/<name>`, by
    `named_parameters`' names: a weight tied elsewhere before it is stored there), as they
    are or, on the meta device, read through `parts.weights`."""
    head = f"{parts.blocks_prefix}.{layer}."
    names = {n[len(head):] for n, p in parts.model.named_parameters() if not p.requires_grad and n.startswith(head)}
    named = [(n, p) for n, p in parts.blocks[layer].named_parameters() if n in names]
    values = layer_values(parts, layer, named)
    return {f"frozen/{head}{n}": v.to("cpu").contiguous() for (n, _), v in zip(named, values, strict=True)}


def state_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers `model.state_dict()` holds (persistent), by its names."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {n: t for n, t in model.state_dict(keep_vars=True).items() if n not in params and not t.is_meta}


def _ranges(f: _TensorFile, name: str, shape: torch.Size) -> Callable[[int, int, int], torch.Tensor]:
    """A resident parameter's state in the checkpoint as `ResidentState.set` reads it:
    (component, first, end) -> those elements of its flat master, m or v."""
    def read(c: int, a: int, b: int) -> torch.Tensor:
        return f.take_range(f"{COMPS[c]}/{name}", shape, a, b)

    return read


def _spread(src: torch.Tensor, at: int, k: int, head: torch.Tensor, tail: torch.Tensor | None) -> None:
    """Copy `src`, a unit's elements [at, at + len), to its head ([0, k)) and tail ([k, n))."""
    end = at + src.numel()
    if at < k:
        head[at : min(end, k)] = src[: min(end, k) - at]
    if end > k:
        assert tail is not None
        tail[max(at, k) - k : end - k] = src[max(at, k) - at :]


def apply_checkpoint(
    e: Engine, parts: ModelParts, target: Path, manifest: dict[str, Any],
    obuf: HostBuffer | None = None, pbuf: HostBuffer | None = None, stop: threading.Event | None = None,
) -> dict[str, torch.Tensor]:
    """Blocking, on a freshly set-up engine: overwrite the optimizer and parameter units
    (heads and tails), the resident state and the counters. Returns the RNG state. Raises
    Stopped before the next layer once `stop` is set (its task was cancelled)."""
    ostore, pstore = e.stores["opt"], e.stores["param"]
    obuf = obuf if obuf is not None else alloc_host(max(ostore.max_tail_bytes, 1), pin=False)
    pbuf = pbuf if pbuf is not None else alloc_host(max(pstore.max_tail_bytes, 1), pin=False)
    specs = layer_specs(parts)
    for layer in range(e.N):
        if stop is not None and stop.is_set():
            raise Stopped(f"load from {target} cancelled part-way")
        # unit by unit, each parameter's piece straight into the unit's head and staging
        # buffer (no copy of the layer's state: one parameter's tensor at a time)
        prefix = f"{parts.blocks_prefix}.{layer}."
        with _TensorFile(target / layer_file(layer)) as f:
            s0 = 0
            for part, n in enumerate(e.layer_parts[layer]):
                if not n:
                    continue
                ou, pu = ostore.unit((layer, part)), pstore.unit((layer, part))
                ohead, phead = ostore.head(ou), pstore.head(pu)[0]
                otail = ostore.tail(ou, obuf) if ou.tail_n else None
                ptail = pstore.tail(pu, pbuf)[0] if pu.tail_n else None
                a = 0
                for name, shape in specs[layer]:
                    b = a + shape.numel()
                    lo, hi = max(a, s0), min(b, s0 + n)
                    if lo < hi:
                        for c, comp in enumerate(COMPS):
                            piece = f.take(f"{comp}/{prefix}{name}", shape).view(-1)[lo - a : hi - a]
                            _spread(piece, lo - s0, ou.k, ohead[c], otail[c] if otail is not None else None)
                            if c == 0:  # the parameters: what the optimizer derives from the master
                                _spread(piece.to(e.dtype), lo - s0, pu.k, phead, ptail)
                    a = b
                if ou.tail_n:
                    ostore.write_tail(ou, obuf)
                if pu.tail_n:
                    pstore.write_tail(pu, pbuf)
                s0 += n
    k = e.kernels
    with torch.no_grad(), contextlib.ExitStack() as files:
        f = files.enter_context(_TensorFile(target / RESIDENT))
        layer_files: dict[int, _TensorFile] = {}
        prefix = parts.blocks_prefix + "."
        for i, (name, p) in enumerate(resident_named_params(parts)):
            src = f
            if f"{COMPS[0]}/{name}" not in f.keys() and name.startswith(prefix):
                # a layer's parameter an earlier snake streamed (`_held_now`): in its layer file
                layer = int(name[len(prefix):].partition(".")[0])
                if layer not in layer_files:
                    layer_files[layer] = files.enter_context(_TensorFile(target / layer_file(layer)))
                src = layer_files[layer]
            k.resident.set(i, _ranges(src, name, p.shape))
    synchronize(e.device)
    step = int(manifest["step"])
    e.next_t = step
    _set_missed_steps(e, manifest.get("missed_steps", {}))
    if e.scaler is not None and manifest.get("loss_scale") is not None:
        e.scaler.load(manifest["loss_scale"])  # (a checkpoint without one: the config's init_scale)
    # nothing is pending after the flush at save time: the delayed steps of iteration
    # `step` would apply the gradients of iteration step - 1, which the masters hold
    e.first_delayed = step + 1 if step > 0 else 0
    for layer in range(e.N):
        for part, n in enumerate(e.layer_parts[layer]):
            if n:
                e.ledger.set(("param", layer, part), step)
                e.ledger.set(("opt", layer, part), step)
    with _TensorFile(target / RNG) as f:
        if "torch/cpu" not in f.keys():
            raise SnakeError(f"load: {target / RNG} lacks the torch RNG state: the checkpoint is damaged")
        return {key: f.take(key, dtype=torch.uint8) for key in sorted(f.keys())}
