"""An audit of snake.hf under Hugging Face configuration options tests/test_hf.py does not
try: rope scaling (linear, dynamic, YaRN, Llama 3, LongRoPE), attention and MLP biases,
tied and untied heads, head_dim other than hidden / heads, one key-value head, windows
shorter than odd-length sequences under SDPA and eager attention, many experts (some get no
token in a micro-batch), one and three micro-batches, bf16, and dropout anywhere in the
model (reproduced exactly by a reference that seeds the generator as snake does); also
streamed and PEFT models of such configurations and the options snake refuses by name."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import warnings

import pytest
import torch
from torch import nn

from snake import ModelError, SnakeTrainer
from snake.adapters import describe
from snake.kernels import Kernels
from tests.helpers import batches, mixed_reference
from tests.test_hf import (
    OLD,
    VOCAB,
    assert_matches,
    assert_mixed_precision,
    bf16_copy,
    make,
    parts_logits,
    reference,
    snake_config,
)

ROPE = 10000.0
LINEAR = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": ROPE}}
# dynamic NTK and YaRN past a short original context (8 tokens; the tests' rows are 13)
DYNAMIC = {"max_position_embeddings": 8, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": ROPE}}
YARN = {"rope_parameters": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8, "rope_theta": ROPE}}
LLAMA3 = {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8, "rope_theta": ROPE}}
# Phi-3's LongRoPE on half of each head (short factors up to 8 tokens, long ones past them)
LONGROPE = {"partial_rotary_factor": 0.5, "max_position_embeddings": 64, "original_max_position_embeddings": 8,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": ROPE, "short_factor": [1.0] * 4,
                                "long_factor": [2.0, 3.0, 4.0, 5.0], "original_max_position_embeddings": 8,
                                "partial_rotary_factor": 0.5}}
DSV3_YARN = {"rope_parameters": {"rope_type": "yarn", "rope_theta": ROPE, "factor": 4.0, "original_max_position_embeddings": 8,
                                 "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}}
GEMMA3_SCALED = {"sliding_window": 5, "rope_parameters": {
    "sliding_attention": {"rope_type": "default", "rope_theta": ROPE},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}}
BIASES = {"attention_bias": True, "mlp_bias": True}
QWEN2_SWA = {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}  # layers 1 and 2 windowed
UNTIED = {"tie_word_embeddings": False}

# (test id, family, options): ~12 families (dense, windowed, MoE, latent attention, hybrids,
# older layouts) under options tests/test_hf.py leaves at their defaults
VARIANTS = [
    ("llama-linear-bias-mqa", "llama", {**LINEAR, **BIASES, "num_key_value_heads": 1}),
    ("llama-dynamic", "llama", DYNAMIC),
    ("llama-yarn-head24-tied", "llama", {**YARN, "head_dim": 24, "tie_word_embeddings": True}),
    ("llama-llama3", "llama", LLAMA3),
    ("qwen2-swa-from-layer1", "qwen2", QWEN2_SWA),
    ("qwen3-yarn-bias-mqa", "qwen3", {**YARN, "attention_bias": True, "num_key_value_heads": 1, "head_dim": 24}),
    ("mistral-window5-mqa", "mistral", {"sliding_window": 5, "num_key_value_heads": 1, "head_dim": 8}),
    ("gemma2-window5-softcap", "gemma2", {"sliding_window": 5, "attn_logit_softcapping": 20.0, "query_pre_attn_scalar": 8}),
    ("gemma3-window5-scaled-global", "gemma3", GEMMA3_SCALED),
    ("phi3-longrope-partial", "phi3", LONGROPE),
    ("phi3-window5", "phi3", {"sliding_window": 5}),
    ("mixtral-16-experts", "mixtral", {"num_local_experts": 16, "num_experts_per_tok": 2, "sliding_window": 5}),
    ("qwen3moe-every-other", "qwen3moe", {"decoder_sparse_step": 2, "num_experts": 16, "num_experts_per_tok": 2}),
    ("olmoe-16-experts", "olmoe", {"num_experts": 16, "num_experts_per_tok": 2}),
    ("deepseekv3-yarn-16-experts", "deepseekv3", {**DSV3_YARN, "n_routed_experts": 16}),
    ("deepseekv3-no-interleave", "deepseekv3", {"rope_interleave": False}),
    ("llama4-nope-chunk5", "llama4", {"no_rope_layers": [1, 0, 1], "floor_scale": 4, "attention_chunk_size": 5}),
    ("qwen3next", "qwen3next", {}),
    ("jamba", "jamba", {}),
    ("lfm2", "lfm2", {}),
    ("cohere-qknorm-bias-tied", "cohere", {"use_qk_norm": True, "attention_bias": True, "tie_word_embeddings": True}),
    ("gpt2-upcast-inverse-scaled", "gpt2", {"reorder_and_upcast_attn": True, "scale_attn_by_inverse_layer_idx": True}),
    ("neox-linear-rope", "neox", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": ROPE,
                                                      "partial_rotary_factor": 0.5}}),
    ("falcon-dynamic-mqa", "falcon_new", {**DYNAMIC, "num_kv_heads": 1}),
    ("bloom-post-norm-residual", "bloom", {"apply_residual_connection_post_layernorm": True}),
    ("opt-no-bias", "opt", {"enable_bias": False, "layer_norm_elementwise_affine": False}),
    ("gptneo-window5", "neo", {"window_size": 5}),
]
BY_ID = {name: (kind, kw) for name, kind, kw in VARIANTS}
# transformers runs these with eager attention only (tests/test_hf.py's make picks it)
EAGER_ONLY = ("gemma2", "bloom", "neo")


def _ids(cases):
    return [c[0] for c in cases]


LOGITS = [(name, kind, kw, attn) for attn in ("sdpa", "eager") for name, kind, kw in VARIANTS
          if not (attn == "sdpa" and kind in EAGER_ONLY)]


@pytest.mark.parametrize("name,kind,kw,attn", LOGITS, ids=[f"{n}-{a}" for n, _, _, a in LOGITS])
def test_parts_give_the_models_logits_for_odd_lengths(name, kind, kw, attn):
    """The described parts give the model's own logits for rows of 7 and 13 tokens (around
    windows of 4-5, chunks of 5, rope contexts of 8), within 1e-5."""
    model = make(kind, attn, **kw).eval()
    parts = describe(model)
    for T in (7, 13):
        idx = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            torch.testing.assert_close(parts_logits(parts, idx), model(idx).logits, rtol=0, atol=1e-5,
                                       msg=lambda m, T=T: f"T={T}: {m}")


async def _train(model, data, tmp_path, micro: int, *, dtype: str = "float32", steps: int = 3,
                 schedule: str = "vertical") -> dict[str, torch.Tensor]:
    cfg = dataclasses.replace(snake_config(tmp_path, schedule, dtype), micro_batches=micro)
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(steps), timeout=120)
        return await trainer.state_dict()


def _data(micro: int, T: int, n: int = 3):
    return batches(n, 2 * micro, seq=T, vocab=VOCAB)


# (variant, micro-batches, row length, attention)
TRAIN = [
    ("llama-linear-bias-mqa", 3, 13, "sdpa"),
    ("llama-dynamic", 1, 13, "sdpa"),
    ("llama-yarn-head24-tied", 3, 7, "eager"),
    ("llama-llama3", 1, 7, "sdpa"),
    ("qwen2-swa-from-layer1", 3, 13, "sdpa"),
    ("qwen2-swa-from-layer1", 1, 13, "eager"),
    ("qwen3-yarn-bias-mqa", 3, 13, "sdpa"),
    ("mistral-window5-mqa", 3, 13, "eager"),
    ("gemma2-window5-softcap", 3, 13, "eager"),
    ("gemma3-window5-scaled-global", 3, 13, "sdpa"),
    ("phi3-longrope-partial", 3, 13, "sdpa"),
    ("mixtral-16-experts", 3, 7, "sdpa"),
    ("qwen3moe-every-other", 3, 7, "sdpa"),
    ("deepseekv3-yarn-16-experts", 3, 7, "sdpa"),
    ("llama4-nope-chunk5", 3, 13, "sdpa"),
    ("qwen3next", 3, 13, "sdpa"),
    ("lfm2", 3, 13, "eager"),
    ("cohere-qknorm-bias-tied", 3, 13, "sdpa"),
    ("gpt2-upcast-inverse-scaled", 3, 13, "sdpa"),
    ("falcon-dynamic-mqa", 3, 13, "sdpa"),
    ("bloom-post-norm-residual", 1, 13, "eager"),
    ("opt-no-bias", 3, 13, "sdpa"),
    ("olmoe-16-experts", 1, 13, "sdpa"),
    ("deepseekv3-no-interleave", 1, 13, "eager"),
    ("jamba", 3, 13, "sdpa"),
    ("neox-linear-rope", 3, 7, "eager"),
    ("gptneo-window5", 3, 13, "eager"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("name,micro,T,attn", TRAIN, ids=[f"{n}-m{m}-T{t}-{a}" for n, m, t, a in TRAIN])
async def test_training_matches_plain_pytorch(tmp_path, name, micro, T, attn):
    """Three steps of gradient accumulation + AdamW give plain PyTorch's weights (the
    bounds of tests/test_hf.py). (MoE variants route to 2 of 16 experts: with one, the
    normalised routing weight is 1 and the router's gradient is rounding noise, which AdamW
    turns into steps no two implementations share.)"""
    kind, kw = BY_ID[name]
    model = make(kind, attn, **kw)
    data = _data(micro, T)
    want = reference(model, data, micro)
    assert_matches(await _train(model, data, tmp_path, micro), want)


BF16 = [
    ("mistral-window5-mqa", 2, "sdpa"),
    ("gemma2-window5-softcap", 2, "eager"),
    ("gemma3-window5-scaled-global", 3, "sdpa"),
    ("qwen2-swa-from-layer1", 3, "eager"),
    ("phi3-longrope-partial", 2, "sdpa"),
    ("mixtral-16-experts", 3, "sdpa"),
    ("deepseekv3-yarn-16-experts", 3, "sdpa"),
    ("jamba", 2, "sdpa"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("name,micro,attn", BF16, ids=[f"{n}-m{m}-{a}" for n, m, a in BF16])
async def test_bf16_follows_plain_mixed_precision(tmp_path, name, micro, attn):
    """bf16 with the head untied (a tied weight's two gradients are summed in fp32 by snake
    on purpose, README) against plain PyTorch mixed precision, at tests/test_hf.py's bound;
    DeepSeek V3 keeps its router in fp32."""
    kind, kw = BY_ID[name]
    model = bf16_copy(kind, attn=attn, **{**kw, **UNTIED})
    data = _data(micro, 13)
    want = mixed_reference(model, data, micro, fused=True)
    assert_mixed_precision(await _train(model, data, tmp_path, micro, dtype="bfloat16"), want)


# -- dropout: a reference that draws what snake draws ----------------------------------------


def _hook_points(model: nn.Module, kind: str):
    """(embedding, layers, final norm) of the test model `kind`: where snake's pre, each
    layer and post start."""
    if kind == "gpt2":
        t = model.transformer
        return t.wte, t.h, t.ln_f
    if kind in OLD:
        from snake.hf.families import _OLD

        lay = _OLD[type(model).__name__]
        base = model.get_submodule(lay.base)
        return getattr(base, lay.embed), getattr(base, lay.layers), getattr(base, lay.norm)
    inner = model.model
    return inner.embed_tokens, inner.layers, getattr(inner, "final_layernorm", None) or inner.norm


def seeded_reference(model: nn.Module, data, micro: int, kind: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """tests/test_hf.py's reference with the CPU generator seeded, before the embedding,
    each layer and the final norm, as snake seeds it for pre, the layer and post of that
    iteration and micro-batch (`Kernels.seed_for`): every dropout mask and router jitter
    is then the one snake draws, forward and recompute alike."""
    m = copy.deepcopy(model)
    m.train()
    stub = type("Seeded", (), {"seed": seed})()
    at = {"t": 0, "m": 0}

    def seeding(layer: int):
        def hook(module, args):
            torch.default_generator.manual_seed(Kernels.seed_for(stub, at["t"], layer, at["m"]) % 2**63)
        return hook

    embed, layers, norm = _hook_points(m, kind)
    handles = [embed.register_forward_pre_hook(seeding(-1)), norm.register_forward_pre_hook(seeding(10**6))]
    handles += [layer.register_forward_pre_hook(seeding(i)) for i, layer in enumerate(layers)]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    state = torch.get_rng_state()
    try:
        for t, (x, y) in enumerate(data):
            opt.zero_grad(set_to_none=True)
            for i, (xc, yc) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
                at.update(t=t, m=i)
                logits = m(xc).logits
                loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), yc.reshape(-1)) / micro
                loss.backward()
            opt.step()
    finally:
        torch.set_rng_state(state)
        for h in handles:
            h.remove()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


P = 0.3
DROPOUT = [
    ("llama-attention", "llama", "sdpa", 3, {"attention_dropout": P}),
    ("mistral-attention-window", "mistral", "eager", 1, {"attention_dropout": P, "sliding_window": 5}),
    ("gemma2-attention", "gemma2", "eager", 2, {"attention_dropout": P}),
    ("phi-everywhere", "phi", "sdpa", 2, {"embd_pdrop": P, "resid_pdrop": P, "attention_dropout": P}),
    ("neox-everywhere", "neox", "sdpa", 3, {"hidden_dropout": P, "attention_dropout": P}),
    ("opt-everywhere", "opt", "sdpa", 2, {"dropout": P, "attention_dropout": P, "activation_dropout": P}),
    ("mixtral-jitter-attention", "mixtral", "sdpa", 2, {"router_jitter_noise": 0.3, "attention_dropout": P}),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("name,kind,attn,micro,kw", DROPOUT, ids=_ids(DROPOUT))
async def test_dropout_trains_as_plain_pytorch_drawing_the_same_masks(tmp_path, name, kind, attn, micro, kw):
    """Dropout inside the layers (attention, residual, activation, Mixtral's router
    jitter) and outside them (embedding): snake's weights are plain PyTorch's when PyTorch
    draws from the same seeds (the forward's masks are the recompute's: a recompute that
    drew other masks would give gradients of another forward than the loss's). The
    dropout changes the run (against the same reference without it)."""
    model = make(kind, attn, **kw)
    data = _data(micro, 13, n=2)
    want = seeded_reference(model, data, micro, kind)
    got = await _train(model, data, tmp_path, micro, steps=2)
    assert_matches(got, want)
    quiet = seeded_reference(make(kind, attn), data, micro, kind)
    assert any(not torch.allclose(quiet[k], want[k], atol=1e-4) for k in want)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind,kw", [
    ("gemma3", {**GEMMA3_SCALED, "attention_dropout": P}),
    ("deepseekv3", {**DSV3_YARN, "attention_dropout": P}),
    ("jamba", {"attention_dropout": P}),
], ids=["gemma3-windowed", "deepseekv3-yarn", "jamba"])
async def test_dropout_under_the_horizontal_schedule_draws_the_same_masks(tmp_path, kind, kw):
    """The horizontal schedule (every micro-batch through a layer before the next layer)
    seeds each (iteration, layer, micro-batch) alike: plain PyTorch's weights with the same
    draws, for layers of two kinds (sliding and global; dense and experts; Mamba and
    attention)."""
    model = make(kind, **kw)
    data = _data(3, 13, n=2)
    want = seeded_reference(model, data, 3, kind)
    assert_matches(await _train(model, data, tmp_path, 3, steps=2, schedule="horizontal"), want)


@pytest.mark.asyncio
@pytest.mark.parametrize("name,kind,kw", [
    ("phi-everywhere", "phi", {"embd_pdrop": P, "resid_pdrop": P, "attention_dropout": P}),
    ("mixtral-jitter-window", "mixtral", {"router_jitter_noise": 0.3, "attention_dropout": P, "sliding_window": 5}),
    ("gpt2", "gpt2", {}),
    ("phi3-longrope-partial", "phi3", LONGROPE),
], ids=["phi-dropout", "mixtral-jitter-window", "gpt2", "phi3-longrope"])
async def test_evaluate_at_other_lengths_is_the_eval_mode_loss(tmp_path, name, kind, kw):
    """evaluate() on rows of 7 and 13 tokens after training on 10 (other masks, windows
    and LongRoPE factors than training's), dropout and jitter off: the model's eval-mode
    loss with the trained weights."""
    model = make(kind, **kw)
    cfg = dataclasses.replace(snake_config(tmp_path), micro_batches=2)
    async with SnakeTrainer(model, data=_data(2, 10, n=2), config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(2), timeout=120)
        trained = copy.deepcopy(model)
        trained.load_state_dict(await trainer.state_dict())
        trained.eval()
        for T in (7, 13):
            data = _data(2, T, n=2)
            got = await trainer.evaluate(data)
            with torch.no_grad():
                want = sum(nn.functional.cross_entropy(trained(x).logits.reshape(-1, VOCAB), y.reshape(-1)).item()
                           for x, y in data) / len(data)
            assert abs(got.loss - want) < 1e-5, (T, got.loss, want)


def _lora(model: nn.Module, **options):
    from peft import LoraConfig, get_peft_model

    config = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "lora_dropout": 0.0, "task_type": "CAUSAL_LM",
              **options}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, LoraConfig(**config))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return peft_model


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("kind,kw,p", [
    ("gemma3", GEMMA3_SCALED, 0.0), ("gpt2", {}, 0.0), ("qwen2", QWEN2_SWA, 0.3), ("falcon_new", {}, 0.3),
], ids=["gemma3-windowed", "gpt2-conv1d", "qwen2-windowed-lora-dropout", "falcon-lora-dropout"])
async def test_lora_on_every_linear_layer_trains_as_plain_pytorch(tmp_path, kind, kw, p):
    """PEFT's LoRA on every linear layer ("all-linear": GPT-2's Conv1D, Falcon's fused
    query-key-value too) of windowed and older models, with LoRA's dropout (seeded as
    snake seeds it) or without."""
    model = _lora(make(kind, **kw), lora_dropout=p)
    base = model.get_base_model()
    data = _data(3, 13, n=2)
    want = seeded_reference(base, data, 3, kind)
    assert_matches(await _train(model, data, tmp_path, 3, steps=2), want)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_of_fused_experts_is_refused_by_name(tmp_path):
    """"all-linear" on a mixture of experts also adapts the fused experts' parameters
    (PEFT's `target_parameters`), which snake refuses by name (README)."""
    model = _lora(make("olmoe", num_experts=4, num_experts_per_tok=2))
    with pytest.raises(ModelError, match=r"target_parameters.*ParamWrapper"):
        SnakeTrainer(model, data=_data(1, 13), config=snake_config(tmp_path))


@pytest.mark.asyncio
@pytest.mark.parametrize("kind,kw,shard", [
    ("qwen2", {**QWEN2_SWA, "tie_word_embeddings": True}, "20KB"),
    ("gemma3", {**GEMMA3_SCALED, "tie_word_embeddings": True}, None),
    ("olmoe", {"num_experts": 8, "num_experts_per_tok": 2}, "30KB"),
    ("jamba", {}, None),
], ids=["qwen2-windowed-tied-sharded", "gemma3-tied", "olmoe-converted-sharded", "jamba"])
async def test_streamed_variants_train_as_plain_pytorch(tmp_path, kind, kw, shard):
    """stream_hf of windowed, tied, converted-expert and hybrid checkpoints at 3
    micro-batches of 13 tokens: the weights of plain PyTorch on the model loaded whole."""
    from snake.hf import load_hf, stream_hf
    from tests.test_stream_hf import saved

    _, path = saved(kind, tmp_path, shard, **kw)
    data = _data(3, 13)
    want = reference(load_hf(path), data, 3)
    assert_matches(await _train(stream_hf(path), data, tmp_path, 3), want)


# -- refusals -----------------------------------------------------------------------------------


REFUSED = [
    ("mixtral", {"output_router_logits": True}, r"output_router_logits=True.*output_router_logits = False"),
    ("qwen3moe", {"output_router_logits": True}, r"output_router_logits=True"),
    ("olmoe", {"output_router_logits": True}, r"output_router_logits=True"),
    ("qwen3next", {"output_router_logits": True}, r"output_router_logits=True"),
    ("jamba", {"output_router_logits": True}, r"output_router_logits=True"),
    ("dbrx", {"output_router_logits": True}, r"output_router_logits=True"),
    ("bamba", {"z_loss_coefficient": 0.5}, r"z_loss_coefficient=0.5"),
    ("gemma4", {"hidden_size_per_layer_input": 16}, r"per-layer inputs \(hidden_size_per_layer_input=16"),
    ("gemma4", {"num_kv_shared_layers": 1}, r"num_kv_shared_layers=1"),
    ("gemma3", {"use_bidirectional_attention": True}, r"use_bidirectional_attention=True"),
    ("xglm", {"layerdrop": 0.2}, r"layerdrop=0.2"),
    ("biogpt", {"layerdrop": 0.2}, r"layerdrop=0.2"),
]


@pytest.mark.parametrize("kind,kw,says", REFUSED, ids=[f"{k}-{next(iter(kw))}" for k, kw, _ in REFUSED])
def test_what_snake_would_train_differently_is_refused_by_name(kind, kw, says):
    with pytest.raises(ModelError, match=says):
        describe(make(kind, **kw))


@pytest.mark.parametrize("impl", ["flash_attention_2", "flex_attention"])
def test_attention_snake_cannot_window_per_layer_is_refused(impl):
    """Qwen2 windowed from layer 1 on: flash attention takes each layer's window from the
    layer (snake runs them through one copy of layer 0), and flex attention is not
    supported; each refused naming attn_implementation='sdpa'."""
    model = make("qwen2", **QWEN2_SWA)
    model.config._attn_implementation = impl
    with pytest.raises(ModelError, match="attn_implementation='sdpa'"):
        describe(model)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind,kw", [("qwen2", {**QWEN2_SWA, **UNTIED}), ("deepseekv3", {})],
                         ids=["qwen2-windowed", "deepseekv3-fp32-router"])
async def test_streamed_bf16_follows_plain_mixed_precision(tmp_path, kind, kw):
    """stream_hf(dir, dtype=bfloat16) of a windowed model and of one that keeps its router
    in fp32: plain PyTorch mixed precision on load_hf(dir, dtype=bfloat16)."""
    from snake.hf import load_hf, stream_hf
    from tests.test_stream_hf import saved

    _, path = saved(kind, tmp_path, None, **kw)
    data = _data(3, 13)
    want = mixed_reference(load_hf(path, dtype=torch.bfloat16), data, 3, fused=True)
    got = await _train(stream_hf(path, dtype=torch.bfloat16), data, tmp_path, 3, dtype="bfloat16")
    assert_mixed_precision(got, want)
