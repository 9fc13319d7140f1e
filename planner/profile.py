"""What the planner knows about the machine: a `MachineProfile`, measured once and cached.

`measure_profile` times a real block on the device, host<->device copies, SSD reads and
writes through the runtime's own storage backend (`snake.io.open_storage`, O_DIRECT, the
token-bucket cap when one is given), and CPU AdamW; the probes live in `planner/probes.py`.
Timings are cached as JSON in the offload directory, keyed by machine, device, dtype, model
shape and cap; free memory is read fresh on every call.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from snake.errors import ConfigError
from snake.memory import DTYPE_BYTES, ModelShape

if TYPE_CHECKING:
    from snake.adapters import ModelParts
    from snake.models.gpt import GPTConfig

MiB = 1 << 20
CACHE_VERSION = 4  # 4: block probes time the runtime kernels over distinct blocks
_MEASURED = (
    "fwd_seconds",
    "bwd_seconds",
    "recompute_seconds",
    "pre_post_seconds",
    "h2d_bytes_per_s",
    "d2h_bytes_per_s",
    "ssd_read_bytes_per_s",
    "ssd_write_bytes_per_s",
    "adam_elems_per_s",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class MachineProfile:
    """Measured costs of one block and of every channel, for one model shape.

    Times are per block (one layer) and per micro-batch: fwd_seconds (forward, no grad),
    recompute_seconds (forward building the graph), bwd_seconds (backward only).
    pre_post_seconds: embedding + head + loss, forward and backward, per micro-batch.
    Bandwidths in bytes/s; adam_elems_per_s: CPU AdamW elements updated per second.
    cpu_memory_bytes: host memory the runtime may use. device_memory_bytes: free device
    memory. device: "cpu" or "cuda" (on "cpu" the device working set is host memory too).
    """

    fwd_seconds: float
    bwd_seconds: float
    recompute_seconds: float
    pre_post_seconds: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    ssd_read_bytes_per_s: float
    ssd_write_bytes_per_s: float
    adam_elems_per_s: float
    cpu_memory_bytes: float
    device_memory_bytes: float
    shape: ModelShape
    device: str = "cpu"
    device_link_bytes_per_s: float | None = None  # SnakeConfig's emulated link cap, if any
    # offload_dir is on a file system in memory (tmpfs): the SSD tier's files take host memory
    # (set from the config by planner.integrate.with_budgets, not measured)
    offload_in_memory: bool = False

    def __post_init__(self) -> None:
        for name in _MEASURED:
            v = getattr(self, name)
            if not isinstance(v, int | float) or not v > 0 or v == float("inf"):
                raise ConfigError(f"profile.{name}", v, "must be a finite number > 0",
                                  "a measured cost: remeasure, e.g. snake plan --remeasure")
        for name in ("cpu_memory_bytes", "device_memory_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not v > 0 or v == float("inf"):
                raise ConfigError(f"profile.{name}", v, "must be a finite number of bytes > 0",
                                  "a memory budget, e.g. snake plan --cpu-memory 8GiB / --device-memory 8GiB")
        link = self.device_link_bytes_per_s
        if link is not None and (not isinstance(link, int | float) or not 0 < link < float("inf")):
            raise ConfigError("profile.device_link_bytes_per_s", link, "must be a finite number > 0 or None")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError("profile.device", self.device, "must be 'cpu' or 'cuda'")

    def to_json(self) -> dict:
        """A JSON-ready dict (shape as a nested dict)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> MachineProfile:
        # profiles saved before the head's working set was modelled have no vocab_size: none
        return cls(**{**d, "shape": ModelShape(**{"vocab_size": 0, **d["shape"]})})


def shape_of(model_cfg: GPTConfig, micro_batch_size: int, seq_len: int, dtype: str) -> ModelShape:
    """The ModelShape of a `GPTConfig` at a micro-batch of micro_batch_size x seq_len tokens.

    Resident params: token + position embeddings and the final norm (the head is tied)."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError("dtype", dtype, f"must be one of {tuple(DTYPE_BYTES)}")
    if micro_batch_size < 1:
        raise ConfigError("micro_batch_size", micro_batch_size, "must be an integer >= 1")
    if not 1 <= seq_len <= model_cfg.block_size:
        raise ConfigError(
            "seq_len", seq_len, f"must be in [1, block_size={model_cfg.block_size}]",
            "a shorter sequence, or a model with a larger block_size",
        )
    c = model_cfg.n_embd
    resident = (model_cfg.vocab_size + model_cfg.block_size) * c + c * (2 if model_cfg.bias else 1)
    return ModelShape(
        n_layers=model_cfg.n_layer,
        layer_params=model_cfg.block_params(),
        ckpt_elems=micro_batch_size * seq_len * c,
        resident_params=resident,
        tokens_per_micro=micro_batch_size * seq_len,
        dtype_bytes=DTYPE_BYTES[dtype],
        vocab_size=model_cfg.vocab_size,
    )


def shape_of_parts(parts: ModelParts, micro_batch_size: int, seq_len: int, dtype: str) -> ModelShape:
    """The ModelShape of any described model (`snake.adapters.describe`): its block's and its
    resident parameters, counted (`param_counts`); its hidden size and vocabulary, read from
    its embedding's and its head's outputs on one token."""
    from snake.adapters import hidden_size, vocab_size

    if dtype not in DTYPE_BYTES:
        raise ConfigError("dtype", dtype, f"must be one of {tuple(DTYPE_BYTES)}")
    tokens = micro_batch_size * seq_len
    return ModelShape(
        **param_counts(parts, dtype),
        ckpt_elems=tokens * hidden_size(parts),
        tokens_per_micro=tokens,
        dtype_bytes=DTYPE_BYTES[dtype],
        hidden_bytes=4 if parts.hidden_fp32 is not None and DTYPE_BYTES[dtype] != 4 else None,
        vocab_size=vocab_size(parts),
    )


def param_counts(parts: ModelParts, dtype: str, *, pre: bool | None = None) -> dict[str, Any]:
    """The ModelShape fields a described model's parameters give, counted without running
    it (so also of a model on the meta device, given `pre`: whether its embedding trains a
    parameter, `snake.adapters.pre_trains`, probed where not given)."""
    from snake.adapters import (
        frozen_in_files,
        frozen_named,
        kept_fp32_params,
        layer_numels,
        lowest_backward,
        resident_named_params,
    )
    from snake.kernels import TORCH_DTYPES

    sizes = layer_numels(parts)
    lowest = lowest_backward(parts, pre)
    frozen = [sum(p.numel() for _, p in frozen_named(b)) for b in parts.blocks]  # streamed with the layer
    slots = [p + f for p, f in zip(sizes, frozen, strict=True)]
    return dict(
        n_layers=len(parts.blocks),
        layer_params=-(-sum(sizes) // len(sizes)),  # layers of several kinds: their mean
        largest_layer_params=max(sizes) if len(set(sizes)) > 1 else None,
        layer_frozen_params=-(-sum(frozen) // len(frozen)),
        largest_slot_params=max(slots) if any(frozen) else None,
        layer_frozen_in_files=frozen_in_files(parts, TORCH_DTYPES[dtype]),
        # held on the device: pre/post's frozen parameters and the blocks' kept in fp32
        frozen_params=sum(p.numel() for p in parts.model.parameters() if not p.requires_grad) - sum(frozen),
        fp32_params=kept_fp32_params(parts),
        resident_params=sum(p.numel() for _, p in resident_named_params(parts)),
        bwd_layers=len(parts.blocks) - lowest if lowest else None,
        first_layer_params=sizes[0] if sizes[0] != -(-sum(sizes) // len(sizes)) else None,
    )


def architecture(parts: ModelParts) -> str | None:
    """What a described model's timings depend on beyond its shape, for the profile cache:
    its classes, its block_fn and its Hugging Face config (with the attention
    implementation), and the configs of the PEFT adapters in it (two LoRAs of the same
    size on other modules time differently). None for a model without such a config:
    nothing then tells two of its kind apart (an attribute or a block_fn can change the
    compute, not the shape), so its profile is measured every time rather than shared (an
    audit's repro had a second model 9x slower reuse the first's timings)."""
    cfg = getattr(parts.model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        return None
    fn = getattr(parts.block_fn, "__qualname__", type(parts.block_fn).__qualname__)
    names = f"{type(parts.model).__qualname__}/{type(parts.blocks[0]).__qualname__}/{fn}"
    what = {**cfg.to_dict(), "attn": str(getattr(cfg, "_attn_implementation", ""))}
    peft = getattr(parts.model, "peft_config", None)  # get_peft_model puts it on the base model
    if isinstance(peft, dict) and peft:
        what["peft"] = {str(k): c.to_dict() if hasattr(c, "to_dict") else str(c) for k, c in peft.items()}
    # sets (PEFT's target_modules) in their sorted order: a str of a set changes run to run
    blob = json.dumps(what, sort_keys=True, default=lambda o: sorted(map(str, o)) if isinstance(o, (set, frozenset)) else str(o))
    return f"{names}/{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def free_memory_bytes(device: str) -> tuple[float, float]:
    """(available host bytes, free device bytes); on CPU the device is host memory."""
    import torch

    from snake.device import device_memory_bytes

    host = float(psutil.virtual_memory().available)
    dev = device_memory_bytes(torch.device(device))
    return host, float(dev if dev is not None else host)


def cache_path(offload_dir: str | Path, key: dict) -> Path:
    """offload_dir/snake-profile-<hash of key>.json."""
    blob = json.dumps(key, sort_keys=True).encode()
    return Path(offload_dir) / f"snake-profile-{hashlib.sha256(blob).hexdigest()[:16]}.json"


def _cache_key(shape: ModelShape, device: str, dtype: str, cap: float | None, arch: str | None = None) -> dict:
    import torch

    return {
        **({"architecture": arch} if arch is not None else {}),
        "version": CACHE_VERSION,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "device": device,
        "dtype": dtype,
        "shape": dataclasses.asdict(shape),
        "cap": cap,
    }


def _load(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text())
        return {k: float(d[k]) for k in _MEASURED}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def measure_profile(
    model_cfg: GPTConfig | ModelParts,
    *,
    micro_batch_size: int,
    seq_len: int,
    device: str = "cpu",
    dtype: str = "float32",
    offload_dir: str | Path,
    ssd_bandwidth_bytes_per_s: float | None = None,
    io_bytes: int = 256 * MiB,
    cache: bool = True,
    remeasure: bool = False,
    seconds_per_probe: float = 0.4,
    kind_counts: list[int] | None = None,
    stop: threading.Event | None = None,
) -> MachineProfile:
    """Measure (or load from offload_dir's cache) the profile of `model_cfg` on `device`.

    model_cfg: a built-in GPT's config (fresh blocks of it are timed) or any described model
    (`snake.adapters.ModelParts`: its own blocks, embedding and head are timed, and its
    `architecture` is part of the cache key; without one, nothing is cached). io_bytes: bytes written then read back on the
    SSD (each direction, capped at 256 MiB and at about 2 s of transfer). seconds_per_probe: time spent repeating each timed probe.
    remeasure: ignore (and overwrite) the cache. kind_counts: where model_cfg holds a sample
    of a model's layers with each of its kinds (`snake.adapters.layer_kinds`), how many
    layers of each kind the whole model has: the block times are averaged with them. stop:
    once set, the probes raise Stopped at their next round (a cancelled planning). Takes
    ~5-15 s on two CPU cores."""
    from planner import probes
    from snake.adapters import ModelParts

    if isinstance(model_cfg, ModelParts):
        cfg, parts = None, model_cfg
        shape = shape_of_parts(parts, micro_batch_size, seq_len, dtype)
        arch = architecture(parts)
        if arch is not None and kind_counts is not None:
            arch = f"{arch}/kinds{kind_counts}"
        cache = cache and arch is not None
    else:
        cfg, parts, arch = model_cfg, None, None  # the built-in GPT: its config is the shape
        shape = shape_of(cfg, micro_batch_size, seq_len, dtype)
    kind = "cuda" if str(device).startswith("cuda") else "cpu"
    path = cache_path(offload_dir, _cache_key(shape, str(device), dtype, ssd_bandwidth_bytes_per_s, arch))
    measured = _load(path) if cache and not remeasure else None
    if measured is None:
        measured = probes.measure_all(
            cfg,
            parts=parts,
            micro_batch_size=micro_batch_size,
            seq_len=seq_len,
            device=str(device),
            dtype=dtype,
            offload_dir=Path(offload_dir),
            cap=ssd_bandwidth_bytes_per_s,
            io_bytes=min(int(io_bytes), 256 * MiB),
            seconds=seconds_per_probe,
            kind_counts=kind_counts,
            stop=stop,
        )
        if cache:
            Path(offload_dir).mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(measured, indent=1, sort_keys=True))
    host, dev = free_memory_bytes(str(device))
    return MachineProfile(
        **measured, cpu_memory_bytes=host, device_memory_bytes=dev, shape=shape, device=kind
    )
