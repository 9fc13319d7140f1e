"""Training under a hard memory limit (a cgroup v1 memory controller; needs root and
/sys/fs/cgroup/memory; no swap): what does each way need, and does a run that should fit
under a limit complete there while the other way is killed?

    sudo python benchmarks/memory_limit.py --case resident   # ~4 min
    sudo python benchmarks/memory_limit.py --case lora       # ~6 min

resident: the GPT of `benchmarks/resident_ssd.py` (a 131072 x 512 embedding, 67 M resident
parameters; layers, checkpoints and optimizer states all on SSD), its resident optimizer
state in CPU memory against on SSD (`resident_optimizer`).
lora: the Llama-shaped bf16 checkpoint of `benchmarks/stream_memory.py` (12 layers of width
1024) loaded in float32 with every layer parameter but the query projection frozen, loaded
whole (`load_hf`) against streamed (`stream_hf`, whose frozen layer weights go to a mapped
file the kernel may drop and re-read).

Each run is a fresh process moved into its own memory cgroup. First every way runs without
a limit, reporting the peak of its anonymous memory (RssAnon, what no reclaim can take back);
then every way runs again under a limit halfway between the two ways' anonymous peaks. The
cgroup charges page cache too (libraries read, the mapped frozen weights, a checkpoint
written), which the kernel reclaims under the limit. Reports per run: exit status (-9:
killed by the OOM killer), steps done, losses, the anonymous peak, the cgroup's peak
(memory.max_usage_in_bytes), how often it hit the limit, and the major page faults it took
(pages read back from a file).
Writes benchmarks/results/memory_limit_<case>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, SCRATCH, machine, save  # type: ignore[import-not-found]

CGROUP = Path("/sys/fs/cgroup/memory")
BENCH = ROOT / "benchmarks"


def _stat(group: Path, key: str) -> int:
    for line in (group / "memory.stat").read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def run_limited(argv: list[str], limit: int | None, name: str, tree: Path | None = None) -> dict:
    """`argv` (a python command) in a fresh memory cgroup with `limit` bytes (None: none);
    with `tree` (a worktree of another revision), run in it, importing its snake."""
    group = CGROUP / f"snake-bench-{name}"
    if group.exists():
        group.rmdir()
    group.mkdir()
    try:
        if limit is not None:
            (group / "memory.limit_in_bytes").write_text(str(limit))
        # the shell joins the group, then becomes the run: everything it allocates is charged there
        script = f'echo $$ > {group / "cgroup.procs"} && exec "$@"'
        env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
        out = subprocess.run(["sh", "-c", script, "sh", *argv], cwd=tree or ROOT, capture_output=True, text=True,
                             timeout=1200, env=env)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        row = json.loads(lines[-1]) if lines and out.returncode == 0 else {}
        return {
            "rc": out.returncode, "limit": limit, "completed": out.returncode == 0 and bool(row),
            "peak_bytes": int((group / "memory.max_usage_in_bytes").read_text()),
            "failcnt": int((group / "memory.failcnt").read_text()),
            "major_faults": _stat(group, "total_pgmajfault"),
            "steps_done": len(row.get("losses", [])), "losses": row.get("losses"), "step_s": row.get("step_s"),
            # the process's own anonymous memory at its peak (what no reclaim can take back)
            "anon_peak_mib": row["baseline_anon_mib"] + row["anon_peak_mib"] if row else None,
            "stderr_tail": out.stderr[-600:] if out.returncode else "",
        }
    finally:
        group.rmdir()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=("resident", "lora"), required=True)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if not (CGROUP / "memory.limit_in_bytes").exists():
        raise SystemExit(f"needs a cgroup v1 memory controller at {CGROUP} (and root)")
    SCRATCH.mkdir(parents=True, exist_ok=True)  # offload_dir on the real disk (O_DIRECT)
    with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp:
        if args.case == "resident":
            ways = {w: [sys.executable, str(BENCH / "resident_ssd.py"), "--child", w, f"{tmp}/off-{w}",
                        "--steps", str(args.steps)] for w in ("cpu", "ssd")}
        else:
            sys.path.insert(0, str(BENCH))
            from stream_memory import save_llama  # type: ignore[import-not-found]

            model = Path(tmp) / "model"
            save_llama(model, 12, 1024)
            ways = {w: [sys.executable, str(BENCH / "stream_memory.py"), "--frozen", "--child", w, str(model),
                        str(args.steps), f"{tmp}/off-{w}", "float32"] for w in ("load_hf", "stream_hf")}
        runs = []
        free = {w: run_limited(argv, None, w) for w, argv in ways.items()}
        for w, r in free.items():
            runs.append({"way": w, **r})
            print(f"{w:9s} no limit: rc {r['rc']}, anonymous peak {r['anon_peak_mib']:6.0f} MiB, cgroup peak "
                  f"{r['peak_bytes'] / 2**20:6.0f} MiB, major faults {r['major_faults']}, steps "
                  f"{r['step_s'] and [round(x, 2) for x in r['step_s']]} s, losses {r['losses']}",
                  flush=True)
        # page cache (libraries read, a checkpoint written) is charged too but can be reclaimed:
        # the limit sits between the two ways' anonymous peaks
        peaks = sorted(r["anon_peak_mib"] for r in free.values())
        limit = int((peaks[0] + peaks[-1]) / 2 * 2**20)
        for w, argv in ways.items():
            r = run_limited(argv, limit, w)
            runs.append({"way": w, **r})
            anon = "-" if r["anon_peak_mib"] is None else f"{r['anon_peak_mib']:.0f}"
            print(f"{w:9s} limit {limit / 2**20:6.0f} MiB: rc {r['rc']} ({'completed' if r['completed'] else 'killed'})"
                  f", anonymous peak {anon} MiB, cgroup peak {r['peak_bytes'] / 2**20:6.0f} MiB, limit hits {r['failcnt']}, major faults "
                  f"{r['major_faults']}, steps {r['steps_done']} ({r['step_s'] and [round(x, 2) for x in r['step_s']]} s), "
                  f"losses {r['losses']}", flush=True)
    result = {"machine": machine(), "args": vars(args), "limit": limit, "runs": runs}
    print(f"saved {save(f'memory_limit_{args.case}', result)}")


if __name__ == "__main__":
    main()
