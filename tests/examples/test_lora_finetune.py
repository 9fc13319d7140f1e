"""The LoRA example runs end to end on its demo checkpoint: the held-out loss falls, the
adapters save with PEFT and load back with the trained logits (the example asserts it),
and snake's checkpoint is written; also with the checkpoint's layers left in their files
(--stream)."""

import pytest

from examples.lora_finetune import demo_checkpoint, finetune


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True], ids=["load_hf", "stream_hf"])
async def test_the_lora_example_fine_tunes_and_saves_the_adapters(tmp_path, capsys, stream):
    losses = await finetune(demo_checkpoint(tmp_path / "model"), tmp_path / "out", 10, device="cpu", stream=stream)
    assert losses["after"] < losses["before"] - 0.02
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "out" / "ckpt" / "manifest.json").is_file()
    assert (tmp_path / "out" / "adapter-half" / "adapter_model.safetensors").is_file()
    assert "held-out loss" in capsys.readouterr().out
