"""What a checkpoint records of the trainer's batches: the shape and dtype of their inputs
and targets (the manifest's `batch`), and the batch of zeros a load builds the trainer from
where the data has no batch left after the checkpoint's (a run trained to its end)."""

from __future__ import annotations

from typing import Any

import torch

from snake.data import pair_of

_INPUT_DTYPES = ("int64", "int32")  # what `split_batch` takes: token ids
_TARGET_DTYPES = ("int64",)
_MAX_ELEMENTS = 2**34  # a bound no real batch reaches: a damaged record's size is refused, not allocated


def batch_spec(item: Any) -> dict[str, Any] | None:
    """The shape and dtype of a batch's inputs and targets (a checkpoint's `batch`); None
    where they are not what a run trains on (the checkpoint then records none)."""
    spec = {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for name, t in zip(("inputs", "targets"), pair_of(item), strict=True)}
    return spec if spec_error(spec) is None else None


def spec_error(spec: Any, micro_batches: int | None = None) -> str | None:
    """Why `spec` is not the record of batches a run trains on (None: it is one): inputs
    and targets of one shape (rows, tokens), token ids as `split_batch` takes them, and
    `micro_batches` dividing the rows (where given)."""
    if not isinstance(spec, dict) or sorted(spec) != ["inputs", "targets"]:
        return "must be a mapping of inputs and targets"
    for name, part in spec.items():
        shape = part.get("shape") if isinstance(part, dict) else None
        if not (isinstance(shape, list) and len(shape) == 2
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape)):
            return f"{name}.shape must be [rows, tokens], integers >= 1"
        if shape[0] * shape[1] > _MAX_ELEMENTS:
            return f"{name}.shape has more than {_MAX_ELEMENTS} elements"
        dtypes = _INPUT_DTYPES if name == "inputs" else _TARGET_DTYPES
        if part.get("dtype") not in dtypes:
            return f"{name}.dtype must be one of {dtypes}"
    if spec["inputs"]["shape"] != spec["targets"]["shape"]:
        return "inputs and targets must have one shape"
    if micro_batches is not None and spec["inputs"]["shape"][0] % micro_batches:
        return f"its rows must be a multiple of micro_batches={micro_batches}"
    return None


def stand_in_batch(spec: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of zeros of `spec`'s shapes and dtypes: what sizes an engine where the data
    has no batch left (never trained on)."""
    ins, tgs = (torch.zeros(spec[k]["shape"], dtype=getattr(torch, spec[k]["dtype"])) for k in ("inputs", "targets"))
    return ins, tgs
