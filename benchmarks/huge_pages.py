"""What transparent huge pages save the SSD tier's O_DIRECT transfers (snake.buffers).

    python benchmarks/huge_pages.py          # ~30 s

An O_DIRECT read or write pins every page of the user buffer for the device's DMA, so the
kernel's CPU per transfer grows with the number of pages. `alloc_host` asks for huge pages
(madvise MADV_HUGEPAGE) on buffers of 2 MiB and more; this writes and reads GiB through such
a buffer (32 MiB transfers, the size of an optimizer-state tail in section 1's model) with the
advice and without it, in alternating rounds, and reports the calling thread's system and
user CPU per GiB and the bandwidth. On a CPU device that CPU is taken from the compute
kernels' cores (BENCHMARKS.md section 7). Writes benchmarks/results/huge_pages.json.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from common import SCRATCH, machine, save  # type: ignore[import-not-found]

import snake.buffers as buffers
from snake.io import open_storage

MiB = 1 << 20
UNIT = 32 * MiB
FILE_UNITS = 8


def transfer(total: int, advise: bool) -> dict[str, float]:
    """Write then read `total` bytes (each) through one aligned 32 MiB host buffer."""
    saved = buffers.advise_huge_pages
    if not advise:
        buffers.advise_huge_pages = lambda m: None
    try:
        buf = buffers.alloc_host(UNIT, pin=False)
    finally:
        buffers.advise_huge_pages = saved
    buf.data.fill_(1)  # fault it in before timing, as the runtime's pools are by their first use
    mv = buf.memoryview(UNIT)
    path = SCRATCH / "huge-pages.bin"
    f = open_storage(path, UNIT * FILE_UNITS)
    try:
        r0, t0 = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
        for i in range(total // UNIT):
            f.pwrite(mv, (i % FILE_UNITS) * UNIT)
        for i in range(total // UNIT):
            f.pread(mv, (i % FILE_UNITS) * UNIT)
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
    finally:
        f.close()
        path.unlink(missing_ok=True)
    gib = 2 * total / 2**30
    return {"system_s_per_gib": (r1.ru_stime - r0.ru_stime) / gib,
            "user_s_per_gib": (r1.ru_utime - r0.ru_utime) / gib,
            "gib_per_s": gib / wall, "backend": f.backend}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gib", type=float, default=1.0, help="written and read per variant and round")
    args = ap.parse_args()
    if args.rounds < 1 or not args.gib > 0:
        raise SystemExit("--rounds must be >= 1 and --gib > 0")
    SCRATCH.mkdir(parents=True, exist_ok=True)
    total = max(UNIT, int(args.gib * 2**30) // UNIT * UNIT)
    rows: dict[str, list[dict]] = {"huge_pages": [], "4k_pages": []}
    for rnd in range(args.rounds):
        order = ("huge_pages", "4k_pages") if rnd % 2 == 0 else ("4k_pages", "huge_pages")
        for key in order:
            rows[key].append(transfer(total, key == "huge_pages"))
            r = rows[key][-1]
            print(f"round {rnd} {key:10s} system {r['system_s_per_gib'] * 1e3:6.1f} ms/GiB, user "
                  f"{r['user_s_per_gib'] * 1e3:5.1f} ms/GiB, {r['gib_per_s']:.2f} GiB/s ({r['backend']})", flush=True)
    summary = {k: {f: statistics.median(r[f] for r in v) for f in ("system_s_per_gib", "user_s_per_gib", "gib_per_s")}
               for k, v in rows.items()}
    for k, v in summary.items():
        print(f"{k:10s} median: system {v['system_s_per_gib'] * 1e3:.1f} ms/GiB, user "
              f"{v['user_s_per_gib'] * 1e3:.1f} ms/GiB, {v['gib_per_s']:.2f} GiB/s")
    print(save("huge_pages", {"machine": machine(), "unit_bytes": UNIT, "bytes_each_way": total,
                              "rows": rows, "summary": summary}))


if __name__ == "__main__":
    main()
