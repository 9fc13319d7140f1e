"""Older causal LMs not shaped like Llama (GPT-J, GPT-NeoX, Falcon, Bloom, OPT, ...): their
embeddings, layers, final norm and head, by the layout in `families._OLD`."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from snake.adapters import ModelParts
from snake.errors import DataError, ModelError
from snake.hf.families import _OLD, _attn_impl, _refuse_what_layers_cannot_carry
from snake.hf.layers import _hidden, _MaskCache, _Rotary


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
