"""What a checkpoint records of the trainer's batches: the shape and dtype of their inputs
and targets (the manifest's `batch`), and the batch of zeros a load builds the trainer from
where the data has no batch left after the checkpoint's (a run trained to its end)."""

from __future__ import annotations

from typing import Any

import torch

from snake.data import pair_of

_SPEC_DTYPES = ("int64", "int32", "int16", "int8", "uint8", "bool", "float32", "float16", "bfloat16", "float64")


def batch_spec(item: Any) -> dict[str, Any] | None:
    """The shape and dtype of a batch's inputs and targets (a checkpoint's `batch`); None
    where a dtype is none of `_SPEC_DTYPES` (the checkpoint then records none)."""
    spec = {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for name, t in zip(("inputs", "targets"), pair_of(item), strict=True)}
    return spec if spec_error(spec) is None else None


def spec_error(spec: Any) -> str | None:
    """Why `spec` is not a `batch_spec` (None: it is one)."""
    if not isinstance(spec, dict) or sorted(spec) != ["inputs", "targets"]:
        return "must be a mapping of inputs and targets"
    for name, part in spec.items():
        shape = part.get("shape") if isinstance(part, dict) else None
        if not (isinstance(shape, list) and shape and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                                          for n in shape)):
            return f"{name}.shape must be a list of integers >= 1"
        if part.get("dtype") not in _SPEC_DTYPES:
            return f"{name}.dtype must be one of {_SPEC_DTYPES}"
    return None


def stand_in_batch(spec: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of zeros of `spec`'s shapes and dtypes: what sizes an engine where the data
    has no batch left (never trained on)."""
    ins, tgs = (torch.zeros(spec[k]["shape"], dtype=getattr(torch, spec[k]["dtype"])) for k in ("inputs", "targets"))
    return ins, tgs
