"""The `snake` command: train writes trace.json (a track per actor), report.json and
timeline.png; trace summarize / plot read them back."""

import json

import torch

from snake.cli import main

SMALL = ["--layers", "2", "--embd", "64", "--heads", "2", "--seq", "32", "--batch", "4", "--micro-batches", "2"]


def test_train_three_steps_then_trace_tools(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", "--steps", "3", "--out", str(out), "--offload-dir", str(tmp_path / "off"), *SMALL]) == 0
    trace = json.loads((out / "trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"compute", "h2d", "d2h", "ssd_read", "ssd_write", "optimizer[0]", "data"} <= tracks
    report = json.loads((out / "report.json").read_text())
    assert [s["step"] for s in report["steps"]] == [0, 1, 2]
    assert all(s["loss"] > 0 for s in report["steps"])
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert main(["trace", "summarize", str(out / "trace.json")]) == 0
    text = capsys.readouterr().out
    assert "compute" in text and "ssd->cpu" in text
    assert "event loop CPU:" in text and "of one core" in text
    assert "threads (over run())" in text and "snake-compute" in text
    assert 0 < report["trace_summary"]["event_loop"]["cpu_s"] <= report["trace_summary"]["event_loop"]["run_wall_s"]
    assert report["trace_summary"]["threads"]["snake-compute"]["cpu_s"] > 0
    assert main(["trace", "summarize", "--json", str(out / "trace.json")]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["threads"] == report["trace_summary"]["threads"]
    assert main(["trace", "plot", str(out / "trace.json"), "-o", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_train_longer_lowers_the_loss(tmp_path):
    out = tmp_path / "out"
    assert main(["train", "--steps", "25", "--out", str(out), "--offload-dir", str(tmp_path / "off"), *SMALL]) == 0
    losses = [s["loss"] for s in json.loads((out / "report.json").read_text())["steps"]]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5


def test_bad_trace_file(tmp_path, capsys):
    assert main(["trace", "summarize", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_train_reports_the_held_out_loss_before_and_after(tmp_path, capsys, monkeypatch):
    """--eval-batches (8 by default): the validation loss on windows of the held-out text,
    which the training windows never come from, before and after training. The timeline's
    window is the last steps, without that evaluation after them."""
    import snake.timeline
    from snake.cli import HOLDOUT
    from snake.corpus import holdout_windows, pydoc_bytes

    plotted = {}
    real_plot = snake.timeline.plot_timeline

    def plot(spans, path, *, window_s=None, **kw):
        plotted.update(spans=spans, window_s=window_s)
        real_plot(spans, path, window_s=window_s, **kw)

    monkeypatch.setattr(snake.timeline, "plot_timeline", plot)
    out = tmp_path / "out"
    assert main(["train", "--steps", "25", "--out", str(out), "--offload-dir", str(tmp_path / "off"),
                 "--eval-batches", "3", *SMALL]) == 0
    end = max(s.end_s for s in plotted["spans"])
    shown = {s.name.split()[0] for s in plotted["spans"] if s.end_s >= end - plotted["window_s"]}
    assert "fwd" in shown and "eval" not in shown
    assert any(s.name.startswith("eval ") for s in plotted["spans"])  # the evaluation before training
    val = json.loads((out / "report.json").read_text())["val_loss"]
    assert val["after"] < val["before"] - 0.5
    assert f"held-out loss {val['before']:.4f} -> {val['after']:.4f}" in capsys.readouterr().out
    corpus = pydoc_bytes()
    held = holdout_windows(corpus, batch=4, seq=32, batches=3, holdout=HOLDOUT)
    assert len(held) == 3 and all(x.shape == (4, 32) for x, _ in held)
    first = int(len(corpus) * (1 - HOLDOUT))
    assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in held)
    assert torch.equal(held[0][0][0], corpus[first : first + 32])  # the held-out text's first window
    out0 = tmp_path / "out0"
    assert main(["train", "--steps", "2", "--out", str(out0), "--offload-dir", str(tmp_path / "off0"),
                 "--eval-batches", "0", *SMALL]) == 0
    assert json.loads((out0 / "report.json").read_text())["val_loss"] == {}
    assert "held-out" not in capsys.readouterr().out


def test_resume_goes_on_as_one_longer_run(tmp_path, capsys):
    """--checkpoint after 3 steps, then --resume from it for 2 more: the steps are numbered on,
    their losses and the final checkpoint's tensors are those of a straight 5-step run."""
    from safetensors.torch import load_file

    def train(name: str, steps: int, *extra: str) -> dict:
        out = tmp_path / name
        assert main(["train", "--steps", str(steps), "--out", str(out), "--offload-dir", str(tmp_path / f"off-{name}"),
                     "--checkpoint", str(tmp_path / f"ck-{name}"), "--eval-batches", "1", *SMALL, *extra]) == 0
        return json.loads((out / "report.json").read_text())

    train("first", 3)
    resumed = train("resumed", 2, "--resume", str(tmp_path / "ck-first"))
    straight = train("straight", 5)
    assert [s["step"] for s in resumed["steps"]] == [3, 4]
    assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in straight["steps"][3:]]
    assert resumed["val_loss"]["after"] == straight["val_loss"]["after"]
    files = sorted(p.name for p in (tmp_path / "ck-straight").glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (tmp_path / "ck-resumed").glob("*.safetensors"))
    for name in files:
        got, want = load_file(tmp_path / "ck-resumed" / name), load_file(tmp_path / "ck-straight" / name)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (name, k)


def test_save_every_checkpoints_on_the_way_and_changes_no_step(tmp_path, monkeypatch):
    """--save-every 2 over 5 steps: saves after steps 2 and 4 and at the end; the losses and the
    final checkpoint are those of a run that saved only at the end."""
    from safetensors.torch import load_file

    from snake.trainer import SnakeTrainer

    saved_at: list[int] = []
    real = SnakeTrainer.save

    async def save(self, directory):
        saved_at.append(self.engine.next_t)
        await real(self, directory)

    monkeypatch.setattr(SnakeTrainer, "save", save)

    def train(name: str, *extra: str) -> dict:
        out = tmp_path / name
        assert main(["train", "--steps", "5", "--out", str(out), "--offload-dir", str(tmp_path / f"off-{name}"),
                     "--checkpoint", str(tmp_path / f"ck-{name}"), "--eval-batches", "0", *SMALL, *extra]) == 0
        return json.loads((out / "report.json").read_text())

    every = train("every", "--save-every", "2")
    assert saved_at == [2, 4, 5]
    straight = train("straight")
    assert [s["loss"] for s in every["steps"]] == [s["loss"] for s in straight["steps"]]
    for f in (tmp_path / "ck-straight").glob("*.safetensors"):
        got, want = load_file(tmp_path / "ck-every" / f.name), load_file(f)
        for k in want:
            assert torch.equal(got[k], want[k]), (f.name, k)


def test_a_learning_rate_schedule_goes_on_across_a_resume(tmp_path):
    """--lr-schedule cosine --warmup-steps 2: each step's rate in report.json is the cosine's
    (snake.lr), and a --resume run given the same --decay-steps continues the one schedule:
    its steps, losses and rates are those of the straight run."""
    from snake.lr import WarmupCosine

    def train(name: str, steps: int, *extra: str) -> dict:
        out = tmp_path / name
        assert main(["train", "--steps", str(steps), "--out", str(out), "--offload-dir", str(tmp_path / f"off-{name}"),
                     "--checkpoint", str(tmp_path / f"ck-{name}"), "--eval-batches", "0", "--lr-schedule", "cosine",
                     "--warmup-steps", "2", *SMALL, *extra]) == 0
        return json.loads((out / "report.json").read_text())

    straight = train("straight", 5)
    cos = WarmupCosine(total_steps=5, warmup_steps=2)
    assert [s["lr"] for s in straight["steps"]] == [1e-3 * cos(i) for i in range(5)]
    assert straight["config"]["optimizer"]["lr_schedule"] == {
        "kind": "cosine", "total_steps": 5, "warmup_steps": 2, "min_ratio": 0.0}
    train("first", 3, "--decay-steps", "5")
    resumed = train("resumed", 2, "--resume", str(tmp_path / "ck-first"), "--decay-steps", "5")
    assert [s["step"] for s in resumed["steps"]] == [3, 4]
    assert [(s["loss"], s["lr"]) for s in resumed["steps"]] == [(s["loss"], s["lr"]) for s in straight["steps"][3:]]
    # without --decay-steps a resumed run's decay ends at its own last step (3 + 2 = 5 here too)
    again = train("again", 2, "--resume", str(tmp_path / "ck-first"))
    assert [s["lr"] for s in again["steps"]] == [s["lr"] for s in straight["steps"][3:]]


def test_max_grad_norm_clips_with_every_step_delayed(tmp_path):
    """--max-grad-norm: alpha 1 by default then, each step's norm before clipping in
    report.json, and the losses of a run that clips differ from one that does not."""
    def train(name: str, *extra: str) -> dict:
        out = tmp_path / name
        assert main(["train", "--steps", "4", "--out", str(out), "--offload-dir", str(tmp_path / f"off-{name}"),
                     "--eval-batches", "0", *SMALL, *extra]) == 0
        return json.loads((out / "report.json").read_text())

    clipped = train("clipped", "--max-grad-norm", "0.05")
    plain = train("plain", "--alpha", "1")
    assert clipped["config"]["alpha"] == 1.0 and clipped["config"]["optimizer"]["max_grad_norm"] == 0.05
    assert all(s["grad_norm"] > 0.05 for s in clipped["steps"])
    assert [s["grad_norm"] for s in plain["steps"]] == [None] * 4
    assert clipped["steps"][0]["loss"] == plain["steps"][0]["loss"]  # the first step's loss is before any step
    assert clipped["steps"][-1]["loss"] != plain["steps"][-1]["loss"]
    # inf: the norm only, at the default alpha, and the losses of the run without it
    measured, default = train("measured", "--max-grad-norm", "inf"), train("default")
    assert measured["config"]["alpha"] == 0.25 and all(s["grad_norm"] > 0 for s in measured["steps"])
    assert measured["config"]["optimizer"]["max_grad_norm"] == "inf"  # strict JSON: no Infinity
    json.loads((tmp_path / "measured" / "report.json").read_text(), parse_constant=_no_constant)
    assert [s["loss"] for s in measured["steps"]] == [s["loss"] for s in default["steps"]]


def test_float16_scales_the_loss_dynamically_unless_told_a_number(tmp_path):
    """--dtype float16: a dynamic loss scale by default (GradScaler's defaults; alpha 1
    then), each step's scale and whether it was skipped in report.json; --loss-scale X: a
    static scale, at the default alpha."""
    def train(name: str, *extra: str) -> dict:
        out = tmp_path / name
        assert main(["train", "--steps", "2", "--out", str(out), "--offload-dir", str(tmp_path / f"off-{name}"),
                     "--eval-batches", "0", "--dtype", "float16", *SMALL, *extra]) == 0
        return json.loads((out / "report.json").read_text(), parse_constant=_no_constant)

    dynamic, static = train("dynamic"), train("static", "--loss-scale", "512")
    assert dynamic["config"]["alpha"] == 1.0 and dynamic["config"]["loss_scale"]["init_scale"] == 2.0**16
    assert [(s["loss_scale"], s["skipped"]) for s in dynamic["steps"]] == [(2.0**16, False)] * 2
    assert all(s["grad_norm"] > 0 for s in dynamic["steps"])
    assert static["config"]["alpha"] == 0.25 and static["config"]["loss_scale"] == 512.0
    assert [(s["loss_scale"], s["skipped"], s["grad_norm"]) for s in static["steps"]] == [(512.0, False, None)] * 2


def test_no_decay_norms_leaves_the_norms_undecayed(tmp_path):
    """--no-decay-norms: the report names the filter, and after one step only 1-D weights
    differ from a run that decays every weight: the norms' (the biases start at 0, which
    decay leaves at 0)."""
    from safetensors.torch import load_file

    def train(name: str, *extra: str) -> dict:
        out, ck = tmp_path / f"out-{name}", tmp_path / f"ck-{name}"
        assert main(["train", "--steps", "1", "--out", str(out), "--offload-dir", str(tmp_path / f"off-{name}"),
                     "--checkpoint", str(ck), "--eval-batches", "0", *SMALL, *extra]) == 0
        masters = {}
        for f in ck.glob("*.safetensors"):
            masters.update({k: v for k, v in load_file(f).items() if k.startswith("master/")})
        return json.loads((out / "report.json").read_text()), masters

    report, groups = train("groups", "--no-decay-norms")
    _, all_decay = train("all")
    assert report["config"]["optimizer"]["no_decay"] == {"kind": "callable", "name": "biases_and_norms"}
    assert groups.keys() == all_decay.keys() and len(groups) > 10
    differ = {k for k in groups if not torch.equal(groups[k], all_decay[k])}
    assert differ == {k for k, v in groups.items() if v.dim() < 2 and not k.endswith(".bias")}
    assert "master/ln_f.weight" in differ and "master/blocks.1.ln_2.weight" in differ


def _no_constant(name: str) -> None:
    raise AssertionError(f"{name} is not JSON")


def test_train_without_an_offload_dir_puts_its_temporary_one_where_scratch_parent_says(tmp_path, monkeypatch):
    """The default offload_dir is a temporary directory under `scratch_parent()` (a disk
    where the system's temporary directory is in memory), removed afterwards."""
    parent = tmp_path / "disk"
    parent.mkdir()
    monkeypatch.setattr("snake.cli.scratch_parent", lambda: str(parent))
    out = tmp_path / "out"
    assert main(["train", "--steps", "1", "--eval-batches", "0", "--out", str(out), *SMALL]) == 0
    used = json.loads((out / "report.json").read_text())["config"]["offload_dir"]
    assert used.startswith(str(parent) + "/snake-offload-")
    assert not list(parent.iterdir())


def test_train_with_plan_lets_the_planner_pick_and_reports_what_it_picked(tmp_path, capsys):
    """--plan: placement, alpha and micro-batches are the planner's (SnakeConfig's None), and
    report.json says what it picked; one of them given beside --plan is refused by name."""
    out = tmp_path / "out"
    small = ["--layers", "2", "--embd", "64", "--heads", "2", "--seq", "32", "--batch", "4", "--eval-batches", "0"]
    assert main(["train", "--steps", "2", "--plan", "--out", str(out), "--offload-dir", str(tmp_path / "off"),
                 *small]) == 0
    config = json.loads((out / "report.json").read_text())["config"]
    assert config["micro_batches"] in (1, 2, 4) and config["alpha"] is not None
    assert set(config["placement"]) >= {"param", "ckpt", "opt"}
    capsys.readouterr()
    assert main(["train", "--plan", "--micro-batches", "2", "--out", str(tmp_path / "o2"), *small]) == 2
    assert "--micro-batches" in capsys.readouterr().err and not (tmp_path / "o2").exists()


def test_python_m_snake_and_version():
    """`python -m snake` is the `snake` command; `--version` says the installed version."""
    import subprocess
    import sys
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-m", "snake", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"snake {version('snake')}", out
    bad = subprocess.run([sys.executable, "-m", "snake", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'nope'" in bad.stderr
