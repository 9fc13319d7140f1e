"""Which Hugging Face causal LMs snake recognises and what their configurations ask of it:
the class lists, the attention implementations and layer types, and the options it refuses."""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

from torch import nn

from snake.errors import ModelError

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
