"""`snake train --resume DIR` as a user runs it: a chain of resumed runs is one longer run
(the built-in GPT and a Hugging Face model), and a run that is not the checkpoint's (another
model, LoRA targets, text, windows), or a checkpoint a crash left incomplete, is refused
naming the option before anything is built or written. A checkpoint of `snake train --plan`
resumes without --plan, and a resumed run's report.json says where it went on from."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from snake.cli import main
from snake.train_source import TRAIN_RECORD
from tests.test_cli_hf import tiny_llama

# (PEFT reads transformers' deprecated gradient-checkpointing flag when it loads adapters)
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
GPT = ["--layers", "2", "--embd", "64", "--heads", "2"]
WINDOWS = ["--seq", "32", "--batch", "4", "--micro-batches", "2", "--eval-batches", "0"]


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> list[str]:
    return ["--model", f"hf:{tiny_llama(tmp_path_factory.mktemp('hf') / 'tiny-llama')}"]


def _run(tmp_path, name: str, *argv: str) -> int:
    return main(["train", *argv, "--out", str(tmp_path / name), "--offload-dir", str(tmp_path / f"off-{name}")])


def _report(tmp_path, name: str, *argv: str) -> dict:
    assert _run(tmp_path, name, *argv) == 0
    return json.loads((tmp_path / name / "report.json").read_text())


def _refused(tmp_path, capsys, *argv: str) -> str:
    """The error of a run that is refused before it writes anything (its --out is not made)."""
    capsys.readouterr()
    assert _run(tmp_path, "refused", *argv) == 2
    assert not (tmp_path / "refused").exists()
    return capsys.readouterr().err


def _tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {f"{f.name}/{k}": v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("model", ["gpt", "hf-lora"])
def test_a_run_resumed_twice_is_one_longer_run(tmp_path, hf, model):
    """2 + 2 + 2 steps, each run resuming the checkpoint the last one wrote over itself:
    --steps more steps each time, numbered on, the losses and the final checkpoint's
    tensors those of one 6-step run."""
    argv = [*(GPT if model == "gpt" else [*hf, "--lora", "4", "--lora-targets", "q_proj,v_proj"]), *WINDOWS]
    straight = _report(tmp_path, "straight", *argv, "--steps", "6", "--checkpoint", str(tmp_path / "ck-straight"))
    ck = str(tmp_path / "ck")
    parts = [_report(tmp_path, "r0", *argv, "--steps", "2", "--checkpoint", ck)]
    parts += [_report(tmp_path, f"r{i}", *argv, "--steps", "2", "--checkpoint", ck, "--resume", ck) for i in (1, 2)]
    assert [[s["step"] for s in p["steps"]] for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert [s["loss"] for p in parts for s in p["steps"]] == [s["loss"] for s in straight["steps"]]
    want, got = _tensors(tmp_path / "ck-straight"), _tensors(tmp_path / "ck")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_a_resumed_runs_report_says_where_it_went_on_from(tmp_path):
    first = _report(tmp_path, "first", *GPT, *WINDOWS, "--steps", "2", "--checkpoint", str(tmp_path / "ck"))
    assert first["resumed_from"] is None and first["text"]["text"].startswith("the Python")
    again = _report(tmp_path, "again", *GPT, *WINDOWS, "--steps", "1", "--resume", str(tmp_path / "ck"),
                    "--checkpoint", str(tmp_path / "ck"))
    assert again["resumed_from"] == {"checkpoint": str(tmp_path / "ck"), "step": 2}
    assert again["text"] == first["text"]


def test_a_lora_resumed_with_other_targets_is_refused_naming_lora_targets(tmp_path, hf, capsys):
    """load() refused them once the model was built, naming a tensor ('...k_proj.base_layer.weight
    is frozen but trained in the checkpoint'); PEFT's all-linear and the list of the same
    modules are one LoRA."""
    lora = [*hf, *WINDOWS, "--steps", "1", "--lora", "4"]
    assert _run(tmp_path, "qv", *lora, "--lora-targets", "q_proj,v_proj", "--checkpoint", str(tmp_path / "ck-qv")) == 0
    for more in (["--lora-targets", "q_proj,k_proj"], []):
        err = _refused(tmp_path, capsys, *lora, *more, "--resume", str(tmp_path / "ck-qv"))
        assert "--lora-targets=" in err and "are in q_proj,v_proj (give --lora-targets q_proj,v_proj)" in err
    assert "give --lora 4 --lora-targets q_proj,v_proj" in _refused(
        tmp_path, capsys, *hf, *WINDOWS, "--resume", str(tmp_path / "ck-qv"))
    assert _run(tmp_path, "all", *lora, "--checkpoint", str(tmp_path / "ck-all")) == 0
    every = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    assert _run(tmp_path, "listed", *lora, "--lora-targets", every, "--resume", str(tmp_path / "ck-all")) == 0


@pytest.mark.parametrize("model", ["gpt", "hf"])
def test_another_text_is_refused_naming_text_and_the_same_text_elsewhere_is_taken(tmp_path, hf, capsys, model):
    """The checkpoint's place in the data (its consumed batches) is a place in its text's
    ids: it indexed another text's silently. The text is known by its content: a copy of
    the file elsewhere resumes."""
    argv = [*(GPT if model == "gpt" else hf), *WINDOWS, "--steps", "1"]
    text = tmp_path / "notes.txt"
    text.write_text("snake streams layers through the device, one at a time.\n" * 300)
    other = tmp_path / "other.txt"
    other.write_text(text.read_text().replace("device", "GPU"))
    assert _run(tmp_path, "first", *argv, "--text", str(text), "--checkpoint", str(tmp_path / "ck")) == 0
    err = _refused(tmp_path, capsys, *argv, "--text", str(other), "--resume", str(tmp_path / "ck"))
    assert f"--text='{other}' is not the text the --resume checkpoint trained on, {text} (" in err
    assert f"give --text {text} to go on" in err and "without --resume" in err
    err = _refused(tmp_path, capsys, *argv, "--resume", str(tmp_path / "ck"))
    assert "--text is left out, and the Python" in err and f"is not the text the --resume checkpoint trained on, {text}" in err
    copy = tmp_path / "elsewhere" / "notes.txt"
    copy.parent.mkdir()
    shutil.copy(text, copy)
    assert _run(tmp_path, "again", *argv, "--text", str(copy), "--resume", str(tmp_path / "ck")) == 0
    assert _run(tmp_path, "builtin", *argv, "--checkpoint", str(tmp_path / "ck-builtin")) == 0
    err = _refused(tmp_path, capsys, *argv, "--text", str(text), "--resume", str(tmp_path / "ck-builtin"))
    assert "leave --text out to go on" in err


def test_other_windows_are_refused_naming_batch_and_seq(tmp_path, hf, capsys):
    """--batch and --seq cut the windows the checkpoint's consumed batches count (the GPT's
    --seq is its positions too, which load() refused naming model.wpe.weight)."""
    gpt = [*GPT, "--micro-batches", "2", "--eval-batches", "0", "--steps", "1"]
    assert _run(tmp_path, "g", *gpt, "--seq", "32", "--batch", "4", "--checkpoint", str(tmp_path / "ck-g")) == 0
    err = _refused(tmp_path, capsys, *gpt, "--seq", "32", "--batch", "8", "--resume", str(tmp_path / "ck-g"))
    assert "--batch=8 does not match the --resume checkpoint's 4" in err and "give --batch 4" in err
    err = _refused(tmp_path, capsys, *gpt, "--seq", "16", "--batch", "4", "--resume", str(tmp_path / "ck-g"))
    assert "--seq=16 does not match" in err and "give --seq 32" in err
    argv = [*hf, "--micro-batches", "2", "--eval-batches", "0", "--steps", "1", "--batch", "4"]
    assert _run(tmp_path, "h", *argv, "--seq", "32", "--checkpoint", str(tmp_path / "ck-h")) == 0
    err = _refused(tmp_path, capsys, *argv, "--seq", "16", "--resume", str(tmp_path / "ck-h"))
    assert "--seq=16 does not match the --resume checkpoint's 32" in err


def test_a_checkpoint_of_another_model_is_refused_naming_the_option(tmp_path, hf, capsys):
    """load() named a tensor once the model was built ('model.blocks.*.ln_1.weight=(64,) is
    not in the checkpoint')."""
    gpt, hf_run = [*GPT, *WINDOWS, "--steps", "1"], [*hf, *WINDOWS, "--steps", "1"]
    assert _run(tmp_path, "g", *gpt, "--checkpoint", str(tmp_path / "ck-g")) == 0
    assert _run(tmp_path, "h", *hf_run, "--checkpoint", str(tmp_path / "ck-h")) == 0
    err = _refused(tmp_path, capsys, *hf_run, "--resume", str(tmp_path / "ck-g"))
    assert "--model=" in err and "the built-in GPT (leave --model out and give its shape: --layers 2 --embd 64" in err
    err = _refused(tmp_path, capsys, *gpt, "--resume", str(tmp_path / "ck-h"))
    assert f"--model is left out, but the --resume checkpoint is of a Hugging Face llama (from {hf[1][3:]})" in err
    err = _refused(tmp_path, capsys, *gpt, "--layers", "3", "--resume", str(tmp_path / "ck-g"))
    assert "--layers=3 does not match the --resume checkpoint's GPT" in err and "give --layers 2" in err


def test_a_checkpoint_a_crash_left_is_refused_naming_resume(tmp_path, capsys):
    """Before the model is built: a save interrupted between its renames (the previous
    checkpoint aside, with the way to put it back), a file missing or cut short, a manifest
    that does not read. load() said the last three after building the model, and the run's
    --out was made; the first was 'not a snake checkpoint'."""
    gpt = [*GPT, *WINDOWS, "--steps", "1"]
    assert _run(tmp_path, "first", *gpt, "--checkpoint", str(tmp_path / "ck")) == 0
    shutil.copytree(tmp_path / "ck", tmp_path / "whole")
    (tmp_path / "ck").rename(tmp_path / ".ck[1].old-0123456789ab")  # (a name with glob characters)
    err = _refused(tmp_path, capsys, *gpt, "--resume", str(tmp_path / "ck[1]"))
    assert f"left the previous checkpoint at {tmp_path / '.ck[1].old-0123456789ab'}" in err
    assert "rename that to ck[1]" in err
    for damage, says in ((lambda d: (d / "layer-00001.safetensors").unlink(), "layer-00001.safetensors is missing"),
                         (lambda d: (d / "rng.safetensors").write_bytes(b"x"), "rng.safetensors has 1 bytes"),
                         (lambda d: (d / "manifest.json").write_text("{"), "manifest.json that does not read")):
        broken = tmp_path / "broken"
        shutil.rmtree(broken, ignore_errors=True)
        shutil.copytree(tmp_path / "whole", broken)
        damage(broken)
        err = _refused(tmp_path, capsys, *gpt, "--resume", str(broken))
        assert f"--resume='{broken}'" in err and says in err


def test_a_plan_checkpoint_resumes_without_plan_on_its_alpha_and_micro_batches(tmp_path):
    """--alpha and --micro-batches left out take the checkpoint's, as --plan's resume does:
    they took the defaults (0.25, 4), which did not match what the planner had picked, and
    the run was refused asking for options the user had not given."""
    argv = [*GPT, "--seq", "32", "--batch", "4", "--eval-batches", "0"]
    first = _report(tmp_path, "first", *argv, "--plan", "--steps", "1", "--checkpoint", str(tmp_path / "ck"))
    again = _report(tmp_path, "again", *argv, "--steps", "1", "--resume", str(tmp_path / "ck"))
    for key in ("alpha", "micro_batches"):
        assert again["config"][key] == first["config"][key]
    assert [s["step"] for s in again["steps"]] == [1]


def test_a_checkpoint_without_snake_trains_record_resumes_and_says_what_is_not_checked(tmp_path, capsys):
    """A checkpoint SnakeTrainer.save wrote (or an earlier snake train) has no record of its
    text: it resumes, the text unchecked, and the run says so."""
    gpt = [*GPT, *WINDOWS, "--steps", "1"]
    assert _run(tmp_path, "first", *gpt, "--checkpoint", str(tmp_path / "ck")) == 0
    (tmp_path / "ck" / TRAIN_RECORD).unlink()
    capsys.readouterr()
    assert _run(tmp_path, "again", *gpt, "--resume", str(tmp_path / "ck")) == 0
    assert f"holds no {TRAIN_RECORD}" in capsys.readouterr().err


def test_the_default_corpus_is_named_with_its_python_release():
    """The documentation shipped with Python differs between patch releases (3.11.2 and
    3.11.7 by a thousand characters): a --resume under another one was refused saying that
    'the Python 3.11 documentation' is not 'the Python 3.11 documentation'."""
    import platform

    import torch

    from snake.train_source import text_record

    record = text_record(None, "some text", torch.arange(4))
    assert record["text"] == f"the Python {platform.python_version()} documentation"
    assert not record["given"]
