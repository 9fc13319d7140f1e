"""Hugging Face `transformers` causal LMs as snake models (the `hf` extra).

`describe_hf(model)` recognises GPT-2 (`GPT2LMHeadModel`) and the Llama family (the classes
in `_LLAMA_FAMILY`, dense and mixture-of-experts, which compose as `LlamaForCausalLM` does)
and returns the `ModelParts` snake streams: the decoder layers are the blocks, the
embeddings are `pre`, the final norm and the LM head are `post` (with what a model does
around its layers: Granite's multipliers, Cohere's logit scale, Gemma's soft cap). Any
other model gives None (snake then asks for an explicit `snake.ModelParts`).

Blocks run outside the model's own `forward`, so the block function supplies what the
model would pass each layer (it takes the layer's index): a causal mask (None for SDPA /
flash attention, which mask causally themselves; an additive 4D mask for eager attention or
a sliding window shorter than the sequence, per layer where `layer_types` mix them),
position ids 0..T-1, and for the Llama family the rotary `position_embeddings` (cos, sin)
from the model's `rotary_emb` (per attention type for Gemma 3). No KV cache is used.

Dropout is safe: snake forks the RNG per (iteration, layer, micro-batch), so the backward's
recompute of a layer draws the same masks as its forward.

`load_hf` builds a model from a config or a local directory; `stream_hf` loads the model in a
local directory with its layers' weights left in their safetensors files until snake copies
them into its tiers (PEFT's adapters on such a model are initialised by `init_adapters`,
which the trainer calls); `export_hf` writes trained weights as a directory
`from_pretrained` loads (safetensors).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import inspect
import json
import logging
import math
import os
import re
import shutil
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from snake.adapters import ModelParts, check_param_wrappers, has_peft_layers, layer_kinds
from snake.errors import DataError, ModelError, StorageError
from snake.memory import fmt_size

__all__ = ["describe_hf", "export_hf", "init_adapters", "load_hf", "stream_hf"]
log = logging.getLogger("snake")

# decoder-only models whose embedding (`model.embed_tokens`), layers (`model.layers`), final
# norm and head (`lm_head`) compose as Llama's, with what some of them do outside their
# layers (`_Outside`, which also knows the other names some give the embedding, final norm
# and rotary table) and layers that differ by type (`_layer_kinds`; what a layer reads from
# its own attributes, snake's kernels set per layer); each is trained against plain PyTorch
# in tests/test_hf.py. Hybrids of attention and recurrent layers (linear attention, Mamba,
# short convolutions: `_UNMASKED` layer types, unmasked without padding) have layers of
# two or more kinds. Not here (snake asks for ModelParts): Zamba and Zamba 2 (a transformer
# block shared by several layers), models that carry more than the hidden state from layer
# to layer (hyper-connections: DeepSeek V4, HY-V4, Qwen4Exp; Zaya; Inkling 2) or run the same
# layers in a loop (Dory, Inkling 2 Loop), token ids fed to every layer (Gemma 3n; Gemma 4's
# per-layer inputs, `_refuse_what_layers_cannot_carry`, as its layers reusing an earlier
# layer's keys and values)
_LLAMA_FAMILY = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
    "OlmoForCausalLM", "Olmo2ForCausalLM", "StableLmForCausalLM", "Starcoder2ForCausalLM", "GemmaForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM", "GraniteForCausalLM", "GraniteMoeForCausalLM", "CohereForCausalLM", "PhiForCausalLM",
    "GlmForCausalLM", "Glm4ForCausalLM", "HeliumForCausalLM", "ArceeForCausalLM", "MinistralForCausalLM",
    "Cohere2ForCausalLM", "SmolLM3ForCausalLM", "Exaone4ForCausalLM", "DiffLlamaForCausalLM",
    # layers of two kinds (dense and mixture-of-experts: snake.adapters.layer_kinds), some
    # with multi-head latent attention (DeepSeek V2 / V3), chunked attention (Llama 4) or
    # attention sinks (gpt-oss)
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM",
    "Dots1ForCausalLM", "Mistral4ForCausalLM", "Llama4ForCausalLM", "GptOssForCausalLM", "Ernie4_5ForCausalLM",
    "Cohere2MoeForCausalLM", "ExaoneMoeForCausalLM", "HunYuanMoEV1ForCausalLM",
    # routing statistics kept as frozen parameters (requires_grad=False: left as they are)
    "Ernie4_5_MoeForCausalLM", "AfmoeForCausalLM",
    # hybrids: attention beside recurrent layers (`_UNMASKED`): gated delta nets (Qwen3-Next,
    # Qwen3.5, OLMo hybrid), Kimi delta attention, lightning attention (MiniMax), Mamba
    # (Jamba, Bamba, Granite 4 hybrid, Nemotron-H), short convolutions (LFM2); Falcon-H1's
    # layers run attention and Mamba side by side ("hybrid": the attention's causal mask)
    "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "OlmoHybridForCausalLM",
    "KimiLinearForCausalLM", "MiniMaxForCausalLM", "JambaForCausalLM", "BambaForCausalLM",
    "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM",
    "FalconH1ForCausalLM", "Olmo3ForCausalLM", "Lfm3ForCausalLM", "LaraMiniForCausalLM", "RecurrentGemmaForCausalLM",
    # more of the Llama family, some with their own names or scaling outside the layers
    # (`_Outside`), windows on every layer (`_WINDOW_FROM_CONFIG`), per-type rotary tables
    # (Laguna, Mellum, MiMo-V2-Flash), latent attention (Youtu, MiniCPM3, LongCat-Flash) or
    # experts (JetMoE, Kolibri, MiniMax-M2, Solar Open, Phi-MoE, Inkling)
    "HunYuanDenseV1ForCausalLM", "Jais2ForCausalLM", "JetMoeForCausalLM", "Kolibri1ForCausalLM", "LagunaForCausalLM",
    "MellumForCausalLM", "MiniMaxM2ForCausalLM", "NemotronForCausalLM", "SeedOssForCausalLM", "SolarOpenForCausalLM",
    "YoutuForCausalLM", "LongcatFlashForCausalLM", "MiMoV2FlashForCausalLM", "HyperCLOVAXForCausalLM",
    "MiniCPM3ForCausalLM", "NanoChatForCausalLM", "PersimmonForCausalLM", "PhimoeForCausalLM", "Ministral3ForCausalLM",
    "VaultGemmaForCausalLM", "InklingForCausalLM", "ApertusForCausalLM", "Apertus1p5TextForCausalLM", "AXK1ForCausalLM",
    "AriaTextForCausalLM", "BailingHybridForCausalLM", "BitNetForCausalLM", "CwmForCausalLM", "FlexOlmoForCausalLM",
    "FlintForCausalLM", "HYV3ForCausalLM", "CohereCompassForCausalLM", "GraniteMoeSharedForCausalLM",
    "GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM", "BeamForCausalLM",
    # Gemma 4 without per-layer inputs or shared keys and values (dense and with experts; keys
    # as values on full-attention layers), each layer scaled by its own `layer_scalar` buffer
    "Gemma4ForCausalLM",
    # sparse attention whose indexer reads the causal mask to pick each query's keys
    # (`_FULL_MASK`; "indexed_attention"): DeepSeek V3.2, GLM's `GlmMoeDsa`, AXK2, dots3
    # note; the indexer runs under no_grad, so its weights stay as they are, as in PyTorch;
    # and Doge, whose dynamic mask keeps each query's top keys of the causal ones
    "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "AXK2ForCausalLM", "Dots3NoteForCausalLM", "DogeForCausalLM",
)
# attention-free models of Mamba layers alone (`_mamba_parts`)
_MAMBA = ("MambaForCausalLM", "Mamba2ForCausalLM", "FalconMambaForCausalLM")
# without `layer_types`, these window every layer's attention by config.sliding_window when
# it is set (their forward picks create_sliding_window_causal_mask then)
_WINDOW_FROM_CONFIG = (
    "MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Starcoder2ForCausalLM", "Qwen3MoeForCausalLM",
    "PhimoeForCausalLM", "Ministral3ForCausalLM", "DogeForCausalLM",
)
# attention implementations that mask causally by themselves when given no mask
_SELF_CAUSAL = ("sdpa", "flash_attention_2", "flash_attention_3")
_SUPPORTED_ATTN = ("eager", *_SELF_CAUSAL)
# layer types without softmax attention: a recurrent token mixer (linear attention, Mamba, a
# short convolution), causal by construction and given a mask only for padding
# (transformers' create_recurrent_attention_mask is None for an unpadded batch, which is
# all snake trains on), or none at all (Nemotron-H's "moe" and "mlp" layers)
_UNMASKED = ("linear_attention", "conv", "moe", "mlp")
# layer types with softmax attention ("hybrid": Falcon-H1's attention beside Mamba, causal)
_ATTENTION = ("full_attention", "sliding_attention", "chunked_attention", "hybrid", "hybrid_sliding", "indexed_attention")
# models given the whole causal mask under SDPA too (transformers: allow_is_causal_skip=False),
# as SDPA's boolean mask, because their layers read it (snake's `_MaskCache(full=True)`)
_FULL_MASK = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "AXK2ForCausalLM", "Dots3NoteForCausalLM", "DogeForCausalLM")
# layer types windowed by the config's window (Inkling's "hybrid_sliding": `sliding_window_size`)
_WINDOWED = ("sliding_attention", "hybrid_sliding")
# models whose attention mask is computed from the layer's own weights (Inkling's relative
# position bias, Doge's dynamic mask): their forward runs with autograd on
# (`ModelParts.forward_with_grad`)
_LEARNED_MASK = ("InklingForCausalLM", "DogeForCausalLM")
# models with a rotary base per layer (`_rotary_by_layer`)
_ROTARY_BY_LAYER = ("GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM")
# models whose rotary table only layers of these types take (the others: position_embeddings=None)
_ROTARY_ONLY = {"LaraMiniForCausalLM": ("sliding_attention",)}


# -- recognition ----------------------------------------------------------------------------


def describe_hf(model: nn.Module) -> ModelParts | None:
    """ModelParts for a supported Hugging Face causal LM, None for any other module.

    Raises ModelError for a supported class whose configuration snake cannot stream
    (layers that differ by their index, an unsupported attention implementation). A model
    from `stream_hf` gets its layers' weights from their files (`ModelParts.weights`)."""
    parts = _describe_hf(model)
    weights = getattr(model, "snake_layer_weights", None)
    if parts is None or weights is None:
        return parts
    if has_peft_layers(model):
        # PEFT wrapped some of the layers' modules (`q_proj` is now `q_proj.base_layer`): the
        # files hold them by their own names; the adapters it made beside them are on the
        # meta device with the layers, uninitialised, until snake initialises them
        weights = _PeftNames.of(weights)
        parts = dataclasses.replace(parts, weights=weights)
        _init_adapters(model, parts)
    # a layer parameter is on the meta device, or real because snake read it from the files
    # (frozen ones) or PEFT made it (an adapter the files do not hold: one added after the
    # first, which PEFT initialises itself): one made real otherwise (model.to_empty) would
    # train on whatever it holds
    for i, block in enumerate(parts.blocks):
        stored: set[str] | None = None  # taken where needed: a copy of the layer
        for name, p in block.named_parameters():
            if p.is_meta or getattr(p, "snake_read", False):
                continue
            if stored is None and has_peft_layers(block):
                stored = _stored_names(block)
            if stored is not None and _unwrapped_name(name) not in stored:
                continue
            raise ModelError(
                f"model: {parts.blocks_prefix}.{i}.{name} of a model from stream_hf is no longer on the "
                "meta device, and snake did not read it (model.to_empty(...) leaves memory as it finds "
                "it): load the model again; a streamed model stays where stream_hf put it (.to(dtype) "
                "is fine, .to(device) is not)"
            )
    return dataclasses.replace(parts, weights=weights)


def _describe_hf(model: nn.Module) -> ModelParts | None:
    if "transformers" not in sys.modules:  # an HF model would have imported it
        return None
    import transformers

    # transformers 5 renamed the flag (the old name warns); 4.x has only the old one
    flag = next((a for a in ("is_activation_checkpointing", "is_gradient_checkpointing") if hasattr(type(model), a)), None)
    if flag is not None and getattr(model, flag):
        warnings.warn(
            f"snake: {type(model).__name__} has gradient checkpointing enabled; snake keeps one "
            "checkpoint per layer and recomputes each layer itself, so the model's own checkpointing "
            "only adds another forward per layer: disable it (model.activation_checkpointing_disable(); "
            "gradient_checkpointing_disable() before transformers 5)",
            stacklevel=3,
        )
    if isinstance(model, transformers.GPT2LMHeadModel):
        return _gpt2_parts(model)
    for name in _MAMBA:
        cls = getattr(transformers, name, None)
        if cls is not None and isinstance(model, cls):
            return _mamba_parts(model)
    for name in _OLD:
        cls = getattr(transformers, name, None)
        if cls is not None and isinstance(model, cls):
            return _old_parts(model, name)
    for name in _LLAMA_FAMILY:
        cls = getattr(transformers, name, None)
        if cls is not None and isinstance(model, cls):
            return _llama_parts(model, name)
    return None


def supported() -> str:
    """The Hugging Face classes describe_hf recognises, for messages."""
    return ", ".join(("GPT2LMHeadModel", *_LLAMA_FAMILY, *_MAMBA, *_OLD))


def _attn_impl(model: nn.Module) -> str:
    config: Any = model.config
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in _SUPPORTED_ATTN:
        raise ModelError(
            f"model: {type(model).__name__} uses attn_implementation={impl!r}; snake calls its "
            f"layers directly and supports {list(_SUPPORTED_ATTN)}: load it with "
            "attn_implementation='sdpa' (or 'eager')"
        )
    return impl


def _gpt2_parts(model: nn.Module) -> ModelParts:
    config: Any = model.config
    impl = _attn_impl(model)
    masks = _MaskCache(impl, window=None)
    n_positions = int(config.n_positions)

    def pre(m: Any, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[-1] > n_positions:  # learned absolute positions: no row beyond the table
            raise DataError(
                f"data: sequence length {idx.shape[-1]} exceeds the model's n_positions={n_positions} "
                "(GPT-2's learned positions); give batches of at most n_positions tokens per row"
            )
        t = m.transformer
        pos = torch.arange(idx.shape[-1], device=idx.device)
        return t.drop(t.wte(idx) + t.wpe(pos)[None])

    def post(m: Any, h: torch.Tensor) -> torch.Tensor:
        return m.lm_head(m.transformer.ln_f(h))

    def block_fn(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return _hidden(block(h, attention_mask=masks.get(h), use_cache=False))

    t: Any = model.transformer
    return ModelParts(
        model=model, blocks=list(t.h), blocks_prefix="transformer.h", pre=pre, post=post, block_fn=block_fn
    )


class _OldLayout(NamedTuple):
    """Where an older (non-Llama) causal LM keeps its parts: the inner model (`base`, a dotted
    path on the model), and under it the layers, the token embedding, learned or sinusoidal
    positions (None: none) and the final norm (None: none); the head is on the model itself.
    `block`: what the layers take besides the hidden state and the mask ("plain"; "rotary":
    position ids and the base's `rotary_emb` table; "falcon", "bloom", "mpt": ALiBi or the
    causal mask as those models build them)."""

    base: str
    layers: str
    embed: str
    positions: str | None
    norm: str | None
    head: str
    block: str


_OLD: dict[str, _OldLayout] = {
    "GPTNeoXForCausalLM": _OldLayout("gpt_neox", "layers", "embed_in", None, "final_layer_norm", "lm_head", "rotary"),
    "GPTNeoXJapaneseForCausalLM": _OldLayout(
        "gpt_neox_japanese", "layers", "embed_in", None, "final_layer_norm", "embed_out", "rotary"),
    "GPTJForCausalLM": _OldLayout("transformer", "h", "wte", None, "ln_f", "lm_head", "rotary"),
    "CodeGenForCausalLM": _OldLayout("transformer", "h", "wte", None, "ln_f", "lm_head", "rotary"),
    "DbrxForCausalLM": _OldLayout("transformer", "blocks", "wte", None, "norm_f", "lm_head", "rotary"),
    "FalconForCausalLM": _OldLayout("transformer", "h", "word_embeddings", None, "ln_f", "lm_head", "falcon"),
    "BloomForCausalLM": _OldLayout("transformer", "h", "word_embeddings", None, "ln_f", "lm_head", "bloom"),
    "MptForCausalLM": _OldLayout("transformer", "blocks", "wte", None, "norm_f", "lm_head", "mpt"),
    "GPTBigCodeForCausalLM": _OldLayout("transformer", "h", "wte", "wpe", "ln_f", "lm_head", "plain"),
    "GPTNeoForCausalLM": _OldLayout("transformer", "h", "wte", "wpe", "ln_f", "lm_head", "plain"),
    "OPTForCausalLM": _OldLayout("model.decoder", "layers", "embed_tokens", "embed_positions", "final_layer_norm",
                                 "lm_head", "plain"),
    "XGLMForCausalLM": _OldLayout("model", "layers", "embed_tokens", "embed_positions", "layer_norm", "lm_head", "plain"),
    "BioGptForCausalLM": _OldLayout("biogpt", "layers", "embed_tokens", "embed_positions", "layer_norm",
                                    "output_projection", "plain"),
}


def _old_parts(model: nn.Module, name: str) -> ModelParts:
    """The older causal LMs of `_OLD`: pre is the embedding (plus learned positions, Bloom's
    embedding norm, OPT's input projection, the embedding dropout), post the final norm (OPT's
    output projection) and the head; the layers get the causal mask, and where the model
    gives them one, position ids with the rotary table or an ALiBi bias built from T."""
    config: Any = model.config
    lay = _OLD[name]
    impl = _attn_impl(model)
    _refuse_what_layers_cannot_carry(model)  # DBRX's output_router_logits
    base: Any = model.get_submodule(lay.base)
    if getattr(config, "add_cross_attention", False):
        raise ModelError(f"model: {name} has add_cross_attention=True; snake trains decoder-only causal LMs")
    if float(getattr(config, "layerdrop", 0.0) or 0.0) > 0.0:
        raise ModelError(
            f"model: {name} has layerdrop={config.layerdrop}, which skips whole layers at random in "
            "training; snake runs every layer: set model.config.layerdrop = 0.0 (and the model's)"
        )
    # Falcon materialises its mask under SDPA too (ALiBi is added onto it); the others mask
    # causally by themselves under SDPA (GPT-Neo's, Bloom's, MPT's layers mask by themselves, eager only)
    masks = _MaskCache(impl, window=None, full=lay.block == "falcon")
    rotary = _Rotary(base.rotary_emb if lay.block == "rotary" or (lay.block == "falcon" and not base.use_alibi) else None)
    pos_mod = getattr(base, lay.positions) if lay.positions else None
    # learned positions: a table of rows (OPT and BioGPT: 2 rows ahead of position 0)
    n_positions = (int(pos_mod.num_embeddings) - int(getattr(pos_mod, "offset", 0))
                   if isinstance(pos_mod, nn.Embedding) else None)
    # dropout of the embedding: a module (`drop`, `emb_dropout`) or a rate (XGLM, BioGPT)
    drop_name = next((d for d in ("drop", "emb_dropout") if isinstance(getattr(base, d, None), nn.Dropout)), None)
    mpt_max = int(getattr(config, "max_seq_len", 0) or 0)
    drop_p = float(base.dropout) if name in ("XGLMForCausalLM", "BioGptForCausalLM") else 0.0
    norm, head, embed = lay.norm, lay.head, lay.embed

    def pre(m: Any, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[-1]
        if name == "MptForCausalLM" and T > mpt_max:  # its forward builds ALiBi for max_seq_len keys
            raise DataError(
                f"data: sequence length {T} exceeds MPT's max_seq_len={mpt_max}; give shorter rows or "
                "raise model.config.max_seq_len (ALiBi extends to longer sequences)"
            )
        if n_positions is not None and T > n_positions:
            raise DataError(
                f"data: sequence length {T} exceeds the {n_positions} learned positions of {name}; "
                "give batches of at most that many tokens per row"
            )
        b = m.get_submodule(lay.base)
        h = getattr(b, embed)(idx)
        if name == "BloomForCausalLM":
            h = b.word_embeddings_layernorm(h)
        if name == "OPTForCausalLM" and b.project_in is not None:
            h = b.project_in(h)
        if pos_mod is not None:
            pos = torch.arange(T, device=idx.device)[None]
            table = getattr(b, str(lay.positions))
            if name == "XGLMForCausalLM":  # (position_ids, cache_length)
                at = table(pos, 0)
            elif name in ("OPTForCausalLM", "BioGptForCausalLM"):  # (attention_mask, cache_length, position_ids)
                at = table(None, 0, position_ids=pos)
            else:
                at = table(pos)
            h = h + at.to(h.dtype)
        if drop_name is not None:
            h = getattr(b, drop_name)(h)
        if drop_p > 0.0:
            h = nn.functional.dropout(h, p=drop_p, training=m.training)
        return h

    def post(m: Any, h: torch.Tensor) -> torch.Tensor:
        b = m.get_submodule(lay.base)
        if norm is not None and getattr(b, norm, None) is not None:  # OPT-350m: no final norm
            h = getattr(b, norm)(h)
        if name == "OPTForCausalLM" and b.project_out is not None:
            h = b.project_out(h)
        return getattr(m, head)(h)

    n_heads = int(getattr(base, "num_heads", 0) or getattr(config, "num_attention_heads", 0) or 0)
    head_dim = int(config.hidden_size) // n_heads if n_heads else 0
    falcon_alibi = lay.block == "falcon" and bool(base.use_alibi)
    if falcon_alibi and impl.startswith("flash_attention"):
        raise ModelError(f"model: {name} with alibi=True adds ALiBi onto its mask: load it with "
                         "attn_implementation='sdpa' (or 'eager')")

    def block_fn(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        B, T = h.shape[:2]
        mask = masks.get(h)
        if lay.block == "plain":  # (XGLM checks the mask's batch size)
            mask = mask.expand(B, -1, -1, -1) if mask is not None else None
            return _hidden(block(h, attention_mask=mask, use_cache=False))
        if lay.block == "rotary":
            position_ids = torch.arange(T, device=h.device)[None]
            return _hidden(block(h, attention_mask=mask, position_ids=position_ids, use_cache=False,
                                 position_embeddings=rotary(h, position_ids, "full_attention")))
        if lay.block == "bloom":
            from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

            alibi = _get_alibi_slopes(n_heads, h.device)[:, None, None] * torch.arange(T, device=h.device)
            alibi = alibi.repeat(B, 1, 1).to(h.dtype)
            return _hidden(block(h, alibi=alibi, attention_mask=mask, use_cache=False))
        if lay.block == "mpt":
            from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

            bias = build_mpt_alibi_tensor(n_heads, mpt_max, device=h.device)  # sliced to T keys by the layer
            assert mask is not None  # eager only: always a mask
            return _hidden(block(h, position_bias=bias, attention_mask=mask.to(torch.bool), use_cache=False))
        # Falcon: rotary positions, or ALiBi divided by sqrt(head_dim) added onto the causal mask
        position_ids = torch.arange(T, device=h.device)[None]
        if not falcon_alibi:
            return _hidden(block(h, alibi=None, attention_mask=mask, position_ids=position_ids, use_cache=False,
                                 position_embeddings=rotary(h, position_ids, "full_attention")))
        from transformers.models.falcon.modeling_falcon import build_alibi_tensor

        alibi = build_alibi_tensor(torch.ones(B, T, dtype=torch.long, device=h.device), n_heads, dtype=h.dtype)
        min_dtype = torch.finfo(h.dtype).min
        assert mask is not None  # full=True: always a mask (flash refused above)
        if mask.dtype == torch.bool:
            mask = torch.where(mask, torch.full((), 0.0, device=h.device, dtype=h.dtype), min_dtype)
        mask = torch.masked_fill(alibi.reshape(B, -1, *alibi.shape[1:]) / math.sqrt(head_dim), mask < -1, min_dtype)
        return _hidden(block(h, alibi=alibi, attention_mask=mask, position_ids=position_ids, use_cache=False))

    return ModelParts(
        model=model, blocks=list(getattr(base, lay.layers)), blocks_prefix=f"{lay.base}.{lay.layers}",
        pre=pre, post=post, block_fn=block_fn,
    )


def _rotary_by_layer(model: nn.Module) -> list[_Rotary | None]:
    """Granite SWA's rotary table per layer: one per base (`config.layer_rope_theta`, one
    model-level table per distinct base in `model.rotary_embs`), None where the base is 0
    (no positions: NoPE)."""
    config: Any = model.config
    inner: Any = model.model
    tables = {float(emb.config.rope_parameters["rope_theta"]): _Rotary(emb) for emb in inner.rotary_embs}
    return [tables[float(theta)] if theta else None for theta in config.layer_rope_theta]


def _nope_scaling(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """Beam's query scale by position for its layers without rotary positions, from its own
    modeling module."""
    return sys.modules[type(model).__module__].compute_attention_scaling  # type: ignore[no-any-return]


def _mamba_parts(model: nn.Module) -> ModelParts:
    """Mamba, Mamba 2 and Falcon Mamba: an embedding, Mamba layers that take the hidden
    state alone (no mask: causal by construction; no positions), a final norm and the head."""

    def pre(m: Any, idx: torch.Tensor) -> torch.Tensor:
        return m.backbone.embeddings(idx)

    def post(m: Any, h: torch.Tensor) -> torch.Tensor:
        # the norm keeps the residual's float32 (`residual_in_fp32`); the head takes its own dtype
        h = m.backbone.norm_f(h)
        return m.lm_head(h.to(m.lm_head.weight.dtype)).float()

    def block_fn(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return _hidden(block(h))

    backbone: Any = model.backbone
    fp32 = "model.config.residual_in_fp32" if getattr(model.config, "residual_in_fp32", False) else None
    return ModelParts(
        model=model, blocks=list(backbone.layers), blocks_prefix="backbone.layers", pre=pre, post=post,
        block_fn=block_fn, hidden_fp32=fp32,
    )


def _llama_parts(model: nn.Module, name: str) -> ModelParts:
    inner: Any = model.model
    impl = _attn_impl(model)
    _refuse_what_layers_cannot_carry(model)
    specs, kinds = _layer_kinds(model, impl, name)
    full = name in _FULL_MASK
    masks = {spec: _MaskCache(impl, window=spec[0], chunk=spec[1], full=full) for spec in set(specs)}
    rotary = _Rotary(getattr(inner, "pos_emb" if name == "Lfm2MoeForCausalLM" else "rotary_emb", None))
    rotary_only = _ROTARY_ONLY.get(name)
    by_layer = _rotary_by_layer(model) if name in _ROTARY_BY_LAYER else None
    nope_scaling = _nope_scaling(model) if name == "BeamForCausalLM" else None
    outside = _Outside(model, name)
    gemma4 = name == "Gemma4ForCausalLM"

    def pre(m: Any, idx: torch.Tensor) -> torch.Tensor:
        return outside.pre(m, idx)

    def post(m: Any, h: torch.Tensor) -> torch.Tensor:
        return outside.post(m, h)

    uniform = len(set(zip(specs, kinds, strict=True))) == 1
    model_config: Any = model.config

    def block_fn(block: nn.Module, h: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        if layer is None:  # a caller from before layers could differ
            if not uniform:
                raise ModelError(
                    f"model: the layers of {name} differ by attention type; call its block_fn with "
                    "the layer's index: block_fn(block, hidden, layer=i)"
                )
            layer = 0
        position_ids = torch.arange(h.shape[1], device=h.device)[None]
        kwargs: dict[str, Any] = {
            "attention_mask": None if kinds[layer] in _UNMASKED else masks[specs[layer]].get(h),
            "position_ids": position_ids,
            "use_cache": False,
        }
        nope = nope_scaling is not None and model_config.rope_parameters[kinds[layer]] is None
        # dots3 note: the indexed layers' table from the hidden state in float32, as its forward builds it
        at = h.float() if name == "Dots3NoteForCausalLM" and kinds[layer] == "indexed_attention" else h
        pe = rotary(at, position_ids, kinds[layer]) if by_layer is None and not nope else None
        if nope_scaling is not None:  # Beam: no rotary on some types, a query scale by position there
            kwargs["position_embeddings"] = pe
            kwargs["attention_scaling"] = nope_scaling(position_ids) if nope else None
        elif by_layer is not None:  # the layer's own table, or none (NoPE)
            own = by_layer[layer]
            kwargs["position_embeddings"] = own(h, position_ids, kinds[layer]) if own is not None else None
        elif rotary_only is not None:
            kwargs["position_embeddings"] = pe if kinds[layer] in rotary_only else None
        elif pe is not None:
            kwargs["position_embeddings"] = pe
        if gemma4:  # where its attention leaves its keys and values for layers that reuse them (none here)
            kwargs["shared_kv_states"] = {}
        return _hidden(block(h, **kwargs))

    return ModelParts(
        model=model, blocks=list(inner.layers), blocks_prefix="model.layers", pre=pre, post=post, block_fn=block_fn,
        forward_with_grad=name in _LEARNED_MASK,
    )


class _Outside:
    """What a model of the Llama family does around its layers: the embedding (scaled by
    Granite's, Falcon-H1's and HyperCLOVA X's multiplier or RecurrentGemma's normalizer,
    normed by NanoChat; dropped out by Phi and StarCoder 2), and after the final norm the
    hidden state divided (MiniCPM3, Inkling) before the head, and the logits scaled (Cohere,
    Granite, Falcon-H1, HyperCLOVA X), soft-capped (Gemma 2 and 3, VaultGemma,
    RecurrentGemma, NanoChat) or cast to float32 (Nemotron-H), as their own forward does.
    The embedding is `embed_tokens` (Nemotron-H: `embeddings`); the final norm `norm` or
    the name in `_FINAL_NORM`."""

    def __init__(self, model: nn.Module, name: str) -> None:
        config: Any = model.config
        granite = name in ("GraniteForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeHybridForCausalLM",
                           "GraniteMoeSharedForCausalLM", "GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM")
        falcon = name == "FalconH1ForCausalLM"
        clova = name == "HyperCLOVAXForCausalLM"
        self.embed = "embeddings" if name == "NemotronHForCausalLM" else "embed_tokens"
        self.embed_mult = float(config.embedding_multiplier) if granite or falcon or clova else None
        self.normalizer = name == "RecurrentGemmaForCausalLM"  # the model's buffer, in h's dtype
        self.embed_norm = name == "NanoChatForCausalLM"  # the final norm, before the layers too
        self.norm = _FINAL_NORM.get(name, "norm")
        self.head_div = (float(config.logits_scaling) if name == "MiniCPM3ForCausalLM"
                         else float(config.logits_mup_width_multiplier) if name == "InklingForCausalLM" else None)
        self.logits_div = float(config.logits_scaling) if granite else None
        self.logits_mult = (float(config.logit_scale or 1.0) if name.startswith("Cohere")
                            else float(config.lm_head_multiplier) if falcon
                            else float(config.logits_scaling) if clova else None)
        cap_field = "logits_soft_cap" if name == "RecurrentGemmaForCausalLM" else "final_logit_softcapping"
        capped = "Gemma" in name or name in ("NanoChatForCausalLM", "BeamForCausalLM")
        cap = getattr(config, cap_field, None) if capped else None
        self.softcap = float(cap) if cap else None
        # Nemotron-H's logits, and Beam's before its soft cap, in float32
        self.to_float = name == "NemotronHForCausalLM" or (name == "BeamForCausalLM" and self.softcap is not None)

    def pre(self, m: Any, idx: torch.Tensor) -> torch.Tensor:
        h = getattr(m.model, self.embed)(idx)
        if self.embed_mult is not None:
            h = h * self.embed_mult
        if self.normalizer:
            h = h * m.model.normalizer.type(h.dtype)
        if self.embed_norm:
            h = getattr(m.model, self.norm)(h)
        drop = getattr(m.model, "embed_dropout", None)  # Phi's module
        if isinstance(drop, nn.Module):
            h = drop(h)
        p = getattr(m.model, "embedding_dropout", 0.0)  # StarCoder2's rate
        if isinstance(p, float) and p > 0.0:
            h = nn.functional.dropout(h, p=p, training=m.training)
        return h

    def post(self, m: Any, h: torch.Tensor) -> torch.Tensor:
        h = getattr(m.model, self.norm)(h)
        if self.head_div is not None:
            h = h / self.head_div
        logits = m.lm_head(h)
        if self.logits_div is not None:
            logits = logits / self.logits_div
        if self.logits_mult is not None:
            logits = logits * self.logits_mult
        if self.to_float:
            logits = logits.float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


# the final norm's name where it is not `norm`
_FINAL_NORM = {
    "PhiForCausalLM": "final_layernorm", "JambaForCausalLM": "final_layernorm", "BambaForCausalLM": "final_layernorm",
    "FalconH1ForCausalLM": "final_layernorm", "Lfm2ForCausalLM": "embedding_norm", "Lfm2MoeForCausalLM": "embedding_norm",
    "NemotronHForCausalLM": "norm_f", "PersimmonForCausalLM": "final_layernorm", "Lfm3ForCausalLM": "embedding_norm",
    "RecurrentGemmaForCausalLM": "final_norm",
}


def _refuse_what_layers_cannot_carry(model: nn.Module) -> None:
    """ModelError for options whose effect spans layers, which snake's layer-by-layer
    stream cannot reproduce."""
    config: Any = model.config
    name = type(model).__name__
    if getattr(config, "output_router_logits", False):
        raise ModelError(
            f"model: {name} has output_router_logits=True, which adds the routers' load-balancing "
            "loss over all layers' routing together; snake streams one layer at a time and trains "
            "the language-model loss alone: set model.config.output_router_logits = False"
        )
    if getattr(config, "z_loss_coefficient", 0.0):
        raise ModelError(
            f"model: {name} has z_loss_coefficient={config.z_loss_coefficient}, a loss term its own "
            "forward adds to the language-model loss (Bamba's z-loss on the logits), which snake "
            "does not compute: set model.config.z_loss_coefficient = 0.0"
        )
    bidirectional = getattr(config, "use_bidirectional_attention", False)
    if bidirectional and bidirectional != "vision":  # Gemma 4's "vision": only among image tokens
        raise ModelError(
            f"model: {name} has use_bidirectional_attention={bidirectional!r}; snake trains causal language "
            "models: set it to False"
        )
    if getattr(config, "hidden_size_per_layer_input", 0):
        raise ModelError(
            f"model: {name} has per-layer inputs (hidden_size_per_layer_input="
            f"{config.hidden_size_per_layer_input}: an embedding of the token ids fed to every layer, as "
            "Gemma4TextConfig's default, gemma-4-e2b's configuration, has); snake carries the hidden state alone from layer to layer and "
            "cannot train it (a Gemma 4 configuration with hidden_size_per_layer_input=0 it can)"
        )
    if getattr(config, "num_kv_shared_layers", 0):
        raise ModelError(
            f"model: {name} has num_kv_shared_layers={config.num_kv_shared_layers}: its last layers reuse the "
            "keys and values of an earlier layer, which snake's layer-by-layer stream does not carry; it "
            "cannot train it"
        )


def _layer_kinds(model: nn.Module, impl: str, name: str) -> tuple[list[tuple[int | None, int | None]], list[str]]:
    """Per layer: the mask it needs, (window, chunk) (None, None for full causal
    attention), and its attention type (which rotary table Gemma 3 uses). ModelError for
    what snake cannot run."""
    config: Any = model.config
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if name == "InklingForCausalLM":
        window = getattr(config, "sliding_window_size", None)
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None)
    if types:
        kinds = list(types)[:n]
        for kind in sorted(set(kinds)):
            if kind not in (*_ATTENTION, *_UNMASKED):
                raise ModelError(f"model: {name} uses attention type {kind!r}, which snake does not support")
        # MiniMax windows its full-attention layers by config.sliding_window when it is set
        windowed = (*_WINDOWED, "full_attention") if name == "MiniMaxForCausalLM" else _WINDOWED
        specs = [(int(window) if kind in windowed and window else None,
                  int(chunk) if kind == "chunked_attention" and chunk else None) for kind in kinds]
        # (recurrent layers take no mask: a hybrid whose attention layers all mask alike is uniform)
        attention = {(spec, kind) for spec, kind in zip(specs, kinds, strict=True) if kind not in _UNMASKED}
        if impl.startswith("flash_attention") and len({spec for spec, _ in attention}) > 1:
            raise ModelError(
                f"model: {name} mixes attention types across layers ({sorted({k for _, k in attention})}), which flash "
                "attention takes from each layer's own attributes, and snake runs every layer through "
                "one copy of layer 0: load it with attn_implementation='sdpa' (or 'eager')"
            )
        return specs, kinds
    w = _uniform_window(model, impl, name)
    return [(w, None)] * n, ["sliding_attention" if w else "full_attention"] * n


def _uniform_window(model: nn.Module, impl: str, name: str) -> int | None:
    """The window every layer uses in a model without `layer_types`, None for full causal
    attention."""
    config: Any = model.config
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if name == "Qwen2ForCausalLM":
        # transformers without layer_types: eager / SDPA window only where the model-level
        # mask builder takes the config (~4.48 to 4.52), then with config.sliding_window for
        # every layer; flash attention windows per layer (from max_window_layers on)
        if not impl.startswith("flash_attention"):
            return int(window) if window and _qwen2_mask_windows(model) else None
        if not getattr(config, "use_sliding_window", False) or not window:
            return None
        first_sliding = int(getattr(config, "max_window_layers", 0))
        if 0 < first_sliding < n:
            raise ModelError(
                f"model: {name} uses sliding-window attention from layer {first_sliding} on and "
                "full attention below, which flash attention takes from each layer: load it with "
                "attn_implementation='sdpa' (or 'eager')"
            )
        return int(window) if first_sliding <= 0 else None
    if name in _WINDOW_FROM_CONFIG:
        return int(window) if window else None
    return None


def _qwen2_mask_windows(model: nn.Module) -> bool:
    builder = getattr(type(getattr(model, "model", None)), "_prepare_4d_causal_attention_mask_with_cache_position", None)
    if builder is None:
        return False
    try:
        return "config" in inspect.signature(builder).parameters
    except (TypeError, ValueError):
        return False


# -- block helpers ---------------------------------------------------------------------------


def _hidden(out: Any) -> torch.Tensor:
    """Decoder layers return a tensor (transformers >= 4.54) or a tuple led by it."""
    return out[0] if isinstance(out, tuple | list) else out


class _MaskCache:
    """The attention mask a layer needs for a (T, dtype, device): None where the attention
    kernel masks causally by itself, else an additive (1, 1, T, T) mask with the dtype's
    minimum above the diagonal (and before the sliding window, or outside the query's chunk
    of `chunk` tokens: Llama 4's chunked attention), as transformers builds it. With `full`
    always a mask, under SDPA a boolean one (True: attend), as transformers builds it when
    told not to skip it."""

    def __init__(self, impl: str, window: int | None, chunk: int | None = None, *, full: bool = False) -> None:
        self.impl = impl
        self.window = window
        self.chunk = chunk
        self.full = full
        self._cache: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        self._lock = threading.Lock()

    def get(self, h: torch.Tensor) -> torch.Tensor | None:
        T = h.shape[1]
        needs_window = self.window is not None and T > self.window
        needs_chunk = self.chunk is not None and T > self.chunk
        if self.impl.startswith("flash_attention"):
            return None  # flash kernels get the window from the layer itself
        if self.impl in _SELF_CAUSAL and not needs_window and not needs_chunk and not self.full:
            return None
        key = (T, h.dtype, h.device)
        with self._lock:
            mask = self._cache.get(key)
            if mask is None:
                q = torch.arange(T, device=h.device)[:, None]
                k = torch.arange(T, device=h.device)[None, :]
                allowed = k <= q
                if needs_window:
                    assert self.window is not None
                    allowed &= k > q - self.window
                if needs_chunk:
                    assert self.chunk is not None
                    allowed &= (k // self.chunk) == (q // self.chunk)
                if self.full and self.impl == "sdpa":  # as transformers builds it for SDPA
                    mask = allowed[None, None]
                else:
                    mask = torch.zeros(T, T, dtype=h.dtype, device=h.device)
                    mask.masked_fill_(~allowed, torch.finfo(h.dtype).min)
                    mask = mask[None, None]
                if len(self._cache) > 16:
                    self._cache.clear()
                self._cache[key] = mask
        return mask


class _Rotary:
    """The rotary embedding for positions 0..T-1 ((cos, sin), or the complex `freqs_cis` of
    DeepSeek V2 and Llama 4) from a private copy of the model's `rotary_emb`, one
    copy per device (its buffers are the model's, outside the blocks, so the shell block
    that snake runs on the device does not carry them); for the layer's attention type
    where the table depends on it (Gemma 3: local and global bases). None where the model
    has no model-level rotary embedding (older transformers: the layers compute it)."""

    def __init__(self, rotary: nn.Module | None) -> None:
        self.rotary = copy.deepcopy(rotary) if rotary is not None else None
        self.per_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
        self._per_device: dict[torch.device, nn.Module] = {}
        self._lock = threading.Lock()

    def __call__(self, h: torch.Tensor, position_ids: torch.Tensor, kind: str) -> Any:
        if self.rotary is None:
            return None
        with self._lock:
            mod = self._per_device.get(h.device)
            if mod is None:
                mod = copy.deepcopy(self.rotary).to(h.device)
                self._per_device[h.device] = mod
        if self.per_type and kind in _UNMASKED:  # a table per attention type; none for a recurrent layer
            return None
        with torch.no_grad():
            return mod(h, position_ids, kind) if self.per_type else mod(h, position_ids)


# -- loading and export ----------------------------------------------------------------------


def load_hf(path_or_config: Any, **kwargs: Any) -> nn.Module:
    """A causal LM from a `transformers` config object (fresh weights, `from_config`) or a
    local directory with a config and safetensors weights (`from_pretrained`, no network).
    `kwargs` go to transformers (e.g. `attn_implementation`, `dtype`); the attention
    implementation defaults to "sdpa", or "eager" for a model without SDPA (Gemma 2)."""
    if "attn_implementation" not in kwargs:
        try:
            return _load_hf(path_or_config, attn_implementation="sdpa", **kwargs)
        except ValueError as e:
            if "scaled_dot_product_attention" not in str(e):
                raise
        return _load_hf(path_or_config, attn_implementation="eager", **kwargs)
    return _load_hf(path_or_config, **kwargs)


# image-text checkpoints whose language model is one of snake's families but which
# AutoModelForCausalLM loads whole, vision tower and all (Gemma 3, Gemma 4): `load_hf` and
# `stream_hf` load their text part as that family's causal LM, its tensors renamed so
# (transformers 5 stores the language model under `model.language_model.`, 4.x under
# `language_model.model.`); the other towers' tensors stay in the files
_TEXT_PART = {
    r"^model\.language_model\.": "model.",
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
}
_TEXT_NAMES = "model.language_model.* (or transformers 4's language_model.model.*)"


def _causal_name(config: Any) -> str | None:
    """The name of AutoModelForCausalLM's class for `config`, None where it has none."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if config is None or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return None
    cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return getattr(cls, "__name__", None)


def text_part(config: Any) -> Any | None:
    """The text config of an image-text model's `config` whose language model snake trains
    but whose own causal LM class (AutoModelForCausalLM's) it does not, else None."""
    known = {"GPT2LMHeadModel", *_LLAMA_FAMILY, *_MAMBA, *_OLD}
    if config is None or _causal_name(config) in known:
        return None
    text = getattr(config, "text_config", None)
    if text is None or text is config or _causal_name(text) not in known:
        return None
    text = copy.deepcopy(text)
    # the whole model ties its head to the embedding as its own config says, whatever the
    # text config's says: so does its text part
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", text.tie_word_embeddings))
    return text


def text_part_hint(model: nn.Module) -> str | None:
    """What to do with an image-text model whose language model snake trains, None for any
    other model."""
    text = text_part(getattr(model, "config", None))
    if text is None:
        return None
    return (
        f"model: {type(model).__name__} is an image-text model; snake trains its language model "
        f"({_causal_name(text)}): load the checkpoint's directory with snake.hf.load_hf(dir) or "
        "snake.hf.stream_hf(dir), which give that part alone (the other towers stay in the files)"
    )


def _other_towers(keys: Iterable[str]) -> list[str]:
    """The modules of an image-text checkpoint's stored tensors outside its language model
    (`_TEXT_PART`): each key's first component past a leading `model.` (vision_tower,
    multi_modal_projector, ...)."""
    out = set()
    for key in keys:
        if key.startswith("lm_head.") or any(re.match(pattern, key) for pattern in _TEXT_PART):
            continue
        parts = key.split(".")
        out.add(parts[1] if parts[0] == "model" and len(parts) > 1 else parts[0])
    return sorted(out)


def _text_tensors(where: Mapping[str, _Stored], directory: Path) -> dict[str, _Stored]:
    """An image-text checkpoint's language-model tensors under the text model's names
    (`_TEXT_PART`); its other towers' are left out."""
    out: dict[str, _Stored] = {}
    for key, at in where.items():
        for pattern, to in _TEXT_PART.items():
            name, n = re.subn(pattern, to, key)
            if n:
                out[name] = at
                break
        else:
            if key.startswith("lm_head."):
                out[key] = at
    if not any(name.startswith("model.") for name in out):
        raise ModelError(
            f"stream_hf: {str(directory)!r} is an image-text checkpoint whose config names a language model, "
            f"but its weights hold none under {_TEXT_NAMES}; save the model again with transformers"
        )
    return out


def causal_lm_class(config: Any) -> Any:
    """The causal LM class for a transformers config: AutoModelForCausalLM's, or for a
    family transformers does not register there (Mistral 4) the class of snake's families
    its config names (`architectures`, or the config class's stem + "ForCausalLM")."""
    import transformers
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM
    stem = type(config).__name__.removesuffix("Config")
    for name in [*(getattr(config, "architectures", None) or []), f"{stem}ForCausalLM"]:
        if name in _LLAMA_FAMILY and hasattr(transformers, name):
            return getattr(transformers, name)
    raise ModelError(
        f"load_hf: transformers has no causal LM for {type(config).__name__} (model_type "
        f"{getattr(config, 'model_type', None)!r}); snake recognises {supported()}"
    )


def _load_hf(path_or_config: Any, **kwargs: Any) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    if isinstance(path_or_config, PretrainedConfig):
        path_or_config = text_part(path_or_config) or path_or_config  # an image-text model: its text part
        cls = causal_lm_class(path_or_config)
        if cls is AutoModelForCausalLM:
            return AutoModelForCausalLM.from_config(path_or_config, **kwargs)
        return cls._from_config(path_or_config, **kwargs)
    if isinstance(path_or_config, str | os.PathLike):
        path = Path(path_or_config)
        if not path.is_dir():
            raise ModelError(
                f"load_hf: {str(path)!r} is not a directory; pass a local directory with "
                "config.json and *.safetensors weights, or a transformers config object"
            )
        kwargs.setdefault("use_safetensors", True)
        kwargs.setdefault("local_files_only", True)
        files = path / kwargs.get("subfolder", "")
        if kwargs["use_safetensors"] and (files / "config.json").is_file() and not any(files.glob("*.safetensors")):
            raise ModelError(
                f"load_hf: {str(files)!r} has a config.json but no *.safetensors weights; for a model "
                f"with fresh weights from that config pass the config: "
                f"load_hf(transformers.AutoConfig.from_pretrained({str(files)!r}))"
            )
        config = AutoConfig.from_pretrained(str(path), local_files_only=kwargs["local_files_only"],
                                            subfolder=kwargs.get("subfolder", ""))
        text = text_part(config)
        if text is not None:  # an image-text checkpoint: its language model, the tensors renamed
            cls = causal_lm_class(text)
            if cls is AutoModelForCausalLM:  # the class it stands for, to subclass
                from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

                cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(text)]
            try:
                towers = _other_towers(_safetensors_keys(files))
            except ModelError:  # a damaged directory: from_pretrained says what is wrong
                towers = []
            # the other towers' tensors are left in the files: not reported one per line as
            # unexpected (hundreds of lines for a vision tower), but in one line here
            quiet: Any = type(cls.__name__, (cls,), {
                "__module__": cls.__module__,
                "_keys_to_ignore_on_load_unexpected": [rf"(^|\.)({'|'.join(map(re.escape, towers))})\."],
            }) if towers else cls
            model, info = quiet.from_pretrained(str(path), **{"key_mapping": _TEXT_PART, **kwargs, "config": text},
                                                output_loading_info=True)
            model.__class__ = cls  # the family's own class, as from_pretrained of it gives
            if towers:
                log.info("load_hf: the language model of %s; the tensors of its %s stay in the files",
                         path, ", ".join(towers))
            if info["missing_keys"]:  # stored under names `_TEXT_PART` does not know: fresh weights instead
                raise ModelError(
                    f"load_hf: {str(path)!r} is an image-text checkpoint; snake loads its language model, but "
                    f"found no {min(info['missing_keys'])!r} ({len(info['missing_keys'])} tensors missing) stored "
                    f"as {_TEXT_NAMES}; save the model again with transformers"
                )
            _freeze_as_built(model, cls, text)
            return model
        cls = causal_lm_class(config)
        model = cls.from_pretrained(str(path), **kwargs)
        _freeze_as_built(model, cls, config)
        return model
    raise ModelError(
        f"load_hf: expected a transformers PretrainedConfig or a directory path, got "
        f"{type(path_or_config).__name__}"
    )


def stream_hf(
    path: str | os.PathLike[str], *, dtype: torch.dtype | str = "auto", attn_implementation: str | None = None
) -> nn.Module:
    """The causal LM in a local directory (config.json and *.safetensors), as `load_hf`
    loads it, but with its layers' parameters left in their files (on the meta device)
    until snake copies them into its tiers, one layer at a time: the process never holds
    the model's layer weights beside snake's own copy of them, so a model whose weights do
    not fit in CPU memory trains with its parameters and optimizer states placed on SSD. The
    embedding, head, final norm and buffers are read at once; frozen parameters (and those
    kept in float32) when a trainer is made from the model. Give the model to `SnakeTrainer`
    as any other; it cannot run a forward of its own (`export_hf` fills it).

    dtype: the parameters' dtype ("auto": the config's, else the stored weights', as
    `from_pretrained` takes it). attn_implementation: as `load_hf` (default "sdpa", or
    "eager" for a model without SDPA). Weights stored under other names or shapes than the
    model's (the experts of a mixture of experts stored one by one, which transformers 5
    fuses; older names) go through transformers' own conversion, one layer at a time.
    The directory must stay as it is until training has started (snake reads the layers
    from it when the trainer builds its tiers): do not export into it. Needs transformers 5."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    if int(transformers.__version__.split(".")[0]) < 5:
        raise ModelError(
            f"stream_hf: needs transformers 5 or later (its loader's layer-by-layer conversion); this is "
            f"{transformers.__version__}: upgrade it, or load the whole model with snake.hf.load_hf(dir)"
        )
    directory = Path(path)
    where = _safetensors_keys(directory)
    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelError(
            f"stream_hf: cannot read {str(directory / 'config.json')!r} as a transformers config "
            f"({str(e).strip().splitlines()[0][:300]}); it must name a model_type transformers knows"
        ) from None
    chosen = _load_dtype(dtype, config, where)
    text = text_part(config)
    if text is not None:  # an image-text checkpoint: its language model, the tensors renamed
        where = _text_tensors(where, directory)
        config = text
    cls = causal_lm_class(config)
    impls = [attn_implementation] if attn_implementation is not None else ["sdpa", "eager"]
    for impl in impls:
        try:
            with _parameters_on_meta():
                if cls is AutoModelForCausalLM:
                    model = cls.from_config(config, attn_implementation=impl, dtype=chosen)
                else:
                    model = cls._from_config(config, attn_implementation=impl, dtype=chosen)
            break
        except (ValueError, ImportError) as e:
            if attn_implementation is not None:
                raise ModelError(f"stream_hf: attn_implementation={impl!r}: {e}") from None
            if impl == impls[-1] or "scaled_dot_product_attention" not in str(e):
                raise
    model.eval()  # as from_pretrained returns it
    parts = _describe_hf(model)
    if parts is None:
        raise ModelError(f"stream_hf: snake does not know how the layers of {type(model).__name__} compose; it recognises {supported()}")
    source = _LayerSource(model, parts, where, chosen, directory)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    prefix = parts.blocks_prefix + "."
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta and not n.startswith(prefix)]
    if missing:
        raise ModelError(
            f"stream_hf: {str(directory)!r} has no {missing[0]!r} ({len(missing)} tensors outside the layers "
            "missing); load it with snake.hf.load_hf(dir), which initialises what a checkpoint leaves out"
        )
    source.check()
    model.snake_layer_weights = source  # describe_hf gives it to the ModelParts
    return model


_FLOATS = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_STORED = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def _load_dtype(dtype: torch.dtype | str, config: Any, where: Mapping[str, _Stored]) -> torch.dtype:
    """The dtype `stream_hf` builds in: `dtype`, or for "auto" the config's, else that of the
    first floating-point tensor stored (as `from_pretrained(dtype="auto")`)."""
    from safetensors import safe_open

    chosen: Any = dtype
    if chosen == "auto":
        chosen = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if chosen is None:
            for at in where.values():
                with safe_open(str(at.file), framework="pt") as f:
                    chosen = _STORED.get(f.get_slice(at.key).get_dtype())
                if chosen is not None:
                    break
            chosen = chosen or torch.float32
    if isinstance(chosen, str):
        chosen = getattr(torch, chosen, None)
    if chosen not in _FLOATS:
        raise ModelError(
            f"stream_hf: dtype {dtype!r} is not one snake trains in; pass torch.float32, torch.bfloat16, "
            'torch.float16 or "auto"'
        )
    return chosen


class _LayerSource:
    """`ModelParts.weights` for `stream_hf`: a layer's parameters from the files. Where the
    files use the model's names they are read by name (memory-mapped by safetensors, copied
    out one tensor at a time, cast to the model's dtype); otherwise transformers' own
    conversion (`convert_and_load_state_dict_in_model`, as `from_pretrained` runs it) loads
    the layer's stored tensors into the model, snake takes the layer's parameters and puts
    the model's meta ones back. Made by `stream_hf`, which it loads everything outside the
    layers, and the layers' buffers, into."""

    def __init__(self, model: Any, parts: ModelParts, where: Mapping[str, _Stored], dtype: torch.dtype,
                 directory: Path) -> None:
        self.model, self.where, self.directory = model, where, directory
        self.prefix = parts.blocks_prefix + "."
        self.n_layers = len(parts.blocks)
        self.lock = threading.Lock()  # one conversion at a time: it sets the model's parameters
        state = model.state_dict(keep_vars=True)
        # a checkpoint may leave out the base model's prefix (the Hub's GPT-2: "h.0.", OPT:
        # "decoder.layers.0."), as from_pretrained accepts
        base = str(getattr(model, "base_model_prefix", "") or "")
        heads = [self.prefix] + ([self.prefix[len(base) + 1:]] if base and self.prefix.startswith(base + ".") else [])
        layer_key = re.compile("^(?:" + "|".join(re.escape(h) for h in heads) + r")(\d+)\.")
        self.stored: list[dict[str, str]] = [{} for _ in range(self.n_layers)]  # per layer: name in layer -> key
        outside = []
        for key in where:
            m = layer_key.match(key)
            if m and int(m.group(1)) < self.n_layers:
                self.stored[int(m.group(1))][key[m.end():]] = key
            else:
                outside.append(key)
        self.lazy = {k: t for k, t in state.items() if k.startswith(self.prefix) and isinstance(t, nn.Parameter)}
        # the dtype each layer parameter is loaded in, as load_hf would load it: a cast of the
        # model afterwards (`.float()`) then casts what was loaded (`layer_values`), as it
        # would cast load_hf's weights
        self.dtypes = {k: t.dtype for k, t in self.lazy.items()}
        self.direct = all(k in where for k in self.lazy) and all(n in where for n, _ in model.named_parameters()
                                                                   if not n.startswith(self.prefix))
        self.load: Callable[[list[str]], Any] | None = None
        if self.direct:
            self._check_shapes({k: t for k, t in state.items() if k in where})
            eager = {k: _read(where[k], t.dtype if t.is_floating_point() else None)
                     for k, t in state.items() if k not in self.lazy and k in where}
            model.load_state_dict(eager, strict=False, assign=True)
            return
        self.load = _converter(model, dtype, where)
        self.load(outside)
        for i in range(self.n_layers):  # the layers' stored buffers: by name, or converted with the layer
            head = f"{self.prefix}{i}."
            buffers = [k for k, t in state.items() if k.startswith(head) and not isinstance(t, nn.Parameter)]
            if not buffers:
                continue
            if all(k[len(head):] in self.stored[i] for k in buffers):
                model.load_state_dict({k: _read(where[self.stored[i][k[len(head):]]],
                                                state[k].dtype if state[k].is_floating_point() else None)
                                       for k in buffers}, strict=False, assign=True)
            else:
                self._converted(i)

    def __call__(self, layer: int) -> Mapping[str, torch.Tensor]:
        if self.direct:
            return _LayerReader(self, f"{self.prefix}{layer}.")
        return self._converted(layer)

    def _check_shapes(self, state: Mapping[str, torch.Tensor]) -> None:
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for k in state:
            by_file.setdefault(self.where[k].file, []).append(k)
        for file, keys in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for k in keys:
                    stored = tuple(f.get_slice(self.where[k].key).get_shape())
                    if stored != tuple(state[k].shape):
                        raise ModelError(
                            f"stream_hf: the checkpoint's {k!r} has shape {stored}, the model its config.json "
                            f"describes {tuple(state[k].shape)}: the directory's config.json does not match its weights"
                        )

    def _converted(self, layer: int) -> dict[str, torch.Tensor]:
        assert self.load is not None
        block = self.model.get_submodule(f"{self.prefix}{layer}")
        with self.lock:
            sites = [(mod, attr, p) for mod in block.modules() for attr, p in mod._parameters.items() if p is not None]
            head = f"{self.prefix}{layer}."
            try:
                # transformers loads by the model's own names: PEFT's wrappers out of the way
                with _peft_unwrapped(block):
                    self.load(list(self.stored[layer].values()))
                    return {n: p.detach().to(self.dtypes.get(head + n, p.dtype))
                            for n, p in block.named_parameters() if not p.is_meta}
            finally:
                for mod, attr, p in sites:
                    mod._parameters[attr] = p

    def check(self) -> None:
        """ModelError unless every layer's parameters can be read: each one's names (and
        shapes) where read by name; where converted, a layer of each kind is converted now
        and every other layer must store what the first of its kind does."""
        blocks = [self.model.get_submodule(f"{self.prefix}{i}") for i in range(self.n_layers)]
        if self.direct:
            return  # every name was found, every shape checked
        kinds, firsts = layer_kinds(blocks)
        for i in range(self.n_layers):
            if not self.stored[i]:
                raise ModelError(
                    f"stream_hf: the checkpoint has no layer {i} ({self.prefix}{i}.*): config.json gives "
                    f"{self.n_layers} layers; make its layer count (num_hidden_layers) match the weights"
                )
        for first in firsts:
            read = self._converted(first)
            for name, p in blocks[first].named_parameters():
                if p.is_meta and name not in read:
                    raise ModelError(
                        f"stream_hf: the checkpoint has no {self.prefix}{first}.{name} (nor anything "
                        "transformers converts into it); load it with snake.hf.load_hf(dir) to see what it holds"
                    )
        shapes = _stored_shapes(self.where)
        for i, kind in enumerate(kinds):
            first = firsts[kind]
            mine, want = set(self.stored[i]), set(self.stored[first])
            if mine != want:
                name = min((want - mine) or (mine - want))
                raise ModelError(
                    f"stream_hf: the checkpoint's layer {i} stores other tensors than layer {first} "
                    f"(its kind's first): {self.prefix}{i}.{name} is in one of them only; load it with snake.hf.load_hf(dir) "
                    "to see what it holds"
                )
            for name in sorted(mine):
                here, there = shapes[self.stored[i][name]], shapes[self.stored[first][name]]
                if here != there:
                    raise ModelError(
                        f"stream_hf: the checkpoint's {self.stored[i][name]!r} has shape {here}, layer {first}'s "
                        f"{there} ({str(self.where[self.stored[i][name]].file)!r}); layers of one kind store one shape: "
                        "the file is damaged or from another model"
                    )


class _LayerReader(Mapping[str, torch.Tensor]):
    """One layer's parameters read by name, each when asked for."""

    def __init__(self, source: _LayerSource, head: str) -> None:
        self.source, self.head = source, head

    def __getitem__(self, name: str) -> torch.Tensor:
        key = self.head + name
        if key not in self.source.lazy:
            raise KeyError(name)
        return _read(self.source.where[key], self.source.dtypes[key])

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.head + name in self.source.lazy

    def __iter__(self) -> Iterator[str]:
        return (k[len(self.head):] for k in self.source.lazy if k.startswith(self.head))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _converter(model: Any, dtype: torch.dtype, where: Mapping[str, _Stored]) -> Callable[[list[str]], Any]:
    """keys -> load those stored tensors into `model` through transformers' conversion of
    its weights (renames, fused experts), as `from_pretrained` does; ModelError for shapes
    that do not match or a conversion that fails."""
    from safetensors import SafetensorError, safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import logging as hf_logging

    plan = getattr(model, "_get_dtype_plan", None)
    mapping: Any = get_model_conversion_mapping(model, None, None)
    config = LoadStateDictConfig(dtype=dtype, dtype_plan=plan(dtype) if callable(plan) else {}, weight_mapping=mapping)

    def load(keys: list[str]) -> None:
        files = {}
        for file in {where[k].file for k in keys}:
            try:
                files[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as e:
                raise _gone(file, e) from None
        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # one bar per layer read would flood a training log
        try:
            info, _ = convert_and_load_state_dict_in_model(
                model=model, state_dict={k: files[where[k].file].get_slice(where[k].key) for k in keys},
                load_config=config,
            )
        finally:
            if bar:
                hf_logging.enable_progress_bar()
            for f in files.values():
                f.__exit__(None, None, None)
        if info.mismatched_keys:
            key, stored, want = sorted(info.mismatched_keys)[0]
            raise ModelError(
                f"stream_hf: the checkpoint's {key!r} has shape {tuple(stored)}, the model its config.json "
                f"describes {tuple(want)}: the directory's config.json does not match its weights"
            )
        if info.conversion_errors or info.error_msgs:
            key, what = next(iter(info.conversion_errors.items()), None) or ("", info.error_msgs[0])
            what = str(what).strip().splitlines()[-1][:300]
            raise ModelError(
                f"stream_hf: transformers could not convert the stored weights{' of ' + repr(key) if key else ''} "
                f"({what}); the files are damaged or from another model: load it with snake.hf.load_hf(dir)"
            )

    return load


# -- PEFT adapters of a streamed model -------------------------------------------------------

# the path components PEFT puts between a wrapped module and its own parameters: a tuner
# layer's `base_layer` (LoRA, DoRA, IA3), `original_module` and the trained copies
# `modules_to_save.<adapter>` of `modules_to_save` (a copy starts as the original)
_PEFT_WRAPS = re.compile(r"(?<![^.])(?:base_layer|original_module|modules_to_save\.[^.]+)\.")


def _unwrapped_name(name: str) -> str:
    """A parameter's name in a layer PEFT wrapped -> its name in the layer as stored."""
    return _PEFT_WRAPS.sub("", name)


class _PeftNames(Mapping[str, torch.Tensor]):
    """One layer's stored weights (`_LayerSource`'s) by the names of the layer PEFT wrapped."""

    def __init__(self, read: Mapping[str, torch.Tensor]) -> None:
        self.read = read

    @staticmethod
    def of(weights: Callable[[int], Mapping[str, torch.Tensor]]) -> Callable[[int], Mapping[str, torch.Tensor]]:
        return lambda layer: _PeftNames(weights(layer))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read[_unwrapped_name(name)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and _unwrapped_name(name) in self.read

    def __iter__(self) -> Iterator[str]:
        return iter(self.read)

    def __len__(self) -> int:
        return len(self.read)


def _peft_inner(module: nn.Module) -> nn.Module | None:
    """The module a PEFT wrapper wraps (a tuner layer's base layer, `modules_to_save`'s
    original), None for a module PEFT did not wrap."""
    if not type(module).__module__.startswith("peft."):
        return None
    get_base = getattr(module, "get_base_layer", None)
    inner = get_base() if callable(get_base) else getattr(module, "original_module", None)
    return inner if isinstance(inner, nn.Module) and inner is not module else None


def _unwrap(block: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Put each module PEFT wrapped in `block` in its wrapper's place; returns (parent,
    name, wrapper) of each."""
    swaps = []
    for parent in list(block.modules()):
        for name, child in list(parent._modules.items()):
            inner = _peft_inner(child) if child is not None else None
            if child is not None and inner is not None:
                swaps.append((parent, name, child))
                parent._modules[name] = inner
    return swaps


@contextlib.contextmanager
def _peft_unwrapped(block: nn.Module) -> Iterator[None]:
    """`block` with each module PEFT wrapped in its place, unwrapped, until the end."""
    swaps = _unwrap(block)
    try:
        yield
    finally:
        for parent, name, child in reversed(swaps):
            parent._modules[name] = child


def _base_free(config: Any) -> bool:
    """Whether a PEFT config's initialisation of its adapters reads no base weight: LoRA's
    default (A as an nn.Linear, B zero), "gaussian" and none (False), without DoRA (whose
    magnitude is the base weight's norm); IA3's (ones)."""
    kind = type(config).__name__
    if kind == "LoraConfig":
        return not getattr(config, "use_dora", False) and config.init_lora_weights in (True, False, "gaussian")
    return kind == "IA3Config"


def init_adapters(model: nn.Module) -> int:
    """Initialise the adapters PEFT put into the layers of a model from `stream_hf` (a
    `PeftModel` or its base model) with PEFT's own initialisation, one layer at a time.

    `get_peft_model` makes a layer's adapters beside its weights, which `stream_hf` leaves
    in their files on the meta device, so the adapters are left there too, uninitialised.
    Here each layer's adapters are made again by PEFT (`inject_adapter_in_model`, the
    model's PEFT configs) on a copy of the layer whose weights are read from the files
    where the initialisation reads them (DoRA's magnitude), else left unread; they
    are put into the model's layer in the dtype PEFT gave them, and the layer's weights stay
    in their files. Layer by layer in order, the adapters draw from torch's random
    generator as `get_peft_model` draws for a model in memory: seeded alike just before,
    they are the same, where the config adapts modules of the layers only (adapters of the
    embedding, outside the layers, are drawn by `get_peft_model` before the layers'; the
    head's after). PEFT's adapter buffers (OFT's) are made too. An initialisation that
    changes the base weights (PiSSA, OLoRA, LoftQ, CorDA) is refused: the files keep the
    weights as they were. Adapters outside the layers are made by `get_peft_model` itself
    (not with `low_cpu_mem_usage=True`, which is refused).

    `SnakeTrainer` calls it for a model whose adapters are not yet initialised; call it
    yourself to choose when they draw, or to keep it off an event loop where it reads the
    base weights (DoRA: `await asyncio.to_thread(init_adapters, model)`). Returns the number
    of adapter tensors initialised (0 where there are none left to initialise)."""
    from snake.adapters import peft_base

    base = peft_base(model) or model
    parts = _describe_hf(base)
    weights = getattr(base, "snake_layer_weights", None)
    if parts is None or weights is None:
        raise ModelError(
            f"init_adapters: {type(base).__name__} is not a model from snake.hf.stream_hf; PEFT initialises "
            "the adapters of a model in memory itself (get_peft_model)"
        )
    return _init_adapters(base, dataclasses.replace(parts, weights=_PeftNames.of(weights)))


def _stored_names(block: nn.Module) -> set[str]:
    """The names of a layer's parameters and buffers as stored (PEFT's wrappers unwrapped)."""
    copy_ = copy.deepcopy(block)  # what is on the meta device allocates nothing
    _unwrap(copy_)
    return {n for n, _ in [*copy_.named_parameters(remove_duplicate=False), *copy_.named_buffers()]}


def _init_adapters(model: nn.Module, parts: ModelParts) -> int:
    assert parts.weights is not None
    configs = getattr(model, "peft_config", None)
    prefix = parts.blocks_prefix + "."
    outside = next((n for n, p in model.named_parameters() if p.is_meta and not n.startswith(prefix)), None)
    if outside is not None and has_peft_layers(model):
        raise ModelError(
            f"model: PEFT left {outside}, outside the layers, on the meta device (get_peft_model(..., "
            "low_cpu_mem_usage=True) makes the adapters without their values); snake initialises the "
            "adapters of a streamed model's layers only: call get_peft_model without low_cpu_mem_usage"
        )
    check_param_wrappers(parts)
    made: list[tuple[dict[str, Any], str, torch.Tensor]] = []  # put in once every layer's are made
    for i, block in enumerate(parts.blocks):
        if not any(t.is_meta for t in [*block.parameters(), *block.buffers()]):
            continue
        copy_ = copy.deepcopy(block)
        _unwrap(copy_)  # the layer as stored
        stored = {n for n, _ in [*copy_.named_parameters(remove_duplicate=False), *copy_.named_buffers()]}
        todo = [(n, t) for n, t in [*block.named_parameters(remove_duplicate=False), *block.named_buffers()]
                if t.is_meta and _unwrapped_name(n) not in stored]
        if not todo:
            continue
        if not isinstance(configs, dict) or not configs:
            raise ModelError(
                f"model: {parts.blocks_prefix}.{i}.{todo[0][0]} of a model from stream_hf is on the meta device "
                "and the files do not hold it, and the model has no PEFT config to initialise it with "
                "(peft_config); make the adapters with peft.get_peft_model"
            )
        made += _init_layer(parts, i, block, copy_, todo, configs)
    for where, attr, t in made:
        where[attr] = t
    return len(made)


def _init_layer(parts: ModelParts, layer: int, block: nn.Module, copy_: nn.Module,
                todo: list[tuple[str, torch.Tensor]], configs: dict[str, Any]
                ) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    """Layer `layer`'s adapters `todo` (parameters and buffers on the meta device), made by
    PEFT on `copy_`, a copy of `block` as stored (unwrapped), given the stored weights here:
    (the `_parameters` or `_buffers` of its module in `block`, attribute, tensor) of each."""
    from peft import inject_adapter_in_model

    from snake.adapters import layer_values

    read = not all(_base_free(c) for c in configs.values())
    # the copy's weights read from the files, or (where the initialisation does not read
    # them) allocated and left as they are
    named = [(n, p) for n, p in copy_.named_parameters(remove_duplicate=False) if p.is_meta]
    if read:
        values = layer_values(parts, layer, named)
    else:
        values = [torch.empty(p.shape, dtype=p.dtype) for _, p in named]
    mods = dict(copy_.named_modules())
    for (name, _), v in zip(named, values, strict=True):
        mod_name, _, attr = name.rpartition(".")
        mods[mod_name]._parameters[attr] = nn.Parameter(v, requires_grad=False)
    before = {n: v.clone() for (n, _), v in zip(named, values, strict=True)} if read else {}
    # PEFT finds its targets by their path in the model: the copy sits at the layer's path
    root: nn.Module = nn.Module()
    node = root
    *path, last = f"{parts.blocks_prefix}.{layer}".split(".")
    for step in path:
        node.add_module(step, nn.Module())
        node = node.get_submodule(step)
    node.add_module(last, copy_)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's own notes on a model it sees again
        for adapter, config in configs.items():
            if getattr(config, "trainable_token_indices", None) is not None:  # the embedding's, outside the layer
                config = copy.copy(config)
                config.trainable_token_indices = None
            try:
                inject_adapter_in_model(config, root, adapter_name=adapter)
            except (ValueError, TypeError, NotImplementedError) as e:
                raise ModelError(
                    f"model: PEFT could not make adapter {adapter!r} ({type(config).__name__}) of layer {layer} again "
                    f"to initialise it ({str(e).strip().splitlines()[0][:300]}); load the model with "
                    "snake.hf.load_hf(dir) before get_peft_model"
                ) from None
    made: dict[str, torch.Tensor] = {**dict(copy_.named_buffers()), **dict(copy_.named_parameters(remove_duplicate=False))}
    for name, v in before.items():
        now = made.get(_find_wrapped(made, name))
        if now is not None and not torch.equal(now.detach(), v):
            kinds = sorted({str(getattr(c, "init_lora_weights", type(c).__name__)) for c in configs.values()})
            raise ModelError(
                f"model: the adapters' initialisation ({', '.join(kinds)}) changes the base weight "
                f"{parts.blocks_prefix}.{layer}.{name}, which stream_hf keeps in its files as stored; initialise "
                "them so that the base stays (init_lora_weights=True, 'gaussian'), or load the model with "
                "snake.hf.load_hf(dir) before get_peft_model"
            )
    mods = dict(block.named_modules())
    out: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for name, t in todo:
        got = made.get(name)
        if got is None or got.is_meta or tuple(got.shape) != tuple(t.shape):
            raise ModelError(
                f"model: PEFT made no {parts.blocks_prefix}.{layer}.{name} of shape {tuple(t.shape)} when it made "
                "the layer's adapters again (its configs in model.peft_config differ from what made them); "
                "load the model with snake.hf.load_hf(dir) before get_peft_model"
            )
        mod_name, _, attr = name.rpartition(".")
        value = got.detach().to(t.dtype if t.is_floating_point() else got.dtype).clone()
        if isinstance(t, nn.Parameter):
            # trained where both say so: PEFT's move to the meta device re-made some as trained
            # (AdaLoRA's rank count), an adapter not active is not
            new = nn.Parameter(value, requires_grad=t.requires_grad and got.requires_grad)
            new.snake_read = True  # type: ignore[attr-defined]  # initialised by snake, not left by to_empty
            out.append((mods[mod_name]._parameters, attr, new))
        else:
            out.append((mods[mod_name]._buffers, attr, value))
    return out


def _find_wrapped(made: Mapping[str, Any], name: str) -> str:
    """The name in a layer PEFT wrapped of its stored parameter `name`."""
    return next((n for n in made if _unwrapped_name(n) == name and n != name), name)


def _read(at: _Stored, dtype: torch.dtype | None) -> torch.Tensor:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(at.file), framework="pt") as f:
            t = f.get_tensor(at.key)
    except (SafetensorError, OSError) as e:
        raise _gone(at.file, e) from None
    return t.to(dtype) if dtype is not None and t.dtype != dtype else t


def _gone(file: Path, e: BaseException) -> ModelError:
    return ModelError(
        f"stream_hf: cannot read {str(file)!r} ({e}); a streamed model's directory must stay as it "
        "was loaded until training has started (snake reads the layers from it then): restore it, "
        "and export elsewhere"
    )


def _stored_shapes(where: Mapping[str, _Stored]) -> dict[str, tuple[int, ...]]:
    """Each stored tensor's shape, from the files' headers."""
    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    by_file: dict[Path, list[str]] = {}
    for k, at in where.items():
        by_file.setdefault(at.file, []).append(k)
    for file, keys in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            out.update({k: tuple(f.get_slice(where[k].key).get_shape()) for k in keys})
    return out


class _Stored(NamedTuple):
    """Where a tensor of the model is stored: its file and its name there (another than the
    model's for the text part of an image-text checkpoint, `_TEXT_PART`)."""

    file: Path
    key: str


def _safetensors_keys(directory: Path) -> dict[str, _Stored]:
    """Every tensor name in a local model directory's safetensors weights -> its file
    (`model.safetensors`, or the shards `model.safetensors.index.json` maps), each file's
    header read (ModelError for a missing, damaged or incomplete shard: before training, not
    when its layer is reached)."""
    from safetensors import SafetensorError, safe_open

    if not (directory / "config.json").is_file():
        raise ModelError(f"stream_hf: {str(directory)!r} has no config.json; pass a local model directory")
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ModelError(f"stream_hf: {str(index)!r} is not a safetensors index ({e}); save the model again") from None
        listed: dict[Path, set[str]] = {}
        for k, f in weight_map.items():
            listed.setdefault(directory / f, set()).add(k)
    else:
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelError(f"stream_hf: {str(directory)!r} has no *.safetensors weights")
        listed = {f: set() for f in files}
    out: dict[str, _Stored] = {}
    for file, keys in listed.items():
        try:
            with safe_open(str(file), framework="pt") as f:
                have = set(f.keys())
        except (SafetensorError, OSError) as e:
            raise ModelError(f"stream_hf: cannot read {str(file)!r} ({e}); copy or save the model again") from None
        if keys - have:
            raise ModelError(
                f"stream_hf: {str(file)!r} has no {min(keys - have)!r}, which the index puts there; copy or "
                "save the model again"
            )
        out.update({k: _Stored(file, k) for k in keys or have})
    return out


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """While a model is built: each parameter goes to the meta device as it is registered
    (after its module made it, before the module initialises it), buffers stay as built
    (the rotary tables computed in the modules' __init__). Patches
    `nn.Module.register_parameter`, as accelerate's `init_empty_weights` does, for this
    thread alone: modules other threads build meanwhile keep their parameters."""
    with _META_BUILD:  # one build at a time: each puts back what it found
        register = nn.Module.register_parameter
        builder = threading.get_ident()

        def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            register(module, name, param)
            if param is not None and not param.is_meta and threading.get_ident() == builder:
                module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

        nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            nn.Module.register_parameter = register  # type: ignore[method-assign]


_META_BUILD = threading.Lock()


def _freeze_as_built(model: nn.Module, cls: Any, config: Any) -> None:
    """`from_pretrained` returns every parameter trainable, also those the model's class
    builds frozen (requires_grad=False: Ernie 4.5 MoE's and AFMoE's routing statistics),
    which `from_config` keeps frozen: freeze them as the class builds them (read off a copy
    on the meta device), so snake leaves them as plain PyTorch training would."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        built = cls.from_config(config) if cls is AutoModelForCausalLM else cls._from_config(config)
    frozen = [n for n, p in built.named_parameters() if not p.requires_grad]
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)


def _check_export_space(model: nn.Module, out: Path) -> None:
    """Refuse, before a file is written, an export whose tensors alone (each storage once, as
    save_pretrained writes a tied weight once) exceed the free space where `out` is."""
    seen: dict[tuple[int, int], int] = {}
    for t in model.state_dict().values():
        if t.device.type != "meta":
            seen[(t.untyped_storage().data_ptr(), t.storage_offset())] = t.numel() * t.element_size()
    need = sum(seen.values())
    disk = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(disk).free
    if need > free:
        raise StorageError(
            errno.ENOSPC,
            f"export_hf: {disk} has {fmt_size(free)} free but the model's weights take at least "
            f"{fmt_size(need)}; nothing was written: free space there or export somewhere else",
        )


def export_hf(state_dict: Mapping[str, torch.Tensor], model: nn.Module, out_dir: str | os.PathLike[str]) -> Path:
    """Load `state_dict` (e.g. `await trainer.state_dict()`) into `model` (strictly, cast to
    the model's dtypes) and save it with `save_pretrained` as safetensors in `out_dir`, which
    `from_pretrained` / `load_hf` load. Returns the directory."""
    save: Callable[..., Any] | None = getattr(model, "save_pretrained", None)
    if save is None:
        raise ModelError(f"export_hf: {type(model).__name__} is not a transformers model (no save_pretrained)")
    if any(p.is_meta for p in model.parameters()):
        # a model from stream_hf: its layers take the trained tensors (cast to its dtypes;
        # it holds them from now on), and a tied head is tied again
        own = model.state_dict()
        model.load_state_dict(
            {k: v.to(own[k].dtype) if k in own and v.is_floating_point() else v for k, v in state_dict.items()},
            strict=True, assign=True,
        )
        tie = getattr(model, "tie_weights", None)
        if callable(tie):
            tie()
    else:
        model.load_state_dict(dict(state_dict), strict=True)
    out = Path(out_dir)
    _check_export_space(model, out)
    out.mkdir(parents=True, exist_ok=True)
    save(str(out))  # safetensors is the default (the only format in transformers >= 5)
    if not any(out.glob("*.safetensors")):
        raise ModelError(f"export_hf: save_pretrained wrote no safetensors file in {str(out)!r}")
    return out
