"""`snake train` with bad arguments: one line `snake train: ...` (or argparse's message) on
stderr and exit status 2, before any training; a bug inside an actor keeps its traceback."""

from __future__ import annotations

import pytest

from snake import cli
from snake.errors import ActorFailed, DataError

SMALL = ["--layers", "2", "--embd", "32", "--heads", "2", "--seq", "16", "--batch", "4",
         "--micro-batches", "2", "--steps", "1"]


def _train(tmp_path, capsys, *extra: str) -> tuple[int, str]:
    """Exit status and stderr of `snake train` (argparse's errors exit through SystemExit)."""
    argv = ["train", *SMALL, "--out", str(tmp_path / "out"), "--offload-dir", str(tmp_path / "off"), *extra]
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = int(e.code or 0)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--steps", "0"], "argument --steps: 0 must be an integer >= 1"),
        (["--layers", "0"], "argument --layers: 0 must be an integer >= 1"),
        (["--heads", "-1"], "argument --heads: -1 must be an integer >= 1"),
        (["--embd", "0"], "argument --embd: 0 must be an integer >= 1"),
        (["--batch", "0"], "argument --batch: 0 must be an integer >= 1"),
        (["--seq", "0"], "argument --seq: 0 must be an integer >= 1"),
        (["--micro-batches", "0"], "argument --micro-batches: 0 must be an integer >= 1"),
        (["--seed", "-1"], "argument --seed: -1 must be in [0, 2**63 - 1]"),
        (["--seed", str(2**63)], "argument --seed:"),
        (["--device", "mps"], "argument --device: 'mps' is not 'cpu', 'cuda' or 'cuda:N'"),
        (["--device", "cuda:99"], "argument --device: device='cuda:99'"),
        (["--placement", "2,0.5,0.5"], "argument --placement: placement.param=2.0 must be in [0, 1]"),
        (["--placement", "0.5,0.5"], "argument --placement: '0.5,0.5' must be three numbers"),
        (["--placement", "0.5,0.5,0.5,0.5,0.5"], "must be three numbers param,ckpt,opt or four param,ckpt,opt,grad"),
        (["--placement", "0.5,0.5,0.5,2"], "argument --placement: placement.grad=2.0 must be in [0, 1]"),
        (["--heads", "5"], "snake train: --heads=5 must divide --embd=32"),
        (["--micro-batches", "3"], "snake train: --batch=4 is not divisible by --micro-batches=3"),
        (["--seq", "100000000"], "snake train: --seq=100000000 is longer than the training text allows"),
        (["--alpha", "1.5"], "snake train: alpha=1.5 must be in [0, 1]"),
        (["--lr", "-1"], "snake train: optimizer.lr=-1.0 must be"),
        (["--lr-schedule", "step"], "argument --lr-schedule: invalid choice: 'step'"),
        (["--max-grad-norm", "1", "--alpha", "0.5"], "snake train: alpha=0.5 must be 1.0 (or None) with optimizer.max_grad_norm=1.0"),
        (["--max-grad-norm", "0"], "snake train: optimizer.max_grad_norm=0.0 must be a number > 0, math.inf or None"),
        (["--warmup-steps", "-1"], "argument --warmup-steps:"),
        (["--loss-scale", "dynamic"], "snake train: --loss-scale='dynamic' applies to --dtype float16 only, not float32"),
        (["--loss-scale", "0", "--dtype", "float16"], "argument --loss-scale: 0.0 must be a finite number > 0, or 'dynamic'"),
        (["--loss-scale", "big", "--dtype", "float16"], "argument --loss-scale: 'big' is neither 'dynamic' nor a number"),
        (["--dtype", "float16", "--alpha", "0.5"], "snake train: alpha=0.5 must be 1.0 (or None) with a dynamic loss_scale"),
        (["--decay-steps", "0"], "argument --decay-steps: 0 must be an integer >= 1"),
        # the constant schedule has no decay to end (it was ignored)
        (["--decay-steps", "5"], "snake train: --decay-steps=5 is where a decay ends, and --lr-schedule constant has none"),
        (["--lr-schedule", "cosine", "--warmup-steps", "2"], "snake train: --warmup-steps=2 must be <= the decay's 1 steps"),
        (["--lr-schedule", "linear", "--warmup-steps", "3", "--decay-steps", "2"], "snake train: --warmup-steps=3 must be <= the decay's 2 steps"),
    ],
)
def test_bad_argument_is_one_line_and_status_2(tmp_path, capsys, extra, says):
    rc, err = _train(tmp_path, capsys, *extra)
    assert rc == 2
    assert says in err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_bad_paths_are_refused_before_training(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    full = tmp_path / "full"
    (full / "notes").mkdir(parents=True)
    cases = [
        (["--offload-dir", str(afile)], f"snake train: offload_dir='{afile}' is a file"),
        (["--out", str(afile)], f"snake train: --out='{afile}' is a file, not a directory"),
        (["--out", str(afile / "sub")], f"snake train: --out='{afile / 'sub'}' cannot be created"),
        (["--checkpoint", str(afile)], f"snake train: --checkpoint='{afile}' exists and is not a directory"),
        (["--checkpoint", str(afile / "ck")], f"snake train: --checkpoint='{afile / 'ck'}' cannot be created: {afile} is a file"),
        (["--checkpoint", str(full)], f"snake train: --checkpoint='{full}' is a directory with files but no manifest.json"),
    ]
    for extra, says in cases:
        rc, err = _train(tmp_path, capsys, *extra)
        assert rc == 2
        assert err.startswith(says) and len(err.splitlines()) == 1, err
        assert not (tmp_path / "out" / "report.json").exists()  # nothing trained
    assert afile.read_text() == "x"


def _raises(exc: BaseException):
    def fake_train_main(args) -> int:
        raise exc

    return fake_train_main


def test_a_bug_in_an_actor_keeps_its_traceback(tmp_path, capsys, monkeypatch):
    bug = ActorFailed("compute", IndexError("list index out of range"), iteration=0)
    bug.__cause__ = IndexError("list index out of range")
    monkeypatch.setattr(cli, "_train_main", _raises(bug))
    with pytest.raises(ActorFailed):
        cli.main(["train", *SMALL])
    bad_data = ActorFailed("data", DataError("batch size changed"), iteration=3)
    bad_data.__cause__ = DataError("batch size changed")
    monkeypatch.setattr(cli, "_train_main", _raises(bad_data))
    assert cli.main(["train", *SMALL]) == 2
    assert capsys.readouterr().err.startswith("snake train: actor 'data' failed at iteration=3")
