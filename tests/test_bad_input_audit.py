"""Bad input an audit (round 38) found accepted, or refused late, or with a raw error: each is
now refused with an error naming what is wrong, before anything is touched."""

import json

import pytest
import torch

from snake import ConfigError, DataError, SnakeConfig, SnakeError, SnakeTrainer
from snake.cli import main
from tests.helpers import batches, tiny_gpt
from tests.test_lifecycle import config, open_bin_files, snake_threads

SMALL = ["--layers", "2", "--embd", "32", "--heads", "2", "--seq", "16", "--batch", "4", "--micro-batches", "2",
         "--eval-batches", "0"]


@pytest.mark.asyncio
async def test_a_save_over_the_offload_dir_is_refused(tmp_path):
    """save() to the trainer's offload_dir (or a directory holding it): its rename would take
    the live SSD tier and the directory's lock with it (a second save there did, and a second
    trainer then ran on the same directory). A checkpoint inside it is fine."""
    off = tmp_path / "off"
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(4, 4), config=config(off)) as t:
        for target in (off, tmp_path):
            with pytest.raises(SnakeError, match="is or holds the trainer's offload_dir"):
                await t.save(target)
        await t.run(1)
        with pytest.raises(SnakeError, match="is or holds the trainer's offload_dir"):
            await t.save(off)
        assert sorted(p.name for p in off.glob("*.bin"))  # the tier is still there
        await t.save(off / "ckpt")
        await t.run(1)
    assert json.loads((off / "ckpt" / "manifest.json").read_text())["step"] == 1


@pytest.mark.parametrize("same_as", ["--offload-dir", "--out"])
def test_train_refuses_a_checkpoint_path_over_its_own_directories_before_training(tmp_path, capsys, same_as):
    """`snake train --checkpoint X` with X its --offload-dir or --out trained the whole run,
    then failed to save it."""
    ckpt = tmp_path / "x"
    dirs = {"--offload-dir": str(tmp_path / "off"), "--out": str(tmp_path / "out"), same_as: str(ckpt)}
    rc = main(["train", "--steps", "2", "--checkpoint", str(ckpt), *[a for kv in dirs.items() for a in kv], *SMALL])
    assert rc == 2
    assert f"--checkpoint={str(ckpt)!r} is or holds the {same_as} directory" in capsys.readouterr().err
    assert not ckpt.exists() and not (tmp_path / "out").exists()


def test_export_refuses_a_directory_that_is_not_a_model_directory(tmp_path, capsys):
    """`snake export CK --hf DIR` wrote config.json and model.safetensors into any directory;
    now only into a new or empty one, or a Hugging Face model directory (re-exported)."""
    assert main(["train", "--steps", "1", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "o"),
                 "--offload-dir", str(tmp_path / "off"), *SMALL]) == 0
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "ck"), "--hf", str(other)]) == 2
    assert "is a directory with files but no config.json" in capsys.readouterr().err
    assert sorted(p.name for p in other.iterdir()) == ["todo.txt"]
    assert main(["export", str(tmp_path / "ck"), "--hf", ""]) == 2
    assert "--hf='' is empty" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "ck"), "--hf", str(tmp_path / "hf")]) == 0
    assert main(["export", str(tmp_path / "ck"), "--hf", str(tmp_path / "hf")]) == 0  # over an earlier export


def test_export_of_an_edited_manifest_says_so(tmp_path, capsys):
    """A checkpoint whose recorded model config was edited (a head count that does not
    divide the width, another width) gave a traceback; now one line naming the manifest."""
    ck = tmp_path / "ck"
    assert main(["train", "--steps", "1", "--checkpoint", str(ck), "--out", str(tmp_path / "o"),
                 "--offload-dir", str(tmp_path / "off"), *SMALL]) == 0
    manifest = json.loads((ck / "manifest.json").read_text())
    for change in ({"n_head": 5}, {"n_embd": 48}):
        edited = {**manifest, "model_config": {**manifest["model_config"], **change}}
        (ck / "manifest.json").write_text(json.dumps(edited))
        capsys.readouterr()
        assert main(["export", str(ck), "--hf", str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("snake export: export: ") and "was its manifest.json edited?" in err
        assert "Traceback" not in err and not (tmp_path / "hf").exists()


def test_train_refuses_more_evaluation_batches_than_the_held_out_text_holds(tmp_path, capsys):
    """--eval-batches 10**9 made every window up front: 24 GB, then the process was killed."""
    assert main(["train", "--steps", "1", "--out", str(tmp_path / "o"), "--eval-batches", "1000000000",
                 *SMALL[:-2]]) == 2
    err = capsys.readouterr().err
    assert "--eval-batches=1000000000 is more than the held-out text" in err and "use --eval-batches" in err


@pytest.mark.asyncio
@pytest.mark.parametrize("data,says", [
    ([], "evaluate: data gave no batch"),
    ({"a": 1}, "evaluate: data: expected an iterable or async iterable of (inputs, targets) batches, got a dict"),
    ([torch.zeros(2, 4, dtype=torch.long)], "each batch must be a pair (inputs, targets)"),
])
async def test_evaluate_before_the_first_run_checks_its_data_before_setting_up(tmp_path, data, says):
    """evaluate() before run() set the engine up (its tier files, its threads) and only then
    looked at its data."""
    off = tmp_path / "off"
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(2, 4), config=config(off)) as t:
        with pytest.raises(DataError, match=None) as caught:
            await t.evaluate(data)
        assert says in str(caught.value)
        assert t.engine is None and not open_bin_files(off) and not snake_threads()
        assert (await t.evaluate(batches(1, 4, seed=3))).batches == 1  # still usable


@pytest.mark.asyncio
async def test_an_on_step_that_takes_no_report_is_refused_before_the_run(tmp_path):
    """It passed the check and failed the run after its first iteration, closing the trainer."""
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(3, 4), config=config(tmp_path / "o")) as t:
        with pytest.raises(ConfigError, match="on_step=.* cannot be called with one StepReport"):
            await t.run(1, on_step=lambda: None)
        assert t.engine is None
        await t.run(1, on_step=lambda report, *rest: None)
        await t.run(1, on_step=print)  # a builtin


def test_a_loss_scale_float32_cannot_hold_is_refused():
    """float16's static loss_scale=1e-40 failed the first iteration (float32 cannot hold it)."""
    with pytest.raises(ConfigError, match=r"loss_scale=1e-40 must be a finite number >= 1.18e-38"):
        SnakeConfig(offload_dir="x", dtype="float16", loss_scale=1e-40)
    SnakeConfig(offload_dir="x", dtype="float16", loss_scale=0.5)


@pytest.mark.asyncio
async def test_load_with_data_shorter_than_the_checkpoint_took_is_refused_before_it_reads(tmp_path):
    """A list shorter than the batches the checkpoint consumed was read, then refused, and
    the trainer was closed, so the retry the message advised was refused too."""
    data = batches(6, 4)
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=data, config=config(tmp_path / "a")) as t:
        await t.run(3)
        await t.save(tmp_path / "ck")
    t = SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=data[3:5], config=config(tmp_path / "b"))
    with pytest.raises(DataError, match="has consumed 3 global batches but data holds 2"):
        await t.load(tmp_path / "ck")
    assert t.engine is None and t._broken is None
    await t.load(tmp_path / "ck", skip_data=False)  # the retry the message names
    await t.run(2)
    await t.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("call,field", [
    (lambda t, p: t.save(None), "directory=None must be a path"),
    (lambda t, p: t.save(123), "directory=123 must be a path"),
    (lambda t, p: t.load(None), "directory=None must be a path"),
    (lambda t, p: t.save(p / "c", frozen=1), "save(frozen=...)=1 must be True, False or None"),
    (lambda t, p: t.load(p / "c", skip_data="no"), "load(skip_data=...)='no' must be True or False"),
    (lambda t, p: t.state_dict(trained_only="yes"), "state_dict(trained_only=...)='yes' must be True or False"),
])
async def test_paths_and_flags_of_the_wrong_type_are_refused_by_name(tmp_path, call, field):
    """A None path gave a bare TypeError; truthy non-bools (skip_data='no') were taken as True."""
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(2, 4), config=config(tmp_path / "o")) as t:
        with pytest.raises(ConfigError) as caught:
            await call(t, tmp_path)
        assert str(caught.value).startswith(field)
        assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("data,says", [
    ({"inputs": 1}, "data: expected an iterable or async iterable of (inputs, targets) batches, got a dict"),
    (torch.zeros(3, 4, dtype=torch.long), "got a Tensor; for one batch pass [(inputs, targets)]"),
    ("text", "got a str"),
])
def test_data_that_is_one_batch_or_a_text_is_named_as_such(tmp_path, data, says):
    """A dict iterated its keys ("each batch must be a pair ..., got str"), a tensor its rows."""
    with pytest.raises(DataError) as caught:
        SnakeTrainer(tiny_gpt(n_layer=2), data=data, config=config(tmp_path / "o"))
    assert says in str(caught.value)
    assert not (tmp_path / "o").exists()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["sparse", "nested"])
async def test_sparse_and_nested_batches_are_data_errors(tmp_path, kind):
    """They failed deep in torch (NotImplementedError, RuntimeError) instead."""
    x, y = batches(1, 4)[0]
    bad = x.to_sparse() if kind == "sparse" else torch.nested.nested_tensor(list(x), layout=torch.jagged)
    t = SnakeTrainer(tiny_gpt(n_layer=2), data=[(bad, y)], config=config(tmp_path / "o"))
    with pytest.raises(DataError, match="data: batch inputs must be a dense"):
        await t.run(1)
    await t.close()


@pytest.mark.parametrize("argv,says", [
    (["--cpu-memory", "1e400"], "'1e400' is too large a size"),
    (["--cpu-memory", "0.5"], "'0.5' must be at least 1 byte"),
    (["--model", "gpt:n_layer=2,bias=maybe"], "model field bias='maybe' must be true or false"),
    (["--model", "gpt:n_layer=2,n_layer=3"], "model field 'n_layer' is given twice"),
])
def test_plan_refuses_sizes_and_model_fields_it_would_misread(tmp_path, capsys, argv, says):
    """1e400 bytes was taken as inf and refused only after profiling; 0.5 bytes as a budget;
    bias=maybe as False; a key given twice as its last value."""
    from planner.cli import plan_main

    base = {"--model": "gpt:n_layer=2,n_embd=32,n_head=2,vocab_size=64,block_size=16", "--micro-batch-size": "1",
            "--offload-dir": str(tmp_path / "off")}
    base.update(dict(zip(argv[::2], argv[1::2], strict=True)))
    assert plan_main([a for kv in base.items() for a in kv]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "off").exists()


@pytest.mark.parametrize("config_json,says", [
    ({"num_attention_heads": 5}, "transformers cannot read its config"),
    ({"vocab_size": 0}, "its config.json has vocab_size=0; it must be >= 1"),
])
def test_plan_of_an_hf_config_transformers_refuses_is_one_line(tmp_path, capsys, config_json, says):
    """They printed a traceback (rc 1), the second after making the offload directory."""
    from planner.cli import plan_main

    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                               "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128,
                                               **config_json}))
    assert plan_main(["--model", f"hf:{d}", "--seq-len", "16", "--micro-batch-size", "1",
                      "--offload-dir", str(tmp_path / "off")]) == 2
    # the last line (transformers may log a warning of the config before it, on its own)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(("snake plan: model 'hf:", "snake plan: error: argument --model: model 'hf:")) and says in last
    assert not (tmp_path / "off").exists()



@pytest.mark.asyncio
@pytest.mark.parametrize("edit,says", [
    ({"placement": [1, 1, 1]}, "records placement=[1, 1, 1], not a mapping of shares"),
    ({"placement": {"param": 2.0}}, "records a placement the config refuses"),
    ({"micro_batches": "2"}, "records a value the config refuses"),
])
async def test_a_damaged_manifest_the_planner_would_fill_the_config_from_is_named(tmp_path, edit, says):
    """A trainer leaving micro_batches, alpha and placement to the checkpoint (None) took a
    damaged manifest's values raw: a bare TypeError, or an error worded as the trainer's own."""
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(4, 4), config=config(tmp_path / "a")) as t:
        await t.run(1)
        await t.save(tmp_path / "ck")
    path = tmp_path / "ck" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["config"].update(edit)
    path.write_text(json.dumps(manifest))
    import dataclasses

    cfg = dataclasses.replace(config(tmp_path / "b"), micro_batches=None, alpha=None, placement=None)
    t = SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(4, 4), config=cfg)
    with pytest.raises(SnakeError, match="load: the checkpoint's manifest") as caught:
        await t.load(tmp_path / "ck")
    assert says in str(caught.value) and "damaged" in str(caught.value)
    assert t.engine is None and t._broken is None
    await t.close()
