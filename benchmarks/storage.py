"""The SSD tier's backend (snake.io.open_storage: pread/pwrite, O_DIRECT, aligned mmap
buffers) against fio on the same directory, block size and access pattern.

    python benchmarks/storage.py          # ~1 min; needs fio (apt-get install -y fio)

Sequential write then read of a 256 MiB file in 1 MiB blocks, with 1 and 2 threads (fio:
--ioengine=psync --direct=1 --numjobs=1/2, each job its own half of the file for 2).
Rounds alternate snake and fio, so background load hits both alike. Writes
benchmarks/results/storage.json and storage.png.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import RESULTS, SCRATCH, figure, machine, save  # type: ignore[import-not-found]

from snake.io import open_storage

MiB = 1 << 20
BS = MiB


def snake_bw(directory: Path, size: int, threads: int, backend: str = "auto") -> dict[str, float]:
    """(write, read) bytes/s of open_storage over `size` bytes, `threads` threads each
    owning a contiguous 1/threads of the file."""
    path = directory / "snake-storage.bin"
    f = open_storage(path, size, backend=backend)  # type: ignore[arg-type]
    used = f.backend
    part = size // threads
    out = {}
    try:
        for op in ("pwrite", "pread"):
            def worker(i: int, op: str = op) -> None:
                with mmap.mmap(-1, BS) as buf:
                    buf.write(os.urandom(BS))
                    view = memoryview(buf)
                    try:
                        fn = getattr(f, op)
                        for off in range(i * part, (i + 1) * part, BS):
                            fn(view, off)
                    finally:
                        view.release()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                for fut in [pool.submit(worker, i) for i in range(threads)]:
                    fut.result()
            out["write" if op == "pwrite" else "read"] = size / (time.perf_counter() - t0)
    finally:
        f.close()
        path.unlink(missing_ok=True)
    out["backend"] = used
    return out


def fio_bw(fio: str, directory: Path, size: int, threads: int) -> dict[str, float]:
    out = {}
    path = directory / "fio-storage.bin"
    for rw in ("write", "read"):
        cmd = [fio, "--name=snakecmp", f"--filename={path}", f"--rw={rw}", f"--bs={BS}",
               "--direct=1", "--ioengine=psync", f"--size={size // threads}", f"--numjobs={threads}",
               "--offset_increment=" + str(size // threads), "--group_reporting",
               "--output-format=json", "--end_fsync=0", "--invalidate=1"]
        res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        job = res["jobs"][0]
        out[rw] = job[rw]["bw_bytes"]
    path.unlink(missing_ok=True)
    out["version"] = res.get("fio version")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--backend", default="auto", choices=("auto", "posix", "buffered", "kvikio"),
                    help="snake's storage backend to measure (auto: O_DIRECT where the file system takes it; "
                         "kvikio needs CUDA and its driver)")
    ap.add_argument("--name", default=None, help="results file name (default storage, or storage_quick)")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: must be >= 1")
    size = (64 if args.quick else 256) * MiB
    rounds = 1 if args.quick else args.rounds
    fio = shutil.which("fio")
    SCRATCH.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    res: dict = {"machine": machine(), "block_bytes": BS, "file_bytes": size, "fio": fio,
                 "directory_fs": None, "rounds": []}
    try:
        res["directory_fs"] = subprocess.run(["df", "-T", str(SCRATCH)], capture_output=True,
                                             text=True).stdout.splitlines()[-1].split()[1]
    except (OSError, IndexError):
        pass
    with tempfile.TemporaryDirectory(dir=SCRATCH) as d:
        d = Path(d)
        for _ in range(rounds):
            for threads in (1, 2):
                row = {"threads": threads, "snake": snake_bw(d, size, threads, args.backend)}
                if fio:
                    row["fio"] = fio_bw(fio, d, size, threads)
                res["rounds"].append(row)
                print(json.dumps(row), flush=True)
    summary = {}
    for threads in (1, 2):
        rs = [r for r in res["rounds"] if r["threads"] == threads]
        s = {}
        for op in ("write", "read"):
            sn = [r["snake"][op] for r in rs]
            s[f"snake_{op}_MBps"] = statistics.median(sn) / 1e6
            if fio:
                fi = [r["fio"][op] for r in rs]
                ratios = [a / b for a, b in zip(sn, fi, strict=True)]
                s[f"fio_{op}_MBps"] = statistics.median(fi) / 1e6
                s[f"{op}_ratio_median"] = statistics.median(ratios)
                s[f"{op}_ratio_min"], s[f"{op}_ratio_max"] = min(ratios), max(ratios)
        summary[f"threads_{threads}"] = s
    # the stores checksum every SSD block with xxh3 (snake/stores.py): its cost per byte
    import xxhash
    with mmap.mmap(-1, 64 * MiB) as buf:
        buf.write(os.urandom(64 * MiB))
        view = memoryview(buf)
        t0 = time.perf_counter()
        for off in range(0, 64 * MiB, BS):
            xxhash.xxh3_64_intdigest(view[off:off + BS])
        summary["xxh3_MBps"] = 64 * MiB / (time.perf_counter() - t0) / 1e6
        view.release()
    res["summary"] = summary
    res["target"] = "snake >= 0.9 x fio"
    res["seconds_total"] = time.perf_counter() - t_start
    name = args.name or ("storage_quick" if args.quick else "storage")
    print(save(name, res))
    print(json.dumps(summary, indent=1))

    fig, (ax,) = figure(1, 1)
    labels, sn, fi = [], [], []
    for threads in (1, 2):
        for op in ("write", "read"):
            labels.append(f"{op}\n{threads} thr")
            sn.append(summary[f"threads_{threads}"][f"snake_{op}_MBps"])
            fi.append(summary[f"threads_{threads}"].get(f"fio_{op}_MBps", 0.0))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], sn, 0.4, label="snake.io (O_DIRECT)")
    ax.bar([x + 0.2 for x in xs], fi, 0.4, label="fio psync --direct=1")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("MB/s (median of rounds)")
    ax.set_title("1 MiB sequential blocks, 256 MiB file")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)


if __name__ == "__main__":
    main()
