"""An audit of how snake reads batches and normalizes the loss, against plain PyTorch and
transformers written here: every batch form README.md accepts ((inputs, targets) pairs,
lists of two, Hugging Face mappings with or without labels and attention_mask, bool masks,
int32 ids, a tokenizer's BatchEncoding, non-contiguous tensors), ignored targets spread
unevenly over micro-batches (one micro-batch with none left), right padding, and the
refusals README promises (a DataError naming what is wrong, the trainer left usable).

README: "the loss is the mean cross-entropy over the whole global batch ... Targets of -100
... are not trained on: the mean is over the other targets of the global batch, so a
micro-batch weighs by how many it keeps, as in one big batch"; for a mapping, "the `labels`
(the `input_ids` where there are none, -100 at the padding) shifted one to the left, the
mean over the global batch's labels that are not -100"; evaluate's `.loss` is "the mean
cross-entropy over every target token that is not -100" of batches "of any size and length".
Every expectation comes from the reference computed in the test."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from snake import DataError, Placement, SnakeConfig, SnakeTrainer
from tests.helpers import tiny_gpt
from tests.test_hf import NEAR_EPS_GRAD, VOCAB, Want, assert_matches, make

T = 60.0
IGN = -100
MIXED = Placement(param=0.5, ckpt=0.5, opt=0.5)


def _cfg(path, **kw) -> SnakeConfig:
    return SnakeConfig(**{"micro_batches": 2, "device": "cpu", "offload_dir": path, "alpha": 0.3,
                          "placement": MIXED, "stall_timeout_s": 30.0, **kw})


# -- the reference: one big batch, per token, written out -------------------------------------


def _canon(batch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(input_ids as int64, attention_mask or None, targets aligned with the logits: the
    token each position predicts, -100 where nothing is trained) of any batch form, as
    README defines them: a pair's targets as given; a mapping's labels (the input_ids where
    there are none, -100 where the mask is 0) shifted one to the left."""
    if isinstance(batch, tuple | list):
        x, y = batch
        return x.long().contiguous(), None, y.long().contiguous()
    ids = batch["input_ids"].long()
    mask = batch.get("attention_mask")
    labels = batch.get("labels")
    if labels is None:
        labels = ids.clone()
        if mask is not None:
            labels[~mask.bool()] = IGN
    labels = labels.long()
    y = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGN)], dim=1)
    return ids.contiguous(), None if mask is None else mask.long(), y


def _logits(m, x, mask):
    """The model's logits; a transformers model gets the attention mask (the built-in GPT takes
    ids alone: right padding, which causal attention keeps from every real token)."""
    out = m(input_ids=x, attention_mask=mask) if mask is not None and isinstance(m, tf.PreTrainedModel) else m(x)
    return getattr(out, "logits", out)


def _ce_sum(logits, y) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGN,
                           reduction="sum")


def _reference(model, data, micro: int = 2, *, lr=1e-3, wd=0.01, fused: bool = True):
    """Plain PyTorch: each global batch split in `micro` along dim 0, each micro-batch's
    summed cross-entropy over the targets not -100 divided by the global batch's count of
    them (one big batch's mean), gradients accumulated, then torch's AdamW. The model gets
    the attention mask where the batch has one (transformers' own masked forward). Returns
    (state, each step's loss before its update); the state's `near_eps` marks the elements
    whose gradient was ever nonzero but below NEAR_EPS_GRAD, where AdamW magnifies rounding
    (the masked forward runs other kernels than snake's maskless one; tests/test_hf.py)."""
    m = copy.deepcopy(model)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd, fused=fused)
    losses = []
    near: dict[str, torch.Tensor] = {}
    for batch in data:
        x, mask, y = _canon(batch)
        count = int((y != IGN).sum())
        opt.zero_grad(set_to_none=True)
        total = 0.0
        chunks = zip(x.chunk(micro), (mask.chunk(micro) if mask is not None else [None] * micro), y.chunk(micro),
                     strict=True)
        for xc, mc, yc in chunks:
            loss = _ce_sum(_logits(m, xc, mc), yc) / count
            loss.backward()
            total += float(loss.detach())
        for p in m.parameters():  # fused AdamW reads a gradient as laid out as its parameter
            if p.grad is not None and p.grad.stride() != p.stride():
                p.grad = torch.empty_like(p).copy_(p.grad)
        for n, p in m.named_parameters():
            if p.grad is not None:
                tiny = (p.grad != 0) & (p.grad.abs() < NEAR_EPS_GRAD)
                near[n] = tiny if n not in near else near[n] | tiny
        opt.step()
        losses.append(total)
    want = Want((k, v.detach().clone()) for k, v in m.state_dict().items())
    want.near_eps = near
    return want, losses


def _eval_reference(model, state, data) -> tuple[float, int]:
    """The eval-mode forward of `model` with `state` over `data`: the cross-entropy summed
    over every target not -100, over their count (and the count)."""
    m = copy.deepcopy(model)
    m.load_state_dict(state)
    m.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in data:
            x, mask, y = _canon(batch)
            total += float(_ce_sum(_logits(m, x, mask).double(), y))
            count += int((y != IGN).sum())
    return total / count, count


def _close(got: dict, want: dict, tol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=tol, atol=tol, msg=lambda m, k=k: f"{k}: {m}")


# -- data -------------------------------------------------------------------------------------


def _padded(rows: int, seq: int, lengths: list[int], seed: int, vocab: int = VOCAB):
    """Right-padded rows of the given lengths (0: a row of padding alone): (input_ids with
    padding id 0, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (rows, seq), generator=g)
    mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def _pair(rows: int, seq: int, seed: int, vocab: int = 96):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _small(kind: str, **kw):
    """tests/test_hf.py's model of `kind`, two layers of 32 wide (heads of 8)."""
    return make(kind, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8, **kw)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same values laid out column by column: not contiguous."""
    out = t.t().contiguous().t()
    assert not out.is_contiguous() and torch.equal(out, t)
    return out


def _hf_mixed_forms(seq: int = 12):
    """Three global batches of 4 rows (2 micro-batches of 2), one of each form:
    0. a collator's mapping: input_ids, attention_mask, labels (-100 at the padding), the
       first micro-batch far more padded than the second, one label inside a row -100 too;
    1. a tokenizer's BatchEncoding of int32 input_ids and a bool attention_mask, no labels,
       its first micro-batch nothing but padding (no target trained on there);
    2. the (inputs, targets) pair, targets the next tokens, -100 at the padding."""
    ids0, mask0 = _padded(4, seq, [3, 5, seq, seq - 1], seed=11)
    labels0 = ids0.masked_fill(mask0 == 0, IGN)
    labels0[3, 4] = IGN
    ids1, mask1 = _padded(4, seq, [0, 0, seq, 7], seed=12)
    b1 = tf.BatchEncoding({"input_ids": ids1.int(), "attention_mask": mask1.bool()})
    ids2, mask2 = _padded(4, seq, [seq, 2, 9, seq], seed=13)
    labels2 = ids2.masked_fill(mask2 == 0, IGN)
    y2 = torch.cat([labels2[:, 1:], torch.full((4, 1), IGN)], dim=1)
    return [{"input_ids": ids0, "attention_mask": mask0, "labels": labels0}, b1, (ids2, y2)]


# -- training: weights and losses against the reference --------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("kind,kw", [
    ("llama", {"pad_token_id": 0}),
    ("qwen2", {}),
    ("gemma2", {}),     # eager attention, a sliding window of 4 (rows of 12), soft-capped logits, tied head
    ("mixtral", {}),    # experts, a sliding window of 4
])
async def test_hf_models_train_every_batch_form_as_one_big_masked_batch(tmp_path, kind, kw):
    """A mapping with labels, a BatchEncoding without (int32 ids, a bool mask, one
    micro-batch wholly padding) and a pair, padded on the right unevenly: the weights and
    each step's loss are those of transformers' own masked forward with the mean over the
    global batch's labels that are not -100."""
    model = _small(kind, **kw)
    data = _hf_mixed_forms()
    want, losses = _reference(model, data)
    async with SnakeTrainer(model, data=data, config=_cfg(tmp_path / "off")) as t:
        report = await asyncio.wait_for(t.run(3), T)
        got = await asyncio.wait_for(t.state_dict(), T)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert [s.loss for s in report.steps] == pytest.approx(losses, rel=1e-5), (
        f"{kind}: step losses {[s.loss for s in report.steps]} are not the global per-token means {losses}")
    assert_matches(got, want)


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_gpt_pairs_in_every_form_with_ignored_targets_spread_unevenly(tmp_path, schedule):
    """The built-in GPT, four steps, each batch in another form README accepts: a tuple with
    far more targets ignored in the first micro-batch than the second; a list of two, int32
    inputs, both tensors laid out column by column, the first micro-batch's targets all
    -100; strided views of wider tensors; a mapping of input_ids and attention_mask (right
    padding). Weights and each step's loss are one big batch's."""
    x0, y0 = _pair(4, 16, seed=1)
    y0 = y0.clone()
    y0[:2, 3:] = IGN
    y0[3, :5] = IGN
    x1, y1 = _pair(4, 16, seed=2)
    y1 = y1.clone()
    y1[:2] = IGN
    y1[2, 10:] = IGN
    g = torch.Generator().manual_seed(3)
    wide = torch.randint(0, 96, (4, 33), generator=g)
    x2, y2 = wide[:, 0:32:2], wide[:, 1:33:2]
    assert not x2.is_contiguous() and not y2.is_contiguous()
    ids3, mask3 = _padded(4, 16, [16, 4, 0, 11], seed=4, vocab=96)
    data = [(x0, y0), [_column_major(x1.int()), _column_major(y1)], (x2, y2),
            {"input_ids": ids3, "attention_mask": mask3}]
    model = tiny_gpt(n_layer=2, n_embd=32)
    want, losses = _reference(model, data, fused=False)
    async with SnakeTrainer(model, data=data, config=_cfg(tmp_path / "off", schedule=schedule)) as t:
        report = await asyncio.wait_for(t.run(4), T)
        got = await asyncio.wait_for(t.state_dict(), T)
    assert [s.loss for s in report.steps] == pytest.approx(losses, rel=1e-5), (
        f"step losses {[s.loss for s in report.steps]} are not the global per-token means {losses}")
    _close(got, want)


@pytest.mark.asyncio
async def test_a_micro_batch_with_every_target_ignored_on_ssd_with_m4(tmp_path):
    """Four micro-batches, everything on SSD, every step delayed in part: two micro-batches
    keep no target (one in the middle, one last), the others weigh by what they keep."""
    data = []
    for i in range(2):
        x, y = _pair(8, 12, seed=30 + i)
        y = y.clone()
        y[2:4] = IGN  # the second micro-batch: nothing to train on
        y[6:8] = IGN  # the last one: nothing either
        y[0, 1:] = IGN  # the first keeps 1 + 12 targets, the third 24
        data.append((x, y))
    model = tiny_gpt(n_layer=2, n_embd=32)
    want, losses = _reference(model, data, micro=4, fused=False)
    cfg = _cfg(tmp_path / "off", micro_batches=4, placement=Placement.all_ssd())
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        report = await asyncio.wait_for(t.run(2), T)
        got = await asyncio.wait_for(t.state_dict(), T)
    assert [s.loss for s in report.steps] == pytest.approx(losses, rel=1e-5)
    _close(got, want)


# -- refusals: a clear DataError, nothing trained on the bad batch, the trainer usable -------------


def _bad_later_batches():
    ids, mask = _padded(4, 16, [16, 9, 12, 16], seed=40, vocab=96)
    labels = ids.masked_fill(mask == 0, IGN)
    out_label = labels.clone()
    out_label[1, 5] = 96
    out_id = ids.clone()
    out_id[2, 3] = 96
    neg = labels.clone()
    neg[0, 7] = -1
    x, y = _pair(4, 16, seed=41)
    return {
        "all-padding": ({"input_ids": ids, "attention_mask": torch.zeros_like(mask)}, "every target"),
        "label-past-vocab": ({"input_ids": ids, "attention_mask": mask, "labels": out_label}, r"\[0, 96\)"),
        "id-past-vocab": ({"input_ids": out_id, "attention_mask": mask}, r"\[0, 96\)"),
        "label-negative": ({"input_ids": ids, "attention_mask": mask, "labels": neg}, "min -1"),
        "other-length": ((x[:, :12], y[:, :12]), "keep shapes fixed"),
        "rows-not-divisible": (_pair(3, 16, seed=42), "not divisible"),
    }


@pytest.mark.asyncio
async def test_a_bad_later_batch_ends_the_run_after_the_steps_before_it(tmp_path):
    """For each bad batch: run(2, data=[good, bad]) raises a DataError naming what is wrong,
    its report has the good batch's step, and nothing of the bad one is trained: after all
    of them and a last good step the weights are the reference's over the good batches."""
    cases = _bad_later_batches()
    good = [_pair(4, 16, seed=50 + i) for i in range(len(cases) + 1)]
    model = tiny_gpt(n_layer=2, n_embd=32)
    async with SnakeTrainer(model, data=good[:1], config=_cfg(tmp_path / "off")) as t:
        for i, (case, (bad, says)) in enumerate(cases.items()):
            with pytest.raises(DataError, match=says) as e:
                await asyncio.wait_for(t.run(2, data=[good[i], bad]), T)
            assert len(e.value.report.steps) == 1, f"{case}: {len(e.value.report.steps)} steps reported"
        await asyncio.wait_for(t.run(1, data=good[-1:]), T)
        got = await asyncio.wait_for(t.state_dict(), T)
    _close(got, _reference(model, good, fused=False)[0])


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["attention_mask", "labels", "input_ids"])
@pytest.mark.parametrize("call", ["first-batch", "later-batch", "evaluate"])
async def test_a_mapping_with_a_tensor_on_another_device_is_a_data_error(tmp_path, where, call):
    """README: "Bad configuration and bad input raise ConfigError / DataError / ModelError
    naming the field before any state is written", and a bad batch later in the stream ends
    the run cleanly, the trainer usable; a pair's tensor on the meta device is a DataError
    naming the device (tests/test_bad_input.py). A mapping's attention_mask, labels or
    input_ids (the labels then made from them) there must be too, the trainer going on."""
    ids, mask = _padded(4, 16, [16, 9, 12, 16], seed=60, vocab=96)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGN)}
    batch[where] = batch[where].to("meta")
    if where == "input_ids":
        del batch["labels"]
    good = [_pair(4, 16, seed=61 + i) for i in range(2)]
    off = tmp_path / "off"
    data = {"first-batch": [batch], "later-batch": [good[0], batch], "evaluate": good[:1]}[call]
    async with SnakeTrainer(tiny_gpt(n_layer=2, n_embd=32), data=data, config=_cfg(off)) as t:
        try:
            if call == "evaluate":
                await asyncio.wait_for(t.evaluate([batch]), T)
            else:
                await asyncio.wait_for(t.run(len(data)), T)
        except DataError as exc:
            assert "meta" in str(exc), str(exc)
            if call == "later-batch":
                assert len(exc.report.steps) == 1
        except Exception as exc:  # noqa: BLE001 - what it raised instead is the finding
            pytest.fail(f"{call}: a batch whose {where} is on the meta device raised {type(exc).__name__}: "
                        f"{str(exc)[:160]} instead of a DataError naming the device, "
                        f"{'and closed the trainer' if t._broken else 'a failure'} (snake/data.py:610/620/621: "
                        "_hf_pair reads the mask's and labels' values and mixes their devices before split_batch "
                        "checks the devices at snake/data.py:662; snake/actors/data.py:92 catches DataError alone)")
        else:
            pytest.fail(f"{call}: a batch whose {where} is on the meta device was taken")
        if call == "first-batch":
            assert not list(off.glob("*.bin")), "state was written before the batch was checked"
        await asyncio.wait_for(t.run(1, data=good[1:]), T)


# -- evaluate() -------------------------------------------------------------------------------------


def _hf_eval_batches():
    """Held-out batches unlike the training ones (4 rows of 12): 3 rows of 12 (a mapping with
    labels), 5 rows of 20 (longer than training and than the sliding window; int32 ids, a
    bool mask, no labels), 4 rows whose first two are padding alone (a micro-batch with no
    target), a BatchEncoding, and a pair of 1 row of 7."""
    ids0, mask0 = _padded(3, 12, [12, 4, 9], seed=70)
    ids1, mask1 = _padded(5, 20, [20, 13, 20, 6, 17], seed=71)
    ids2, mask2 = _padded(4, 16, [0, 0, 16, 3], seed=72)
    ids3, mask3 = _padded(2, 10, [10, 8], seed=73)
    x4, y4 = _pair(1, 7, seed=74, vocab=VOCAB)
    y4 = y4.clone()
    y4[0, :3] = IGN
    return [
        {"input_ids": ids0, "attention_mask": mask0, "labels": ids0.masked_fill(mask0 == 0, IGN)},
        {"input_ids": ids1.int(), "attention_mask": mask1.bool()},
        {"input_ids": ids2, "attention_mask": mask2},
        tf.BatchEncoding({"input_ids": ids3, "attention_mask": mask3}),
        (x4, y4),
    ]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
async def test_evaluate_takes_every_batch_form_as_the_models_own_eval_forward(tmp_path, kind):
    """evaluate() before and after two training steps, over batches of other sizes and
    lengths and every form: the loss and the token count of transformers' eval-mode masked
    forward with the same weights; one batch at a time per pass gives the same."""
    model = _small(kind)
    train = _hf_mixed_forms()[:2]
    held = _hf_eval_batches()
    async with SnakeTrainer(model, data=train, config=_cfg(tmp_path / "off")) as t:
        before = await asyncio.wait_for(t.evaluate(held), T)
        await asyncio.wait_for(t.run(2), T)
        after = await asyncio.wait_for(t.evaluate(held), T)
        single = await asyncio.wait_for(t.evaluate(held, batches_per_pass=1), T)
        state = await asyncio.wait_for(t.state_dict(), T)
    want0, count = _eval_reference(model, model.state_dict(), held)
    want1, _ = _eval_reference(model, state, held)
    assert (before.tokens, before.batches) == (count, len(held))
    assert after.tokens == single.tokens == count
    assert before.loss == pytest.approx(want0, rel=1e-5)
    assert after.loss == pytest.approx(want1, rel=1e-5)
    assert single.loss == pytest.approx(want1, rel=1e-5)


@pytest.mark.asyncio
async def test_evaluate_gpt_batch_forms_and_bad_batches_part_way(tmp_path):
    """The GPT's evaluate over a list pair of int32 inputs laid out by column, strided views,
    a mapping and batches of 3 and 5 rows: PyTorch's eval loss and count. A bad batch after
    a good one in the same pass (a row past block_size, an id or a target past the
    vocabulary) is a DataError naming it; every buffer comes back and the trainer trains and
    evaluates on."""
    x0, y0 = _pair(3, 12, seed=80)
    y0 = y0.clone()
    y0[0, :6] = IGN
    g = torch.Generator().manual_seed(81)
    wide = torch.randint(0, 96, (5, 41), generator=g)
    ids2, mask2 = _padded(2, 9, [9, 5], seed=82, vocab=96)
    held = [[_column_major(x0.int()), _column_major(y0)], (wide[:, 0:40:2], wide[:, 1:41:2]),
            {"input_ids": ids2, "attention_mask": mask2}]
    long_x, long_y = _pair(2, 40, seed=83)  # block_size is 32
    bad_id = x0.clone()
    bad_id[1, 2] = 96
    bad_target = y0.clone()
    bad_target[2, 2] = 96
    bads = {"longer than block_size": ((long_x, long_y), "block_size=32"),
            "id past the vocabulary": ((bad_id, y0), r"\[0, 96\)"),
            "target past the vocabulary": ((x0, bad_target), r"\[0, 96\)")}
    model = tiny_gpt(n_layer=2, n_embd=32)
    data = [_pair(4, 16, seed=84 + i) for i in range(2)]
    async with SnakeTrainer(model, data=data, config=_cfg(tmp_path / "off")) as t:
        await asyncio.wait_for(t.run(1), T)
        for name, (bad, says) in bads.items():
            try:
                await asyncio.wait_for(t.evaluate([held[1], bad], batches_per_pass=2), T)
            except DataError as exc:
                assert says.replace("\\", "") in str(exc), f"{name}: {exc}"
            else:
                pytest.fail(f"evaluate() took a batch {name}")
            assert t.engine is not None
            t.engine.check_pools()
        await asyncio.wait_for(t.run(1), T)
        report = await asyncio.wait_for(t.evaluate(held), T)
        state = await asyncio.wait_for(t.state_dict(), T)
    want, count = _eval_reference(model, state, held)
    assert (report.tokens, report.batches) == (count, 3)
    assert report.loss == pytest.approx(want, rel=1e-5)
    _close(state, _reference(model, data, fused=False)[0])
