"""Storage backends: O_DIRECT round trips, buffered fallback, the bandwidth cap, errors."""

import os
import time

import pytest
import torch

from snake.buffers import alloc_host
from snake.errors import StorageError
from snake.io import ALIGN, StorageFallbackWarning, open_storage
from snake.io.base import TokenBucket
from snake.io.posix import PosixFile


def _buf(n, fill=None):
    b = alloc_host(n, pin=False)
    if fill is not None:
        b.data[:n] = torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8) + fill
    return b


def test_o_direct_round_trip(tmp_path):
    f = open_storage(tmp_path / "x.bin", 4 * ALIGN)
    assert f.backend == "posix-direct"
    src, dst = _buf(2 * ALIGN, fill=3), _buf(2 * ALIGN)
    f.pwrite(src.memoryview(2 * ALIGN), ALIGN)
    f.pread(dst.memoryview(2 * ALIGN), ALIGN)
    assert torch.equal(src.data, dst.data)
    f.close()
    assert (tmp_path / "x.bin").stat().st_size == 4 * ALIGN
    assert (os.stat(tmp_path / "x.bin").st_mode & 0o777) == 0o600


def test_buffered_fallback_where_o_direct_is_refused(tmp_path, monkeypatch):
    # tmpfs refused O_DIRECT before Linux 6.6; this machine's may take it, so the refusal
    # is faked here and only here
    import snake.io.open as opener

    monkeypatch.setattr(opener, "o_direct_works", lambda directory: False)
    with pytest.warns(StorageFallbackWarning, match="O_DIRECT"):
        f = open_storage(tmp_path / "x.bin", ALIGN)
    assert f.backend == "posix-buffered"
    b = _buf(ALIGN, fill=1)
    f.pwrite(b.memoryview(ALIGN), 0)
    out = _buf(ALIGN)
    f.pread(out.memoryview(ALIGN), 0)
    assert torch.equal(b.data, out.data)
    f.close()


def test_read_past_end_is_a_storage_error(tmp_path):
    f = PosixFile(tmp_path / "x.bin", ALIGN, direct=True)
    with pytest.raises(StorageError, match="short read"):
        f.pread(_buf(2 * ALIGN).memoryview(2 * ALIGN), 0)
    f.close()


def test_bandwidth_cap(tmp_path):
    rate = 8 * 2**20
    f = open_storage(tmp_path / "x.bin", 4 * 2**20, bucket=TokenBucket(rate))
    b = _buf(2**20, fill=0)
    t0 = time.perf_counter()
    for i in range(4):
        f.pwrite(b.memoryview(2**20), i * 2**20)
    elapsed = time.perf_counter() - t0
    f.close()
    assert elapsed >= 0.8 * (4 * 2**20 - TokenBucket(rate).burst) / rate
    assert "cap" in f.backend


def test_capped_read_goes_before_a_write_in_flight(tmp_path):
    """Under the cap a read waits for one piece of a large write already waiting out its
    tokens, not for all of it, and the two together still respect the cap."""
    import threading

    from snake.io.base import Throttled

    piece = Throttled.CHUNK
    rate = 16 * piece  # a piece in 1/16 s, the write (8 pieces) in 0.5 s
    f = open_storage(tmp_path / "x.bin", 9 * piece, bucket=TokenBucket(rate))
    big, small = _buf(8 * piece, fill=2), _buf(64 * 1024)
    t0 = time.perf_counter()
    writer = threading.Thread(target=f.pwrite, args=(big.memoryview(8 * piece), 0))
    writer.start()
    time.sleep(0.05)
    r0 = time.perf_counter()
    f.pread(small.memoryview(64 * 1024), 8 * piece)
    read_s = time.perf_counter() - r0
    writer.join()
    total_s = time.perf_counter() - t0
    f.close()
    # reads first: at most one piece (62 ms) + its own 64 KiB; behind the whole write ~0.45 s
    assert read_s < 0.25, read_s
    assert total_s >= 0.8 * (8 * piece + 64 * 1024 - TokenBucket(rate).burst) / rate


def test_capped_writes_wait_while_a_read_is_in_progress():
    import threading

    bucket, passed = TokenBucket(1e9), threading.Event()
    waiter = threading.Thread(target=lambda: (bucket.wait_for_reads(), passed.set()))
    with bucket.reading():
        waiter.start()
        assert not passed.wait(0.2)  # held while the read moves
    assert passed.wait(5)  # and let go when it ends
    waiter.join()


def test_a_failed_capped_read_does_not_hold_writes_back(tmp_path):
    """A read that raises still ends its turn: the next write goes at once."""
    from snake.io.base import Throttled

    class Failing:  # a fake file: only this test's read fails
        path, backend = tmp_path / "x.bin", "fake"

        def pread(self, buf, offset):
            raise StorageError(5, "injected")

        def pwrite(self, buf, offset):
            pass

        def close(self):
            pass

    bucket = TokenBucket(1e9)
    f = Throttled(Failing(), bucket)
    with pytest.raises(StorageError, match="injected"):
        f.pread(memoryview(bytearray(ALIGN)), 0)
    t0 = time.perf_counter()
    f.pwrite(memoryview(bytearray(ALIGN)), 0)  # would block forever with the read still counted
    assert time.perf_counter() - t0 < 0.5


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding `addr`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_large_host_buffers_ask_for_huge_pages():
    # O_DIRECT pins every page of its buffer: 2 MiB pages cut the kernel's share ~4x.
    # "hg" is the madvise(MADV_HUGEPAGE) flag, set whatever the system's THP mode is.
    big, small = alloc_host(8 << 20, pin=False), alloc_host(64 << 10, pin=False)
    assert "hg" in _vm_flags(big.data.data_ptr())
    assert "hg" not in _vm_flags(small.data.data_ptr())


def test_kvikio_that_cannot_open_falls_back_to_posix_when_chosen(tmp_path, monkeypatch):
    """On CUDA `auto` chooses kvikio; where its CuFile would not open (a driver without
    cuFile, a file system it refuses) the engine's build failed there. Chosen, not asked
    for: the store goes on with O_DIRECT and says so. Asked for, it still fails."""
    import snake.io.open as opening
    from snake.io.kvikio_file import KvikioOpenError

    class Refused:
        def __init__(self, path, nbytes):  # type: ignore[no-untyped-def]
            raise KvikioOpenError(f"kvikio could not open {path} (RuntimeError: cuFile: no such driver)")

    class Full:
        def __init__(self, path, nbytes):  # type: ignore[no-untyped-def]
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(opening, "kvikio_usable", lambda: True)
    monkeypatch.setattr(opening, "KvikioFile", Full)
    with pytest.raises(OSError, match="No space"):  # a full disk is not kvikio's: no fallback, no warning
        open_storage(tmp_path / "z.bin", 4 * ALIGN, use_gds=True)
    monkeypatch.setattr(opening, "KvikioFile", Refused)
    with pytest.warns(StorageFallbackWarning, match="kvikio could not open"):
        f = open_storage(tmp_path / "x.bin", 4 * ALIGN, use_gds=True)
    assert f.backend == "posix-direct"
    src, dst = _buf(ALIGN, fill=1), _buf(ALIGN)
    f.pwrite(src.memoryview(ALIGN), 0)
    f.pread(dst.memoryview(ALIGN), 0)
    assert torch.equal(src.data, dst.data)
    f.close()
    with pytest.raises(RuntimeError, match="no such driver"):
        open_storage(tmp_path / "y.bin", ALIGN, backend="kvikio", use_gds=True)
