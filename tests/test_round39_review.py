"""Round 39's review: what it found in the day's features, each guarded here."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from snake import SnakeTrainer
from snake.cli import main
from tests.helpers import batches
from tests.test_hf import VOCAB, make, snake_config

# (PEFT reads transformers' deprecated gradient-checkpointing flag, and warns of an adapter
# on a tied embedding, as the test means to have)
pytestmark = [pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
              pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning"),
              pytest.mark.filterwarnings("ignore:Model with `tie_word_embeddings=True`:UserWarning")]
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM")


async def trained(model, data, tmp_path, **save):
    async with SnakeTrainer(model, data=data, config=snake_config(tmp_path / "run")) as trainer:
        await asyncio.wait_for(trainer.run(1), timeout=120)
        await trainer.save(tmp_path / "ckpt", **save)
        model.get_base_model().load_state_dict(await trainer.state_dict())


@pytest.mark.asyncio
@pytest.mark.parametrize("target", ["embed_tokens", "lm_head"])
async def test_a_merged_export_of_an_adapted_tied_embedding_gives_the_trained_logits(tmp_path, target):
    """LoRA on the embedding (or the head) of a model that ties them: the trained model's
    other side computed with the base weight, which the merge changed too when they stayed
    tied (the logits 0.3 off); the export unties them."""
    from transformers import AutoModelForCausalLM

    model = get_peft_model(make("llama", tie_word_embeddings=True),
                           LoraConfig(**LORA, target_modules=[target, "q_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_(0, 0.05)
    data = batches(1, 4, seq=16, vocab=VOCAB)
    await trained(model, data, tmp_path, frozen=True)
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    x = data[0][0]
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(x).logits, model.eval()(x).logits, rtol=0, atol=1e-5)


@pytest.mark.asyncio
async def test_the_one_trained_adapter_not_named_default_exports_to_its_own_directory(tmp_path, capsys):
    """Two adapters, the second active (set_adapter), saved without the frozen parameters:
    the checkpoint holds the second alone, which PEFT writes in DIR/second; the export
    refused it ("wrote no adapter_config.json") after writing it. It names that directory."""
    base = make("llama")
    model = get_peft_model(copy.deepcopy(base), LoraConfig(**LORA, target_modules=["q_proj"]))
    model.add_adapter("second", LoraConfig(**LORA, target_modules=["v_proj"]))
    model.set_adapter("second")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B.second" in name:
                p.normal_(0, 0.05)
    data = batches(1, 4, seq=16, vocab=VOCAB)
    await trained(model, data, tmp_path)
    capsys.readouterr()
    out = tmp_path / "adapters"
    assert main(["export", str(tmp_path / "ckpt"), "--peft", str(out)]) == 0
    assert f"wrote {out / 'second'} " in capsys.readouterr().out
    # and again into the same directory: PEFT's layout of it, not another's files
    assert main(["export", str(tmp_path / "ckpt"), "--peft", str(out)]) == 0
    again = PeftModel.from_pretrained(base, str(out / "second"), adapter_name="second")
    x = data[0][0]
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(x).logits, model.eval()(x).logits, rtol=0, atol=1e-6)


@pytest.mark.asyncio
async def test_adalora_adapters_export_from_a_checkpoint_without_the_frozen_parameters(tmp_path):
    """AdaLoRA's frozen rank count (ranknum) is not saved by PEFT (it rebuilds it from the
    config) nor by a checkpoint saved without the frozen parameters (save's default for a
    PEFT model): the export refused it, "the checkpoint is not of this model"."""
    from peft import AdaLoraConfig

    base = make("llama")
    config = AdaLoraConfig(init_r=4, target_r=2, lora_alpha=8, target_modules=["q_proj"], total_step=10,
                           task_type="CAUSAL_LM")
    model = get_peft_model(copy.deepcopy(base), config)
    data = batches(1, 4, seq=16, vocab=VOCAB)
    await trained(model, data, tmp_path)
    out = tmp_path / "adapter"
    assert main(["export", str(tmp_path / "ckpt"), "--peft", str(out)]) == 0
    again = PeftModel.from_pretrained(base, str(out))
    x = data[0][0]
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(x).logits, model.eval()(x).logits, rtol=0, atol=1e-6)
