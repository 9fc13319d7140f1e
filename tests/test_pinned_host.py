"""Page-locked host memory, exactly its size: with CUDA snake pins its host buffers by
registering mappings of their own (cudaHostRegister) instead of torch's `pin_memory=True`,
which rounds every allocation up to the next power of two and keeps it cached: a store head
of 40 GB took 64 GiB of page-locked memory, beyond what the memory check and the planner
count. And what the link never reads (the optimizer state, the optimizer's and the delayed
gradients' staging buffers) is not page-locked at all.

Without a GPU the registration is a recording stand-in for cudaHostRegister (the real one
is checked in tests/test_cuda.py::test_host_buffers_are_pinned_exactly)."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest
import torch

import snake.buffers
import snake.engine
from snake import Placement, SnakeConfig, SnakeTrainer
from snake.buffers import alloc_host, alloc_host_tensor, mapped
from snake.errors import Stopped
from snake.io.base import ALIGN
from tests.helpers import batches, tiny_gpt


def _mapped_ranges() -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            a, b = line.split()[0].split("-")
            out.append((int(a, 16), int(b, 16)))
    return out


def _is_mapped(ptr: int, n: int) -> bool:
    return any(a <= ptr and ptr + n <= b for a, b in _mapped_ranges())


class Registrar:
    """Stands in for cudaHostRegister: records each range, and whether it was still
    mapped when it was unregistered."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.live: dict[int, int] = {}
        self.registered: list[int] = []  # sizes, in order
        self.undone_while_mapped: list[bool] = []

    def __call__(self, ptr: int, nbytes: int):  # type: ignore[no-untyped-def]
        if self.refuse:
            return None
        self.live[ptr] = nbytes
        self.registered.append(nbytes)

        def undo() -> None:
            self.undone_while_mapped.append(_is_mapped(ptr, nbytes))
            del self.live[ptr]

        return undo


def test_a_pinned_buffer_is_registered_at_its_exact_size():
    """torch.empty(n + ALIGN, pin_memory=True) reserved PowerOf2Ceil(n + ALIGN): an 8 MiB
    checkpoint unit took 16 MiB."""
    reg = Registrar()
    for n in (8 << 20, 3 * ALIGN + 1, 1):
        buf = alloc_host(n, pin=True, register=reg)
        want = max(-(-n // ALIGN) * ALIGN, ALIGN)
        assert buf.nbytes == want and buf.data.data_ptr() % ALIGN == 0
        assert reg.registered[-1] == want and reg.live[buf.data.data_ptr()] == want
        assert not buf.data.any()
        buf.data[-1] = 7  # the whole of it is usable
    t = alloc_host_tensor(1000, torch.bfloat16, pin=True, register=reg)
    assert t.dtype == torch.bfloat16 and t.numel() == 1000 and not t.any()
    assert reg.registered[-1] == 2000 and reg.live[t.data_ptr()] == 2000


def test_the_registration_is_undone_when_the_last_view_goes_while_still_mapped():
    reg = Registrar()
    t = alloc_host_tensor(1 << 20, torch.float32, pin=True, register=reg)
    ptr = t.data_ptr()
    views = [t[10:20], t.view(torch.int32)[5:], t[: 1 << 19].view(torch.uint8)]
    del t
    gc.collect()
    assert ptr in reg.live  # views still use it
    views[0][:] = 1.0
    del views
    gc.collect()
    assert ptr not in reg.live
    assert reg.undone_while_mapped == [True]
    assert not _is_mapped(ptr, 1 << 20)  # and then the mapping went


def test_a_forked_child_does_not_unregister_or_unmap_its_parents_memory():
    """A DataLoader worker is a fork. A pinned buffer is not mapped in it at all (Linux
    copies page-locked private pages into the child at the fork, so each worker took a copy
    of every pinned buffer; or makes them copy-on-write, and the parent's next write moves
    its page from the one the device reads). Its objects, collected there, do not call into
    CUDA (the child has none of its own), nor unmap the address: the child's own memory may
    lie there by then, which that unmapped under it (SIGSEGV at its next touch)."""
    import ctypes
    import mmap
    import os

    n = 16 << 20
    calls: list[int] = []

    def register(ptr: int, nbytes: int):  # type: ignore[no-untyped-def]
        return lambda: calls.append(os.getpid())

    t = alloc_host_tensor(n, torch.uint8, pin=True, register=register)
    t[:] = 7
    ptr = t.data_ptr()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            seen = _is_mapped(ptr, n)
            # memory of its own where the buffer was (as the kernel hands out a free range)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_long]
            prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10  # MAP_FIXED
            if not seen:
                assert libc.mmap(ptr, n, prot, flags, -1, 0) == ptr
            del t
            gc.collect()
            kept = _is_mapped(ptr, n)  # the child's own memory is still there
            os.write(w, f"{len(calls)} {seen} {kept}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    got = os.read(r, 64)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the child died: {status}"
    assert got == b"0 False True"
    assert _is_mapped(ptr, n) and int(t[-1]) == 7
    del t
    gc.collect()
    assert calls == [os.getpid()]


def test_a_refused_registration_returns_none_and_keeps_no_mapping():
    reg = Registrar(refuse=True)
    before = len(_mapped_ranges())
    for _ in range(20):
        assert mapped(4 << 20, pin=True, register=reg) is None
    gc.collect()
    assert len(_mapped_ranges()) <= before + 2


def test_a_cancelled_allocation_registers_nothing():
    reg = Registrar()
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        alloc_host_tensor(1 << 20, torch.float32, pin=True, register=reg, stop=stop)
    assert reg.registered == []


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_what_is_page_locked_on_the_paths_a_gpu_takes(tmp_path, monkeypatch, schedule):
    """The trainer as on CUDA (pin on), on the CPU: the link's buffers are page-locked, each
    at its size, the optimizer's state and its staging buffers are not, the weights are
    those of the same run unpinned, and after close() every registration is undone."""
    steps, data = 2, batches(2, 8)
    cfg = dict(device="cpu", micro_batches=4, schedule=schedule, alpha=0.5,
               placement=Placement(param=0.5, ckpt=0.5, opt=0.5, grad=0.5))

    async def train(where, pin: bool):  # type: ignore[no-untyped-def]
        async with SnakeTrainer(tiny_gpt(), data=data, config=SnakeConfig(offload_dir=where, **cfg)) as t:
            await asyncio.wait_for(t.run(steps), 120)
            stores = {k: s.cpu for k, s in t.engine.stores.items()}
            pools = {k: [b.data for b in p._free._queue] for k, p in t.engine.pools.items() if p is not None}
            return await t.state_dict(), stores, pools

    want, _, _ = await train(tmp_path / "plain", False)
    reg = Registrar()
    monkeypatch.setattr(snake.engine, "pin_host_memory", lambda device: True)
    monkeypatch.setattr(snake.buffers, "register_host_memory", reg)
    got, stores, pools = await train(tmp_path / "pinned", True)
    for k in want:
        assert torch.equal(want[k], got[k]), k

    def locked(t: torch.Tensor) -> bool:
        return any(p <= t.data_ptr() < p + n for p, n in reg.live.items())

    assert locked(stores["param"]) and locked(stores["ckpt"])
    assert not locked(stores["opt"])
    for name in ("param_in", "ckpt_in", "ckpt_out"):
        assert pools[name] and all(locked(b) for b in pools[name]), name
    for name in ("opt", "param_out", "grad_out", "grad_in"):
        assert not any(locked(b) for b in pools.get(name, [])), name
    # exact sizes: the param store head's registration is its bytes, not a power of two
    head = stores["param"]
    assert reg.live[head.data_ptr()] == head.numel() * head.element_size()
    del stores, pools, head
    gc.collect()
    assert reg.live == {}
    assert all(reg.undone_while_mapped)
