"""`snake export CHECKPOINT --hf OUT`: a checkpoint's fp32 master weights as a model that
`transformers` loads with `from_pretrained`. The built-in GPT becomes a GPT2LMHeadModel
(same math: exact GELU, tied head, LayerNorm eps 1e-5; missing biases are zeros);
a Hugging Face model is rebuilt from its own config."""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from snake.errors import SnakeError

log = logging.getLogger("snake")

_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def read_masters(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(manifest, fp32 master weights by parameter name, and the frozen parameters and the
    model's buffers (those in its state_dict) as they are) of a snake checkpoint."""
    from snake.manifest import read_manifest

    d = Path(directory)
    manifest = read_manifest(d, what="export")  # its files' sizes and sha256 too, as load() checks
    masters: dict[str, torch.Tensor] = {}
    for name in manifest["files"]:
        if name.endswith(".safetensors") and name != "rng.safetensors":
            with safe_open(str(d / name), framework="pt") as f:  # the masters only: not m and v
                for key in f.keys():
                    for prefix in ("master/", "frozen/", "buffer/"):
                        if key.startswith(prefix):
                            masters[key[len(prefix) :]] = f.get_tensor(key)
    return manifest, masters


def gpt_to_gpt2(config: dict[str, Any], masters: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    """A transformers GPT2Config and GPT2LMHeadModel state dict for the built-in GPT."""
    from transformers import GPT2Config

    c = config["n_embd"]
    # the built-in GPT ties its head to the embedding (the checkpoint then holds one of
    # them); a model whose head was untied holds its own, trained apart
    head = masters.get("lm_head.weight")
    hf = GPT2Config(
        vocab_size=config["vocab_size"], n_positions=config["block_size"], n_embd=c, n_layer=config["n_layer"],
        n_head=config["n_head"], activation_function="gelu", resid_pdrop=config["dropout"],
        embd_pdrop=config["dropout"], attn_pdrop=config["dropout"], layer_norm_epsilon=1e-5,
        tie_word_embeddings=head is None,
        # the built-in GPT has no special tokens; GPT2Config's default (50256, GPT-2's
        # <|endoftext|>) is out of range of a smaller vocabulary: transformers warned of
        # "unexpected behavior" on every load, and generate() would never see that token
        bos_token_id=None, eos_token_id=None,
    )
    sd: dict[str, torch.Tensor] = {"transformer.wte.weight": masters["wte.weight"], "transformer.wpe.weight": masters["wpe.weight"]}
    sd["lm_head.weight"] = masters["wte.weight"] if head is None else head
    zeros = {"ln_1.bias": c, "ln_2.bias": c, "attn.c_attn.bias": 3 * c, "attn.c_proj.bias": c, "mlp.c_fc.bias": 4 * c, "mlp.c_proj.bias": c}
    for i in range(config["n_layer"]):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for name in ("ln_1.weight", "ln_2.weight", *_TRANSPOSED, *zeros):
            t = masters.get(src + name)
            if t is None:
                t = torch.zeros(zeros[name])
            sd[dst + name] = t.t().contiguous() if name in _TRANSPOSED else t
    sd["transformer.ln_f.weight"] = masters["ln_f.weight"]
    sd["transformer.ln_f.bias"] = masters.get("ln_f.bias", torch.zeros(c))
    placed = {"wte.weight", "wpe.weight", "lm_head.weight", "ln_f.weight", "ln_f.bias"} | {
        f"blocks.{i}.{name}" for i in range(config["n_layer"]) for name in ("ln_1.weight", "ln_2.weight", *_TRANSPOSED, *zeros)}
    left = sorted(set(masters) - placed)
    if left:  # a model changed after it was built (a head with a bias, a layer added): not GPT-2's shape
        raise SnakeError(
            f"export: the checkpoint holds {', '.join(left[:3])}{' ...' if len(left) > 3 else ''}, which the built-in "
            "GPT exported as GPT-2 has no place for (the model was changed after it was built); load its weights with "
            "snake.export.read_masters and save them yourself"
        )
    return hf, sd


def export_checkpoint_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """Blocking: write `checkpoint`'s weights as a `from_pretrained` directory in `out`."""
    from snake.hf import export_hf

    manifest, masters = read_masters(checkpoint)
    config = manifest.get("model_config")
    if not config:
        raise SnakeError(
            f"export: {checkpoint} does not record its model's config: it is of a custom ModelParts model, "
            "or was saved by a snake from before checkpoints recorded it; for the built-in GPT or a Hugging "
            "Face model, load it into a trainer of the same model and save it again with this snake, then "
            "export that; else load its weights with snake.export.read_masters and save them yourself"
        )
    kind = config.pop("kind")
    if kind == "transformers+peft":
        return _export_merged(checkpoint, manifest, masters, out)
    if manifest.get("frozen_stored", True) is False:
        raise SnakeError(
            f"export: {checkpoint} was saved without its frozen parameters (save(frozen=False)), which the "
            "model its config builds needs; export in the process that trained it with "
            "snake.hf.export_hf(await trainer.state_dict(), model, out), or save with frozen=True"
        )
    try:
        sd, model = _model_and_state(checkpoint, kind, config, masters)
    except SnakeError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' and torch's own kinds, of a config it refuses
        raise SnakeError(
            f"export: {checkpoint}'s recorded model config does not build its model ({type(e).__name__}: "
            f"{' '.join(str(e).split())}); was its manifest.json edited? Export in the process that trained it "
            "with snake.hf.export_hf(await trainer.state_dict(), model, out)"
        ) from e
    ours = model.state_dict()
    for key, value in sd.items():
        if key in ours and tuple(value.shape) != tuple(ours[key].shape):
            raise SnakeError(
                f"export: {checkpoint} holds {key} of shape {tuple(value.shape)} but its recorded model config "
                f"builds it as {tuple(ours[key].shape)}; was its manifest.json edited? Export in the process that "
                "trained it with snake.hf.export_hf(await trainer.state_dict(), model, out)"
            )
    _source_generation(model, manifest)
    return _with_tokenizer(export_hf(sd, model, out), manifest)


def _source(manifest: dict[str, Any]) -> str | None:
    """The local directory the model was loaded from (its config's `_name_or_path`), if any."""
    source = (manifest.get("model_config") or {}).get("_name_or_path")
    return source if isinstance(source, str) and source and Path(source).is_dir() else None


def _source_generation(model: Any, manifest: dict[str, Any]) -> None:
    """Give `model` the generation config of the directory it was loaded from (sampling,
    lengths, special tokens), as from_pretrained gave the trained model, where it has one:
    the export generates as the source did, not with defaults derived from the config."""
    source = _source(manifest)
    if source is None or not (Path(source) / "generation_config.json").is_file():
        return
    try:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as e:
        log.warning("export: the generation config of %s was not read (%s); the export's is the config's", source,
                    type(e).__name__)


def _with_tokenizer(out: Path, manifest: dict[str, Any]) -> Path:
    """The tokenizer of the directory the model was loaded from (its config's
    `_name_or_path`, where that is a local directory that has one) saved beside the exported
    weights, so that the export is a model directory to use or train again as it is; none
    where there is none (logged)."""
    source = _source(manifest)
    if source is None:
        return out
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers' and the tokenizer libraries' own kinds
        log.info("export: no tokenizer of %s copied (%s)", source, type(e).__name__)
        return out
    tokenizer.save_pretrained(str(out))
    return out


def _model_and_state(checkpoint: str | Path, kind: str, config: dict[str, Any],
                     masters: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any]:
    """The model a checkpoint's recorded config builds, fresh, and the state to export into
    it: the checkpoint's masters by the model's names (its buffers, where the checkpoint
    holds none, the config's)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2LMHeadModel

    from snake.hf import causal_lm_class

    if kind == "snake.gpt":
        hf_config, sd = gpt_to_gpt2(config, masters)
        return sd, GPT2LMHeadModel(hf_config)
    model_type = config.pop("model_type")

    def build(**changes: Any) -> tuple[Any, dict[str, str]]:
        hf_config = AutoConfig.for_model(model_type, **{**config, **changes})
        cls = causal_lm_class(hf_config)
        model = cls.from_config(hf_config) if cls is AutoModelForCausalLM else cls._from_config(hf_config)
        names: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        return model, {name: names[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}

    model, canonical = build()
    if any(key != src and key in masters for key, src in canonical.items()):
        # a weight the config ties (the head to the embedding) that the trained model held
        # apart, trained on its own (its head given a weight after it was built): untied
        model, canonical = build(tie_word_embeddings=False)
    sd = {}
    fresh = []  # what the checkpoint does not hold: the config's initial value
    for key, value in model.state_dict().items():
        src = canonical.get(key, key)
        sd[key] = masters[src] if src in masters else masters.get(key, value)
        if src not in masters and key not in masters:
            fresh.append(key)
    left = sorted(set(masters) - set(sd) - set(canonical.values()))
    if left:  # a tensor added after the model was built (a head's bias): the config builds no place for it
        raise SnakeError(
            f"export: {checkpoint} holds {', '.join(left[:3])}{' ...' if len(left) > 3 else ''}, which the model "
            "its recorded config builds has no place for (the model was changed after it was built); export in "
            "the process that trained it with snake.hf.export_hf(await trainer.state_dict(), model, out), or load "
            "its weights with snake.export.read_masters and save them yourself"
        )
    if fresh:
        # a checkpoint saved before they were stored holds no buffers (a layer's own scale or
        # routing bias, which the config does not give); any other missing tensor would be
        # exported with the config's fresh values
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        stored_buffers = any(k not in params and k in masters for k in model.state_dict())
        if stored_buffers or any(k in params for k in fresh):
            raise SnakeError(
                f"export: {checkpoint} holds no {fresh[0]!r} ({len(fresh)} tensors of the model its config builds "
                "missing): the checkpoint is not of this model; export in the process that trained it with "
                "snake.hf.export_hf(await trainer.state_dict(), model, out)"
            )
        log.warning("export: %s holds no buffers (saved before they were stored): %d buffers (%s) take the "
                    "config's initial values, which may not be the trained model's; save it again, or export "
                    "in-process with snake.hf.export_hf", checkpoint, len(fresh), ", ".join(fresh[:3]))
    return sd, model



# initialisations that change the base weights: the adapters a checkpoint holds are of that
# changed base, which a user's base model is not (PEFT converts them at save_pretrained with
# path_initial_model_for_weight_conversion, in the process that made them)
_BASE_CHANGING = ("pissa", "olora", "corda", "loftq", "eva")
_IN_PROCESS = ("peft_model.get_base_model().load_state_dict(await trainer.state_dict(trained_only=True), "
               "strict=False), then peft_model.save_pretrained(out)")


def _peft_model(checkpoint: str | Path, manifest: dict[str, Any], masters: dict[str, torch.Tensor], *,
                meta: bool, what: str) -> tuple[Any, list[str]]:
    """The PEFT model a checkpoint's recorded model and PEFT configs build (on the meta
    device if `meta`), holding the checkpoint's tensors, and the names of the adapters it
    holds every value of, the active ones first (in the order they were active). `what`: the
    operation errors name."""
    from peft import get_peft_model
    from peft.config import PeftConfig
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from snake.hf import causal_lm_class

    config = dict(manifest.get("model_config") or {})
    config.pop("kind", None)
    record = manifest.get("peft")
    recorded = record.get("configs") if isinstance(record, dict) else None
    if not isinstance(recorded, dict) or not recorded or not all(isinstance(v, dict) for v in recorded.values()):
        raise SnakeError(
            f"{what}: {checkpoint} does not record its PEFT config (saved by a snake before it did, or with a "
            f"config JSON cannot hold); save it again with this snake, or in the process that trains it: {_IN_PROCESS}"
        )
    configs = {}
    for name, d in recorded.items():
        try:
            # the base is named after get_peft_model (which warns of a name not the model's)
            configs[name] = PeftConfig.from_peft_type(**{**d, "base_model_name_or_path": None})
        except Exception as e:  # noqa: BLE001 - PEFT's own kinds, of a config this PEFT does not know
            raise SnakeError(
                f"{what}: {checkpoint}'s recorded PEFT config {name!r} does not build with this PEFT "
                f"({type(e).__name__}: {' '.join(str(e).split())[:300]}); export in the process that trains it: "
                f"{_IN_PROCESS}"
            ) from e
        init = str(getattr(configs[name], "init_lora_weights", "")).lower()
        if any(init.startswith(kind) for kind in _BASE_CHANGING):
            raise SnakeError(
                f"{what}: {checkpoint}'s adapter {name!r} has init_lora_weights={init!r}, which changes the base "
                "weights, so its adapters do not apply to the base model; convert them in the process that trains "
                "it with peft_model.save_pretrained(out, path_initial_model_for_weight_conversion=...)"
            )
    model_type = config.pop("model_type", None)
    try:
        hf_config = AutoConfig.for_model(model_type, **config)
        cls = causal_lm_class(hf_config)
        # (PEFT reads a flag transformers 5 deprecates: its FutureWarning is not the user's)
        with torch.device("meta") if meta else contextlib.nullcontext(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            base = cls.from_config(hf_config) if cls is AutoModelForCausalLM else cls._from_config(hf_config)
            names = iter(configs)
            first = next(names)
            model = get_peft_model(base, configs[first], adapter_name=first)
            for name in names:
                model.add_adapter(name, configs[name])
    except Exception as e:  # noqa: BLE001 - transformers' and PEFT's own kinds
        raise SnakeError(
            f"{what}: {checkpoint}'s recorded model and PEFT configs do not build its model "
            f"({type(e).__name__}: {' '.join(str(e).split())[:300]}); was its manifest.json edited? Export in the "
            f"process that trains it: {_IN_PROCESS}"
        ) from e
    inner = model.get_base_model()
    own = inner.state_dict()
    strange = [k for k in masters if k not in own]
    if strange:
        raise SnakeError(
            f"{what}: {checkpoint} holds {strange[0]!r} ({len(strange)} tensors), which the model its recorded "
            "configs build has not: the checkpoint is not of this model; was its manifest.json edited?"
        )
    inner.load_state_dict({k: v.to(own[k].dtype) if v.is_floating_point() and not meta else v
                           for k, v in masters.items()}, strict=False, assign=meta)
    held = []
    for name in configs:
        # the recorded base (get_peft_model took the name of the model built here)
        model.peft_config[name].base_model_name_or_path = recorded[name].get("base_model_name_or_path")
        if meta:  # what PEFT saves of it (not a frozen part it rebuilds, AdaLoRA's ranknum): on
            # the meta device where the checkpoint holds no value
            saved = get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False)
            values, empty = list(saved), [k for k, v in saved.items() if v.is_meta]
        else:
            values = [k for k, _ in inner.named_parameters() if name in k.split(".")]
            empty = [k for k in values if k not in masters]
        if not empty:
            held.append(name)
        elif len(configs) == 1 or len(empty) < len(values):
            raise SnakeError(
                f"{what}: {checkpoint} holds no value for adapter {name!r}'s {empty[0]!r} ({len(empty)} tensors "
                "missing): the checkpoint is not of this model"
            )
        else:  # an adapter that was not active: frozen, and not stored (save(frozen=True) stores it)
            log.warning("%s: %s holds none of adapter %r (it was not trained, and was saved without the frozen "
                        "parameters); it is left out", what, checkpoint, name)
    if not held:
        raise SnakeError(f"{what}: {checkpoint} holds none of its adapters' values: nothing to export")
    active = [a for a in record.get("active") or [] if a in held]  # type: ignore[union-attr]
    return model, active + [a for a in held if a not in active]


def _export_merged(checkpoint: str | Path, manifest: dict[str, Any], masters: dict[str, torch.Tensor],
                   out: str | Path) -> Path:
    """A PEFT model's checkpoint as the whole model, its active adapters merged into the base
    weights (PEFT's merge_and_unload), which needs the base: a checkpoint saved with
    save(frozen=True)."""
    from snake.hf import export_hf

    if manifest.get("frozen_stored", True) is False:
        raise SnakeError(
            f"export --hf: {checkpoint} is of a PEFT model saved without its frozen base weights (save's default "
            "for one): export its adapters with `snake export CHECKPOINT --peft DIR` and load them onto the base "
            "with PeftModel.from_pretrained(base_model, DIR); for the whole model, merged, save with "
            "save(frozen=True)"
        )
    model, held = _peft_model(checkpoint, manifest, masters, meta=False, what="export --hf")
    record = manifest.get("peft") or {}
    active = [a for a in record.get("active") or [] if a in held]
    if not active:
        raise SnakeError(f"export --hf: {checkpoint} records no active adapter to merge; export them with --peft")
    _untie_adapted_head(model.get_base_model())
    merged = model.merge_and_unload(adapter_names=active)
    _source_generation(merged, manifest)
    return _with_tokenizer(export_hf(merged.state_dict(), merged, out), manifest)


def _untie_adapted_head(model: Any) -> None:
    """Give a head tied to the embedding a weight of its own where an adapter wraps either
    (LoRA on embed_tokens or lm_head), and the config untied: the trained model computed the
    other with the base weight, which merged into the shared one would take the adapter's
    change too (the logits of a LoRA on a tied embed_tokens were 0.3 off)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    emb, head = (get() if callable(get) else None for get in (get_in, get_out))
    if not isinstance(emb, nn.Module) or not isinstance(head, nn.Module):
        return
    if not any(isinstance(m, BaseTunerLayer) for m in (emb, head)):
        return
    base_head = head.get_base_layer() if isinstance(head, BaseTunerLayer) else head
    base_emb = emb.get_base_layer() if isinstance(emb, BaseTunerLayer) else emb
    weight, shared = getattr(base_head, "weight", None), getattr(base_emb, "weight", None)
    if not isinstance(weight, torch.Tensor) or not isinstance(shared, torch.Tensor) or shared is not weight:
        return
    base_head.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False


def export_checkpoint_peft(checkpoint: str | Path, out: str | Path) -> Path:
    """Blocking: write the adapters of `checkpoint` (a PEFT model's: its trained fp32 master
    weights) as PEFT's `save_pretrained` does, adapter_config.json and
    adapter_model.safetensors in `out` for an adapter named "default", in `out/NAME` for
    another (as PEFT does), which `PeftModel.from_pretrained(base_model, DIR)` loads.
    Returns the directory of the first adapter, the active one. The base is built on the meta device
    from the recorded config: nothing of it is read or written (not even a resized embedding,
    which PEFT's save_pretrained may add: save such a model in the process that trains it)."""
    manifest, masters = read_masters(checkpoint)
    kind = (manifest.get("model_config") or {}).get("kind")
    if kind != "transformers+peft":
        raise SnakeError(f"export --peft: {checkpoint} is not of a model with PEFT's adapters; export it with --hf")
    model, held = _peft_model(checkpoint, manifest, masters, meta=True, what="export --peft")
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    # the adapters alone: the base's embedding is not saved, nor is the base looked up on the
    # Hub (PEFT's "auto" does, to see if the vocabulary was resized)
    model.save_pretrained(str(path), selected_adapters=held, save_embedding_layers=False)
    # PEFT writes the adapter named "default" in `out`, any other in `out/NAME`: the
    # directory returned is the first (active) adapter's
    first = path if held[0] == "default" else path / held[0]
    if not (first / "adapter_config.json").is_file():
        raise SnakeError(f"export --peft: PEFT's save_pretrained wrote no adapter_config.json in {str(first)!r}")
    return first
