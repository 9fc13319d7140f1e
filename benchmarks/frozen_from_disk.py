"""A LoRA-style fine-tune of a streamed model whose mapped frozen weights the memory cannot
hold, measured against the planner's two models of it: the frozen weights in the page cache
(as the planner assumed for every plan before round 37), and read from the SSD at every load
of a layer (`planner.model.vertical_phases(frozen_from_disk=True)`).

    sudo python benchmarks/frozen_from_disk.py [--steps 6]   # ~5 min; root and a cgroup v1 memory controller
    sudo python benchmarks/frozen_from_disk.py --base REV [--pairs 3]   # and the limited run A/B against REV
    sudo python benchmarks/frozen_from_disk.py --base REV --no-limit   # the A/B without a limit

Saves `stream_memory.py`'s Llama (12 layers of width 1024, bf16 safetensors) and trains it as
`stream_memory.py --frozen` does (loaded with `stream_hf` in float32, every layer parameter
but the query projection frozen: 141 M frozen elements, 564 MiB mapped in float32;
everything on SSD, alpha 0, one 1 x 32-token micro-batch, float32 compute on the CPU), in a
fresh process: once without a memory limit, then in a memory cgroup whose limit is that run's
anonymous peak plus `--room` MiB, less than the mapped frozen weights. The planner's profile
of the same model (its probes, in this process) gives both predictions. Reports the step
seconds (median after the first), the major page faults and both predictions. With `--base
REV` the limited run is repeated `--pairs` times from this tree and from REV (a temporary git
worktree), alternating, and each pair's ratio of median step times is reported. Writes
benchmarks/results/frozen_from_disk.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from ab import base_worktree  # type: ignore[import-not-found]
from common import ROOT, SCRATCH, machine, on_worker, save  # type: ignore[import-not-found]
from memory_limit import CGROUP, run_limited  # type: ignore[import-not-found]
from stream_memory import save_llama  # type: ignore[import-not-found]


def predictions(model: Path, offload: Path) -> dict[str, float]:
    """The planner's iteration seconds of the run's configuration, the frozen weights cached
    and read from the SSD at every load, from a profile measured here."""
    import torch

    from planner.integrate import profile_for_config
    from planner.model import layer_seconds, mapped_frozen_bytes, phases_for, shares
    from snake import Placement, SnakeConfig
    from snake.adapters import describe
    from snake.hf import stream_hf

    streamed = stream_hf(model, dtype=torch.float32)
    for name, p in streamed.named_parameters():
        if ".layers." in name and "q_proj" not in name:
            p.requires_grad_(False)
    placement = Placement.all_ssd()
    cfg = SnakeConfig(micro_batches=1, offload_dir=offload, placement=placement, alpha=0.0, device="cpu",
                      dtype="float32")
    profile = on_worker(profile_for_config, describe(streamed), cfg, 1, 32, "cpu")  # its probes off this thread
    x = shares(placement, profile.shape, 0.0, "vertical")
    out = {"mapped_frozen_bytes": mapped_frozen_bytes(profile.shape),
           "ssd_read_bytes_per_s": profile.ssd_read_bytes_per_s}
    for label, flag in (("cached", False), ("from_disk", True)):
        phases = phases_for(profile, 1, 0.0, "vertical", flag)
        out[label] = profile.shape.n_layers * layer_seconds(phases, x) + profile.pre_post_seconds
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--room", type=int, default=64, help="MiB over the free run's anonymous peak (the limit)")
    ap.add_argument("--base", default=None, help="also run the limited run from this git revision, alternating")
    ap.add_argument("--pairs", type=int, default=3, help="limited runs from each tree with --base")
    ap.add_argument("--no-limit", action="store_true", help="with --base: the pairs run without a limit")
    ap.add_argument("--name", default="frozen_from_disk", help="results/<name>.json")
    args = ap.parse_args()
    if not (CGROUP / "memory.limit_in_bytes").exists():
        raise SystemExit(f"needs a cgroup v1 memory controller at {CGROUP} (and root)")
    SCRATCH.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=SCRATCH) as tmp:
        model = Path(tmp) / "model"
        save_llama(model, 12, 1024)
        pred = predictions(model, Path(tmp) / "off-profile")
        print(f"planner: {pred['cached']:.3f} s/iteration with the frozen weights cached, {pred['from_disk']:.3f} s "
              f"read from the SSD ({pred['mapped_frozen_bytes'] / 2**20:.0f} MiB mapped, SSD read "
              f"{pred['ssd_read_bytes_per_s'] / 1e6:.0f} MB/s)", flush=True)

        def argv(i: int, tree: Path = ROOT) -> list[str]:
            return [sys.executable, str(tree / "benchmarks" / "stream_memory.py"), "--frozen", "--child", "stream_hf",
                    str(model), str(args.steps), f"{tmp}/off-{i}", "float32"]

        runs: list[dict] = []

        def report(label: str, r: dict) -> float | None:
            steps = r["step_s"] or []
            median = statistics.median(steps[1:]) if len(steps) > 1 else None
            runs.append({"label": label, **r, "median_step_s": median})
            print(f"{label:16s}: rc {r['rc']}, steps {[round(s, 2) for s in steps]} s (median after the first "
                  f"{median if median is None else round(median, 3)}), major faults {r['major_faults']}, anonymous "
                  f"peak {r['anon_peak_mib']} MiB, cgroup peak {r['peak_bytes'] / 2**20:.0f} MiB, losses {r['losses']}",
                  flush=True)
            return median

        free = run_limited(argv(0), None, "frozen-free")
        report("no limit", free)
        limit = int((free["anon_peak_mib"] + args.room) * 2**20)
        limited = f"limit {limit / 2**20:.0f} MiB"
        pair_limit: int | None = limit
        if args.no_limit:
            pair_limit, limited = None, "no limit"
        ratios = []
        if args.base is None:
            report(limited, run_limited(argv(1), limit, "frozen-limited"))
        else:
            with base_worktree(args.base) as (base, tree):
                for i in range(args.pairs):  # alternating, the base first in even pairs
                    order = [("base", tree), ("this", ROOT)] if i % 2 == 0 else [("this", ROOT), ("base", tree)]
                    got = {who: report(f"{limited}, {who if who == 'this' else base}",
                                       run_limited(argv(2 + 2 * i + (who == "this"), t), pair_limit, "frozen-limited",
                                                   t))
                           for who, t in order}
                    if got["this"] and got["base"]:
                        ratios.append(got["this"] / got["base"])
                        print(f"pair {i}: this / {base} {ratios[-1]:.3f}", flush=True)
            if ratios:
                print(f"this / {base}: median {statistics.median(ratios):.3f} over {len(ratios)} pairs "
                      f"{[round(r, 3) for r in ratios]}", flush=True)
    result = {"machine": machine(), "args": vars(args), "limit": limit, "predicted": pred, "runs": runs,
              "ratios_this_over_base": ratios}
    print(f"saved {save(args.name, result)}")


if __name__ == "__main__":
    main()
