"""`snake export CHECKPOINT --hf DIR` writes a model transformers loads with
from_pretrained, giving the same logits as the trained weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from snake import Placement, SnakeConfig, SnakeTrainer
from snake.cli import main
from snake.hf import load_hf
from tests.helpers import batches, tiny_gpt


async def _train_and_save(model, tmp_path, data):
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path / "off", placement=Placement(param=0.5, ckpt=0.5, opt=0.5),
                      alpha=0.3, device="cpu")
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        await trainer.run(2)
        await trainer.save(tmp_path / "ckpt")
        return await trainer.state_dict()


@pytest.mark.asyncio
@pytest.mark.parametrize("bias,frozen", [(True, False), (False, False), (False, True)],
                         ids=["bias", "no-bias", "frozen-positions"])
async def test_builtin_gpt_exports_as_gpt2(tmp_path, bias, frozen):
    """frozen-positions: a frozen position table (not stepped, so not among the masters)
    comes from the checkpoint's frozen tensors."""
    model = tiny_gpt(n_layer=2, bias=bias)
    if frozen:
        with torch.no_grad():
            model.wpe.weight.mul_(3.0)
        model.wpe.weight.requires_grad_(False)
    data = batches(3, 4)
    state = await _train_and_save(model, tmp_path, data)
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    model.load_state_dict(state)
    model.eval()
    hf.eval()
    x = data[0][0]
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=1e-4, atol=1e-5)
    # no special token ids of GPT-2's 50257-token vocabulary (out of this one's range)
    assert hf.config.bos_token_id is None and hf.config.eos_token_id is None
    out = hf.generate(x[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)


@pytest.mark.asyncio
@pytest.mark.parametrize("frozen", [False, True, "layer"],
                         ids=["llama", "llama-frozen-norm-and-embedding", "llama-frozen-first-layer"])
async def test_llama_exports(tmp_path, frozen):
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    torch.manual_seed(0)
    model = load_hf(cfg)
    if frozen == "layer":  # a frozen layer streams its weights and steps none
        model.model.layers[0].requires_grad_(False)
    elif frozen:  # values a fresh model of the config would not have
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(2.0)
            model.model.layers[1].input_layernorm.weight.fill_(0.5)
        model.model.embed_tokens.weight.requires_grad_(False)
        model.model.layers[1].input_layernorm.weight.requires_grad_(False)
    data = batches(3, 4)
    state = await _train_and_save(model, tmp_path, data)
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
    hf = load_hf(tmp_path / "hf")
    model.load_state_dict(state)
    x = data[0][0]
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)


def test_export_of_a_non_checkpoint_fails_clearly(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--hf", str(tmp_path / "hf")]) == 2
    assert "not a snake checkpoint" in capsys.readouterr().err


@pytest.mark.asyncio
async def test_an_export_that_cannot_fit_is_refused_before_a_file_is_written(tmp_path, capsys, monkeypatch):
    """The weights' bytes (a tied weight once) against the free space of the output's disk:
    `snake export` fails in one line naming the sizes, and writes nothing; with room it exports."""
    import shutil
    from collections import namedtuple

    from safetensors import safe_open

    model = tiny_gpt(n_layer=2)
    await _train_and_save(model, tmp_path, batches(2, 4))
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        written = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    real = shutil.disk_usage
    usage = namedtuple("usage", "total used free")
    for free, ok in ((written - 1, False), (written + 4096, True)):
        monkeypatch.setattr(shutil, "disk_usage",
                            lambda p, free=free: usage(1 << 40, 0, free) if str(p).startswith(str(tmp_path)) else real(p))
        out = tmp_path / f"hf-{free}"
        capsys.readouterr()
        assert main(["export", str(tmp_path / "ckpt"), "--hf", str(out)]) == (0 if ok else 2)
        if not ok:
            err = capsys.readouterr().err
            assert "snake export:" in err and "free but the model's weights take at least" in err, err
            assert not out.exists()
        else:
            assert (out / "model.safetensors").is_file()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["gemma4moe", "deepseekv3"])
async def test_each_layers_own_buffers_are_exported(tmp_path, kind, caplog):
    """Buffers a trained checkpoint holds and a config does not (Gemma 4's `layer_scalar`,
    DeepSeek V3's routing bias `e_score_correction_bias`, another in every layer) are saved
    with the checkpoint and exported from it: `snake export` rebuilt the model from its
    config and wrote the config's (1.0, 0.0), so the exported model gave other logits
    (0.48 apart on the Gemma 4 test model). A checkpoint saved without them still exports,
    with a warning that names them."""
    import json
    import logging

    from safetensors.torch import load_file, save_file

    from tests.test_hf import VOCAB, make

    model = make(kind)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.model.layers:
            buf = layer.layer_scalar if kind == "gemma4moe" else getattr(layer.mlp, "gate", None)
            if kind == "deepseekv3" and buf is not None:
                buf = buf.e_score_correction_bias
            if buf is not None:
                buf.copy_(torch.rand(buf.shape, generator=g) + 0.5)
    data = batches(3, 4, vocab=VOCAB)
    state = await _train_and_save(model, tmp_path, data)
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    model.load_state_dict(state)
    x = data[0][0]
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(x).logits, model.eval()(x).logits, rtol=1e-5, atol=1e-5)
    # a checkpoint of before: no buffers in it (its manifest's digest made to match)
    ckpt = tmp_path / "ckpt"
    resident = load_file(str(ckpt / "resident.safetensors"))
    save_file({k: v for k, v in resident.items() if not k.startswith("buffer/")}, str(ckpt / "resident.safetensors"))
    import hashlib

    manifest = json.loads((ckpt / "manifest.json").read_text())
    data_bytes = (ckpt / "resident.safetensors").read_bytes()
    manifest["files"]["resident.safetensors"] = {"bytes": len(data_bytes), "sha256": hashlib.sha256(data_bytes).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="snake"):
        assert main(["export", str(ckpt), "--hf", str(tmp_path / "old")]) == 0
    assert "holds no buffers" in caplog.text and ("layer_scalar" in caplog.text or "e_score_correction_bias" in caplog.text)


@pytest.mark.asyncio
async def test_a_checkpoint_missing_a_parameter_of_its_config_is_refused(tmp_path, capsys):
    """The model its config builds has a parameter the checkpoint does not hold (a config
    edited after saving): refused, where the export wrote that parameter's fresh values."""
    import json

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    torch.manual_seed(0)
    await _train_and_save(load_hf(cfg), tmp_path, batches(3, 4))
    manifest_path = tmp_path / "ckpt" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["model_config"]["attention_bias"] = True
    manifest_path.write_text(json.dumps(manifest))
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) != 0
    assert "holds no 'model.layers.0.self_attn.q_proj.bias'" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
