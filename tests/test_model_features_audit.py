"""Audit: PyTorch model features a user's model may carry (hooks, parametrizations, shared
modules, sparse / max_norm embeddings, buffers changed in forward, checkpointing and custom
autograd inside a block, torch.compile, submodule modes, odd parameter layouts and dtypes,
blocks whose output is not a tensor). Each is either trained as plain PyTorch trains a deep
copy of the same model (gradient accumulation + torch.optim.AdamW), or refused with a
ModelError before anything is written to the offload_dir."""

from __future__ import annotations

import asyncio
import copy
import re
import warnings

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm
from torch.utils.checkpoint import checkpoint

from snake import ModelError, ModelParts, SnakeConfig, SnakeError, SnakeTrainer
from tests.helpers import StackLM, batches, kinds_parts, reference

D, VOCAB, SEQ, MICRO, STEPS = 16, 96, 8, 2, 2


class Blk(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


def stack(block=Blk, n: int = 2) -> StackLM:
    torch.manual_seed(0)
    return StackLM(block, n=n, d=D, vocab=VOCAB)


def data(steps: int = STEPS):
    return batches(steps, 2 * MICRO, seq=SEQ, vocab=VOCAB)


def config(tmp_path, name: str = "off", **kw) -> SnakeConfig:
    return SnakeConfig(device="cpu", offload_dir=tmp_path / name, micro_batches=MICRO, **kw)


async def snake_train(parts, tmp_path, steps: int = STEPS, name: str = "off", **kw) -> dict:
    async with SnakeTrainer(parts, data=data(steps), config=config(tmp_path, name, **kw)) as t:
        await asyncio.wait_for(t.run(steps), timeout=60)
        return await t.state_dict()


def diffs(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-6) -> dict[str, object]:
    """Keys whose values differ (compared as float64: dtypes aside), missing or extra."""
    out: dict[str, object] = {k: "missing" for k in want.keys() - got.keys()}
    out.update({k: "extra" for k in got.keys() - want.keys()})
    for k in want.keys() & got.keys():
        a, b = got[k].double(), want[k].double()
        if a.shape != b.shape:
            out[k] = f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
        elif not torch.allclose(a, b, rtol=rtol, atol=atol):
            out[k] = float((a - b).abs().max())
    return dict(sorted(out.items()))


async def parity(model: nn.Module, tmp_path, parts: ModelParts | None = None, what: str = "", **kw) -> None:
    """snake's weights and buffers after STEPS steps are plain PyTorch's on a deep copy."""
    want, _ = reference(model, data(), MICRO)
    got = await snake_train(parts if parts is not None else kinds_parts(model), tmp_path, **kw)
    bad = diffs(got, want)
    assert not bad, f"{what}: snake's state_dict differs from plain PyTorch's (max abs diff per key): {bad}"


def nothing_written(tmp_path, name: str = "off") -> bool:
    off = tmp_path / name
    return not off.exists() or not any(off.iterdir())


async def refused_or_parity(model: nn.Module, tmp_path, what: str, parts: ModelParts | None = None) -> None:
    """Either a ModelError when the trainer is made, with nothing written, or the weights of
    plain PyTorch. Anything else (a failure part-way through the run) is a bug."""
    parts = parts if parts is not None else kinds_parts(model)
    try:
        trainer = SnakeTrainer(parts, data=data(), config=config(tmp_path))
    except ModelError:
        assert nothing_written(tmp_path), f"{what}: refused, but only after writing to the offload_dir"
        return
    async with trainer:
        try:
            await asyncio.wait_for(trainer.run(STEPS), timeout=60)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{what}: not refused with a ModelError when the trainer was made, but failed in "
                        f"the run: {type(e).__name__}: {str(e)[:300]}")
        got = await trainer.state_dict()
    want, _ = reference(model, data(), MICRO)
    bad = diffs(got, want)
    assert not bad, f"{what}: accepted, but trained other weights than plain PyTorch: {bad}"


def refused(parts: ModelParts, tmp_path, match: str) -> None:
    """A ModelError naming `match` when the trainer is made, nothing written, and the
    user's model unchanged (its state_dict, buffers included)."""
    before = {k: v.clone() for k, v in parts.model.state_dict().items()}
    with pytest.raises(ModelError, match=match):
        SnakeTrainer(parts, data=data(), config=config(tmp_path))
    assert nothing_written(tmp_path)
    after = parts.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "the refusal changed the user's model"


async def fails_at_its_first_step_naming_the_fix(model: nn.Module, tmp_path, match: str) -> None:
    """What snake can only see by running a layer (which it does not do before the run: a
    layer run outside training may change what it keeps, a recurrent layer's state): the
    first step fails with a ModelError naming the fix as the cause, the trainer closed."""
    async with SnakeTrainer(kinds_parts(model), data=data(), config=config(tmp_path)) as t:
        with pytest.raises(SnakeError) as info:
            await asyncio.wait_for(t.run(STEPS), timeout=60)
    chain, e = [], info.value
    while e is not None:
        chain.append(e)
        e = e.__cause__
    assert any(isinstance(x, ModelError) and re.search(match, str(x)) for x in chain), chain


# -- hooks ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_same_hooks_on_every_block_train_as_in_pytorch(tmp_path):
    """A forward hook changing a block's output, a forward pre-hook changing a submodule's
    input and a full backward hook changing the gradient into the block, the same on every
    block: the weights PyTorch trains. The backward hook fires once per layer and micro-batch,
    as in PyTorch (forward hooks fire again in the recompute: documented)."""
    model = stack()
    calls: list[int] = []
    scale = torch.linspace(0.5, 1.5, D)
    for layer in model.layers:
        layer.register_forward_hook(lambda mod, args, out: out * scale)
        layer.lin.register_forward_pre_hook(lambda mod, args: (args[0] * 2.0,))
        layer.register_full_backward_hook(lambda mod, gi, go: (calls.append(1), (gi[0] * scale,))[1])
    want, _ = reference(model, data(), MICRO)
    in_pytorch, calls[:] = len(calls), []
    got = await snake_train(kinds_parts(model), tmp_path)
    assert not diffs(got, want), diffs(got, want)
    assert len(calls) == in_pytorch == 2 * STEPS * MICRO


@pytest.mark.asyncio
async def test_a_forward_hook_on_one_block_changes_that_block_alone(tmp_path):
    """A hook on block 1 only (not the first block of its kind) must act on block 1, as in
    PyTorch; snake runs every layer through a copy of the kind's first block, so it is
    dropped."""
    model = stack()
    model.layers[1].register_forward_hook(lambda mod, args, out: out * 0.5)
    await refused_or_parity(model, tmp_path, "forward hook on block 1 alone (dropped: never fires in snake, "
                            "whose shell is a copy of block 0; adapters.layer_kinds / shells._shell)")


@pytest.mark.asyncio
async def test_a_forward_hook_on_the_first_block_leaves_the_others_alone(tmp_path):
    """A hook on block 0 only must not act on block 1: in snake the kind's shell, a deep copy
    of block 0 with its hooks, runs every layer of the kind."""
    model = stack()
    model.layers[0].register_forward_hook(lambda mod, args, out: out * 0.5)
    await refused_or_parity(model, tmp_path, "forward hook on block 0 alone (applied to every layer of the kind)")


@pytest.mark.asyncio
async def test_a_full_backward_hook_on_one_block_acts_on_that_block_alone(tmp_path):
    model = stack()
    scale = torch.linspace(0.0, 2.0, D)
    model.layers[0].register_full_backward_hook(lambda mod, gi, go: (gi[0] * scale,))
    await refused_or_parity(model, tmp_path, "full backward hook on block 0 alone (applied to block 1 too)")


@pytest.mark.asyncio
async def test_a_forward_hook_on_the_whole_model(tmp_path):
    """A hook on the model changes what model(x) gives (here the logits); snake never calls
    the model's forward (pre and post run as functions of it), so it is silently ignored."""
    model = stack()
    model.register_forward_hook(lambda mod, args, out: out * 2.0)
    await refused_or_parity(model, tmp_path, "forward hook on the whole model (silently ignored)")


# -- parametrizations -------------------------------------------------------------------


class _Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["custom", "weight_norm", "orthogonal"])
async def test_parametrized_block_weights_train_their_originals(tmp_path, how):
    model = stack()
    for layer in model.layers:
        if how == "custom":
            parametrize.register_parametrization(layer.lin, "weight", _Symmetric())
        elif how == "weight_norm":
            weight_norm(layer.lin)
        else:
            orthogonal(layer.lin)
    want, _ = reference(model, data(), MICRO)
    got = await snake_train(kinds_parts(model), tmp_path)
    assert any(".parametrizations.weight.original" in k for k in got)
    assert not diffs(got, want), diffs(got, want)


@pytest.mark.asyncio
async def test_spectral_norm_in_blocks(tmp_path):
    """spectral_norm's power iteration updates its `_u`/`_v` buffers in place in every
    training forward (once per micro-batch in PyTorch); its weights depend on them."""
    model = stack()
    for layer in model.layers:
        spectral_norm(layer.lin)
    await refused_or_parity(model, tmp_path, "spectral_norm in the blocks (buffers updated in forward: "
                            "per-layer _u/_v run their power iteration in the forward and again in the recompute)")


# -- shared modules and parameters ------------------------------------------------------


def test_one_module_twice_in_the_block_list_is_refused_by_what_it_is(tmp_path):
    """ALBERT-style: one block object at two places of the ModuleList. Refused, but the
    message must say the block is the same module as another, not blame blocks_prefix (which
    is right)."""
    model = stack()
    model.layers.append(model.layers[0])
    with pytest.raises(ModelError) as e:
        SnakeTrainer(kinds_parts(model), data=data(), config=config(tmp_path))
    assert nothing_written(tmp_path)
    msg = str(e.value)
    assert any(w in msg.lower() for w in ("same", "twice", "shared", "shares")), (
        f"the refusal of a block listed twice does not say so; it sends the user to blocks_prefix: {msg!r}")


def test_a_submodule_shared_between_blocks_is_refused(tmp_path):
    """ALBERT-style sharing of a submodule (its weights) across layers: refused by name."""
    model = stack(n=3)
    model.layers[2].lin = model.layers[0].lin
    with pytest.raises(ModelError, match=r"layers\.2\.lin\.weight.*same tensor.*layers\.0\.lin\.weight"):
        SnakeTrainer(kinds_parts(model), data=data(), config=config(tmp_path))
    assert nothing_written(tmp_path)


# -- embeddings -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_sparse_embedding_is_refused_before_training(tmp_path):
    """torch.optim.AdamW refuses sparse gradients; snake must refuse nn.Embedding(sparse=True)
    by name (or train it as the dense one), not fail part-way through the first step."""
    model = stack()
    model.embed = nn.Embedding(VOCAB, D, sparse=True)
    dense = stack()
    dense.embed.weight.data.copy_(model.embed.weight.data)
    parts = kinds_parts(model)
    try:
        trainer = SnakeTrainer(parts, data=data(), config=config(tmp_path))
    except ModelError:
        assert nothing_written(tmp_path)
        return
    async with trainer:
        try:
            await asyncio.wait_for(trainer.run(STEPS), timeout=60)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"nn.Embedding(sparse=True) not refused up front; the run failed in the first step: "
                        f"{type(e).__name__}: {str(e)[:300]} (kernels.py _accumulate_resident: "
                        "g.reshape(-1) of a sparse gradient)")
        got = await trainer.state_dict()
    want, _ = reference(dense, data(), MICRO)
    assert not diffs(got, want), diffs(got, want)


def test_a_max_norm_embedding_is_refused(tmp_path):
    """nn.Embedding(max_norm=...) renormalizes the looked-up rows of its weight in place in
    every forward: PyTorch's AdamW then steps the renormalized weight, where snake's masters
    would not follow (round 44: they trained other weights, 9.8 off, and the set-up's probes
    renormalized rows of the user's own embedding). Refused by name, the model untouched."""
    model = stack()
    model.embed = nn.Embedding(VOCAB, D, max_norm=1.0)
    with torch.no_grad():
        model.embed.weight.mul_(3.0)  # rows well past max_norm
    refused(kinds_parts(model), tmp_path, r"'embed' \(Embedding\) has max_norm=1.0.*max_norm=None")


# -- buffers changed in forward ---------------------------------------------------------


class BNBlk(Blk):
    def __init__(self, d: int = D) -> None:
        super().__init__(d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.bn(self.lin(h).transpose(1, 2)).transpose(1, 2))


def test_batchnorm_running_stats_in_blocks_are_refused(tmp_path):
    """BatchNorm in a block: PyTorch updates each layer's running stats once per micro-batch
    forward; snake runs a layer's forward again for its backward and keeps no per-layer copy
    of them (round 44: it gave the initial stats back, and evaluate() used other ones).
    Refused by name; without running statistics it trains as PyTorch."""
    refused(kinds_parts(stack(BNBlk)), tmp_path, r"'layers.0.bn' \(BatchNorm1d\) keeps running statistics")


@pytest.mark.asyncio
async def test_batchnorm_without_running_stats_in_blocks_trains_as_pytorch(tmp_path):
    """track_running_stats=False, the fix the refusal gives: the batch's statistics in
    training and in evaluation alike, the weights PyTorch's."""
    model = stack(BNBlk)
    for layer in model.layers:
        layer.bn = nn.BatchNorm1d(D, track_running_stats=False)
    await refused_or_parity(model, tmp_path, "BatchNorm1d(track_running_stats=False) in the blocks")


class PreBN(StackLM):
    def __init__(self) -> None:
        super().__init__(Blk, n=2, d=D, vocab=VOCAB)
        self.bn = nn.BatchNorm1d(D)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.embed(idx).transpose(1, 2)).transpose(1, 2)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_batchnorm_in_pre_is_refused(tmp_path):
    """A BatchNorm in `pre`: PyTorch updates its running stats once per micro-batch; snake
    runs pre again for its backward (round 44: twice, in the user's model too). Refused by
    name, the model's buffers untouched."""
    torch.manual_seed(0)
    model = PreBN()
    parts = ModelParts(model=model, blocks=list(model.layers), blocks_prefix="layers",
                       pre=lambda m, i: m.bn(m.embed(i).transpose(1, 2)).transpose(1, 2),
                       post=lambda m, h: m.head(h))
    refused(parts, tmp_path, r"'bn' \(BatchNorm1d\) keeps running statistics")


# -- inside a block: checkpointing, custom autograd, compile, modes ----------------------


class CkptBlk(Blk):
    reentrant = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + checkpoint(lambda x: torch.tanh(self.lin(x)), h, use_reentrant=self.reentrant)


class ReentrantBlk(CkptBlk):
    reentrant = True


@pytest.mark.asyncio
async def test_non_reentrant_checkpoint_inside_a_block(tmp_path):
    await parity(stack(CkptBlk), tmp_path, what="torch.utils.checkpoint(use_reentrant=False) in a block")


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad:UserWarning")
async def test_reentrant_checkpoint_inside_a_block(tmp_path):
    """PyTorch trains a block that checkpoints with use_reentrant=True (loss.backward()).
    snake's recompute takes torch.autograd.grad, which reentrant checkpointing refuses: the
    first step's error names the layer and use_reentrant=False (round 44: torch's own
    message about .grad(), which does not say where)."""
    await fails_at_its_first_step_naming_the_fix(stack(ReentrantBlk), tmp_path,
                                                 r"layer \d uses torch.utils.checkpoint with use_reentrant=True")


class _SignedSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x.abs()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * 2 * x.abs()


class FnBlk(Blk):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + _SignedSquare.apply(torch.tanh(self.lin(h)))


@pytest.mark.asyncio
async def test_a_custom_autograd_function_in_a_block(tmp_path):
    await parity(stack(FnBlk), tmp_path, what="custom autograd.Function", alpha=0.5)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["wrapped", "in_place"])
async def test_compiled_blocks(tmp_path, how):
    """torch.compile'd blocks (the eager backend: no C++ compiler needed), as an
    OptimizedModule in the list or compiled in place (Module.compile)."""
    model = stack()
    for i in range(len(model.layers)):
        if how == "wrapped":
            model.layers[i] = torch.compile(model.layers[i], backend="eager")
        else:
            model.layers[i].compile(backend="eager")
    with warnings.catch_warnings():  # dynamo's own, in plain PyTorch's training of the deep copy
        warnings.filterwarnings("ignore", r"The \.grad attribute of a Tensor that is not a leaf")
        want, _ = reference(model, data(), MICRO)
    got = await snake_train(kinds_parts(model), tmp_path)
    assert not diffs(got, want), diffs(got, want)


class DropBlk(Blk):
    def __init__(self, d: int = D) -> None:
        super().__init__(d)
        self.drop = nn.Dropout(0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(torch.tanh(self.lin(h)))


@pytest.mark.asyncio
async def test_a_run_trains_every_module_as_after_model_train(tmp_path):
    """README: a run trains the model as after `model.train()`, whatever mode the user left
    it or its modules in (a Hugging Face model loads in eval mode; its dropout is on in
    training): a block's dropout put in eval mode trains as one in train mode."""
    model = stack(DropBlk)
    model.train()
    for layer in model.layers:
        layer.drop.eval()
    on = copy.deepcopy(model).train()
    got = await snake_train(kinds_parts(model), tmp_path, name="evaled")
    want = await snake_train(kinds_parts(on), tmp_path, name="train")
    assert not diffs(got, want), diffs(got, want)
    assert not model.layers[0].drop.training, "the user's modes come back after the run"


@pytest.mark.asyncio
async def test_requires_grad_toggled_between_runs_is_refused_until_set_back(tmp_path):
    """What a trainer trains is fixed when its engine is built: a parameter frozen between
    two runs is refused by name at the next call (round 44: training went on stepping it,
    and state_dict() laid the masters out by the new flags: a bias 0.29 off), and once set
    back the trainer goes on as before, the weights plain PyTorch's."""
    model = stack()
    want, _ = reference(model, data(2), MICRO)
    w = model.layers[0].lin.weight
    async with SnakeTrainer(kinds_parts(model), data=data(2), config=config(tmp_path)) as t:
        await asyncio.wait_for(t.run(1), timeout=60)
        w.requires_grad_(False)
        for call in (lambda: t.run(1), t.state_dict, lambda: t.save(tmp_path / "ck"), lambda: t.evaluate(data(1))):
            with pytest.raises(ModelError, match="'layers.0.lin.weight' has requires_grad=False now"):
                await asyncio.wait_for(call(), timeout=60)
        assert not (tmp_path / "ck").exists()
        w.requires_grad_(True)
        await asyncio.wait_for(t.run(1), timeout=60)
        got = await t.state_dict()
    assert not diffs(got, want), diffs(got, want)


# -- parameter layouts and dtypes -------------------------------------------------------


class StridedBlk(nn.Module):
    """Parameters that are a transposed view, a slice of a wider tensor and a channels_last
    4-d tensor."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.w_t = nn.Parameter(torch.randn(d, d).t() / d**0.5)
        self.w_slice = nn.Parameter((torch.randn(d, 2 * d) / d**0.5)[:, 1 : d + 1])
        self.w_cl = nn.Parameter(torch.randn(2, 2, 2, 2).to(memory_format=torch.channels_last))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mix = self.w_cl.reshape(-1)[:D]
        return h + torch.tanh(h @ self.w_t) * torch.sigmoid(h @ self.w_slice) + mix


@pytest.mark.asyncio
async def test_non_contiguous_and_channels_last_parameters(tmp_path):
    model = stack(StridedBlk)
    assert not model.layers[0].w_t.is_contiguous() and not model.layers[0].w_slice.is_contiguous()
    assert not model.layers[0].w_cl.is_contiguous()
    model.head.weight = nn.Parameter(model.head.weight.detach().t().contiguous().t())  # resident, transposed
    assert not model.head.weight.is_contiguous()
    await parity(model, tmp_path, what="non-contiguous parameters", alpha=0.5)


class F64Blk(Blk):
    def __init__(self, d: int = D) -> None:
        super().__init__(d)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, d, dtype=torch.float64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h)) * self.gain.to(h.dtype)


@pytest.mark.asyncio
async def test_a_float64_parameter_in_a_block(tmp_path):
    await parity(stack(F64Blk), tmp_path, what="float64 block parameter")


class LogitScaleLM(nn.Module):
    """A float64 logit scale, registered first (model.parameters()'s first)."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Blk() for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for layer in self.layers:
            h = layer(h)
        return self.head(h) * self.logit_scale.float()


@pytest.mark.asyncio
async def test_a_float64_resident_parameter_first_in_the_model(tmp_path):
    """PyTorch trains it. snake's set-up probes (adapters.vocab_size / hidden_size) make
    their dummy hidden state in the dtype of the model's first parameter, float64 here, and
    the head (float32) fails on it with a bare RuntimeError when the run starts."""
    model = LogitScaleLM()
    parts = ModelParts(model=model, blocks=list(model.layers), blocks_prefix="layers",
                       pre=lambda m, i: m.embed(i), post=lambda m, h: m.head(h) * m.logit_scale.float())
    await refused_or_parity(model, tmp_path, "a float64 parameter first in the model", parts=parts)


# -- blocks whose output is not a tensor ------------------------------------------------


class TupleBlk(Blk):
    def forward(self, h: torch.Tensor):  # type: ignore[override]
        return (h + torch.tanh(self.lin(h)), None)


class DictBlk(Blk):
    def forward(self, h: torch.Tensor):  # type: ignore[override]
        return {"hidden": h + torch.tanh(self.lin(h))}


class UnpackLM(StackLM):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for layer in self.layers:
            out = layer(h)
            h = out[0] if isinstance(out, tuple) else out["hidden"]
        return self.head(h)


@pytest.mark.asyncio
@pytest.mark.parametrize("block", [TupleBlk, DictBlk], ids=["tuple", "dict"])
async def test_a_block_whose_output_is_not_a_tensor(tmp_path, block):
    """With the default block_fn (block(hidden)) a block returning a tuple or a dict cannot
    be chained: the first step's error is a ModelError naming block_fn (round 44: an
    AttributeError inside the compute actor)."""
    torch.manual_seed(0)
    model = UnpackLM(block, n=2, d=D, vocab=VOCAB)
    await fails_at_its_first_step_naming_the_fix(model, tmp_path, r"layer 0 gave a (tuple|dict).*block_fn")


@pytest.mark.asyncio
async def test_a_block_fn_that_unpacks_a_tuple_output(tmp_path):
    torch.manual_seed(0)
    model = UnpackLM(TupleBlk, n=2, d=D, vocab=VOCAB)
    parts = ModelParts(model=model, blocks=list(model.layers), blocks_prefix="layers", pre=lambda m, i: m.embed(i),
                       post=lambda m, h: m.head(h), block_fn=lambda b, h: b(h)[0])
    await parity(model, tmp_path, parts=parts, what="block_fn unpacking a tuple")
