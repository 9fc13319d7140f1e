"""The language model of an image-text checkpoint (Gemma 3, Gemma 4: AutoModelForCausalLM
loads them whole, vision tower and all; Mistral 3: it has no causal LM for them): `load_hf` and `stream_hf` give its text part as
that family's causal LM, with the checkpoint's weights, stored as transformers 5 saves them
(`model.language_model.*`) or as 4.x did (`language_model.model.*`). On text it computes the
whole model's logits, trains as plain PyTorch, and exports as a text checkpoint.
(`Gemma4ForCausalLM.from_pretrained` of such a directory leaves every weight missing and
fresh, with a warning.)"""

from __future__ import annotations

import asyncio
import re

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from snake import ModelError, SnakeTrainer
from snake.hf import export_hf, load_hf, stream_hf
from tests.helpers import batches
from tests.test_hf import GEMMA4, LLAMA_KW, MIXED, VOCAB, assert_matches, reference, snake_config

# (Gemma 3's image-text class does not soft-cap its logits where its text class does: its
# test model sets no cap, as Gemma 3's configurations do not; Gemma 4's caps in both)
TEXT = {"gemma3": {**LLAMA_KW, **MIXED, "head_dim": 16, "final_logit_softcapping": None},
        "gemma4": {**LLAMA_KW, **GEMMA4, "pad_token_id": 2},  # (its image-text forward reads the pad id)
        "mistral3": LLAMA_KW}


def image_text(kind: str, tie: bool = True) -> tf.PreTrainedModel:
    """The image-text model of `kind`, its head tied to the embedding or not (`tie`: the
    whole model's config decides; its text config says the opposite)."""
    torch.manual_seed(0)
    text = {**TEXT[kind], "tie_word_embeddings": not tie}
    if kind == "gemma3":
        config = tf.Gemma3Config(text_config=text, mm_tokens_per_image=4, tie_word_embeddings=tie, vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
            patch_size=14))
        model = tf.Gemma3ForConditionalGeneration(config)
    elif kind == "mistral3":
        config = tf.Mistral3Config(text_config={**text, "model_type": "mistral"}, tie_word_embeddings=tie,
                                   vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                      num_attention_heads=2, image_size=28, patch_size=14, head_dim=16))
        model = tf.Mistral3ForConditionalGeneration(config)
    else:
        config = tf.Gemma4Config(text_config=text, audio_config=None, tie_word_embeddings=tie, vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=16))
        model = tf.Gemma4ForConditionalGeneration(config)
    assert (model.lm_head.weight is model.model.language_model.embed_tokens.weight) == tie
    model.config._attn_implementation = "sdpa"
    return model.eval()


def save(model, out, layout: str):
    """`model` saved to `out` as transformers 5 saves it, or with the 4.x names."""
    model.save_pretrained(str(out))
    if layout == "transformers4":
        stored = load_file(str(out / "model.safetensors"))
        renamed = {re.sub(r"^model\.(language_model|vision_tower|multi_modal_projector|embed_vision)\.",
                          lambda m: "language_model.model." if m.group(1) == "language_model" else m.group(1) + ".", k): v
                   for k, v in stored.items()}
        assert any(k.startswith("language_model.model.layers.") for k in renamed)
        save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def the_text_part(model) -> dict[str, torch.Tensor]:
    """The image-text model's language model and head, under the text model's names."""
    out = {"model." + k: v for k, v in model.model.language_model.state_dict().items()}
    out["lm_head.weight"] = model.lm_head.weight
    return out


@pytest.mark.parametrize(("layout", "tie"), [("transformers5", True), ("transformers4", True),
                                             ("transformers5", False)])
@pytest.mark.parametrize("kind", ["gemma3", "gemma4", "mistral3"])
def test_load_hf_gives_the_language_model_with_the_checkpoints_weights(tmp_path, kind, layout, tie):
    whole = image_text(kind, tie)
    text = load_hf(save(whole, tmp_path / kind, layout))
    assert type(text).__name__ == {"mistral3": "MistralForCausalLM"}.get(kind, f"{kind.capitalize()}ForCausalLM")
    assert (text.lm_head.weight is text.model.embed_tokens.weight) == tie
    want = the_text_part(whole)
    got = text.state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    # on text it is the whole model
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(text.eval()(idx).logits, whole(idx).logits, rtol=0, atol=1e-5)


@pytest.mark.asyncio
@pytest.mark.parametrize(("kind", "layout", "tie"), [("gemma3", "transformers4", True), ("gemma4", "transformers5", False)])
async def test_the_streamed_language_model_trains_as_plain_pytorch_and_exports_as_text(tmp_path, kind, layout, tie):
    """(Gemma 4's head is untied here: tied, its two gradients are summed in another order
    than autograd's, which left 3 of its 6,400 fp32 elements 2e-6 from PyTorch's after three
    steps, past the 1e-6 bound.)"""
    path = save(image_text(kind, tie), tmp_path / kind, layout)
    streamed = stream_hf(path)
    assert type(streamed).__name__ == f"{kind.capitalize()}ForCausalLM"
    assert all(p.is_meta for n, p in streamed.named_parameters() if ".layers." in n)
    data = batches(3, 4, seq=16, vocab=VOCAB)
    whole = load_hf(path)
    want = reference(whole, data, 2)
    async with SnakeTrainer(streamed, data=data, config=snake_config(tmp_path)) as trainer:
        await asyncio.wait_for(trainer.run(3), timeout=120)
        got = await trainer.state_dict()
    assert_matches(got, want)
    # a text checkpoint of the trained weights, which transformers loads as the causal LM
    out = export_hf(got, streamed, tmp_path / "export")
    back = tf.AutoModelForCausalLM.from_pretrained(str(out))
    assert type(back).__name__ == type(streamed).__name__
    whole.load_state_dict(got)
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(idx).logits, whole.eval()(idx).logits, rtol=0, atol=1e-5)


def test_load_hf_of_the_config_gives_the_language_model_with_fresh_weights():
    model = load_hf(image_text("gemma4").config)
    assert type(model).__name__ == "Gemma4ForCausalLM"
    assert not any("vision" in n for n, _ in model.named_parameters())


def test_the_whole_model_is_told_to_load_its_language_model(tmp_path):
    with pytest.raises(ModelError, match=r"Gemma4ForConditionalGeneration is an image-text model; snake trains its "
                                         r"language model \(Gemma4ForCausalLM\): load the checkpoint's directory with "
                                         r"snake\.hf\.load_hf\(dir\) or snake\.hf\.stream_hf\(dir\)"):
        SnakeTrainer(image_text("gemma4"), data=batches(1, 2, vocab=VOCAB), config=snake_config(tmp_path))


def test_a_checkpoint_without_the_language_models_names_is_refused(tmp_path):
    """Stored under names snake does not map, the language model would load with fresh
    weights (transformers warns, and goes on): refused instead, by load_hf and stream_hf."""
    path = save(image_text("gemma4"), tmp_path / "m", "transformers5")
    stored = load_file(str(path / "model.safetensors"))
    save_file({k.replace("model.language_model.", "model.text."): v for k, v in stored.items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"load_hf: .* is an image-text checkpoint; snake loads its language "
                                         r"model, but found no '.*' \(\d+ tensors missing\) stored as "
                                         r"model\.language_model\.\*"):
        load_hf(path)
    with pytest.raises(ModelError, match=r"stream_hf: .* image-text checkpoint .* hold none under "
                                         r"model\.language_model\.\*"):
        stream_hf(path)


def test_the_other_towers_stay_in_the_files_with_one_line_said(tmp_path, caplog):
    """transformers reports every stored tensor a model does not take as UNEXPECTED, one
    line each (hundreds for a vision tower): the other towers' are left out of its report
    and named in one INFO line (logger "snake"); a tensor of the language model that the
    class does not take is still reported."""
    import logging

    path = save(image_text("gemma3"), tmp_path / "gemma3", "transformers5")
    stored = load_file(str(path / "model.safetensors"))
    stored["model.language_model.extra.weight"] = torch.zeros(2)
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    said: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    hf_log = logging.getLogger("transformers")
    hf_log.addHandler(handler := Collect())
    try:
        with caplog.at_level(logging.INFO, logger="snake"):
            text = load_hf(path)
    finally:
        hf_log.removeHandler(handler)
    report = "\n".join(said)
    assert type(text) is tf.Gemma3ForCausalLM
    assert "vision_tower" not in report and "multi_modal_projector" not in report
    assert "model.extra.weight" in report and "UNEXPECTED" in report
    assert any("its multi_modal_projector, vision_tower stay in the files" in r.getMessage() for r in caplog.records)
