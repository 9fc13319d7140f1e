"""`SnakeTrainer.evaluate`: the validation loss of the current weights, streamed layer by
layer, equal to PyTorch's eval-mode loss of the same weights; it changes nothing."""

import asyncio
import copy

import pytest
import torch
import torch.nn.functional as F

from snake import ConfigError, DataError, EvalReport, Placement, SnakeConfig, SnakeTrainer
from tests.helpers import batches, tiny_gpt

MIXED = Placement(param=0.5, ckpt=0.5, opt=0.5)


def torch_eval_loss(model, state, data) -> tuple[float, int]:
    """PyTorch: `model` with `state` loaded, eval mode, no grad; the cross-entropy summed
    over every target not -100, over its count."""
    m = copy.deepcopy(model)
    m.load_state_dict(state)
    m.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in data:
            logits = m(x)
            total += float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                           ignore_index=-100, reduction="sum"))
            count += int((y != -100).sum())
    return total / count, count


def hf_eval_loss(model, state, batch) -> float:
    """A Hugging Face model's own eval-mode mean cross-entropy on `batch` with `state`."""
    model.load_state_dict(state)
    model.eval()
    x, y = batch
    with torch.no_grad():
        logits = model(x).logits
    return float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)))


async def train_then_evaluate(model, cfg, data, held):
    """Two training steps, then evaluate `held`: (the EvalReport, the trained state_dict)."""
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        await t.run(2)
        report = await t.evaluate(held)
        return report, await t.state_dict()


def held_out():
    """Batches unlike the training ones: 3 and 5 rows (not multiples of the micro-batch's 2),
    12 and 16 tokens, some targets -100."""
    a = batches(1, 3, seq=12, seed=7)[0]
    b = batches(1, 5, seq=16, seed=8)[0]
    y = b[1].clone()
    y[0, :5] = -100
    return [a, (b[0], y)]


@pytest.mark.asyncio
@pytest.mark.parametrize("placement,alpha,schedule", [
    (Placement.all_ssd(), 0.3, "vertical"),
    (MIXED, 0.0, "horizontal"),
    (Placement.all_cpu(), 0.3, "vertical"),
])
async def test_matches_pytorch_eval_of_the_same_weights(tmp_path, placement, alpha, schedule):
    model = tiny_gpt(n_layer=3, dropout=0.1)  # dropout: evaluate must turn it off
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=placement, alpha=alpha, schedule=schedule,
                      device="cpu")
    data = held_out()
    report, state = await train_then_evaluate(model, cfg, batches(3, 4), data)
    want, count = torch_eval_loss(model, state, data)
    assert isinstance(report, EvalReport)
    assert report.tokens == count == 3 * 12 + 5 * 16 - 5
    assert report.batches == 2
    assert report.loss == pytest.approx(want, rel=1e-6)


@pytest.mark.asyncio
@pytest.mark.parametrize("placement,schedule", [
    (MIXED, "vertical"), (Placement.all_cpu(), "vertical"), (Placement.all_cpu(), "horizontal")])
async def test_evaluating_changes_nothing(tmp_path, placement, schedule):
    """run(1), evaluate, run(1), evaluate gives bitwise the weights of run(2), with delayed
    steps pending at each evaluate, and the same loss twice over the same data. The
    evaluation's hidden states overwrite the checkpoint and inter-layer gradient memory it
    borrows: nothing a run reads there survives from one run to the next."""
    data = batches(3, 4)
    kw = dict(micro_batches=2, placement=placement, alpha=0.3, device="cpu", schedule=schedule)
    async with SnakeTrainer(tiny_gpt(n_layer=3, dropout=0.1), data=data,
                            config=SnakeConfig(offload_dir=tmp_path / "a", **kw)) as t:
        await t.run(1)
        first = await t.evaluate(held_out())
        again = await t.evaluate(held_out())
        report = await t.run(1)
        got = await t.state_dict()
    async with SnakeTrainer(tiny_gpt(n_layer=3, dropout=0.1), data=data,
                            config=SnakeConfig(offload_dir=tmp_path / "b", **kw)) as t:
        straight = await t.run(2)
        want = await t.state_dict()
    assert first.loss == again.loss
    assert report.steps[0].loss == straight.steps[1].loss
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.asyncio
async def test_before_the_first_run_it_evaluates_the_model_as_given(tmp_path):
    model = tiny_gpt(n_layer=2)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=Placement.all_ssd(), alpha=0.0, device="cpu")
    async with SnakeTrainer(model, data=batches(2, 4), config=cfg) as t:
        report = await t.evaluate(held_out(), max_batches=1)
        await t.run(1)  # the data was not consumed by the evaluation's setup
    want, count = torch_eval_loss(model, model.state_dict(), held_out()[:1])
    assert (report.batches, report.tokens) == (1, count)
    assert report.loss == pytest.approx(want, rel=1e-6)


@pytest.mark.asyncio
async def test_bfloat16_and_frozen_block_parameters(tmp_path):
    """bf16 compute with a frozen block weight (streamed with its layer, not trained): the
    loss PyTorch computes with the same bf16 weights."""
    model = tiny_gpt(n_layer=3)
    for b in model.blocks:
        b.attn.c_attn.weight.requires_grad_(False)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=MIXED, alpha=0.0, device="cpu",
                      dtype="bfloat16")
    data = held_out()
    report, state = await train_then_evaluate(model, cfg, batches(2, 4), data)
    want, _ = torch_eval_loss(copy.deepcopy(model).to(torch.bfloat16), {k: v.to(torch.bfloat16) for k, v in state.items()},
                              data)
    assert report.loss == pytest.approx(want, rel=2e-2)


@pytest.mark.asyncio
async def test_bad_arguments_and_batches_are_refused_and_the_trainer_goes_on(tmp_path):
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=MIXED, alpha=0.0, device="cpu")
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(3, 4), config=cfg) as t:
        await t.run(1)
        for bad in (0, -1, 1.5, True, "2"):
            with pytest.raises(ConfigError, match="max_batches"):
                await t.evaluate(held_out(), max_batches=bad)
        with pytest.raises(DataError, match="iterable"):
            await t.evaluate(42)
        with pytest.raises(DataError, match="no batch"):
            await t.evaluate([])
        x, y = held_out()[0]
        with pytest.raises(DataError, match="int64"):
            await t.evaluate([(x, y.int())])
        with pytest.raises(DataError, match="token ids must be in"):
            await t.evaluate([(x + 1000, y)])
        with pytest.raises(DataError, match="every target of the 2 batches evaluated is -100"):
            await t.evaluate([(x, torch.full_like(y, -100))] * 2)
        await t.run(1)
        assert (await t.evaluate(held_out())).batches == 2


@pytest.mark.asyncio
async def test_a_batch_without_targets_adds_nothing_to_the_mean(tmp_path):
    """A held-out batch of padding alone (every target -100: a collator's last batch of short
    rows) is evaluated, adding no token: the mean over the others is PyTorch's, and a run
    would refuse it as a step (its loss 0/0)."""
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=MIXED, alpha=0.0, device="cpu")
    model = tiny_gpt(n_layer=2)
    held = held_out()
    x, y = held[0]
    empty = (x, torch.full_like(y, -100))
    async with SnakeTrainer(model, data=batches(3, 4), config=cfg) as t:
        await t.run(1)
        state = await t.state_dict()
        for data in ([empty, *held], [held[0], empty, held[1]]):
            got = await t.evaluate(data, batches_per_pass=1)
            want, count = torch_eval_loss(model, state, held)
            assert (got.batches, got.tokens) == (3, count)
            assert got.loss == pytest.approx(want, rel=1e-5)


@pytest.mark.asyncio
async def test_a_cancelled_evaluation_leaves_the_trainer_usable(tmp_path):
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=Placement.all_ssd(), alpha=0.0, device="cpu")
    many = batches(200, 4, seed=9)
    async with SnakeTrainer(tiny_gpt(n_layer=4), data=batches(3, 4), config=cfg) as t:
        await t.run(1)
        task = asyncio.create_task(t.evaluate(many))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(t.run(1), 60)
        assert t.engine is not None
        t.engine.check_pools()  # every slot and staging buffer came back
        assert (await t.evaluate(many, max_batches=3)).batches == 3


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["llama", "gpt2", "mixtral", "deepseekv3", "qwen3next", "mamba"])
async def test_hugging_face_models_match_their_own_eval_forward(tmp_path, kind):
    """Dense, tied, mixture-of-experts, dense-and-expert layers of two kinds, hybrid
    attention/recurrent, recurrent: evaluate equals the Hugging Face model's own eval-mode
    loss with the trained weights."""
    from tests.test_hf import VOCAB, make

    model = make(kind)
    data = batches(2, 4, vocab=VOCAB)
    held = [batches(1, 3, seq=12, vocab=VOCAB, seed=5)[0]]
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=MIXED, alpha=0.3, device="cpu")
    report, state = await train_then_evaluate(model, cfg, data, held)
    assert report.loss == pytest.approx(hf_eval_loss(copy.deepcopy(model), state, held[0]), rel=1e-5)


@pytest.mark.asyncio
async def test_a_streamed_model_with_mapped_frozen_layer_weights(tmp_path):
    """A LoRA-style fine-tune of a model streamed from its files (`stream_hf`): the frozen
    layer weights come from snake's mapped file, the trained ones from the stores; evaluate
    equals the loss of the model loaded whole with the trained weights."""
    from snake.hf import load_hf, stream_hf
    from tests.test_hf import VOCAB
    from tests.test_stream_hf import saved

    _, path = saved("llama", tmp_path)
    streamed = stream_hf(path)
    for name, p in streamed.named_parameters():
        if "mlp" in name:
            p.requires_grad_(False)
    held = [batches(1, 3, seq=12, vocab=VOCAB, seed=5)[0]]
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path / "off", placement=MIXED, alpha=0.3, device="cpu")
    async with SnakeTrainer(streamed, data=batches(2, 4, vocab=VOCAB), config=cfg) as t:
        await t.run(2)
        assert t.engine is not None and t.engine.kernels.frozen_mapped
        report = await t.evaluate(held)
        state = await t.state_dict()
    assert report.loss == pytest.approx(hf_eval_loss(load_hf(path), state, held[0]), rel=1e-5)


@pytest.mark.asyncio
async def test_a_read_error_fails_the_evaluation_not_the_trainer(tmp_path):
    """An I/O error reading a layer: evaluate raises the StorageError naming the file, every
    slot and staging buffer goes back, and (the disk healthy again) the trainer trains on."""
    from snake.errors import StorageError
    from snake.faults import StorageFaults, inject_storage

    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=Placement.all_ssd(), alpha=0.0, device="cpu")
    async with SnakeTrainer(tiny_gpt(n_layer=3), data=batches(3, 4), config=cfg) as t:
        await t.run(1)
        assert t.engine is not None
        f = t.engine.stores["param"].file
        inner = getattr(f, "inner", f)
        healthy = inner._preadv
        inject_storage(f, StorageFaults(seed=1, read_error=1.0))
        with pytest.raises(StorageError, match="param.bin"):
            await t.evaluate(held_out())
        inner._preadv = healthy
        t.engine.check_pools()
        await asyncio.wait_for(t.run(1), 60)
        assert (await t.evaluate(held_out())).batches == 2


@pytest.mark.asyncio
async def test_an_async_iterable_of_batches_as_run_takes(tmp_path):
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=MIXED, alpha=0.0, device="cpu")

    async def stream():
        for b in held_out():
            await asyncio.sleep(0)
            yield b

    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(2, 4), config=cfg) as t:
        await t.run(1)
        listed = await t.evaluate(held_out())
        streamed = await t.evaluate(stream())
        first = await t.evaluate(stream(), max_batches=1)
    assert (streamed.loss, streamed.tokens, streamed.batches) == (listed.loss, listed.tokens, listed.batches)
    assert first.batches == 1 and first.tokens == 3 * 12


def many_held(n: int = 5) -> list:
    """`n` held-out batches of 3 or 5 rows and 12 or 16 tokens."""
    return [batches(1, 3 + 2 * (i % 2), seq=12 + 4 * (i % 2), seed=20 + i)[0] for i in range(n)]


@pytest.mark.asyncio
@pytest.mark.parametrize("placement,schedule", [
    (Placement.all_cpu(), "vertical"), (Placement(param=0.0, ckpt=1.0, opt=0.0), "horizontal")])
async def test_one_pass_reads_the_model_once_for_the_batches_idle_memory_holds(tmp_path, placement, schedule):
    """With the checkpoints in CPU memory (idle between runs) one pass takes all three
    batches (152 tokens; the checkpoints alone hold 192): every layer loaded and run once
    (the trace's spans say so), where one batch per pass streams the model three times; the
    same loss, PyTorch's."""
    model = tiny_gpt(n_layer=3)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=placement, alpha=0.0, schedule=schedule,
                      device="cpu")
    held = many_held(3)
    async with SnakeTrainer(model, data=batches(2, 4), config=cfg) as t:
        await t.run(2)
        spans = len(t.trace.spans)
        grouped = await t.evaluate(held)
        mine = [s for s in list(t.trace.spans)[spans:]]
        single = await t.evaluate(held, batches_per_pass=1)
        two = await t.evaluate(held, max_batches=2)
        state = await t.state_dict()
        assert t.engine is not None
        t.engine.check_pools()  # the borrowed staging buffers came back
    want, count = torch_eval_loss(model, state, held)
    assert (grouped.passes, single.passes, two.passes) == (1, 3, 1)
    assert grouped.batches == single.batches == 3 and two.batches == 2
    assert grouped.tokens == single.tokens == count
    assert grouped.loss == pytest.approx(want, rel=1e-6)
    assert single.loss == pytest.approx(grouped.loss, rel=1e-6)
    names = [(s.actor, s.name) for s in mine]
    assert [n for a, n in names if n.startswith("eval fwd")] == [f"eval fwd L{i}" for i in range(3)]
    assert sum(n.startswith("eval head") for _, n in names) == 3
    if placement.param < 1:  # the layers are read from the disk, once each
        assert [n for a, n in names if a == "ssd_read"] == [f"eval read L{i}" for i in range(3)]
        assert all(s.nbytes > 0 for s in mine if s.actor == "ssd_read")


@pytest.mark.asyncio
async def test_passes_are_as_large_as_the_borrowed_memory_or_batches_per_pass(tmp_path):
    """Everything on SSD: the staging buffers hold some batches, not all; a pass ends at the
    first batch that does not fit and that batch starts the next. `batches_per_pass` may go
    past them (in memory of their own). The loss is the same every way."""
    model = tiny_gpt(n_layer=3)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=Placement.all_ssd(), alpha=0.0, device="cpu")
    held = many_held(8)
    async with SnakeTrainer(model, data=batches(2, 4), config=cfg) as t:
        await t.run(1)
        auto = await t.evaluate(held)
        wide = await t.evaluate(held, batches_per_pass=8)
        two = await t.evaluate(held, batches_per_pass=2)
        state = await t.state_dict()
    want, _ = torch_eval_loss(model, state, held)
    assert 1 < auto.passes < 8, auto
    assert (wide.passes, two.passes) == (1, 4)
    for r in (auto, wide, two):
        assert r.batches == 8
        assert r.loss == pytest.approx(want, rel=1e-6)


@pytest.mark.asyncio
async def test_bad_batches_per_pass_is_refused(tmp_path):
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=MIXED, alpha=0.0, device="cpu")
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(2, 4), config=cfg) as t:
        for bad in (0, -2, 2.0, True, "3"):
            with pytest.raises(ConfigError, match="batches_per_pass"):
                await t.evaluate(held_out(), batches_per_pass=bad)
        await t.run(1)
        assert (await t.evaluate(held_out(), batches_per_pass=1)).passes == 2


def test_the_timeline_colours_evaluations_apart():
    """evaluate's spans (on the compute, h2d and ssd_read tracks) have their own colour and
    legend entry in the timeline, not the optimizer's grey."""
    from snake.timeline import COLORS, _color

    for name in ("eval fwd L0", "eval read L2", "eval param L1", "eval head", "eval pre"):
        assert _color(name) == COLORS["eval"] != COLORS["adamw"]
