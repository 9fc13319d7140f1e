"""What a Hugging Face model's forward hands each decoder layer, made outside that forward:
the causal mask (per window, cached) and the rotary table's (cos, sin)."""

from __future__ import annotations

import copy
import inspect
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from snake.hf.families import _SELF_CAUSAL, _UNMASKED


def _rotary_by_layer(model: nn.Module) -> list[_Rotary | None]:
    """Granite SWA's rotary table per layer: one per base (`config.layer_rope_theta`, one
    model-level table per distinct base in `model.rotary_embs`), None where the base is 0
    (no positions: NoPE)."""
    config: Any = model.config
    inner: Any = model.model
    tables = {float(emb.config.rope_parameters["rope_theta"]): _Rotary(emb) for emb in inner.rotary_embs}
    return [tables[float(theta)] if theta else None for theta in config.layer_rope_theta]


def _nope_scaling(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """Beam's query scale by position for its layers without rotary positions, from its own
    modeling module."""
    return sys.modules[type(model).__module__].compute_attention_scaling  # type: ignore[no-any-return]


def _hidden(out: Any) -> torch.Tensor:
    """Decoder layers return a tensor (transformers >= 4.54) or a tuple led by it."""
    return out[0] if isinstance(out, tuple | list) else out


class _MaskCache:
    """The attention mask a layer needs for a (T, dtype, device): None where the attention
    kernel masks causally by itself, else an additive (1, 1, T, T) mask with the dtype's
    minimum above the diagonal (and before the sliding window, or outside the query's chunk
    of `chunk` tokens: Llama 4's chunked attention), as transformers builds it. With `full`
    always a mask, under SDPA a boolean one (True: attend), as transformers builds it when
    told not to skip it."""

    def __init__(self, impl: str, window: int | None, chunk: int | None = None, *, full: bool = False) -> None:
        self.impl = impl
        self.window = window
        self.chunk = chunk
        self.full = full
        self._cache: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        self._lock = threading.Lock()

    def get(self, h: torch.Tensor) -> torch.Tensor | None:
        T = h.shape[1]
        needs_window = self.window is not None and T > self.window
        needs_chunk = self.chunk is not None and T > self.chunk
        if self.impl.startswith("flash_attention"):
            return None  # flash kernels get the window from the layer itself
        if self.impl in _SELF_CAUSAL and not needs_window and not needs_chunk and not self.full:
            return None
        key = (T, h.dtype, h.device)
        with self._lock:
            mask = self._cache.get(key)
            if mask is None:
                q = torch.arange(T, device=h.device)[:, None]
                k = torch.arange(T, device=h.device)[None, :]
                allowed = k <= q
                if needs_window:
                    assert self.window is not None
                    allowed &= k > q - self.window
                if needs_chunk:
                    assert self.chunk is not None
                    allowed &= (k // self.chunk) == (q // self.chunk)
                if self.full and self.impl == "sdpa":  # as transformers builds it for SDPA
                    mask = allowed[None, None]
                else:
                    mask = torch.zeros(T, T, dtype=h.dtype, device=h.device)
                    mask.masked_fill_(~allowed, torch.finfo(h.dtype).min)
                    mask = mask[None, None]
                if len(self._cache) > 16:
                    self._cache.clear()
                self._cache[key] = mask
        return mask


class _Rotary:
    """The rotary embedding for positions 0..T-1 ((cos, sin), or the complex `freqs_cis` of
    DeepSeek V2 and Llama 4) from a private copy of the model's `rotary_emb`, one
    copy per device (its buffers are the model's, outside the blocks, so the shell block
    that snake runs on the device does not carry them); for the layer's attention type
    where the table depends on it (Gemma 3: local and global bases). None where the model
    has no model-level rotary embedding (older transformers: the layers compute it)."""

    def __init__(self, rotary: nn.Module | None) -> None:
        self.rotary = copy.deepcopy(rotary) if rotary is not None else None
        self.per_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        self._per_device: dict[torch.device, nn.Module] = {}
        self._lock = threading.Lock()

    def __call__(self, h: torch.Tensor, position_ids: torch.Tensor, kind: str) -> Any:
        if self.rotary is None:
            return None
        with self._lock:
            mod = self._per_device.get(h.device)
            if mod is None:
                mod = copy.deepcopy(self.rotary).to(h.device)
                self._per_device[h.device] = mod
        if self.per_type and kind in _UNMASKED:  # a table per attention type; none for a recurrent layer
            return None
        with torch.no_grad():
            return mod(h, position_ids, kind) if self.per_type else mod(h, position_ids)
