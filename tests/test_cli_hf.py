"""`snake train --model hf:DIR`: a Hugging Face model directory (its config, weights and
tokenizer) trained on its tokenizer's ids of the text (the Python documentation, or
--text FILE); with --stream its layers' weights stay in their files, with --lora RANK
PEFT's adapters train on the frozen base. Its checkpoint exports with `snake export`
(--hf, or --peft of a LoRA). The built-in GPT's options, and LoRA's without a model,
are refused by name."""

from __future__ import annotations

import json
import math

import pytest
import torch

from snake.cli import HOLDOUT, main

# (PEFT reads transformers' deprecated gradient-checkpointing flag when it loads adapters)
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
SMALL = ["--steps", "3", "--seq", "32", "--batch", "4", "--micro-batches", "2", "--eval-batches", "1"]
VOCAB = 300


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")


def tiny_llama(d):
    """A tiny Llama (random weights) with a byte-level BPE tokenizer of 300 ids trained here
    on the start of the documentation text (no download), saved as a model directory `d`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from snake.corpus import pydoc_text

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([pydoc_text()[:100_000]], trainer=trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]))
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(str(d))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)).save_pretrained(str(d))
    return d


def _train(tmp_path, model_dir, *more: str) -> dict:
    out = tmp_path / "out"
    argv = ["train", "--model", f"hf:{model_dir}", *SMALL, "--out", str(out), "--offload-dir", str(tmp_path / "off"),
            "--checkpoint", str(tmp_path / "ckpt"), *more]
    assert main(argv) == 0
    return json.loads((out / "report.json").read_text())


def test_a_hf_model_trains_on_its_tokenizers_ids_and_exports(tmp_path, model_dir, capsys):
    """The first step's loss is the model's own on the first batch of windows of the
    tokenized text (before any update): the text, the tokenizer and the windows are the
    ones snake trains on. The checkpoint exports as a model transformers loads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from snake.corpus import pydoc_text, random_windows

    report = _train(tmp_path, model_dir)
    assert report["model"]["hf"] == str(model_dir) and report["model"]["lora"] is None
    losses = [s["loss"] for s in report["steps"]]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    ids = torch.tensor(AutoTokenizer.from_pretrained(str(model_dir))(pydoc_text(), add_special_tokens=False)["input_ids"])
    assert report["model"]["text_tokens"] == ids.numel()
    x, y = next(random_windows(ids, batch=4, seq=32, seed=0, holdout=HOLDOUT))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item()
    assert losses[0] == pytest.approx(want, abs=1e-5)
    assert "--hf DIR" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "exported")]) == 0
    trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"))
    assert not torch.equal(trained.lm_head.weight, model.lm_head.weight)
    # the source's tokenizer beside the weights: the export is a model directory to train again
    text = "def snake(): return 42"
    assert (AutoTokenizer.from_pretrained(str(tmp_path / "exported"))(text)["input_ids"]
            == AutoTokenizer.from_pretrained(str(model_dir))(text)["input_ids"])
    assert main(["train", "--model", f"hf:{tmp_path / 'exported'}", *SMALL, "--steps", "1", "--eval-batches", "0",
                 "--out", str(tmp_path / "again"), "--offload-dir", str(tmp_path / "off-again")]) == 0


def test_a_lora_of_a_streamed_hf_model_trains_and_exports_its_adapters(tmp_path, model_dir, capsys):
    """--stream --lora: the base stays in its files, PEFT's adapters train; the checkpoint
    exports them with --peft, which PEFT loads onto the base."""
    from peft import PeftModel

    from snake.hf import load_hf

    report = _train(tmp_path, model_dir, "--stream", "--lora", "4", "--lora-targets", "q_proj,v_proj")
    assert report["model"]["stream"] and report["model"]["lora"] == {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    out = capsys.readouterr().out
    assert "M trained" in out and "0.00 M trained" not in out and "--peft DIR" in out
    assert main(["export", str(tmp_path / "ckpt"), "--peft", str(tmp_path / "adapter")]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    PeftModel.from_pretrained(load_hf(model_dir), str(tmp_path / "adapter"))


def test_text_from_a_file_trains_the_gpt_on_its_bytes(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("snake streams layers through the device; " * 400)
    out = tmp_path / "out"
    assert main(["train", "--text", str(text), "--layers", "2", "--embd", "64", "--heads", "2", *SMALL,
                 "--out", str(out), "--offload-dir", str(tmp_path / "off")]) == 0
    assert json.loads((out / "report.json").read_text())["model"]["n_layer"] == 2


@pytest.mark.parametrize("more,says", [
    (["--layers", "4"], "--layers"),
    (["--seq", "100"], "max_position_embeddings"),
    (["--lora-targets", "q_proj"], "give --lora RANK"),
    (["--lora", "4", "--lora-targets", "nothing_here"], "--lora-targets"),
    (["--text", "missing.txt"], "--text"),
], ids=["gpt-option", "seq-beyond-positions", "targets-without-lora", "targets-matching-nothing", "no-text"])
def test_what_a_hf_model_cannot_train_with_is_refused_by_name(tmp_path, model_dir, capsys, more, says):
    argv = ["train", "--model", f"hf:{model_dir}", *SMALL, "--out", str(tmp_path / "out"),
            "--offload-dir", str(tmp_path / "off"), *more]
    if "--seq" in more:
        argv = [a for i, a in enumerate(argv) if not (a == "--seq" or argv[i - 1] == "--seq")] + more
    assert main(argv) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not list((tmp_path / "off").glob("*.bin"))


def test_lora_without_a_model_and_a_directory_without_tokenizer_are_refused(tmp_path, model_dir, capsys):
    import shutil

    assert main(["train", "--lora", "4", "--out", str(tmp_path / "o")]) == 2
    assert "add --model hf:DIR" in capsys.readouterr().err
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    assert main(["train", "--model", f"hf:{bare}", "--out", str(tmp_path / "o")]) == 2
    assert "tokenizer.save_pretrained" in capsys.readouterr().err
    assert main(["train", "--model", f"hf:{tmp_path / 'nowhere'}", "--out", str(tmp_path / "o")]) == 2
    assert "config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--model", "gpt:n_layer=2"])


def test_a_lora_run_resumed_goes_on_as_one_longer_run(tmp_path, model_dir):
    """--resume of a LoRA of a Hugging Face model: the same model options, the steps of one
    longer run (its adapters drawn from --seed again, then loaded from the checkpoint)."""
    argv = ["train", "--model", f"hf:{model_dir}", "--seq", "32", "--batch", "4", "--micro-batches", "2",
            "--eval-batches", "0", "--lora", "4"]

    def losses(name: str, *more: str) -> list[float]:
        assert main([*argv, "--out", str(tmp_path / name), "--offload-dir", str(tmp_path / f"off-{name}"), *more]) == 0
        return [s["loss"] for s in json.loads((tmp_path / name / "report.json").read_text())["steps"]]

    straight = losses("straight", "--steps", "4")
    first = losses("first", "--steps", "2", "--checkpoint", str(tmp_path / "ckpt"))
    assert losses("resumed", "--steps", "2", "--resume", str(tmp_path / "ckpt")) == straight[2:]
    assert first == straight[:2]


def test_a_full_fine_tune_in_bfloat16_starts_its_fp32_masters_from_the_stored_weights(tmp_path, model_dir):
    """--dtype bfloat16 computes in bf16 but keeps fp32 masters: of a float32 model directory
    they are its weights, not their bf16 rounding (a step at lr 0 exports them unchanged)."""
    from safetensors.torch import load_file

    _train(tmp_path, model_dir, "--dtype", "bfloat16", "--steps", "1", "--lr", "0", "--eval-batches", "0")
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "exported")]) == 0
    stored, exported = load_file(str(model_dir / "model.safetensors")), load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert stored.keys() == exported.keys()
    assert all(torch.equal(stored[k], exported[k]) for k in stored)


class _CharTokenizer:
    """A tokenizer of one id per character that records the texts it is given."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __call__(self, texts: list[str], **kwargs) -> dict:
        assert kwargs["add_special_tokens"] is False
        self.seen.extend(texts)
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def test_a_long_text_is_tokenized_in_pieces_cut_at_line_ends(model_dir):
    """The tokenizer's output of a whole text takes ~200 bytes per byte of it (a 50 MB
    --text peaked at 10 GB) and a Ctrl-C waits for it: it gets pieces cut after a line end
    (else a space), a few at a time, and their ids are the text's, in order."""
    from transformers import AutoTokenizer

    from snake.corpus import pydoc_text, text_ids

    text = "".join(f"line {i} " + "x" * (i % 7) + "\n" for i in range(300)) + "one last line without its end " * 5
    fake = _CharTokenizer()
    ids = text_ids(fake, text, piece_chars=100, batch=3)
    assert ids.dtype == torch.long and ids.tolist() == [ord(c) for c in text]
    assert len(fake.seen) > 10 and all(len(p) <= 130 for p in fake.seen)
    assert all(p.endswith("\n") for p in fake.seen[:-3]) and fake.seen[-2].endswith(" ")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))  # a text of one piece: as tokenized whole
    whole = tokenizer(pydoc_text()[:5000], add_special_tokens=False)["input_ids"]
    assert text_ids(tokenizer, pydoc_text()[:5000]).tolist() == whole


def test_a_lora_checkpoint_resumed_without_its_rank_is_refused_naming_lora(tmp_path, model_dir, capsys):
    """load() would refuse it once the model is built, naming a tensor ('lm_head.weight=None
    is trained but frozen in the checkpoint'); the checkpoint's rank is read first."""
    _train(tmp_path, model_dir, "--lora", "4", "--steps", "1", "--eval-batches", "0")
    capsys.readouterr()
    for more, fix in (([], "give --lora 4"), (["--lora", "8"], "give --lora 4")):
        argv = ["train", "--model", f"hf:{model_dir}", *SMALL, "--resume", str(tmp_path / "ckpt"),
                "--out", str(tmp_path / "again"), "--offload-dir", str(tmp_path / "off2"), *more]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "--lora" in err and fix in err and "trained but frozen" not in err
        assert not (tmp_path / "again").exists()


def test_a_lora_of_gpt2s_conv1d_layers_says_nothing_of_peft_setting_its_own_flag():
    """GPT-2's Conv1D: PEFT sets fan_in_fan_out itself and warns that it did, which `snake
    train --model` printed twice (the meta-device check, then the build)."""
    import warnings

    from transformers import GPT2Config, GPT2LMHeadModel

    from snake.train_source import with_lora

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        base = with_lora(model, 2, ("c_attn",))
    assert not [w for w in seen if "fan_in_fan_out" in str(w.message)]
    assert any("lora_A" in n for n, _ in base.named_parameters())


def test_a_resume_with_another_dtype_is_refused_naming_it_before_anything_is_built(tmp_path, model_dir, capsys):
    """--resume keeps the options a checkpoint resumes with (dtype, schedule, alpha,
    micro-batches, seed): load() refuses another, but once the model is built, and a LoRA's
    frozen base loaded in another --dtype failed its digests first, naming lm_head.weight."""
    argv = ["train", "--model", f"hf:{model_dir}", "--seq", "32", "--batch", "4", "--micro-batches", "2",
            "--eval-batches", "0", "--lora", "4", "--steps", "1"]
    assert main([*argv, "--out", str(tmp_path / "a"), "--offload-dir", str(tmp_path / "off"),
                 "--checkpoint", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    for more, says in ((["--dtype", "bfloat16"], "--dtype='bfloat16' does not match the --resume checkpoint's "
                                                 "'float32' (give --dtype float32"),
                       (["--seed", "7"], "--seed=7 does not match the --resume checkpoint's 0 (give --seed 0")):
        assert main([*argv, *more, "--out", str(tmp_path / "b"), "--resume", str(tmp_path / "ckpt")]) == 2
        assert says in capsys.readouterr().err
        assert not (tmp_path / "b").exists()
