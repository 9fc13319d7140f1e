"""`ModelParts` for a recognised Hugging Face model: GPT-2, the Mamba models, the older layouts
(`old`) and the Llama family, with what each does around its layers (`_Outside`)."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
from torch import nn

from snake.adapters import ModelParts
from snake.errors import DataError, ModelError
from snake.hf.families import (
    _FULL_MASK,
    _LEARNED_MASK,
    _LLAMA_FAMILY,
    _MAMBA,
    _OLD,
    _ROTARY_BY_LAYER,
    _ROTARY_ONLY,
    _UNMASKED,
    _attn_impl,
    _layer_kinds,
    _refuse_what_layers_cannot_carry,
)
from snake.hf.layers import _hidden, _MaskCache, _nope_scaling, _Rotary, _rotary_by_layer
from snake.hf.old import _old_parts


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
