"""Models snake would train wrongly are refused with a ModelError (or DataError) naming the
part and the fix, before any state is written: per-block buffers, frozen or cross-block
tied parameters, meta or mixed devices, non-callable parts, sequences past the positions."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from torch import nn

from snake import DataError, ModelError, ModelParts, SnakeConfig, SnakeTrainer
from snake.adapters import describe, layer_kinds
from tests.helpers import batches, tiny_gpt


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = getattr(self, "scale", 1.0)
        return x + scale * torch.tanh(self.lin(x))


class Tiny(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(96, 16)
        self.layers = nn.ModuleList(Block() for _ in range(n))
        self.out = nn.Linear(16, 96)


def parts(m: Tiny, **kw) -> ModelParts:
    kw = {"pre": lambda mm, i: mm.emb(i), "post": lambda mm, h: mm.out(h), **kw}
    return ModelParts(m, blocks=list(m.layers), blocks_prefix="layers", **kw)


def refused(model, tmp_path, match: str) -> ModelError:
    """The trainer refuses `model` with a ModelError matching `match`, writing nothing."""
    off = tmp_path / "off"
    with pytest.raises(ModelError, match=match) as e:
        SnakeTrainer(model, data=batches(1, 4), config=SnakeConfig(offload_dir=off, device="cpu"))
    assert not off.exists() or not any(off.iterdir()), "nothing may be written for a refused model"
    return e.value


def test_buffer_missing_or_of_another_shape_is_refused(tmp_path):
    m = Tiny()
    m.layers[2].register_buffer("mask", torch.ones(4))
    refused(parts(m), tmp_path, r"block 2's buffer 'mask'.*block 0 has no such buffer")
    m = Tiny()
    for i, layer in enumerate(m.layers):
        layer.register_buffer("mask", torch.ones(4 + (i == 1)))
    refused(parts(m), tmp_path, r"block 1's buffer 'mask'.*\(5,\)")


def test_equal_buffers_in_every_block_are_accepted():
    m = Tiny()
    for layer in m.layers:  # a causal mask / rotary table: the same in every layer
        layer.register_buffer("mask", torch.tril(torch.ones(8, 8)), persistent=False)
        layer.register_buffer("scale", torch.tensor(2.0))
    describe(parts(m))
    describe(tiny_gpt())


def test_blocks_that_differ_are_kinds_of_their_own():
    """A layer whose submodule is of another class (ReLU where block 0 has SiLU: round 23 ran
    it as block 0's, then refused it), that has another module, or other parameters, is a
    kind of its own: it runs through a copy of its own first block
    (tests/test_parity.py::test_layers_of_several_kinds_train_as_themselves). A block
    without parameters is refused: there is nothing to stream."""
    m = Tiny(4)
    for i, layer in enumerate(m.layers):
        layer.act = nn.SiLU() if i % 2 == 0 else nn.ReLU()
    assert layer_kinds(m.layers) == ([0, 1, 0, 1], [0, 1])
    m = Tiny()
    m.layers[2].extra = nn.Identity()
    assert layer_kinds(m.layers) == ([0, 0, 1], [0, 2])
    m = Tiny()
    m.layers[1].lin = nn.Linear(16, 16, bias=False)
    assert layer_kinds(m.layers) == ([0, 1, 0], [0, 1])
    describe(parts(m))
    m = Tiny()
    m.layers[1] = nn.Identity()  # a kind of its own without parameters: it streams nothing
    assert layer_kinds(m.layers) == ([0, 1, 0], [0, 1])
    describe(parts(m))


@pytest.mark.asyncio
async def test_a_block_without_parameters_trains_as_plain_pytorch(tmp_path):
    """A parameterless block (refused until round 36, as each layer had to stream a trained
    parameter) is a layer of no elements."""
    torch.manual_seed(0)
    m = Tiny()
    m.layers[1] = nn.Identity()

    def forward(idx):
        h = m.emb(idx)
        for layer in m.layers:
            h = layer(h)
        return m.out(h)

    data = batches(3, 4)
    ref = copy.deepcopy(m)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for x, y in data:
        opt.zero_grad()
        for xc, yc in zip(x.chunk(2), y.chunk(2), strict=True):
            h = ref.emb(xc)
            for layer in ref.layers:
                h = layer(h)
            nn.functional.cross_entropy(ref.out(h).reshape(-1, 96), yc.reshape(-1)).div(2).backward()
        opt.step()
    cfg = SnakeConfig(offload_dir=tmp_path / "off", device="cpu", micro_batches=2, alpha=0.3)
    async with SnakeTrainer(parts(m), data=data, config=cfg) as t:
        await asyncio.wait_for(t.run(3), timeout=60)
        got = await t.state_dict()
    assert got.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda msg, k=k: f"{k}: {msg}")


def test_weight_tied_across_blocks_is_refused(tmp_path):
    m = Tiny()
    m.layers[1].lin.weight = m.layers[0].lin.weight
    refused(parts(m), tmp_path, r"'layers\.1\.lin\.weight' is the same tensor as 'layers\.0\.lin\.weight'")


def test_weight_tied_between_block_and_pre_is_refused(tmp_path):
    m = Tiny()
    m.out.weight = m.emb.weight  # a pre/post tie (embedding and head) is fine
    describe(parts(m))
    m.norm = nn.LayerNorm(16)
    m.layers[2].lin.bias = m.norm.bias  # a block/resident tie is not
    refused(parts(m), tmp_path, r"'norm\.bias' is the same tensor as 'layers\.2\.lin\.bias' \(pre/post and block 2\)")


def test_tie_inside_one_block_is_accepted():
    m = Tiny()
    for layer in m.layers:
        layer.lin2 = nn.Linear(16, 16)
        layer.lin2.weight = layer.lin.weight
    describe(parts(m))


def test_meta_model_is_refused(tmp_path):
    with torch.device("meta"):
        m = tiny_gpt()
    refused(m, tmp_path, r"'wte\.weight' is on the meta device.*to_empty")


@pytest.mark.cuda
def test_model_on_two_devices_is_refused(tmp_path):
    m = tiny_gpt()
    m.blocks[1].to("cuda")
    refused(m, tmp_path, r"several devices.*'blocks\.1\..*' on cuda:0.*model\.to")


@pytest.mark.parametrize("field", ["pre", "post", "block_fn"])
def test_parts_that_are_not_callable_are_refused(tmp_path, field):
    refused(parts(Tiny(), **{field: "emb"}), tmp_path, rf"ModelParts\.{field} must be a function.*got str")


@pytest.mark.asyncio
async def test_hf_gpt2_sequence_past_n_positions_is_a_data_error(tmp_path):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=32)
    cfg._attn_implementation = "sdpa"
    off = tmp_path / "off"
    config = SnakeConfig(micro_batches=2, offload_dir=off, device="cpu")
    async with SnakeTrainer(tf.GPT2LMHeadModel(cfg), data=batches(1, 4, seq=40), config=config) as trainer:
        with pytest.raises(DataError, match=r"sequence length 40 exceeds the model's n_positions=32"):
            await asyncio.wait_for(trainer.run(1), 30)
    assert not any(off.iterdir()), "no state may be written before the input is checked"
