"""snake must give the weights of plain PyTorch (gradient accumulation + torch AdamW) for
every schedule, placement and delay ratio."""

import copy
import itertools
import warnings

import pytest
import torch

from snake import ModelParts, Placement
from snake.adapters import layer_kinds, takes_layer
from snake.engine import _split_parts
from tests.helpers import (
    KindsLM,
    StackLM,
    assert_close_state,
    assert_tracks_updates,
    batches,
    kinds_parts,
    mixed_reference,
    optimizer_options,
    reference,
    tiny_gpt,
    train,
)

PLACEMENTS = {
    "cpu": Placement.all_cpu(),
    "ssd": Placement.all_ssd(),
    "mixed": Placement(param=0.5, ckpt=0.3, opt=0.6),
}

CASES = list(itertools.product([1, 2, 3, 5], ["vertical", "horizontal"], PLACEMENTS, [0.0, 0.3]))


@pytest.mark.asyncio
@pytest.mark.parametrize("micro,schedule,placement,alpha", CASES)
async def test_matches_plain_pytorch(tmp_path, micro, schedule, placement, alpha):
    # bias=False: a key projection's bias has an identically zero gradient (softmax is
    # shift-invariant), so Adam turns its rounding noise into full-size steps; that
    # element alone cannot match any other implementation. test_bias_model covers biases.
    model = tiny_gpt(n_layer=4, bias=False)
    data = batches(3, 2 * micro)
    want, want_losses = reference(model, data, micro)
    got, report, _ = await train(
        model, data, 3, micro_batches=micro, offload_dir=tmp_path / "off",
        placement=PLACEMENTS[placement], alpha=alpha, schedule=schedule,
    )
    assert_close_state(got, want)
    assert [s.loss for s in report.steps] == pytest.approx(want_losses, abs=1e-5)
    assert [s.tokens for s in report.steps] == [2 * micro * 16] * 3


@pytest.mark.asyncio
async def test_bias_model_matches_except_key_bias(tmp_path):
    model = tiny_gpt(n_layer=4, bias=True)
    data = batches(3, 6)
    want, _ = reference(model, data, 3)
    got, _, _ = await train(
        model, data, 3, micro_batches=3, offload_dir=tmp_path, placement=PLACEMENTS["mixed"], alpha=0.3
    )
    c = model.config.n_embd
    for k in want:
        g, w = got[k], want[k]
        if k.endswith("attn.c_attn.bias"):
            g, w = torch.cat([g[:c], g[2 * c :]]), torch.cat([w[:c], w[2 * c :]])
        # the key bias's noise steps leak slightly into the rest: 1e-5 instead of 1e-6
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.asyncio
async def test_dropout_same_weights_vertical_and_horizontal(tmp_path):
    model = tiny_gpt(n_layer=4, bias=False, dropout=0.2)
    data = batches(3, 6)
    kw = dict(micro_batches=3, placement=PLACEMENTS["mixed"], alpha=0.3)
    v, rv, _ = await train(model, data, 3, offload_dir=tmp_path / "v", schedule="vertical", **kw)
    h, rh, _ = await train(model, data, 3, offload_dir=tmp_path / "h", schedule="horizontal", **kw)
    assert_close_state(v, h)
    # and dropout really acted: the no-dropout reference differs
    want, _ = reference(model, data, 3)
    assert any(not torch.allclose(v[k], want[k], atol=1e-4) for k in want)


@pytest.mark.asyncio
async def test_run_twice_continues(tmp_path):
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(4, 4)
    want, _ = reference(model, data, 2)
    from snake import SnakeConfig, SnakeTrainer

    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=PLACEMENTS["mixed"], alpha=0.3, device="cpu")
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        await trainer.run(1)
        mid = await trainer.state_dict()  # flushes the delayed share; the next run must not redo it
        await trainer.run(3)
        got = await trainer.state_dict()
    assert_close_state(got, want)
    assert not torch.equal(mid["blocks.0.mlp.c_fc.weight"], got["blocks.0.mlp.c_fc.weight"])


@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
async def test_mixed_precision_tracks_fp32(tmp_path, dtype):
    """Low-precision compute with fp32 masters follows the fp32 reference's updates
    (`assert_tracks_updates`: the old bound on the weights alone passed a trainer that never
    updated them)."""
    model = tiny_gpt(n_layer=2, bias=False)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = batches(3, 4)
    want, want_losses = reference(model, data, 2)
    got, report, _ = await train(
        model, data, 3, micro_batches=2, offload_dir=tmp_path, placement=PLACEMENTS["mixed"], alpha=0.3, dtype=dtype
    )
    assert all(v.dtype == torch.float32 for v in got.values())
    assert [s.loss for s in report.steps] == pytest.approx(want_losses, abs=5e-3)  # measured <= 2e-4
    assert_tracks_updates(got, want, init)
    with pytest.raises(AssertionError, match="off by"):  # the check itself: no update fails it
        assert_tracks_updates(init, want, init)


@pytest.mark.asyncio
@pytest.mark.parametrize("backend,used", [("buffered", "posix-buffered"), ("posix", "posix-direct")])
async def test_each_storage_backend_matches_plain_pytorch(tmp_path, backend, used):
    """SnakeConfig.storage_backend picks how the SSD tier's files are read and written; the
    weights do not depend on it (kvikio: tests/test_cuda.py)."""
    import asyncio

    from snake import SnakeConfig, SnakeTrainer

    model = tiny_gpt(n_layer=2, bias=False)
    data = batches(2, 4)
    want, _ = reference(model, data, 2)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path / "off", placement=Placement.all_ssd(), alpha=0.3,
                      device="cpu", storage_backend=backend)
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(2), timeout=120)
        backends = {k: s.file.backend for k, s in trainer.engine.stores.items() if s.file is not None}
        got = await trainer.state_dict()
    assert set(backends.values()) == {used}, backends
    assert_close_state(got, want)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_one_optimizer_worker_with_delay_and_everything_on_ssd(tmp_path, schedule):
    """With one optimizer worker, delayed steps and checkpoints and optimizer states on SSD,
    the optimizer-state reads at an iteration's turn once took every staging buffer ahead of
    the checkpoint read layer 0's backward needed, and the run hung in its second iteration
    (snake.memory.PoolSizes.opt_tails)."""
    model = tiny_gpt(n_layer=2, n_embd=32, bias=False)
    data = batches(3, 4)
    want, _ = reference(model, data, 2)
    got, _, _ = await train(model, data, 3, micro_batches=2, offload_dir=tmp_path, placement=Placement.all_ssd(),
                            alpha=0.3, schedule=schedule, optimizer_workers=1, stall_timeout_s=20)
    assert_close_state(got, want)


@pytest.mark.asyncio
@pytest.mark.parametrize("alpha", [1e-5, 0.99999])
async def test_alpha_that_rounds_a_part_to_nothing(tmp_path, alpha):
    """alpha x (a layer's 12k parameters) rounds to 0 delayed elements, or to all of them:
    nothing is delayed, or all but one element, and the weights are plain PyTorch's (both
    once failed with a KeyError for the empty part's store unit)."""
    model = tiny_gpt(n_layer=2, n_embd=32, bias=False)
    data = batches(3, 4)
    want, _ = reference(model, data, 2)
    got, _, _ = await train(model, data, 3, micro_batches=2, offload_dir=tmp_path, placement=Placement.all_ssd(),
                            alpha=alpha)
    assert_close_state(got, want)


def test_layers_of_several_kinds_delay_a_part_of_every_layer_or_of_none():
    """Each layer delays alpha of its own elements; an alpha that rounds to nothing in a
    small layer but not in a large one delays one element of the small one (the plans step
    a delayed part of every layer or of none)."""
    assert _split_parts([100, 1000], 0.3) == [(70, 30), (700, 300)]
    assert _split_parts([100, 1000], 0.001) == [(99, 1), (999, 1)]
    assert _split_parts([100, 1000], 0.0001) == [(100, 0), (1000, 0)]
    assert _split_parts([100, 1000], 0.99999) == [(1, 99), (1, 999)]
    assert _split_parts([1, 1000], 0.3) == [(1, 0), (1000, 0)]  # a one-element layer: none
    # a layer of no streamed trained elements (frozen, or all it trains held): two empty parts
    assert _split_parts([0, 100, 1000], 0.3) == [(0, 0), (70, 30), (700, 300)]
    assert _split_parts([0, 100, 1000], 0.001) == [(0, 0), (99, 1), (999, 1)]
    assert _split_parts([0, 0], 0.3) == [(0, 0), (0, 0)]
    assert _split_parts([0, 100], 1.0) == [(0, 0), (0, 100)]


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_a_delayed_share_that_rounds_to_nothing_in_the_small_kind(tmp_path, schedule):
    model = KindsLM()
    data = batches(3, 4)
    want, _ = reference(model, data, 2)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    alpha = 0.4 / min(sizes)  # rounds to 0 in the dense layers, to 1 in the experts
    assert round(alpha * min(sizes)) == 0 < round(alpha * max(sizes))
    got, _, _ = await train(kinds_parts(model), data, 3, offload_dir=tmp_path / "off", micro_batches=2,
                            placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=alpha, schedule=schedule)
    assert_close_state(got, want)


def _ignoring(data, seed: int = 3):
    """`data` with about a third of the targets -100, micro-batches differing in how many
    they keep, and the second micro-batch of the first global batch ignored entirely."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (x, y) in enumerate(data):
        y = y.clone()
        y[torch.rand(y.shape, generator=g) < 0.35] = -100
        if i == 0:
            y[y.shape[0] // 3 : 2 * y.shape[0] // 3] = -100
        out.append((x, y))
    return out


def _big_batch_reference(model, data, micro: int):
    """Plain PyTorch, each global batch's loss the mean cross-entropy over its targets that
    are not -100 (one big batch), accumulated over micro-batches as sums / that count."""
    import copy

    m = copy.deepcopy(model)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        trained = int((y != -100).sum())
        total = 0.0
        for xc, yc in zip(x.chunk(micro), y.chunk(micro), strict=True):
            logits = m(xc)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), yc.reshape(-1), ignore_index=-100, reduction="sum") / trained
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, losses


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_ignored_targets_weigh_as_in_one_big_batch(tmp_path, schedule):
    """Targets of -100 (Hugging Face's padding label) are not trained on, and each global
    batch's loss is the mean over the rest, as one big batch: a micro-batch weighs by the
    targets it keeps (before, each micro-batch's own mean / M; a micro-batch keeping none
    gave 0/0). The reported loss is that mean."""
    model = tiny_gpt(n_layer=3, bias=False)
    data = _ignoring(batches(3, 6))
    want, want_losses = _big_batch_reference(model, data, 3)
    got, report, _ = await train(
        model, data, 3, micro_batches=3, offload_dir=tmp_path / "off", placement=PLACEMENTS["mixed"], alpha=0.3,
        schedule=schedule,
    )
    assert_close_state(got, want)
    assert [s.loss for s in report.steps] == pytest.approx(want_losses, abs=1e-5)
    whole = [torch.nn.functional.cross_entropy(model(x).reshape(-1, 96), y.reshape(-1)).item() for x, y in data[:1]]
    assert report.steps[0].loss == pytest.approx(whole[0], abs=1e-5)  # the big batch's mean, before any step


class _StridedLM(torch.nn.Module):
    """Layers that differ by something other than their parameters: layer i adds a
    residual scaled by 1 / (i + 1) (an attribute, as an attention window would be)."""

    def __init__(self, n: int = 3, d: int = 16, vocab: int = 96) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))
        for i, layer in enumerate(self.layers):
            layer.residual = 1.0 / (i + 1)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for layer in self.layers:
            h = h + layer.residual * torch.tanh(layer(h))
        return self.head(h)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_layers_that_differ_beyond_their_parameters_train_as_themselves(tmp_path, schedule):
    """Every layer runs through one copy of block 0 with its parameters swapped in, so layer
    2's attribute (its residual scale) was layer 0's: the weights went wrong silently. The
    copy now takes each layer's scalar attributes where the layers differ, and a block_fn
    that takes `layer` gets the index (forward and the backward's recompute): both match
    the model's own forward."""
    model = _StridedLM()
    data = batches(3, 4)
    want, _ = reference(model, data, 2)
    residual = [layer.residual for layer in model.layers]

    def parts(block_fn):
        return ModelParts(model=model, blocks=list(model.layers), blocks_prefix="layers",
                          pre=lambda m, i: m.embed(i), post=lambda m, h: m.head(h), block_fn=block_fn)

    def with_index(block, h, layer):
        return h + residual[layer] * torch.tanh(block(h))

    def as_attribute(block, h):
        return h + block.residual * torch.tanh(block(h))

    kw = dict(micro_batches=2, placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.3, schedule=schedule)
    got, _, _ = await train(parts(with_index), data, 3, offload_dir=tmp_path / "a", **kw)
    assert_close_state(got, want)
    got, _, _ = await train(parts(as_attribute), data, 3, offload_dir=tmp_path / "b", **kw)
    assert_close_state(got, want)


class _PrivateStridedLM(_StridedLM):
    """The same layers with the residual scale kept in a private attribute and in a tuple."""

    def __init__(self) -> None:
        super().__init__()
        for i, layer in enumerate(self.layers):
            layer._residual = 1.0 / (i + 1)
            layer.pair = (1.0, 1.0 / (i + 1))
            del layer.residual

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for layer in self.layers:
            h = h + layer._residual * layer.pair[1] * torch.tanh(layer(h))
        return self.head(h)


@pytest.mark.asyncio
async def test_private_and_tuple_attributes_are_carried_per_layer(tmp_path):
    """An audit's find: a per-layer value in a `_private` attribute or in a tuple ran as layer
    0's (5.8e-3 off in three steps); the shell takes those too."""
    model = _PrivateStridedLM()
    data = batches(3, 4)
    want, _ = reference(model, data, 2)
    parts = ModelParts(model=model, blocks=list(model.layers), blocks_prefix="layers",
                       pre=lambda m, i: m.embed(i), post=lambda m, h: m.head(h),
                       block_fn=lambda block, h: h + block._residual * block.pair[1] * torch.tanh(block(h)))
    got, _, _ = await train(parts, data, 3, offload_dir=tmp_path / "off", micro_batches=2,
                            placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.3)
    assert_close_state(got, want)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,placement", itertools.product(["vertical", "horizontal"], ["mixed", "ssd"]))
async def test_layers_of_several_kinds_train_as_themselves(tmp_path, schedule, placement):
    """Dense and mixture-of-experts layers in one model: each kind runs through a copy of
    its own first block, each layer's units in the tiers are its own size (the slots the
    largest kind's), and the weights are plain PyTorch's for both schedules, a delayed
    share of every layer, and the tiers on SSD."""
    model = KindsLM()
    assert layer_kinds(model.layers) == ([0, 1, 2, 1, 0], [0, 1, 2])
    data = batches(3, 4)
    want, want_losses = reference(model, data, 2)
    got, report, traffic = await train(kinds_parts(model), data, 3, offload_dir=tmp_path / "off", micro_batches=2,
                                       placement=PLACEMENTS[placement], alpha=0.3, schedule=schedule)
    assert_close_state(got, want)
    assert [s.loss for s in report.steps] == pytest.approx(want_losses, abs=1e-5)
    # every layer moves its own parameters (not the largest kind's room), twice an
    # iteration (vertical) or twice per micro-batch (horizontal)
    own = sum(p.numel() for p in model.parameters() if p is not model.embed.weight) - sum(
        p.numel() for p in model.head.parameters())
    loads = 2 if schedule == "vertical" else 2 * 2
    assert traffic[("cpu", "gpu", "param")] == loads * own * 4
    assert traffic[("gpu", "cpu", "grad")] == (1 if schedule == "vertical" else 2) * own * 4


class _BufferedLM(_StridedLM):
    """Layers alike in their parameters whose buffers differ (as a router's per-expert bias
    does in DeepSeek V3 from layer to layer)."""

    def __init__(self, persistent: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        for layer in self.layers:
            del layer.residual
            layer.register_buffer("shift", torch.randn(16, generator=g), persistent=persistent)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for layer in self.layers:
            h = _shifted(layer, h)
        return self.head(h)


def _shifted(layer: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h + torch.tanh(layer(h) + layer.shift)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,persistent", [("vertical", True), ("horizontal", False)])
async def test_layers_whose_buffers_differ_train_as_themselves(tmp_path, schedule, persistent):
    """Round 23 refused blocks whose buffer values differ (every layer ran with block 0's);
    the shell now takes each layer's own, and the buffers come back unchanged. The block
    function names its block `layer`: that is not the index's parameter (it was called
    with layer=i twice over)."""
    assert not takes_layer(_shifted)
    model = _BufferedLM(persistent)
    data = batches(3, 4)
    want, _ = reference(model, data, 2)
    parts = ModelParts(model=model, blocks=list(model.layers), blocks_prefix="layers",
                       pre=lambda m, i: m.embed(i), post=lambda m, h: m.head(h), block_fn=_shifted)
    got, _, _ = await train(parts, data, 3, offload_dir=tmp_path / "off", micro_batches=2,
                            placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.3, schedule=schedule)
    assert_close_state(got, want)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_frozen_parameters_stay_as_they_are(tmp_path, schedule):
    """Parameters with requires_grad=False (a frozen position table outside the blocks, a
    frozen projection in one block: that block a kind of its own) stay as they are, as
    torch.optim.AdamW leaves a parameter without a gradient; everything else trains to
    plain PyTorch's weights. Refused before (snake stepped every parameter)."""
    model = tiny_gpt(n_layer=3, n_embd=32, bias=False)
    model.wpe.weight.requires_grad_(False)
    model.blocks[1].attn.c_proj.weight.requires_grad_(False)
    assert layer_kinds(model.blocks)[0] == [0, 1, 0]
    data = batches(3, 4)
    want, _ = reference(model, data, 2)
    got, _, _ = await train(model, data, 3, offload_dir=tmp_path / "off", micro_batches=2,
                            placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.3, schedule=schedule)
    assert_close_state(got, want)
    for key in ("wpe.weight", "blocks.1.attn.c_proj.weight"):
        assert torch.equal(got[key], model.state_dict()[key])
    assert not torch.equal(got["blocks.0.attn.c_proj.weight"], model.state_dict()["blocks.0.attn.c_proj.weight"])


class _AliasedBufferLM(torch.nn.Module):
    """Each layer's shift registered twice (on the block and on its submodule: one tensor,
    two names), read through the second name, different in every layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(6)
        self.embed = torch.nn.Embedding(96, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16)) for _ in range(3))
        for layer in self.layers:
            layer.register_buffer("alias", torch.randn(16, generator=g))
            layer[0].register_buffer("shift", layer.alias)
        self.head = torch.nn.Linear(16, 96)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for layer in self.layers:
            h = _through_alias(layer, h)
        return self.head(h)


def _through_alias(block: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h + torch.tanh(block(h) + block[0].shift)


@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_a_buffer_under_two_names_takes_each_layers_values_at_both(tmp_path, dtype):
    """An audit's find: a per-layer buffer registered under two names was set under the
    first only, and the other kept block 0's values (5.5e-3 off in fp32; in bf16 the shell's
    dtype conversion had made two tensors of it)."""
    model = _AliasedBufferLM()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    data = batches(3, 4)
    want, _ = reference(model, data, 2)
    parts = ModelParts(model=model, blocks=list(model.layers), blocks_prefix="layers",
                       pre=lambda m, i: m.embed(i), post=lambda m, h: m.head(h), block_fn=_through_alias)
    got, _, _ = await train(parts, data, 3, offload_dir=tmp_path / "off", micro_batches=2, dtype=dtype,
                            placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.3)
    if dtype == "float32":
        assert_close_state(got, want)
    else:
        assert_tracks_updates(got, want, init)


class _TiedInBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16, bias=False)
        self.b = torch.nn.Linear(16, 16, bias=False)
        self.b.weight = self.a.weight  # one weight, two names

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.b(torch.tanh(self.a(h)))




@pytest.mark.asyncio
async def test_a_weight_tied_inside_a_block_comes_back_under_both_names(tmp_path):
    """An audit's find (since the first round): state_dict() gave the trained weight under
    the name named_parameters lists first and the initial one under the other."""
    torch.manual_seed(0)
    model = StackLM(_TiedInBlock)
    data = batches(3, 4)
    want, _ = reference(model, data, 2)
    parts = kinds_parts(model)
    got, _, _ = await train(parts, data, 3, offload_dir=tmp_path / "off", micro_batches=2,
                            placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.3)
    assert "layers.1.b.weight" in got
    assert_close_state(got, want)


@pytest.mark.asyncio
async def test_frozen_parameters_of_a_bf16_model_come_back_in_fp32_unchanged(tmp_path):
    """state_dict() gives fp32 weights: the frozen ones too, after a run as before it (an
    audit's find: bf16 after a run)."""
    from snake import SnakeConfig, SnakeTrainer

    model = tiny_gpt(n_layer=2, n_embd=32, bias=False).to(torch.bfloat16)
    model.wpe.weight.requires_grad_(False)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path / "off", device="cpu", dtype="bfloat16",
                      placement=Placement.all_cpu(), alpha=0.0)
    async with SnakeTrainer(model, data=batches(2, 4), config=cfg) as t:
        before = await t.state_dict()
        await t.run(2)
        after = await t.state_dict()
    for state in (before, after):
        assert state["wpe.weight"].dtype == torch.float32
        assert torch.equal(state["wpe.weight"], model.wpe.weight.float())
    assert after["blocks.0.attn.c_proj.weight"].dtype == torch.float32


class _UnusedInBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.spare = torch.nn.Linear(16, 16)  # never called

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


@pytest.mark.asyncio
async def test_a_parameter_that_never_gets_a_gradient_stays_as_it_is(tmp_path, caplog):
    """torch.optim.AdamW leaves a parameter whose .grad stays None; snake used to step it
    with a zero gradient (weight decay moved it). It is left now, and each such parameter
    is named once in a log record."""
    torch.manual_seed(0)
    model = StackLM(_TiedInBlock)
    model.layers = torch.nn.ModuleList(_UnusedInBlock() for _ in range(2))
    data = batches(3, 4)
    want, _ = reference(model, data, 2)
    parts = kinds_parts(model)
    with caplog.at_level("INFO", logger="snake"):
        got, _, _ = await train(parts, data, 3, offload_dir=tmp_path / "off", micro_batches=2,
                                placement=Placement.all_cpu(), alpha=0.0)
    said = [r.getMessage() for r in caplog.records if "got no gradient" in r.getMessage()]
    assert sorted(m.split("'")[1] for m in said) == [
        "layers.0.spare.bias", "layers.0.spare.weight", "layers.1.spare.bias", "layers.1.spare.weight"]
    assert_close_state(got, want)
    assert torch.equal(got["layers.0.spare.weight"], model.state_dict()["layers.0.spare.weight"])


SPLIT = 48  # tokens below it go to expert 0, the rest to expert 1 (`_RoutedLM`)


class _Experts(torch.nn.Module):
    """A mixture-of-experts block with one module per expert, each token routed by the sign
    of its channel 0 (set by `_RoutedLM`'s frozen marks). An expert no token goes to is not
    called, as in a loop over experts: its parameters get no gradient (.grad stays None)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.mix = torch.nn.Linear(d, d)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + 0.1 * torch.tanh(self.mix(h))
        route = (h[..., 0] < 0).long()
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            where = route == e
            if where.any():
                out = out.index_put((where,), torch.tanh(expert(h[where])))
        return h + 0.1 * out


class _RoutedLM(torch.nn.Module):
    """Tokens below SPLIT carry +8 in channel 0, the others -8 (a frozen embedding), so the
    data decides which experts and which head parameters a batch uses."""

    def __init__(self, n_layer: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(96, 16)
        self.marks = torch.nn.Embedding(96, 16)
        with torch.no_grad():
            self.marks.weight.zero_()
            self.marks.weight[:SPLIT, 0] = 8.0
            self.marks.weight[SPLIT:, 0] = -8.0
        self.marks.weight.requires_grad_(False)
        self.layers = torch.nn.ModuleList(_Experts() for _ in range(n_layer))
        self.head = torch.nn.Linear(16, 96)
        self.low = torch.nn.Linear(16, 96, bias=False)  # the head's share for the low tokens only

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = _routed_pre(self, idx)
        for layer in self.layers:
            h = layer(h)
        return _routed_post(self, h)


def _routed_pre(m: _RoutedLM, idx: torch.Tensor) -> torch.Tensor:
    return m.embed(idx) + m.marks(idx)


def _routed_post(m: _RoutedLM, h: torch.Tensor) -> torch.Tensor:
    low = h[..., :1] > 0
    return m.head(h) + m.low(h) * low if bool(low.any()) else m.head(h)


def _routed_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per global batch the tokens' range: low only, high only, both, high only, low only.
    Expert 0 and `low` miss iterations 1 and 3, expert 1 misses 0 and 4."""
    g = torch.Generator().manual_seed(3)
    out = []
    for lo, hi in ((0, SPLIT), (SPLIT, 96), (0, 96), (SPLIT, 96), (0, SPLIT)):
        x = torch.randint(lo, hi, (4, 9), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def _routed_parts(model: _RoutedLM) -> ModelParts:
    return ModelParts(model=model, blocks=list(model.layers), blocks_prefix="layers",
                      pre=_routed_pre, post=_routed_post)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("alpha", [0.0, 0.3])
async def test_experts_no_token_reaches_are_left_as_plain_pytorch_leaves_them(tmp_path, schedule, alpha):
    """An expert (and a head parameter) with no gradient in some iterations: AdamW leaves it
    those steps and counts its own steps (bias correction). Same weights as plain PyTorch,
    with the state partly on SSD and a delayed share that cuts through parameters."""
    torch.manual_seed(0)
    model = _RoutedLM()
    data = _routed_batches()
    want, _ = reference(model, data, 2)
    moved = {k for k in want if not torch.equal(want[k], model.state_dict()[k])}
    assert "layers.0.experts.1.weight" in moved and "marks.weight" not in moved
    got, _, _ = await train(_routed_parts(model), data, 5, offload_dir=tmp_path / "off", micro_batches=2,
                            placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=alpha, schedule=schedule)
    assert_close_state(got, want)


@pytest.mark.asyncio
async def test_missed_steps_resume_exactly_from_a_checkpoint(tmp_path):
    """The steps a parameter missed are part of its optimizer state: a checkpoint after two
    iterations (expert 0 and `low` missed one) resumes to plain PyTorch's five."""
    import json

    from snake import SnakeConfig, SnakeTrainer

    torch.manual_seed(0)
    model = _RoutedLM()
    data = _routed_batches()
    want, _ = reference(model, data, 2)

    def cfg(name: str) -> SnakeConfig:
        return SnakeConfig(device="cpu", offload_dir=tmp_path / name, micro_batches=2,
                           placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.3)

    async with SnakeTrainer(_routed_parts(copy.deepcopy(model)), data=data, config=cfg("a")) as t:
        await t.run(2)
        await t.save(tmp_path / "ckpt")
    missed = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["missed_steps"]
    assert missed["layers.0.experts.0.weight"] == 1 and missed["low.weight"] == 1
    assert missed["layers.2.experts.1.bias"] == 1 and "layers.0.mix.weight" not in missed
    async with SnakeTrainer(_routed_parts(copy.deepcopy(model)), data=data, config=cfg("b")) as t:
        await t.load(tmp_path / "ckpt")
        await t.run(3)
        got = await t.state_dict()
    assert_close_state(got, want)


_SEEN_DTYPES: list[tuple[torch.dtype, torch.dtype]] = []


class _GatedBlock(torch.nn.Module):
    """Two experts mixed by a router whose gate weight and bias a bfloat16 model keeps in
    float32 (as transformers keeps DeepSeek V3's); records the dtypes the router sees."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(d, 2, bias=False)
        self.register_buffer("route_bias", torch.zeros(2))
        self.experts = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        _SEEN_DTYPES.append((self.gate.weight.dtype, self.route_bias.dtype))
        w = torch.softmax(torch.nn.functional.linear(h.float(), self.gate.weight.float()) + self.route_bias, -1)
        w = w.to(h.dtype)
        return h + sum(w[..., e : e + 1] * torch.tanh(x(h)) for e, x in enumerate(self.experts))


class _GatedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(96, 16)
        self.layers = torch.nn.ModuleList(_GatedBlock() for _ in range(3))
        self.head = torch.nn.Linear(16, 96)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for layer in self.layers:
            h = layer(h)
        return _gated_post(self, h)


def _gated_post(m: _GatedLM, h: torch.Tensor) -> torch.Tensor:
    return m.head(h.to(m.head.weight.dtype))


def _gated_model() -> _GatedLM:
    """bfloat16, but the routers' gates and biases (and the head) in float32."""
    torch.manual_seed(0)
    model = _GatedLM().to(torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    for layer in model.layers:
        layer.gate.float()
        layer.route_bias = 0.1 * torch.randn(2, generator=g)
    model.head.float()
    return model


def _gated_parts(model: _GatedLM) -> ModelParts:
    return ModelParts(model=model, blocks=list(model.layers), blocks_prefix="layers",
                      pre=lambda m, i: m.embed(i), post=_gated_post)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("frozen", ["none", "embed"])
async def test_what_a_bf16_model_keeps_in_fp32_stays_fp32(tmp_path, schedule, frozen):
    """A bfloat16 model's router gate and bias in float32 (transformers'
    `_keep_in_fp32_modules`) were run in bfloat16: 2.6 % off plain PyTorch mixed precision's
    updates. They stay float32 now (the gates held on the device with pre/post's), and the
    weights are plain PyTorch mixed precision's (fp32 masters, AdamW) to the bit as measured
    (atol 1e-6 here). Also where the embedding is frozen (an audit's find: the fp32 head ran
    in bf16)."""
    model = _gated_model()
    if frozen == "embed":
        model.embed.requires_grad_(False)
    data = batches(4, 4)
    want = mixed_reference(model, data, 2)
    _SEEN_DTYPES.clear()
    got, _, _ = await train(_gated_parts(model), data, 4, offload_dir=tmp_path / "off", micro_batches=2,
                            placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.3, dtype="bfloat16",
                            schedule=schedule)
    assert set(_SEEN_DTYPES) == {(torch.float32, torch.float32)}
    assert_close_state({k: got[k] for k in want}, want, rtol=0, atol=1e-6)
    assert torch.equal(got["layers.1.route_bias"], model.layers[1].route_bias)


@pytest.mark.asyncio
@pytest.mark.parametrize("option", sorted(optimizer_options()))
async def test_each_optimizer_option_in_bf16_is_plain_mixed_precision(tmp_path, option):
    """A learning-rate schedule, parameters without weight decay, clipping (of the fp32
    gradients): plain PyTorch mixed precision's weights with torch's AdamW so set, in a bf16
    model (untied: snake sums a tied weight's two gradients in fp32) whose fp32 gates are
    held with pre/post. Clipping's norm is summed in another order than torch's, which may
    move the coefficient's last bit: within rtol 1e-5."""
    opt, ref, alpha = optimizer_options()[option]
    model = _gated_model()
    data = batches(4, 4)
    want = mixed_reference(model, data, 2, **ref)
    got, _, _ = await train(_gated_parts(model), data, 4, micro_batches=2, offload_dir=tmp_path,
                            placement=Placement(param=0.5, ckpt=0.3, opt=0.6), alpha=alpha, dtype="bfloat16",
                            optimizer=opt)
    assert_close_state({k: got[k] for k in want}, want, rtol=1e-5 if option == "max_grad_norm" else 0, atol=1e-6)


@pytest.mark.asyncio
async def test_what_a_bf16_model_keeps_in_fp32_resumes_exactly(tmp_path):
    """The held gates' optimizer state goes into checkpoints with pre/post's (and a float32
    model of the same architecture still streams them with the rest of each layer)."""
    from snake import SnakeConfig, SnakeTrainer
    from snake.adapters import layer_specs

    model = _gated_model()
    data = batches(4, 4)
    want = mixed_reference(model, data, 2)

    def cfg(name: str) -> SnakeConfig:
        return SnakeConfig(device="cpu", offload_dir=tmp_path / name, micro_batches=2, dtype="bfloat16",
                           placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.3)

    async with SnakeTrainer(_gated_parts(copy.deepcopy(model)), data=data, config=cfg("a")) as t:
        await t.run(2)
        await t.save(tmp_path / "ckpt")
    async with SnakeTrainer(_gated_parts(copy.deepcopy(model)), data=data, config=cfg("b")) as t:
        await t.load(tmp_path / "ckpt")
        await t.run(2)
        got = await t.state_dict()
    assert_close_state({k: got[k] for k in want}, want, rtol=0, atol=1e-6)
    assert [n for n, _ in layer_specs(_gated_parts(model))[0]] == [
        "experts.0.weight", "experts.0.bias", "experts.1.weight", "experts.1.bias"]
    assert "gate.weight" in [n for n, _ in layer_specs(_gated_parts(_GatedLM()))[0]]


def test_the_memory_model_counts_what_is_kept_in_fp32_at_4_bytes():
    import dataclasses

    from planner.profile import shape_of_parts
    from snake.memory import device_memory

    shape = shape_of_parts(_gated_parts(_gated_model()), 2, 16, "bfloat16")
    assert shape.fp32_params == 3 * 2 * 16 + 96 * 16 + 96  # the gates and the head
    assert shape.resident_params == 96 * 16 + 3 * 2 * 16 + 96 * 16 + 96  # the embedding too
    less = dataclasses.replace(shape, fp32_params=0)
    assert device_memory(shape, n_micro=2) - device_memory(less, n_micro=2) == 2 * shape.fp32_params
    assert shape_of_parts(_gated_parts(_GatedLM()), 2, 16, "bfloat16").fp32_params == 0  # a float32 model
    routers_only = _gated_model()
    for layer in routers_only.layers:  # the gates are all a block trains: held in fp32 all the same
        layer.experts.requires_grad_(False)
    assert shape_of_parts(_gated_parts(routers_only), 2, 16, "bfloat16").fp32_params == 3 * 2 * 16 + 96 * 16 + 96


class _LoraBlock(torch.nn.Module):
    """A frozen base layer with a trained low-rank update (LoRA) and a trained norm."""

    def __init__(self, d: int = 16, r: int = 2) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.base = torch.nn.Linear(d, d)
        self.down = torch.nn.Linear(d, r, bias=False)
        self.up = torch.nn.Linear(r, d, bias=False)
        torch.nn.init.normal_(self.up.weight, std=0.1)  # LoRA starts B at 0; here the update is seen at once
        self.base.requires_grad_(False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        return h + torch.tanh(self.base(x) + self.up(self.down(x)))




@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("placement", ["all_cpu", "mixed"])
async def test_frozen_layer_weights_stream_with_the_layer(tmp_path, schedule, placement):
    """A block's frozen weights (LoRA's base layers) were held on the compute device, one
    copy per layer, all run long: a model whose frozen weights do not fit there could not be
    fine-tuned. They stay in CPU memory now and reach the device with the layer's trained
    parameters, in its slot. Same weights as plain PyTorch, the frozen ones untouched."""
    from snake import SnakeConfig, SnakeTrainer

    torch.manual_seed(0)
    model = StackLM(_LoraBlock)
    data = batches(3, 4)
    want, _ = reference(model, data, 2)
    parts = kinds_parts(model)
    cfg = SnakeConfig(device="cpu", offload_dir=tmp_path / "off", micro_batches=2, alpha=0.3, schedule=schedule,
                      placement=Placement.all_cpu() if placement == "all_cpu" else Placement(param=0.5, ckpt=0.5, opt=0.5))
    async with SnakeTrainer(parts, data=data, config=cfg) as t:
        await t.run(3)
        got = await t.state_dict()
        k = t.engine.kernels
        assert k.layer_frozen == [[], [], []]  # nothing held per layer
        assert [f.numel() for f in k.frozen_host] == [16 * 16 + 16] * 3
        # on a CPU device the frozen weights are used where they are (`Kernels.frozen_views`):
        # the slots hold the trained parameters alone (they were sized for both until round 42)
        assert k.slot_params == 2 * 16 + 2 * 16 * 2  # what Engine sizes the slots with
        to_device = t.traffic()[("cpu", "gpu", "param")]
    assert_close_state(got, want)
    assert torch.equal(got["layers.1.base.weight"], model.layers[1].base.weight)
    # the model's frozen weights are snake's CPU copy (same values), not a second one
    host = k.frozen_host[1]
    assert host.data_ptr() <= model.layers[1].base.weight.data_ptr() < host.data_ptr() + host.numel() * 4
    assert torch.equal(model.layers[1].base.weight, want["layers.1.base.weight"])
    loads = 2 * 3 if schedule == "vertical" else 2 * 3 * 2  # per layer: forward, backward (x M horizontal)
    trained_bytes = (2 * 16 + 2 * 16 * 2) * 4
    frozen_bytes = (16 * 16 + 16) * 4
    # the frozen weights are bound where they are on a CPU device (until round 39 they were
    # copied into the slot where the trained ones were, from the SSD); a GPU's loads copy
    # them too (tests/test_cuda.py). Either way the schedule moves them with the layer: the
    # traffic counts them, as the planner does (before round 44 a CPU device's did not)
    assert to_device == loads * (trained_bytes + frozen_bytes)


def test_the_memory_model_streams_frozen_layer_weights():
    """A LoRA model's frozen base weights count in CPU memory, once, and in the device's
    parameter slots only: not once per layer on the device."""
    import dataclasses

    from planner.profile import shape_of_parts
    from snake.memory import PoolSizes, device_memory, host_memory

    model = StackLM(_LoraBlock)
    parts = kinds_parts(model)
    shape = shape_of_parts(parts, 2, 16, "float32")
    assert (shape.layer_params, shape.layer_frozen_params, shape.frozen_params) == (96, 272, 0)
    assert shape.slot == 96 + 272
    none = dataclasses.replace(shape, layer_frozen_params=0, largest_slot_params=None)
    slots = device_memory(shape, n_micro=2) - device_memory(none, n_micro=2)
    assert slots == PoolSizes().device_param_slots * 272 * 4  # the slots', not every layer's
    # a CPU device's slots hold the trained parameters alone (its frozen ones used where they are)
    assert device_memory(shape, n_micro=2, device_type="cpu") == device_memory(none, n_micro=2, device_type="cpu")
    host = host_memory(shape, n_micro=2, schedule="vertical", workers=2, alpha=0.0)
    assert host.fixed_bytes - host_memory(none, n_micro=2, schedule="vertical", workers=2, alpha=0.0).fixed_bytes == 3 * 272 * 4
    # a layer with its base trained too: two kinds whose slots are both 368 elements (an
    # audit's find: the slot was counted as the largest trained layer plus the mean frozen)
    model.layers[1].base.requires_grad_(True)
    assert shape_of_parts(parts, 2, 16, "float32").slot == 368


def test_the_planner_probes_make_no_copy_of_frozen_layer_weights():
    """The probes' kernels bind slots that hold every parameter: a CPU copy of every layer's
    frozen weights per probe (an audit counted 9 in one planning) is not made, and the model
    is left as it is."""
    from planner.probes import _kernels

    model = StackLM(_LoraBlock)
    parts = kinds_parts(model)
    where = model.layers[0].base.weight.data_ptr()
    k = _kernels(parts, torch.device("cpu"), torch.float32)
    assert k.frozen_host == [None, None, None] and model.layers[0].base.weight.data_ptr() == where


@pytest.mark.asyncio
async def test_a_router_only_fine_tune_of_a_bf16_model_keeps_the_gates_in_fp32(tmp_path):
    """A block that trains only what it keeps in fp32 (its experts frozen) streams its
    frozen experts and no trained element: the gates are held in fp32 and compute in it, as
    plain PyTorch mixed precision computes them (until round 35 they streamed in bf16, as
    every layer streamed at least one trained parameter, and snake warned)."""
    model = _gated_model()
    for layer in model.layers:
        layer.experts.requires_grad_(False)
    want = mixed_reference(model, batches(3, 4), 2)
    _SEEN_DTYPES.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got, _, _ = await train(_gated_parts(model), batches(3, 4), 3, offload_dir=tmp_path / "off", micro_batches=2,
                                placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.3, dtype="bfloat16")
    assert set(_SEEN_DTYPES) == {(torch.float32, torch.float32)}
    assert_close_state({k: got[k] for k in want}, want, rtol=0, atol=1e-6)


class _PermutedBlock(torch.nn.Module):
    """A block with an integer frozen parameter (a permutation of its channels)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.perm = torch.nn.Parameter(torch.randperm(d), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))[..., self.perm]


@pytest.mark.asyncio
async def test_an_integer_frozen_parameter_in_a_block_is_held_as_it_is(tmp_path):
    """An integer nn.Parameter (requires_grad=False) in a block crashed building the shell
    (an audit's find, older than the frozen-streaming change); it is held on the device in
    its own dtype, not streamed in the compute dtype."""
    torch.manual_seed(0)
    model = StackLM(_TiedInBlock)
    model.layers = torch.nn.ModuleList(_PermutedBlock() for _ in range(3))
    data = batches(3, 4)
    want, _ = reference(model, data, 2)
    parts = kinds_parts(model)
    got, _, _ = await train(parts, data, 3, offload_dir=tmp_path / "off", micro_batches=2,
                            placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.3)
    assert_close_state(got, want)
    assert got["layers.2.perm"].dtype == torch.int64 and torch.equal(got["layers.2.perm"], model.layers[2].perm)
