"""Audit of `snake export CHECKPOINT --hf DIR` and `snake.hf.export_hf`: what they write, and
whether transformers' `from_pretrained` of it gives the logits of the trained weights
(`await trainer.state_dict()` loaded into the model that trained). Families and layouts,
dtypes, frozen parts, tied and untied heads, PEFT merges, checkpoints after a resume or a
stop(), streamed models, the files beside the weights, and refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

from snake import Placement, SnakeConfig, SnakeTrainer
from snake.cli import main
from snake.hf import export_hf, load_hf, stream_hf
from tests.helpers import KindsLM, batches, kinds_parts
from tests.test_hf import VOCAB, bf16_copy, make

# (PEFT reads transformers' deprecated gradient-checkpointing flag)
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

SMALL_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=32, bos_token_id=0, eos_token_id=1)


def _cfg(tmp_path, dtype="float32", alpha=0.3):
    return SnakeConfig(micro_batches=2, offload_dir=tmp_path / "off", device="cpu", dtype=dtype, alpha=alpha,
                       placement=Placement(param=0.5, ckpt=0.5, opt=0.5))


async def _train_save(model, tmp_path, data, *, dtype="float32", steps=1, frozen=None):
    async with SnakeTrainer(model, data=data, config=_cfg(tmp_path, dtype)) as trainer:
        await trainer.run(steps)
        await trainer.save(tmp_path / "ckpt", frozen=frozen)
        return await trainer.state_dict()


def _dtypes(directory) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return {f.get_slice(k).get_dtype() for k in f.keys()}


def _tokenizer(directory, prefix: str = "w") -> None:
    """A word-level tokenizer of 96 ids (no training, nothing downloaded) saved in `directory`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"{prefix}{i}": i for i in range(95)} | {"<unk>": 95}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(str(directory))


def _source_dir(directory, *, generation: bool = False, tokenizer: bool = True):
    """A tiny Llama saved as a model directory (with a tokenizer, and a generation config of
    its own where `generation`)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL_LLAMA))
    if generation:
        model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1, do_sample=True, top_k=7,
                                                   temperature=0.5, max_new_tokens=5)
    model.save_pretrained(str(directory))
    if tokenizer:
        _tokenizer(directory)
    return directory


def _freeze(model, what: str | None) -> None:
    if what == "embedding":  # values a fresh model of the config would not have
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(2.0)
        model.get_input_embeddings().weight.requires_grad_(False)
    elif what == "router":
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and "proj" not in name:
                p.requires_grad_(False)
    elif what == "layer0":
        for name, p in model.named_parameters():
            if ".layers.0." in name or ".h.0." in name:
                p.requires_grad_(False)


# -- families, dtypes, frozen parts, tied heads ----------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(("kind", "dtype", "frozen", "kw"), [
    ("qwen2", "float32", "embedding", {"tie_word_embeddings": True}),
    ("gemma", "float32", "embedding", {}),
    ("phi3", "bfloat16", "layer0", {}),
    ("mixtral", "float32", "router", {}),
    ("qwen2moe", "bfloat16", "router", {}),
    ("neox", "bfloat16", None, {}),
    ("opt", "float32", "embedding", {}),
    ("falcon_old", "float32", "layer0", {}),
    ("bloom", "bfloat16", "embedding", {}),
    ("bigcode", "bfloat16", "layer0", {}),
], ids=["qwen2-tied-frozen-emb", "gemma-frozen-scaled-emb", "phi3-bf16-frozen-layer", "mixtral-frozen-router",
        "qwen2moe-bf16-frozen-router", "neox-bf16", "opt-frozen-emb", "falcon-old-frozen-layer", "bloom-bf16-frozen-emb", "bigcode-bf16-frozen-layer"])
async def test_a_family_exports_the_trained_logits_in_its_dtype(tmp_path, kind, dtype, frozen, kw):
    """`snake export --hf` of each family: from_pretrained gives the trained weights' logits
    exactly, in the model's dtype (the safetensors and config.json agree), tied as the
    trained model was."""
    model = bf16_copy(kind, **kw) if dtype == "bfloat16" else make(kind, **kw)
    _freeze(model, frozen)
    data = batches(2, 4, seq=8, vocab=VOCAB)
    state = await _train_save(model, tmp_path, data, dtype=dtype)
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    trained = copy.deepcopy(model)
    trained.load_state_dict(state)
    trained.eval()
    x = data[0][0]
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, trained(x).logits, rtol=0, atol=0)
    want = "BF16" if dtype == "bfloat16" else "F32"
    assert _dtypes(tmp_path / "hf") == {want}
    assert json.loads((tmp_path / "hf" / "config.json").read_text()).get("dtype") == dtype
    tied = trained.get_output_embeddings().weight is trained.get_input_embeddings().weight
    assert (hf.get_output_embeddings().weight is hf.get_input_embeddings().weight) == tied


@pytest.mark.asyncio
async def test_a_bf16_model_made_with_to_exports_as_export_hf_does(tmp_path):
    """A model cast with `.to(torch.bfloat16)` (its config's dtype stays unset) and trained in
    bf16: `export_hf(state, model, dir)` writes bf16 with the trained logits; `snake export`
    of the checkpoint should write the same model."""
    torch.manual_seed(0)
    model = load_hf(LlamaConfig(**SMALL_LLAMA)).to(torch.bfloat16)
    data = batches(2, 4, seq=8)
    state = await _train_save(model, tmp_path, data, dtype="bfloat16")
    export_hf(state, copy.deepcopy(model), tmp_path / "inproc")
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "cli")]) == 0
    assert _dtypes(tmp_path / "inproc") == {"BF16"}
    assert _dtypes(tmp_path / "cli") == {"BF16"}, (
        f"snake export wrote {_dtypes(tmp_path / 'cli')} (config.json dtype "
        f"{json.loads((tmp_path / 'cli' / 'config.json').read_text()).get('dtype')!r}) for a model trained in "
        "bfloat16 (cast with .to()), where export_hf of the same state writes BF16: the checkpoint's model_config "
        "records the config's dtype (unset), not the model's")
    # the same model as export_hf's (not the trained model's logits to the bit: a model cast
    # with .to() computes its rotary frequencies, a non-persistent buffer, in bfloat16, where
    # one loaded in bfloat16 keeps them in float32, whichever export wrote it)
    x = data[0][0]
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(str(tmp_path / "cli"))(x).logits,
                                   AutoModelForCausalLM.from_pretrained(str(tmp_path / "inproc"))(x).logits,
                                   rtol=0, atol=0)


@pytest.mark.asyncio
@pytest.mark.parametrize("change", ["untied-head", "head-bias"])
async def test_a_checkpoint_tensor_the_rebuilt_model_has_no_place_for_is_not_dropped(tmp_path, change):
    """A Hugging Face model whose head was changed after it was built (given a weight of its
    own in a config that ties it; given a bias): the checkpoint holds the trained tensor,
    and `snake export` must either write it (untied, as it does for the built-in GPT and for
    a PEFT merge) or refuse by name, not export a model with other logits."""
    if change == "untied-head":
        model = make("llama", tie_word_embeddings=True)
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 1.5)
    else:
        model = make("llama")
        model.lm_head.bias = torch.nn.Parameter(torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)))
    data = batches(2, 4, seq=8, vocab=VOCAB)
    state = await _train_save(model, tmp_path, data)
    rc = main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")])
    if rc != 0:  # a refusal is fine: nothing written
        assert not (tmp_path / "hf").exists()
        return
    trained = copy.deepcopy(model)
    trained.load_state_dict(state)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    x = data[0][0]
    with torch.no_grad():
        diff = (hf.eval()(x).logits - trained.eval()(x).logits).abs().max().item()
    assert diff < 1e-5, (
        f"snake export ({change}) exited 0 but the exported model's logits are {diff:.3f} off the trained "
        "model's: the checkpoint's "
        f"{'lm_head.weight (untied from the embedding)' if change == 'untied-head' else 'lm_head.bias'} was "
        "silently dropped (the model rebuilt from its config has no place for it, and leftover masters are not "
        "checked for Hugging Face models as they are for the built-in GPT)")


# -- checkpoints after a resume and a stop(), streamed models --------------------------------------


@pytest.mark.asyncio
async def test_a_checkpoint_after_a_resume_and_a_stop_exports_the_trained_weights(tmp_path):
    """Frozen embedding and first layer; trained, saved, resumed in a new trainer, stopped
    by stop() after a step, saved again: the export has that trainer's weights."""
    def build():
        torch.manual_seed(0)
        m = load_hf(LlamaConfig(**SMALL_LLAMA))
        _freeze(m, "embedding")
        _freeze(m, "layer0")
        return m

    data = batches(6, 4, seq=8)
    await _train_save(build(), tmp_path / "a", data, steps=2)
    model = build()
    async with SnakeTrainer(model, data=data, config=_cfg(tmp_path / "b")) as trainer:
        await trainer.load(tmp_path / "a" / "ckpt")
        report = await trainer.run(3, on_step=lambda s: trainer.stop())
        assert report.stopped and len(report.steps) < 3
        await trainer.save(tmp_path / "ckpt")
        state = await trainer.state_dict()
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
    model.load_state_dict(state)
    x = data[0][0]
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path / "hf")(x).logits, model(x).logits, rtol=0, atol=0)


@pytest.mark.asyncio
async def test_a_streamed_model_with_a_frozen_layer_exports_with_its_tokenizer(tmp_path):
    """stream_hf of a model directory (with a tokenizer), its first layer frozen (its weights
    from the files): the export's logits are the trained weights' in the model loaded whole,
    and the directory's tokenizer is saved beside them."""
    from transformers import AutoTokenizer

    src = _source_dir(tmp_path / "src")
    model = stream_hf(src)
    _freeze(model, "layer0")
    data = batches(2, 4, seq=8)
    state = await _train_save(model, tmp_path, data)
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
    whole = load_hf(src)
    whole.load_state_dict(state)
    x = data[0][0]
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))(x).logits,
                                   whole(x).logits, rtol=0, atol=0)
    text = "w3 w17 w94 nope"
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf"))(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(str(src))(text)["input_ids"]


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["cli-of-load_hf", "export_hf-of-stream_hf"])
async def test_the_source_directorys_generation_config_survives_the_export(tmp_path, how):
    """A model directory with a generation_config.json of its own (sampling, top_k,
    temperature, max_new_tokens): the export, a model directory to use as it is (its
    tokenizer is copied), should generate as the source does."""
    src = _source_dir(tmp_path / "src", generation=True)
    want = GenerationConfig.from_pretrained(str(src))
    model = load_hf(src) if how == "cli-of-load_hf" else stream_hf(src)
    data = batches(2, 4, seq=8)
    state = await _train_save(model, tmp_path, data)
    out = tmp_path / "hf"
    if how == "cli-of-load_hf":
        assert main(["export", str(tmp_path / "ckpt"), "--hf", str(out)]) == 0
    else:
        export_hf(state, model, out)
    got = GenerationConfig.from_pretrained(str(out))
    fields = ("do_sample", "top_k", "temperature", "max_new_tokens")
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}, (
        f"{how}: the exported generation_config.json is {({f: getattr(got, f) for f in fields})}, the source's "
        f"{({f: getattr(want, f) for f in fields})}: "
        + ("snake export rebuilds the model from its config and derives a generation config from it, and copies "
           "only the tokenizer of the source directory" if how == "cli-of-load_hf" else
           "stream_hf does not read the directory's generation_config.json (load_hf does), so export_hf of a "
           "streamed model writes one derived from the config"))


@pytest.mark.asyncio
async def test_the_tokenizer_copied_is_the_one_the_model_was_loaded_with(tmp_path, monkeypatch):
    """A model loaded from a relative path (`load_hf("src")`, as `snake train --model
    hf:src` does), exported from another working directory that has a `src` of its own: the
    tokenizer written beside the weights must be the one of the directory the model came
    from, not whatever `src` means where the export runs."""
    from transformers import AutoTokenizer

    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere" / "src").mkdir(parents=True)
    _source_dir(tmp_path / "run" / "src")
    _tokenizer(tmp_path / "elsewhere" / "src", prefix="other")
    monkeypatch.chdir(tmp_path / "run")
    model = load_hf("src")
    await _train_save(model, tmp_path, batches(2, 4, seq=8))
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").is_file(), "no tokenizer was copied"
    text = "w3 w17 w94"
    got = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))(text)["input_ids"]
    want = AutoTokenizer.from_pretrained(str(tmp_path / "run" / "src"))(text)["input_ids"]
    assert got == want, (
        f"the exported tokenizer encodes {text!r} as {got}, the model's own as {want}: snake export resolved the "
        "checkpoint's relative _name_or_path ('src') against the export's working directory and copied another "
        "directory's tokenizer")


# -- PEFT merges ------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")
@pytest.mark.filterwarnings("ignore:Input and output embeddings are no longer tied after merging:UserWarning")
@pytest.mark.parametrize("case", ["modules-to-save-tied-head", "given-the-base-model", "ia3"])
async def test_a_peft_checkpoint_with_its_base_exports_merged_with_the_trained_logits(tmp_path, case):
    """save(frozen=True) of a PEFT model exports with --hf as the whole model, merged:
    a trained copy of a tied head (modules_to_save), the trainer given the base model with
    the adapters in it, IA3's scaling vectors."""
    from peft import IA3Config, LoraConfig, PeftModel, get_peft_model

    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                task_type="CAUSAL_LM")
    base = make("llama", tie_word_embeddings=case == "modules-to-save-tied-head")
    fresh = copy.deepcopy(base)
    if case == "ia3":
        config = IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"],
                           task_type="CAUSAL_LM")
    else:
        config = LoraConfig(**lora, modules_to_save=["lm_head"] if case == "modules-to-save-tied-head" else None)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(7))
    data = batches(2, 4, seq=8, vocab=VOCAB)
    subject = model.get_base_model() if case == "given-the-base-model" else model
    state = await _train_save(subject, tmp_path, data, frozen=True)
    model.get_base_model().load_state_dict(state)
    x = data[0][0]
    with torch.no_grad():
        want = model.eval()(x).logits
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert not any("lora" in k or "ia3" in k or "modules_to_save" in k for k in merged.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, want, rtol=0, atol=1e-5)
    assert main(["export", str(tmp_path / "ckpt"), "--peft", str(tmp_path / "adapter")]) == 0
    again = PeftModel.from_pretrained(fresh, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, want, rtol=0, atol=1e-6)


# -- replacing an export, refusals ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_export_over_a_sharded_model_directory_leaves_a_directory_that_loads(tmp_path):
    """`snake export --hf DIR` over a Hugging Face model directory (allowed: it is replaced)
    that held sharded weights: save_pretrained removed the old shards but not their
    `model.safetensors.index.json`, and snake's own loaders read that index first."""
    from snake import ModelError

    out = tmp_path / "hf"
    load_hf(LlamaConfig(**SMALL_LLAMA)).save_pretrained(str(out), max_shard_size="20KB")
    torch.manual_seed(0)
    model = load_hf(LlamaConfig(**SMALL_LLAMA))
    state = await _train_save(model, tmp_path, batches(2, 4, seq=8))
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(out)]) == 0
    files = sorted(p.name for p in out.iterdir())
    try:
        streamed = stream_hf(out)
    except ModelError as e:
        pytest.fail(f"after an export over a sharded model directory, stream_hf({out.name}) fails ({e}); the "
                    f"directory holds {files}: the old shards' index was left beside the new model.safetensors")
    torch.testing.assert_close(streamed.get_input_embeddings().weight, state["model.embed_tokens.weight"],
                               rtol=0, atol=0)


@pytest.mark.asyncio
async def test_a_model_of_its_own_parts_is_refused_by_name_and_nothing_is_written(tmp_path, capsys):
    """A custom ModelParts model's checkpoint records no config to rebuild it: one line on
    stderr naming that and the in-process way, exit 2, DIR not made."""
    async with SnakeTrainer(kinds_parts(KindsLM()), data=batches(2, 4, seq=8), config=_cfg(tmp_path)) as trainer:
        await trainer.run(1)
        await trainer.save(tmp_path / "ckpt")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "out" / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("snake export: ") and "does not record its model's config" in err
    assert "read_masters" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("what", ["missing", "manifest-not-json", "manifest-not-snakes"])
def test_a_missing_or_broken_checkpoint_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys, what):
    ckpt = tmp_path / "ckpt"
    if what != "missing":
        ckpt.mkdir()
        (ckpt / "manifest.json").write_text("{not json" if what == "manifest-not-json" else "[]")
    assert main(["export", str(ckpt), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("snake export: ") and err.count("\n") == 1 and str(ckpt) in err
    assert {"missing": "no checkpoint directory", "manifest-not-json": "cannot read",
            "manifest-not-snakes": "not a snake checkpoint"}[what] in err
    assert not (tmp_path / "hf").exists()
