"""An audit of what comes out of a trainer: `evaluate()` against plain PyTorch's loss of the
same weights, `state_dict()` against PyTorch's training and the model's own names, dtypes and
buffers, the exports (`snake export --hf/--peft`, `snake.hf.export_hf`, PEFT's
`save_pretrained`) against the trained logits, and misuse of these calls (during a run, on a
closed trainer, bad or no data, twice, at once, from another event loop)."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from snake import AdamW, DataError, DataExhausted, Placement, SnakeConfig, SnakeError, SnakeTrainer
from snake.cli import main as cli
from tests.helpers import StackLM, assert_close_state, batches, kinds_parts, reference, tiny_gpt

MIXED = Placement(param=0.5, ckpt=0.5, opt=0.5)

# (PEFT's own warnings: reading transformers' deprecated flag, tying, saving an adapted embedding)
pytestmark = [pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
              pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning"),
              pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers` to `True`:UserWarning")]


def held_out() -> list:
    """Two batches unlike training's: 3 and 5 rows, 12 and 16 tokens, some targets -100
    (a whole row of one micro-batch among them)."""
    a = batches(1, 3, seq=12, seed=7)[0]
    x, y = batches(1, 5, seq=16, seed=8)[0]
    y = y.clone()
    y[0, :5] = -100
    y[4, :] = -100
    return [a, (x, y)]


def torch_loss(model: nn.Module, state: dict, data, dtype: torch.dtype | None = None) -> float:
    """PyTorch: `model` (in `dtype`) with `state` loaded strictly, eval mode, no grad; the
    cross-entropy summed over every target not -100 over their count. Hugging Face models'
    `.logits` too."""
    m = copy.deepcopy(model)
    if dtype is not None:
        m = m.to(dtype)
    m.load_state_dict(state, strict=True)
    m.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in data:
            out = m(x)
            logits = getattr(out, "logits", out)
            total += float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                           ignore_index=-100, reduction="sum"))
            count += int((y != -100).sum())
    return total / count


def cfg(path, **kw) -> SnakeConfig:
    return SnakeConfig(**{"micro_batches": 2, "offload_dir": path, "placement": MIXED, "alpha": 0.3,
                          "device": "cpu", **kw})


# -- evaluate against PyTorch -------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("dtype,placement,alpha,schedule,micro", [
    ("float32", Placement.all_cpu(), 0.0, "vertical", 1),
    ("float32", Placement.all_ssd(), 0.5, "vertical", 4),
    ("bfloat16", Placement.all_ssd(), 0.5, "vertical", 4),
    ("bfloat16", MIXED, 0.5, "horizontal", 2),
    ("float16", MIXED, 0.5, "vertical", 2),
], ids=["fp32-cpu-m1", "fp32-ssd-m4-delayed", "bf16-ssd-m4-delayed", "bf16-horizontal", "fp16-delayed"])
async def test_evaluate_equals_pytorch_on_the_same_weights(tmp_path, dtype, placement, alpha, schedule, micro):
    """Three steps with delayed shares pending, then evaluate: PyTorch's loss of the
    state_dict's weights in the compute dtype, to 1e-6 (measured 1e-8 to 5e-8); the
    evaluation with dropout off, though the model has dropout."""
    model = tiny_gpt(n_layer=3, dropout=0.1)
    data = held_out()
    async with SnakeTrainer(model, data=batches(4, 4), config=cfg(tmp_path, placement=placement, alpha=alpha,
                                                                 schedule=schedule, micro_batches=micro,
                                                                 dtype=dtype)) as t:
        await t.run(3)
        report = await t.evaluate(data)
        state = await t.state_dict()
    want = torch_loss(model, state, data, getattr(torch, dtype))
    assert report.tokens == 3 * 12 + 5 * 16 - 5 - 16
    assert report.loss == pytest.approx(want, rel=1e-6)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["data-ran-out", "stopped", "clipped", "resident-on-ssd"])
async def test_evaluate_and_state_dict_after_delayed_steps_are_pytorchs(tmp_path, how):
    """With alpha > 0 the last step's delayed share is pending when the run ends (data that ran
    out part-way, a stop(), clipping's alpha 1, the resident state on SSD): state_dict holds
    PyTorch's weights of the steps trained, and evaluate their loss."""
    model = tiny_gpt(n_layer=3, bias=False)  # no bias: no element whose gradient stays near eps
    data = batches(8, 4)
    kw, ref_kw = dict(alpha=0.5), {}
    if how == "clipped":
        kw, ref_kw = dict(alpha=1.0, optimizer=AdamW(max_grad_norm=0.3),
                          placement=Placement(param=0.5, ckpt=0.5, opt=0.5, grad=0.0)), dict(max_norm=0.3)
    if how == "resident-on-ssd":
        kw.update(placement=Placement.all_ssd(), resident_optimizer="ssd")
    source = iter(data[:3]) if how == "data-ran-out" else data
    async with SnakeTrainer(model, data=source, config=cfg(tmp_path, **kw)) as t:
        if how == "data-ran-out":
            with pytest.raises(DataExhausted):
                await t.run(5)
            steps = 3
        elif how == "stopped":
            seen = []

            def on_step(report):
                seen.append(report)
                if len(seen) == 2:
                    t.stop()

            report = await t.run(6, on_step=on_step)
            assert report.stopped
            steps = len(report.steps)
        else:
            await t.run(3)
            steps = 3
        ev = await t.evaluate(held_out())
        got = await t.state_dict()
    want, _ = reference(model, data[:steps], 2, **ref_kw)
    assert_close_state(got, want)
    assert ev.loss == pytest.approx(torch_loss(model, want, held_out()), rel=1e-6)


def hf_held(vocab: int) -> list:
    return [batches(1, 3, seq=12, vocab=vocab, seed=5)[0], batches(1, 5, seq=7, vocab=vocab, seed=6)[0]]


@pytest.mark.asyncio
@pytest.mark.parametrize("case", ["tied-bf16-m4", "tied-frozen-embedding-and-layer", "gpt2-all-ssd-horizontal"])
async def test_hugging_face_outputs_are_the_models_own(tmp_path, case):
    """Hugging Face models with tied embeddings (bf16, fp32 with the tied embedding and the
    bottom layer frozen, GPT-2): evaluate equals the model's own eval loss of the state_dict
    (to 1e-6), the state_dict has the model's keys (both names of the tied weight, equal),
    loads strictly, is the same twice, and keeps every frozen parameter and buffer as it was
    (also before the first run)."""
    from tests.test_hf import VOCAB, bf16_copy, make

    dtype, kw = "float32", {}
    if case == "tied-bf16-m4":
        model = bf16_copy("llama", tie_word_embeddings=True)
        dtype, kw = "bfloat16", dict(micro_batches=4, alpha=0.5)
    elif case == "tied-frozen-embedding-and-layer":
        model = make("llama", tie_word_embeddings=True)
        model.model.embed_tokens.requires_grad_(False)
        model.model.layers[0].requires_grad_(False)
    else:
        model = make("gpt2")
        kw = dict(placement=Placement.all_ssd(), schedule="horizontal")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trained = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    held = hf_held(VOCAB)
    async with SnakeTrainer(model, data=batches(3, 4, vocab=VOCAB), config=cfg(tmp_path, dtype=dtype, **kw)) as t:
        initial = await t.state_dict()
        await t.run(3)
        report = await t.evaluate(held)
        state = await t.state_dict()
        again = await t.state_dict()
    assert state.keys() == initial.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(initial[k].to(v.dtype), v), k
        assert torch.equal(state[k], again[k]), k
        if k not in trained:
            assert torch.equal(state[k].to(v.dtype), v), k
    head, emb = ("lm_head.weight", "transformer.wte.weight") if case.startswith("gpt2") else (
        "lm_head.weight", "model.embed_tokens.weight")
    assert torch.equal(state[head], state[emb])
    want = torch_loss(model, state, held)  # (a bf16 model already: .to() would round its fp32 rotary table)
    assert report.loss == pytest.approx(want, rel=1e-6)


@pytest.mark.asyncio
async def test_each_layers_own_buffers_come_out_as_they_were(tmp_path):
    """Gemma 4's `layer_scalar`, another in every layer (each layer's value swapped into the
    kind's one shell): state_dict gives each layer its own, unchanged, and evaluate computes
    with them."""
    from tests.test_hf import VOCAB, make

    model = make("gemma4moe")
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.copy_(torch.rand(layer.layer_scalar.shape, generator=g) + 0.5)
    buffers = {k: v.clone() for k, v in model.named_buffers() if k in model.state_dict()}
    assert len({float(v.flatten()[0]) for k, v in buffers.items() if "layer_scalar" in k}) == 3
    held = hf_held(VOCAB)
    async with SnakeTrainer(model, data=batches(3, 4, vocab=VOCAB), config=cfg(tmp_path)) as t:
        await t.run(2)
        report = await t.evaluate(held)
        state = await t.state_dict()
    for k, v in buffers.items():
        assert torch.equal(state[k].to(v.dtype), v), k
    assert report.loss == pytest.approx(torch_loss(model, state, held), rel=1e-6)


@pytest.mark.asyncio
async def test_hugging_face_batches_evaluate_as_the_models_own_loss(tmp_path):
    """A mapping batch (input_ids, attention_mask with padding on the right, labels -100 at
    the padding): evaluate equals `model(**batch).loss` of the trained weights; without the
    mask the same."""
    from tests.test_hf import VOCAB, make

    model = make("llama")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, VOCAB, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    mask[2, 8:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    async with SnakeTrainer(model, data=batches(3, 4, vocab=VOCAB), config=cfg(tmp_path)) as t:
        await t.run(2)
        with_mask = await t.evaluate([{"input_ids": ids, "attention_mask": mask, "labels": labels}])
        without = await t.evaluate([{"input_ids": ids, "labels": labels}])
        state = await t.state_dict()
    m = copy.deepcopy(model)
    m.load_state_dict(state, strict=True)
    with torch.no_grad():
        want = float(m.eval()(input_ids=ids, attention_mask=mask, labels=labels).loss)
    assert with_mask.loss == without.loss == pytest.approx(want, rel=1e-6)
    assert with_mask.tokens == int((labels[:, 1:] != -100).sum())


# -- PEFT ---------------------------------------------------------------------------------


def _lora(kind: str, targets: list[str], **kw):
    """A PEFT LoRA model of the test model `kind` (make's `kw`; `dtype`: built so), B away
    from its zero start."""
    from peft import LoraConfig, get_peft_model

    from tests.test_hf import bf16_copy, make

    dtype = kw.pop("dtype", None)
    base = bf16_copy(kind, **kw) if dtype == torch.bfloat16 else make(kind, **kw)
    torch.manual_seed(3)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                            target_modules=targets))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


@pytest.mark.asyncio
@pytest.mark.parametrize("case", ["bf16-base-fp32-adapters", "tied-embedding-adapted"])
async def test_lora_evaluate_state_dict_and_exports(tmp_path, case):
    """LoRA of a bf16 base (fp32 adapters held on the device) and of a tied embedding:
    evaluate equals the PEFT model's own loss with the state_dict loaded strictly into its
    base; PEFT's save_pretrained of those weights, `snake export --peft` and `--hf` (merged,
    saved with its base) each load back with the trained logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.test_hf import VOCAB, bf16_copy, make

    if case == "bf16-base-fp32-adapters":
        def base():
            return bf16_copy("llama")

        model = _lora("llama", ["q_proj", "v_proj", "down_proj"], dtype=torch.bfloat16)
        dtype, merged_atol = "bfloat16", 1e-2  # merged into bf16 weights: rounded
    else:
        def base():
            return make("llama", tie_word_embeddings=True)

        model = _lora("llama", ["q_proj", "embed_tokens"], tie_word_embeddings=True)
        dtype, merged_atol = "float32", 1e-5
    held = hf_held(VOCAB)
    async with SnakeTrainer(model, data=batches(3, 4, vocab=VOCAB), config=cfg(tmp_path / "off", dtype=dtype)) as t:
        await t.run(3)
        report = await t.evaluate(held)
        await t.save(tmp_path / "ckpt", frozen=True)
        state = await t.state_dict()
        trained = await t.state_dict(trained_only=True)
    inner = model.get_base_model()
    assert state.keys() == inner.state_dict().keys()
    assert trained.keys() == {n for n, p in inner.named_parameters() if p.requires_grad}
    for k, v in trained.items():
        assert torch.equal(state[k], v), k
    ref = copy.deepcopy(model)
    ref.get_base_model().load_state_dict(state, strict=True)
    ref.eval()
    assert report.loss == pytest.approx(torch_loss(ref.get_base_model(), state, held), rel=1e-6)
    x = held[0][0]
    with torch.no_grad():
        want = ref(x).logits.float()
    ref.save_pretrained(str(tmp_path / "by-peft"))
    assert cli(["export", str(tmp_path / "ckpt"), "--peft", str(tmp_path / "by-snake")]) == 0
    for d in ("by-peft", "by-snake"):
        again = PeftModel.from_pretrained(base(), str(tmp_path / d)).eval()
        with torch.no_grad():
            torch.testing.assert_close(again(x).logits.float(), want, rtol=0, atol=1e-6)
    assert cli(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits.float(), want, rtol=0, atol=merged_atol)


# -- exports ------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("case", ["llama-tied", "llama-bf16", "gpt2", "builtin-gpt"])
async def test_exports_reproduce_the_trained_logits_in_the_models_dtype(tmp_path, case):
    """With delayed steps pending at the save: `snake export --hf` of the checkpoint and
    (for Hugging Face models) `export_hf(state_dict, fresh copy)` load with from_pretrained
    and give the trained weights' logits exactly, stored in the model's own dtype, a tied
    head tied."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from snake.hf import export_hf
    from tests.test_hf import VOCAB, bf16_copy, make

    dtype, vocab = "float32", VOCAB
    if case == "llama-tied":
        model = make("llama", tie_word_embeddings=True)
    elif case == "llama-bf16":
        model, dtype = bf16_copy("llama"), "bfloat16"
    elif case == "gpt2":
        model = make("gpt2")
    else:
        model, vocab = tiny_gpt(n_layer=2), 96
    data = batches(3, 4, vocab=vocab)
    async with SnakeTrainer(model, data=data, config=cfg(tmp_path / "off", alpha=0.5, dtype=dtype)) as t:
        await t.run(3)
        await t.save(tmp_path / "ckpt")
        state = await t.state_dict()
    trained = copy.deepcopy(model)
    trained.load_state_dict(state, strict=True)
    x = data[0][0]
    with torch.no_grad():
        out = trained.eval()(x)
        want = getattr(out, "logits", out).float()
    assert cli(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "cli")]) == 0
    outs = ["cli"]
    if case != "builtin-gpt":
        export_hf(state, copy.deepcopy(model), tmp_path / "inproc")
        outs.append("inproc")
    for d in outs:
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / d)).eval()
        with torch.no_grad():
            torch.testing.assert_close(hf(x).logits.float(), want, rtol=1e-5, atol=1e-5 if case == "builtin-gpt" else 0)
        assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight or case == "llama-bf16"
        with safe_open(str(tmp_path / d / "model.safetensors"), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16" if dtype == "bfloat16" else "F32"}


# -- misuse -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_calls_during_a_run_at_once_and_on_a_closed_trainer_are_refused_by_name(tmp_path):
    """evaluate/state_dict/save while a run is in progress, or two at once: a SnakeError
    naming the call in progress; the run and the trainer go on (evaluating twice gives the
    same loss). On a closed trainer each says it is closed."""
    model = tiny_gpt(n_layer=2)
    async with SnakeTrainer(model, data=batches(40, 4), config=cfg(tmp_path / "off")) as t:
        await t.run(1)
        run = asyncio.create_task(t.run(20))
        await asyncio.sleep(0.05)
        assert not run.done()
        with pytest.raises(SnakeError, match=r"evaluate: .* in progress \(run\(\) now\)"):
            await t.evaluate(held_out())
        with pytest.raises(SnakeError, match=r"state_dict: .* in progress \(run\(\) now\)"):
            await t.state_dict()
        with pytest.raises(SnakeError, match=r"in progress \(run\(\) now\)"):
            await t.save(tmp_path / "ckpt")
        assert len((await run).steps) == 20
        first, second, third = await asyncio.gather(t.evaluate(held_out()), t.evaluate(held_out()), t.state_dict(),
                                                    return_exceptions=True)
        assert isinstance(second, SnakeError) and "evaluate() now" in str(second)
        assert isinstance(third, SnakeError) and "evaluate() now" in str(third)
        again = await t.evaluate(held_out())
        assert again.loss == first.loss
        state = await t.state_dict()
        assert again.loss == pytest.approx(torch_loss(model, state, held_out()), rel=1e-6)
        t.engine.check_pools()
    for call in (lambda: t.evaluate(held_out()), t.state_dict, lambda: t.save(tmp_path / "late")):
        with pytest.raises(SnakeError, match="closed"):
            await call()


@pytest.mark.asyncio
async def test_bad_or_no_evaluation_data_is_refused_and_the_trainer_goes_on(tmp_path):
    """Wrong shapes, dtypes and ids, in the first batch or a later one, a next() that raises,
    no batch at all (a list, an iterator, an async generator): each a DataError naming the
    problem, every buffer back, and the trainer trains and evaluates on."""
    from tests.test_hf import VOCAB, make

    async def nothing():
        return
        yield

    def raising():
        yield batches(1, 2, seq=8, vocab=VOCAB)[0]
        raise RuntimeError("disk gone")

    ok = batches(1, 2, seq=8, vocab=VOCAB)[0]
    z = torch.zeros(2, 5, dtype=torch.long)
    cases = [
        ([batches(1, 2, seq=40, vocab=VOCAB)[0]], "exceeds the model's n_positions=32"),
        ([ok, batches(1, 2, seq=40, vocab=VOCAB)[0]], "exceeds the model's n_positions=32"),
        ([ok, (torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long))], r"shape \(batch, seq\)"),
        ([(z, torch.zeros(2, 4, dtype=torch.long))], "disagree in shape"),
        ([ok, (z.float(), z)], "integer token ids"),
        ([(z, z - 1)], ">= 0 or -100"),
        ([(z, z + VOCAB)], rf"in \[0, {VOCAB}\)"),
        ([(z + VOCAB, z)], "token ids must be in"),
        (raising(), "RuntimeError: disk gone"),
        ([], "no batch"),
        (iter([]), "no batch"),
        (nothing(), "no batch"),
    ]
    async with SnakeTrainer(make("gpt2"), data=batches(4, 4, vocab=VOCAB),
                            config=cfg(tmp_path, placement=Placement.all_ssd())) as t:
        await t.run(1)
        want = await t.evaluate([ok])
        for data, message in cases:
            with pytest.raises(DataError, match=message):
                await t.evaluate(data)
            t.engine.check_pools()
            assert (await t.evaluate([ok])).loss == want.loss
        await t.run(1)
        assert (await t.evaluate([ok, ok])).batches == 2


@pytest.mark.asyncio
async def test_a_loaded_trainer_evaluates_and_gives_the_saved_weights(tmp_path):
    """Saved with delayed steps pending, loaded into a new trainer (no run): evaluate and
    state_dict are the saving trainer's, bitwise."""
    def config(d):
        return cfg(tmp_path / d, placement=Placement.all_ssd(), alpha=0.5)

    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(4, 4), config=config("a")) as t:
        await t.run(2)
        await t.save(tmp_path / "ckpt")
        saved_eval = await t.evaluate(held_out())
        saved = await t.state_dict()
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(4, 4), config=config("b")) as t:
        await t.load(tmp_path / "ckpt")
        loaded_eval = await t.evaluate(held_out())
        loaded = await t.state_dict()
    assert loaded_eval.loss == saved_eval.loss
    assert loaded.keys() == saved.keys()
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), k


def test_an_evaluation_before_the_first_run_in_its_own_loop_with_listed_data(tmp_path):
    """README: a load() or evaluate() before the first run may run in another event loop (a
    script's asyncio.run() per phase): with a list of batches, the evaluation is of the
    model as given and the run then trains PyTorch's weights."""
    model = tiny_gpt(n_layer=2, bias=False)
    data = batches(3, 4)
    t = SnakeTrainer(model, data=data, config=cfg(tmp_path, alpha=0.5))
    first = asyncio.run(t.evaluate(held_out()))

    async def train():
        try:
            report = await t.run(3)
            return report, await t.state_dict()
        finally:
            await t.close()

    report, state = asyncio.run(train())
    assert len(report.steps) == 3
    assert first.loss == pytest.approx(torch_loss(model, model.state_dict(), held_out()), rel=1e-6)
    assert_close_state(state, reference(model, data, 2)[0])


# -- what this audit found (round 43), each fixed -------------------------------------------


def test_an_evaluation_before_the_first_run_in_its_own_loop_keeps_async_generator_data(tmp_path):
    """Fixed in round 43 (was: The same with the training data an async generator: evaluate() before the first
    run sets the engine up from the training data's first batch, iterating the generator on
    the evaluation's loop; `asyncio.run` closes the async generators of its loop as it ends,
    so the later run gets that one batch and then DataExhausted ("ran out after 1 global
    batches") though the data has 3. An async iterator that is not a generator, or both
    phases in one loop, train the 3 steps.)"""
    data = batches(3, 4)

    async def stream():
        for b in data:
            yield b

    t = SnakeTrainer(tiny_gpt(n_layer=2), data=stream(), config=cfg(tmp_path, alpha=0.0))
    asyncio.run(t.evaluate(held_out()))

    async def train():
        try:
            return await t.run(3)
        finally:
            await t.close()

    assert len(asyncio.run(train()).steps) == 3


class _ScaledBlock(nn.Module):
    """A block with float64 buffers (a scale and a per-channel gain) and an int64 one."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("scale", torch.tensor(1.0 + 1e-9, dtype=torch.float64))
        self.register_buffer("gain", torch.full((d,), 1.0 + 1e-9, dtype=torch.float64))
        self.register_buffer("idx", torch.tensor(7))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h)) * self.scale


@pytest.mark.asyncio
async def test_state_dict_keeps_buffers_in_the_models_own_dtype(tmp_path):
    """Fixed in round 43 (was: state_dict() gives every floating buffer as float32 (`snake.state_dict`'s
    `assemble_state_dict` and `initial_state_dict`: `value.float()`), so a float64 buffer of 1 + 1e-9 comes out 1.0 and
    `model.load_state_dict(state, strict=True)` writes that rounding into a buffer that
    never trains. The evaluation itself computes with the float64 value.)"""
    torch.manual_seed(0)
    model = StackLM(_ScaledBlock, n=3, d=16, vocab=96)
    own = {k: v.clone() for k, v in model.state_dict().items()}
    async with SnakeTrainer(kinds_parts(model), data=batches(3, 4), config=cfg(tmp_path)) as t:
        before = await t.state_dict()
        await t.run(2)
        report = await t.evaluate(held_out())
        state = await t.state_dict()
    assert report.loss == pytest.approx(torch_loss(model, state, held_out()), rel=1e-6)
    for got in (before, state):
        for k in ("layers.0.idx", "layers.1.scale", "layers.2.gain"):
            assert got[k].dtype == own[k].dtype, (k, got[k].dtype, own[k].dtype)
            assert torch.equal(got[k], own[k]), k


@pytest.mark.asyncio
async def test_state_dict_holds_the_frozen_weights_the_trainer_computes_with(tmp_path):
    """Fixed in round 43 (was: README: snake trains its own copy, "changes made to the model meanwhile are not
    seen by the trainer". A frozen position table (resident, outside the layers) changed in
    the model after a run: evaluate() still computes with the trainer's copy (unchanged loss),
    but state_dict() reads the frozen resident parameter from the live model
    (`assemble_state_dict`'s "buffers and frozen parameters, as they are"), so the weights it
    returns are not the ones the trainer trains and evaluates with: PyTorch's loss of them is
    not evaluate()'s.)"""
    model = tiny_gpt(n_layer=2, bias=False)
    model.wpe.weight.requires_grad_(False)
    async with SnakeTrainer(model, data=batches(3, 4), config=cfg(tmp_path, alpha=0.0)) as t:
        await t.run(1)
        before = await t.state_dict()
        with torch.no_grad():
            model.wpe.weight.mul_(3.0)
        report = await t.evaluate(held_out())
        with pytest.warns(UserWarning, match="wpe.weight was changed in place after the trainer was built"):
            after = await t.state_dict()
        with pytest.warns(UserWarning, match="the checkpoint holds the model's changed value"):
            await t.save(tmp_path / "ckpt")
    assert report.loss == pytest.approx(torch_loss(model, before, held_out()), rel=1e-6)  # the trainer's copy
    assert report.loss == pytest.approx(torch_loss(model, after, held_out()), rel=1e-6)
    assert torch.equal(after["wpe.weight"], before["wpe.weight"])


@pytest.mark.asyncio
async def test_export_of_a_builtin_gpt_with_its_own_head_keeps_the_trained_head(tmp_path):
    """Fixed in round 43 (was: A built-in GPT whose head was given a weight of its own (untied) trains it, and
    state_dict() holds it; `snake export --hf` writes a GPT-2 tied to the embedding
    (`snake.export.gpt_to_gpt2`: `lm_head.weight = wte.weight`, tie_word_embeddings=True),
    dropping the trained head without a word: the exported model's logits are 0.88 off.
    Expected: the trained head exported (untied), or the export refused by name.)"""
    from transformers import AutoModelForCausalLM

    model = tiny_gpt(n_layer=2)
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone() * 2.0)
    data = batches(3, 4)
    async with SnakeTrainer(model, data=data, config=cfg(tmp_path / "off")) as t:
        await t.run(2)
        await t.save(tmp_path / "ckpt")
        state = await t.state_dict()
    assert not torch.equal(state["lm_head.weight"], state["wte.weight"])
    trained = copy.deepcopy(model)
    trained.load_state_dict(state, strict=True)
    assert cli(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    x = data[0][0]
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, trained.eval()(x), rtol=1e-4, atol=1e-5)


@pytest.mark.asyncio
async def test_export_of_a_builtin_gpt_changed_beyond_gpt2s_shape_is_refused_by_name(tmp_path, capsys):
    """A head given a bias after the GPT was built: GPT-2 has no place for it, and the export
    says so instead of dropping it (`gpt_to_gpt2`)."""
    model = tiny_gpt(n_layer=2)
    head = nn.Linear(model.wte.weight.shape[1], model.wte.weight.shape[0], bias=True)
    head.weight = model.wte.weight
    model.lm_head = head
    async with SnakeTrainer(model, data=batches(2, 4), config=cfg(tmp_path / "off")) as t:
        await t.run(1)
        await t.save(tmp_path / "ckpt")
    assert cli(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) != 0
    assert "lm_head.bias" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
