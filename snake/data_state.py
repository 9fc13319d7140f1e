"""The position of a stateful data source, as a checkpoint holds it.

A data source is stateful when it has `state_dict()` and `load_state_dict(state)`, as
torchdata's `StatefulDataLoader` (its position in the epoch and its sampler's shuffle
order) and `snake.Epochs` over one have. `DataSource` takes a `Snapshot` of the state after
each batch it reads, on the thread that read it; a checkpoint stores the one after the
last batch the trainer trained on (not the batches read ahead), and `load()` hands it to
the new data's `load_state_dict` instead of reading and dropping the batches trained
before.

A snapshot is a JSON tree (the manifest's `data_state`) and the tensors it refers to (the
checkpoint's `data.safetensors`): no pickle, as the rest of a checkpoint. It holds dicts
(any of these as keys), lists, tuples, str, int, float (nan and infinities too), bool,
None, bytes and dense torch tensors of safetensors' dtypes (on the CPU after a load; a dict
or list subclass comes back as a dict or list); anything else (a namedtuple too, whose
field names would be lost) is refused with the path to it. Every container is tagged (`{"dict": [[k, v], ...]}`, `{"list": [...]}`,
`{"tuple": [...]}`), so that tuples, non-string keys and keys that look like tags come back
as they were."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from snake.errors import DataError, SnakeError

_TAGS = ("dict", "list", "tuple", "tensor", "bytes", "float")
_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
           torch.float32, torch.float64)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A data source's state: `tree` (JSON-able) and the `tensors` it names (copies)."""

    tree: Any
    tensors: dict[str, torch.Tensor]


def take(state_of: Callable[[], Any], what: str = "data.state_dict()") -> Snapshot:
    """Call the source's `state_dict()` and copy what it returns into a Snapshot (a copy:
    a state_dict that hands out its live objects changes them as it reads on). DataError
    where it raises or returns what a checkpoint cannot hold."""
    try:
        state = state_of()
    except Exception as exc:
        line = next(iter(str(exc).splitlines()), "")
        raise DataError(f"{what} raised {type(exc).__name__}: {line}; snake takes the data's state after each "
                        "batch, for checkpoints: fix it, or give data without state_dict()") from exc
    tensors: dict[str, torch.Tensor] = {}
    return Snapshot(_encode(state, "state", tensors, set(), what), tensors)


def restore(snap: Snapshot) -> Any:
    """The state a Snapshot holds, as `state_dict()` returned it (tensors on the CPU)."""
    return _decode(snap.tree, snap.tensors, "data_state")


def check_tree(tree: Any, tensors: set[str]) -> str | None:
    """Why `tree` is not a snapshot's tree whose tensors are `tensors` (None: it is one)."""
    try:
        _decode(tree, dict.fromkeys(tensors, torch.empty(0)), "data_state")
    except SnakeError as exc:
        return str(exc)
    return None


def _encode(x: Any, path: str, tensors: dict[str, torch.Tensor], seen: set[int], what: str) -> Any:
    if x is None or isinstance(x, bool | str):
        return x
    if isinstance(x, int):
        return int(x)  # an IntEnum or a subclass: the number
    if isinstance(x, float):
        return float(x) if math.isfinite(x) else {"float": repr(float(x))}
    if isinstance(x, bytes):
        return {"bytes": x.hex()}
    if isinstance(x, torch.Tensor):
        if x.layout is not torch.strided or x.dtype not in _DTYPES:
            raise DataError(
                f"{what} returned a state that holds a {x.layout} tensor of {x.dtype} at {path}; a checkpoint stores "
                f"dense tensors of {', '.join(str(d).removeprefix('torch.') for d in _DTYPES)} (safetensors): convert "
                "it in state_dict() and back in load_state_dict()"
            )
        key = f"t{len(tensors)}"
        tensors[key] = x.detach().to("cpu", copy=True).contiguous()
        return {"tensor": key}
    if isinstance(x, tuple) and type(x) is not tuple:  # a namedtuple: its fields would come back nameless
        raise DataError(
            f"{what} returned a state that holds a {type(x).__qualname__} (a tuple subclass) at {path}; a checkpoint "
            "stores plain tuples, and this one would come back without its field names: return x._asdict() or "
            "tuple(x)"
        )
    if isinstance(x, dict | list | tuple):
        if id(x) in seen:
            raise DataError(f"{what} returned a state that holds itself at {path}: a checkpoint stores a tree")
        seen.add(id(x))
        try:
            if isinstance(x, dict):
                return {"dict": [[_encode(k, f"{path} key {k!r}", tensors, seen, what),
                                  _encode(v, f"{path}[{k!r}]", tensors, seen, what)] for k, v in x.items()]}
            kind = "tuple" if isinstance(x, tuple) else "list"
            return {kind: [_encode(v, f"{path}[{i}]", tensors, seen, what) for i, v in enumerate(x)]}
        finally:
            seen.discard(id(x))
    hint = ""
    if type(x).__module__ == "numpy":
        hint = " (a numpy array: torch.from_numpy(a); a numpy number: int(n) or float(n))"
    raise DataError(
        f"{what} returned a state that holds a {type(x).__module__}.{type(x).__qualname__} at {path}; a checkpoint "
        f"stores dicts, lists, tuples, str, int, float, bool, None, bytes and torch tensors{hint}: make "
        "state_dict() return those"
    )


def _decode(x: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    if x is None or isinstance(x, bool | int | str | float):
        return x
    if not (isinstance(x, dict) and len(x) == 1 and next(iter(x)) in _TAGS):
        raise _damaged(path, "is not a tagged value")
    (tag, v), = x.items()
    if tag == "dict" and isinstance(v, list) and all(isinstance(kv, list) and len(kv) == 2 for kv in v):
        out = {}
        for i, (k, item) in enumerate(v):
            key = _decode(k, tensors, f"{path} key {i}")
            try:
                hash(key)
            except TypeError:  # a list: no state_dict's key
                raise _damaged(path, f"has a key of type {type(key).__name__}") from None
            out[key] = _decode(item, tensors, f"{path}[{key!r}]")
        return out
    if tag in ("list", "tuple") and isinstance(v, list):
        items = [_decode(item, tensors, f"{path}[{i}]") for i, item in enumerate(v)]
        return tuple(items) if tag == "tuple" else items
    if tag == "tensor" and isinstance(v, str):
        if v not in tensors:
            raise _damaged(path, f"names tensor {v!r}, which data.safetensors lacks")
        return tensors[v]
    if tag == "bytes" and isinstance(v, str):
        try:
            return bytes.fromhex(v)
        except ValueError:
            raise _damaged(path, "is not hex") from None
    if tag == "float" and v in ("nan", "inf", "-inf"):
        return float(v)
    raise _damaged(path, f"has a malformed {tag!r} value")


def _damaged(path: str, why: str) -> SnakeError:
    return SnakeError(f"load: the checkpoint's {path} {why}: the manifest is damaged")
