"""The benchmark scripts import and their helpers work (the scripts themselves take minutes:
run them by hand, see BENCHMARKS.md)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(autouse=True)
def _bench_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))


@pytest.mark.parametrize(
    "name", ["common", "throughput", "delay_and_ssd", "storage", "overheads", "plan_accuracy", "report", "kernels", "cpu_parity",
             "budget_tradeoff", "contention", "huge_pages", "stage_overlap", "block_call_ab", "train_ab", "kinds", "ab",
             "stream_memory", "resident_ssd", "evaluate", "clip", "frozen_bottom", "lora", "memory_limit",
             "frozen_from_disk", "data_rng", "data_gate", "data_state", "stop_latency"]
)
def test_imports(name):
    sys.modules.pop(name, None)
    importlib.import_module(name)


def test_helpers():
    common = importlib.import_module("common")
    throughput = importlib.import_module("throughput")
    t = common.traffic_summary({("ssd", "cpu", "opt"): 10, ("cpu", "ssd", "opt"): 5, ("cpu", "gpu", "param"): 7})
    assert t["ssd_bytes"] == 15 and t["links"]["cpu->gpu"] == 7
    assert throughput.first_at([(1, 10.0), (2, 95.0), (4, 100.0)], 0.9) == 2
    cfg = common.gpt_config(2, 64, 16)
    assert common.model_flops_per_token(cfg, 16) > 6 * 2 * cfg.block_params()
    tuned = common.make_model(cfg, frozen=1)  # frozen_bottom.py's fine-tune of the top layers
    assert [n for n, p in tuned.named_parameters() if not p.requires_grad][:2] == ["wte.weight", "wpe.weight"]
    assert not any(p.requires_grad for p in tuned.blocks[0].parameters())
    assert all(p.requires_grad for p in tuned.blocks[1].parameters())


def test_pooled_roofline_pools_all_rounds():
    throughput = importlib.import_module("throughput")

    def vert(steps):
        return {"tokens_per_iteration": 100, "step_seconds": [9.0, *steps], "tokens_per_s": 100 / sorted(steps)[len(steps) // 2]}

    def torch_ckpt(steps):
        return {"fwd_bwd_step_seconds": [9.0, *steps], "fwd_bwd_seconds": {"median": sorted(steps)[len(steps) // 2]}}

    result = {
        "runs": {"vertical_capped": [vert([1.0, 1.0, 1.0])], "torch+ckpt": [torch_ckpt([0.5, 0.5, 0.5])]},
        "roof_repeats": {"vertical_capped": [[vert([1.2, 1.2, 1.2]), vert([1.1, 1.1, 1.1])]],
                         "torch+ckpt": [[torch_ckpt([1.0, 1.0, 1.0]), torch_ckpt([1.0, 1.0, 1.0])]]},
    }
    # compute-bound: the pooled medians (vertical 1.1 s, PyTorch 1.0 s), not the first round's 0.5
    [row] = throughput.pooled_roofline(result, [{"M": 4, "io_roofline": 1000.0}])
    assert row["rounds"] == 3
    assert abs(row["ratio"] - 1.0 / 1.1) < 1e-9
    assert [round(x, 3) for x in row["ratio_per_round"]] == [0.5, round(1 / 1.2, 3), round(1 / 1.1, 3)]
    # I/O-bound: the I/O roofline caps the bound
    [row] = throughput.pooled_roofline(result, [{"M": 4, "io_roofline": 50.0}])
    assert abs(row["ratio"] - (100 / 1.1) / 50.0) < 1e-9
    # an emulated host<->device link: its roof caps the bound when it is the lowest
    [row] = throughput.pooled_roofline(result, [{"M": 4, "io_roofline": 1000.0, "link_roofline": 40.0}])
    assert abs(row["ratio"] - (100 / 1.1) / 40.0) < 1e-9 and row["link_roofline"] == 40.0


def test_pooled_roofline_skips_each_runs_warmup_iterations():
    """Runs made with --warmup N are timed from iteration N + 1: where the SSD binds the first
    ones run fast while the write-behind fills (section 13), and must not count."""
    throughput = importlib.import_module("throughput")
    vert = {"tokens_per_iteration": 100, "step_seconds": [9.0, 0.5, 0.5, 1.0], "warmup": 3, "tokens_per_s": 100.0}
    torch_ckpt = {"fwd_bwd_step_seconds": [9.0, 0.25, 0.25, 1.0], "warmup": 3, "fwd_bwd_seconds": {"median": 1.0}}
    result = {"runs": {"vertical_capped": [vert], "torch+ckpt": [torch_ckpt]},
              "roof_repeats": {"vertical_capped": [[dict(vert)]], "torch+ckpt": [[dict(torch_ckpt)]]}}
    [row] = throughput.pooled_roofline(result, [{"M": 4, "io_roofline": 1000.0}])
    assert row["vertical"] == 100.0 and row["compute_roofline_torch_ckpt"] == 100.0
    # results from before --warmup: the first iteration only
    for r in (vert, torch_ckpt, *result["roof_repeats"]["vertical_capped"][0], *result["roof_repeats"]["torch+ckpt"][0]):
        del r["warmup"]
    [row] = throughput.pooled_roofline(result, [{"M": 4, "io_roofline": 1000.0}])
    assert row["vertical"] == 200.0 and row["compute_roofline_torch_ckpt"] == 400.0


def test_warmup_flag_is_checked_and_runs_time_the_iterations_after_it(tmp_path, monkeypatch):
    import argparse

    common = importlib.import_module("common")
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    for argv, msg in ((["--warmup", "0"], "--warmup 0: must be >= 1"),
                      (["--steps", "3", "--warmup", "3"], "--steps must exceed --warmup")):
        with pytest.raises(SystemExit, match=msg):
            common.checked_warmup(ap.parse_args(argv))
    common.checked_warmup(ap.parse_args(["--steps", "5", "--warmup", "2"]))
    monkeypatch.setattr(common, "SCRATCH", tmp_path)
    cfg = common.gpt_config(2, 64, 8)
    r = common.snake_run(cfg, micro_batches=2, micro_batch_size=1, seq=8, steps=4, warmup=2, placement=None, alpha=None)
    assert r["warmup"] == 2 and len(r["step_seconds"]) == 4 and r["iteration_seconds"]["n"] == 2
    t = common.torch_loop(cfg, micro_batches=2, micro_batch_size=1, seq=8, steps=4, activation_checkpointing=True, warmup=3)
    assert t["warmup"] == 3 and t["iteration_seconds"]["n"] == 1


def test_vertical_link_bytes_count_each_layer_twice_in_and_its_gradient_out():
    throughput = importlib.import_module("throughput")
    shape = {"n_layers": 8, "layer_params": 1000, "ckpt_elems": 10, "resident_params": 0, "tokens_per_micro": 32,
             "dtype_bytes": 4}
    prof = {"device": "cpu", "shape": shape, "fwd_seconds": 1e-3, "recompute_seconds": 1e-3, "bwd_seconds": 2e-3,
            "pre_post_seconds": 1e-3, "adam_elems_per_s": 1e9, "h2d_bytes_per_s": 1e9, "d2h_bytes_per_s": 1e9,
            "ssd_read_bytes_per_s": 1e9, "ssd_write_bytes_per_s": 1e9, "cpu_memory_bytes": 2**30, "device_memory_bytes": 2**30}
    h2d, d2h = throughput.vertical_link_bytes(prof, 4)
    # parameters in for the forward and the backward; checkpoints in: n - 1 per forward but
    # layer 0's (its inputs are the embedding's), 2n - 1 per backward
    assert h2d == 8 * 2 * 1000 * 4 + (7 * (4 - 1) + 8 * (2 * 4 - 1)) * 10 * 4
    # fp32 gradient out once; checkpoints and inter-layer gradients out (n + n - 1)
    assert d2h == 8 * (1000 * 4 + (2 * 4 - 1) * 10 * 4)


def _openmp_workers() -> set[int]:
    import os
    import threading

    return {int(t) for t in os.listdir("/proc/self/task")} - {t.native_id for t in threading.enumerate()}


def test_on_worker_leaves_no_openmp_team_on_the_calling_thread():
    """A parallel torch op leaves an idle OpenMP team on its thread; with one more team in the
    process every kernel measured next runs slower. on_worker's thread takes it away."""
    import threading
    import time

    import torch

    common = importlib.import_module("common")
    a = torch.randn(1024, 1024)
    seen: dict[str, int] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # new threads run 2 (so a team has one worker on any machine)

    def settled(before: set[int]) -> int:
        """New OpenMP workers, once the exited thread's workers had time to leave (they
        leave on their own after their thread exits)."""
        deadline = time.monotonic() + 5
        while len(_openmp_workers() - before) and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(_openmp_workers() - before)

    def caller() -> None:  # a fresh thread stands for a benchmark's main thread
        before = _openmp_workers()
        common.on_worker(lambda: a @ a)
        seen["on_worker"] = settled(before)
        a @ a  # the same op on the calling thread: its team stays while the thread lives
        seen["direct"] = settled(before)

    t = threading.Thread(target=caller)
    t.start()
    t.join()
    torch.set_num_threads(threads)
    assert seen == {"on_worker": 0, "direct": 1}


def test_benchmarks_measure_profiles_off_the_main_thread():
    """Profiling runs parallel torch ops: the scripts must hand it to common.on_worker, never
    call it on the main thread (whose event loop runs snake next)."""
    import ast

    heavy = {"measure_profile", "plan_for_batch", "profile_for_config"}
    direct = []
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in heavy:
                direct.append(f"{path.name}:{node.lineno} {node.func.id}")
    assert direct == []


@pytest.mark.parametrize("m", [4, 16, 32])
def test_io_roofline_counts_checkpoint_traffic(m):
    """The I/O roofline's bytes are a lower bound on the SSD bytes of every vertical plan
    under the budget, checkpoint traffic included: the planner's best plan moves no fewer,
    and (I/O-bound, 16 MB checkpoints) no more than 5 % more (the bound without the
    checkpoints' own traffic was far below it)."""
    from planner import search
    from planner.integrate import with_budgets
    from snake import SnakeConfig
    from snake.memory import OPT_BYTES_PER_ELEM, host_memory
    from tests.planner.conftest import GiB, synthetic_profile

    throughput = importlib.import_module("throughput")
    p = synthetic_profile(cpu_memory_bytes=40 * GiB, ssd_read_bytes_per_s=0.3e9, ssd_write_bytes_per_s=0.3e9)
    # room for the parameters, 16 micro-batches' checkpoints and half the optimizer states
    budget = int(host_memory(p.shape, n_micro=16, alpha=0.0, schedule="vertical", workers=2, ckpt_in_cpu=True).at(1, 1, 0.5))
    opt_bytes = p.shape.n_layers * p.shape.layer_params * OPT_BYTES_PER_ELEM
    bound = throughput.min_opt_ssd_bytes(p, budget, m, opt_bytes)
    stated = importlib.import_module("common").planner_budget(budget, p)  # as min_opt_ssd_bytes states it
    plan = search(with_budgets(p, SnakeConfig(offload_dir=".", cpu_memory_bytes=stated)), schedule="vertical", n_micro=m)
    assert bound > 0
    assert bound <= plan.ssd_bytes_per_iteration * (1 + 1e-9)
    assert plan.ssd_bytes_per_iteration <= 1.05 * bound


def test_model_flags_are_checked():
    """--device/--layers/--width/--seq (every script that can run on a GPU): a bad value exits
    naming the flag; no flag means the GPU where there is one."""
    import argparse

    import torch

    common = importlib.import_module("common")
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    common.add_model_args(ap, layers=4, width=512, seq=32)
    for argv, msg in ((["--layers", "0"], "--layers 0: must be >= 1"), (["--seq", "-1"], "--seq -1"),
                      (["--steps", "0"], "--steps 0"), (["--device", "tpu"], "--device tpu: must be cpu or cuda")):
        with pytest.raises(SystemExit, match=msg):
            common.checked_device(ap.parse_args(argv), ("steps",))
    assert common.checked_device(ap.parse_args(["--device", "cpu"])) == "cpu"
    assert common.checked_device(ap.parse_args([])) == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device here; use --device cpu"):
            common.checked_device(ap.parse_args(["--device", "cuda"]))


def test_report_runs_has_one_row_per_run(capsys):
    report = importlib.import_module("report")
    d = {
        "model": {"n_layer": 8, "n_embd": 512, "seq": 32},
        "machine": {"cores": 2, "cpu": "Intel(R) Xeon(R) Processor"},
        "cpu_memory_budget_bytes": 330 * 2**20,
        "cap_bytes_per_s": 650e6,
        "Ms": [1, 8, 16],
        "summary": {"capped": {
            "saturated_vertical_over_horizontal": 2.5, "saturated_vertical_over_horizontal_upto16": 2.4,
            "M_to_90pct_vertical": 8, "M_to_90pct_horizontal": 16,
            "M_to_90pct_vertical_upto16": 8, "M_to_90pct_horizontal_upto16": 16,
            "vertical_vs_roofline": [{"M": 1, "ratio": 1.0}, {"M": 8, "ratio": 0.85}, {"M": 16, "ratio": 0.95}],
        }},
    }
    row = report.run_row("b9", d)
    assert row.startswith("| b9 | 8x512 seq 32, 2 cores Intel Xeon Processor; 330 MiB, 650 MB/s | 16 | 2.50 | 2.40 | 8 vs 16 | 8 vs 16 |")
    # the lowest point and how many of the sweep's points reach 0.9 of the roofline
    assert "| 0.85 (M=8), 2/3 |" in row
    report.runs_table()
    out = capsys.readouterr().out
    kept = list(report.R.glob("throughput*.json")) + list((report.R / "logs").glob("throughput*.json"))
    assert len(kept) > 0
    assert sum(line.startswith("| throughput") for line in out.splitlines()) == len(kept)


@pytest.mark.parametrize("kind", ["read", "write", "mixed"])
def test_io_cost_side_thread_moves_ssd_traffic_at_its_rate(tmp_path, kind):
    """contention.py --io-cost: the side thread moves bytes through snake's capped storage at
    the rate asked for, and stops when told."""
    import threading
    import time

    contention = importlib.import_module("contention")
    stop, out, rate = threading.Event(), [], 32e6
    side = threading.Thread(target=contention.io_burner, args=(kind, rate, 2**20, str(tmp_path / "io.bin"), stop, out))
    side.start()
    time.sleep(0.5)
    stop.set()
    side.join(timeout=5)
    assert not side.is_alive() and len(out) == 1
    # 4 MiB of first writes to make every slot readable, then ~0.5 s at the rate (+ its burst)
    assert 0.3 * rate * 0.5 <= out[0]["bytes"] <= rate * 0.5 + 4 * 2**20, out


def test_io_cost_flag_is_checked(monkeypatch):
    contention = importlib.import_module("contention")
    for argv in (["--io-cost", "x"], ["--io-cost", "150,-1"], ["--io-cost", ""], ["--io-cost", "150", "--io-op-mib", "0.001"]):
        monkeypatch.setattr(sys, "argv", ["contention.py", *argv])
        with pytest.raises(SystemExit, match="--io-cost .* must be rates in MB/s > 0.*--io-op-mib at least 4 KiB"):
            contention.main()
    for argv in (["--io-cost", "150", "--io-pieces-mib", "-1"], ["--io-pieces-mib", "4"]):
        monkeypatch.setattr(sys, "argv", ["contention.py", *argv])
        with pytest.raises(SystemExit, match="--io-pieces-mib .* must be sizes in MiB >= 0 .* with --io-cost"):
            contention.main()


def test_data_rng_windows_draw_from_the_global_generator_only_when_asked():
    """data_rng.py's two sources give the same batches, one drawing them from torch's
    global generator (which snake then sees at the first batch) and one from its own."""
    import torch
    from data_rng import windows  # type: ignore[import-not-found]

    tokens = torch.arange(1000)
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    own = list(windows(tokens, 4, 8, 3, 0.0, drawn=False, seed=1234))
    assert torch.equal(torch.get_rng_state(), state)
    drawn = list(windows(tokens, 4, 8, 3, 0.0, drawn=True, seed=1234))
    assert not torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(own, drawn, strict=True))
