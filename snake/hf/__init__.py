"""Hugging Face `transformers` causal LMs as snake models (the `hf` extra).

`describe_hf(model)` recognises GPT-2 (`GPT2LMHeadModel`) and the Llama family (the classes
in `families._LLAMA_FAMILY`, dense and mixture-of-experts, which compose as `LlamaForCausalLM` does)
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

from snake.hf.describe import describe_hf, init_adapters
from snake.hf.export import export_hf
from snake.hf.families import supported
from snake.hf.load import causal_lm_class, load_hf, text_part, text_part_hint
from snake.hf.stream import stream_hf

__all__ = [
    "causal_lm_class", "describe_hf", "export_hf", "init_adapters", "load_hf", "stream_hf", "supported",
    "text_part", "text_part_hint",
]
