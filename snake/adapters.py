"""How snake sees a model: resident `pre` (embeddings) and `post` (final norm, head),
and N `blocks` (hidden -> hidden) that stream through the device. Blocks may be of a few
kinds (`layer_kinds`: dense and mixture-of-experts layers, say); each kind runs through a
copy of its first block."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from snake.errors import ModelError
from snake.model_features import check_features, hook_signature

PreFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]
PostFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]
BlockFn = Callable[..., torch.Tensor]  # (block, hidden) or (block, hidden, *, layer)
LayerWeights = Callable[[int], Mapping[str, torch.Tensor]]  # layer -> its parameters by name


def _call_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x)


@dataclass(frozen=True, eq=False)
class ModelParts:
    """An explicit description of a model, for any `nn.Module`.

    model: owns every parameter. blocks: the layers, in order, all submodules of `model`
    under `blocks_prefix` (state_dict keys `f"{blocks_prefix}.{i}.{name}"`). pre(model,
    idx) -> hidden; post(model, hidden) -> logits; block_fn(block, hidden) -> hidden
    (default: `block(hidden)`). Layers alike in class, parameter names and shapes and
    submodule classes are one kind (`layer_kinds`); every layer runs through one copy of
    its kind's first block with its parameters swapped in, and that copy also takes each
    layer's buffer values and scalar attributes (int, float, bool, str, None: an index, a
    window, a flag) where the layers of its kind differ. Layers of several kinds (dense and
    mixture-of-experts, say) each store and move their own parameters; the device slots
    are sized for the largest. Anything else that differs between layers (a rotary
    table outside the block) must come from the index: a block_fn with a `layer`
    parameter is called as block_fn(block, hidden, layer=i). State a layer changes in its
    own forward (a call counter) is not kept per layer, and the backward runs each layer's
    forward again (as PyTorch's checkpointing does). Parameters outside the blocks are
    resident; tied weights must be there. hidden_fp32: what keeps the hidden state between
    layers in float32 (a config field's name), or None: snake then stores it in float32.
    forward_with_grad: run the forward with autograd on (see the field). weights: where the
    blocks' parameters on the meta device are read from (see the field)."""

    model: nn.Module
    blocks: Sequence[nn.Module]
    blocks_prefix: str
    pre: PreFn
    post: PostFn
    block_fn: BlockFn = _call_block
    # set where the model keeps the hidden state between its layers in float32 whatever it
    # computes in (Mamba's `residual_in_fp32`): snake then stores that state (checkpoints,
    # their gradients) in float32 too (`Kernels.hidden_dtype`), not in the compute dtype
    hidden_fp32: str | None = None
    # run each layer's forward with autograd on, as its backward's recompute runs it, for
    # layers whose kernels choose their algorithm by requires_grad (an attention mask computed
    # from the layer's own weights: CPU SDPA takes another kernel when it needs a gradient);
    # costs a graph per forward, freed at once
    forward_with_grad: bool = False
    # weights(i) -> layer i's parameters by their names in the block (as
    # `block.named_parameters()` names them), real tensors of the block's shapes. With it, the
    # blocks' parameters may be on the meta device: snake reads a layer's through it when it
    # copies them into its tiers (once, layer by layer; and for the planner's probes), so the
    # process never holds the whole model's layer weights (a model from `snake.hf.stream_hf`
    # is described with one). The blocks' buffers, and everything outside them, must be real.
    weights: LayerWeights | None = None


def describe(model: nn.Module | ModelParts) -> ModelParts:
    """Recognise a model (built-in GPT; Hugging Face adapters live in snake.hf) or accept
    an explicit ModelParts. Raises ModelError with what to do otherwise."""
    from snake.models.gpt import GPT

    base = peft_base(model)
    if base is not None:
        # a PEFT model (LoRA and kin): its base model, adapters injected in its layers, is the
        # model snake trains (its parameters and state_dict names are the base model's)
        return describe(base)
    if isinstance(model, ModelParts):
        parts = model
    elif isinstance(model, GPT):
        parts = ModelParts(
            model=model,
            blocks=list(model.blocks),
            blocks_prefix="blocks",
            pre=_gpt_pre,
            post=_gpt_post,
        )
    else:
        hf = _try_hf(model)
        if hf is None:
            fix = ("pass snake.ModelParts(model, blocks=..., blocks_prefix=..., pre=..., post=...) "
                   "describing its embedding (pre), its layers (blocks) and its head (post)")
            if type(model).__module__.startswith("transformers."):
                from snake.hf import supported, text_part_hint

                hint = text_part_hint(model)
                if hint is not None:
                    raise ModelError(hint)
                raise ModelError(
                    f"model: snake does not know how the layers of {type(model).__name__} compose "
                    f"(it recognises {supported()}); {fix}"
                )
            raise ModelError(f"model: cannot find the transformer blocks of {type(model).__name__}; {fix}")
        parts = hf
    check_parts(parts)
    if parts.weights is not None:
        # what the device holds (parameters kept in float32, frozen ones that are not floating
        # point) is held as the model's own: read it now. The streamed frozen ones are read
        # when the runtime is built (`Kernels`: into a file of their own where they can be)
        for i, b in enumerate(parts.blocks):
            streamed = {n for n, _ in [*flat_named(b), *frozen_named(b)]}
            materialize_block(parts, i, b, [n for n, _ in b.named_parameters() if n not in streamed])
    return parts


def peft_base(model: object) -> nn.Module | None:
    """The base model of a PEFT wrapper (`peft.PeftModel`: `get_base_model()`), None for any
    other model."""
    if not type(model).__module__.startswith("peft.") or not callable(getattr(model, "get_base_model", None)):
        return None
    configs = getattr(model, "peft_config", {})
    prompt = [name for name, cfg in (configs.items() if isinstance(configs, dict) else ())
              if getattr(cfg, "is_prompt_learning", False)]
    if prompt:
        raise ModelError(
            f"model: PEFT adapter {prompt[0]!r} is {type(configs[prompt[0]]).__name__}, prompt learning, which "
            "the PeftModel adds to the inputs outside its base model; snake trains the base model with "
            "the adapters PEFT puts into its layers: use LoRA (peft.LoraConfig) or another adapter of "
            "the layers (DoRA, IA3)"
        )
    base = model.get_base_model()  # type: ignore[attr-defined]
    return base if isinstance(base, nn.Module) else None


def has_peft_layers(model: nn.Module) -> bool:
    """Whether PEFT injected its layers (adapters beside a `base_layer`) into `model`."""
    return any(type(m).__module__.startswith("peft.") for m in model.modules())


def check_param_wrappers(parts: ModelParts) -> None:
    """ModelError for PEFT's LoRA of a parameter (`target_parameters`, a `ParamWrapper`: the
    fused experts of a mixture of experts) in a block: PEFT parametrizes the parameter where
    snake binds each layer's parameters itself (it failed in the first step)."""
    for i, block in enumerate(parts.blocks):
        if any(type(m).__name__ == "ParamWrapper" and type(m).__module__.startswith("peft.") for m in block.modules()):
            raise ModelError(
                f"model: PEFT's LoRA of a parameter (target_parameters: {parts.blocks_prefix}.{i} has a "
                "ParamWrapper) is not supported: snake binds each layer's parameters itself, where PEFT "
                "parametrizes them; adapt modules (target_modules) instead"
            )


def takes_layer(fn: BlockFn) -> bool:
    """Whether a block function wants the layer index: a parameter named `layer` after the
    block and the hidden state (`def block_fn(layer, h)` names the block `layer`)."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin or a C callable: no signature to read
        return False
    return "layer" in names[2:]


def call_block(parts: ModelParts, block: nn.Module, h: torch.Tensor, layer: int) -> torch.Tensor:
    """parts.block_fn on layer `layer`, with the index if it takes one."""
    if takes_layer(parts.block_fn):
        return parts.block_fn(block, h, layer=layer)
    return parts.block_fn(block, h)


def _gpt_pre(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return model.embed(idx)  # type: ignore[operator]


def _gpt_post(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return model.head(h)  # type: ignore[operator]


def _try_hf(model: nn.Module) -> ModelParts | None:
    try:
        from snake.hf import describe_hf
    except ImportError:
        return None
    return describe_hf(model)


def check_parts(parts: ModelParts) -> None:
    """ModelError, before anything is built, for a model snake would run wrongly: the
    message names the part (block, parameter, buffer) and what to change."""
    if not isinstance(parts.model, nn.Module):
        raise ModelError(f"model: expected a torch.nn.Module, got {type(parts.model).__name__}")
    for attr in ("pre", "post", "block_fn"):
        fn = getattr(parts, attr)
        if not callable(fn):
            raise ModelError(
                f"model: ModelParts.{attr} must be a function ({attr}(model, tensor) -> tensor), "
                f"got {type(fn).__name__}"
            )
    blocks = list(parts.blocks)
    check_blocks(blocks)
    check_features(parts, blocks)
    check_param_wrappers(parts)
    if not any(p.requires_grad for p in parts.model.parameters()):
        raise ModelError(
            "model: no parameter requires grad, so training would change nothing; unfreeze what "
            "you mean to train (p.requires_grad_(True)) or load a PEFT model's adapters trainable"
        )
    names = dict(parts.model.named_modules())
    for i, b in enumerate(blocks):
        if names.get(f"{parts.blocks_prefix}.{i}") is not b:
            raise ModelError(
                f"model: block {i} is not the submodule '{parts.blocks_prefix}.{i}'; "
                "set blocks_prefix so that blocks are model.<prefix>.<i>"
            )
    _check_devices(parts)
    _check_ties(parts)
    _check_block_buffers(blocks)


def check_blocks(blocks: list[nn.Module]) -> None:
    """ModelError for blocks snake cannot stream: none at all. Blocks that differ (in
    class, parameters or submodule classes) are kinds of their own (`layer_kinds`); a block
    that trains nothing (frozen) streams its frozen weights and steps nothing."""
    if not blocks:
        raise ModelError("model: no blocks found; a model needs at least one block to stream")


def layer_kinds(blocks: Sequence[nn.Module]) -> tuple[list[int], list[int]]:
    """(each layer's kind, each kind's first layer). Layers of one kind have the same class,
    the same parameter names and shapes and the same submodule classes at the same names:
    one copy of the kind's first block can run any of them with their parameters (and
    scalar attributes) swapped in, and the same hooks (that copy runs its block's). Kinds
    are numbered in order of first appearance."""
    keys: dict[object, int] = {}
    kinds: list[int] = []
    firsts: list[int] = []
    for i, b in enumerate(blocks):
        key = (type(b), param_signature(b), tuple((name, type(m)) for name, m in b.named_modules()),
               hook_signature(b))
        if key not in keys:
            keys[key] = len(firsts)
            firsts.append(i)
        kinds.append(keys[key])
    return kinds, firsts


def _check_devices(parts: ModelParts) -> None:
    """Real weights on one device: snake copies them to its tiers and the compute device.
    The blocks' parameters may be on the meta device where `parts.weights` reads them."""
    devices: dict[torch.device, str] = {}
    lazy = parts.blocks_prefix + "." if parts.weights is not None else None
    for kind, named in (("parameter", parts.model.named_parameters()), ("buffer", parts.model.named_buffers())):
        for name, t in named:
            if t.is_meta:
                if kind == "parameter" and lazy is not None and name.startswith(lazy):
                    continue
                where = ("outside the blocks: only the blocks' parameters can be read through "
                         "ModelParts.weights" if lazy is not None else "")
                raise ModelError(
                    f"model: {kind} {name!r} is on the meta device (a shape without data){where and '; ' + where}; "
                    "materialize the weights first, e.g. model.to_empty(device='cpu') and then "
                    "load_state_dict(...) or re-initialise them, or load a Hugging Face model with "
                    "snake.hf.stream_hf(dir), which reads each layer's weights when snake needs them"
                )
            if kind == "parameter":
                devices.setdefault(t.device, name)
    if len(devices) > 1:
        where = ", ".join(f"{n!r} on {d}" for d, n in devices.items())
        raise ModelError(
            f"model: parameters are on several devices ({where}); move the whole model to one "
            "device first, e.g. model.to('cpu'): snake places the weights itself"
        )


def _check_ties(parts: ModelParts) -> None:
    """A tensor shared between two blocks, or between a block and pre/post, would be
    untied: each block's weights are streamed and stepped on their own. Ties inside one
    block and between pre and post are fine."""
    prefix = parts.blocks_prefix + "."
    owners: dict[int, tuple[str, str]] = {}  # id -> (owner, first name)
    for name, p in parts.model.named_parameters(remove_duplicate=False):
        owner = ("block " + name[len(prefix) :].split(".", 1)[0]) if name.startswith(prefix) else "pre/post"
        first = owners.setdefault(id(p), (owner, name))
        if first[0] != owner:
            raise ModelError(
                f"model: parameter {name!r} is the same tensor as {first[1]!r} ({owner} and "
                f"{first[0]}); snake streams and steps each block's weights on their own and "
                "would untie them: give each block its own parameter (tied weights must live in "
                "pre/post, outside the blocks)"
            )


def _check_block_buffers(blocks: list[nn.Module]) -> None:
    """Every layer runs through its kind's shell, a copy of the kind's first block, which
    takes each layer's own buffer values (a router's bias) where they differ: the buffers of
    the blocks of one kind must have the same names, shapes and dtypes."""
    kinds, firsts = layer_kinds(blocks)
    for i, b in enumerate(blocks):
        f = firsts[kinds[i]]
        if f == i:
            continue
        buf0 = dict(blocks[f].named_buffers())
        bufs = dict(b.named_buffers())
        for name in sorted(buf0.keys() | bufs.keys()):
            x, y = buf0.get(name), bufs.get(name)
            if x is None or y is None:
                how = f"block {f} has no such buffer" if x is None else f"block {i} has no such buffer"
            elif x.shape != y.shape or x.dtype != y.dtype:
                how = f"{tuple(y.shape)} {y.dtype} vs block {f}'s {tuple(x.shape)} {x.dtype}"
            else:
                continue
            raise ModelError(
                f"model: block {i}'s buffer {name!r} differs from block {f}'s ({how}); snake runs every "
                f"layer through a copy of the first block of its kind (block {f} here) with the layer's "
                f"own parameters and buffer values: give every block of that kind a {name!r} of one "
                "shape and dtype"
            )


def param_signature(block: nn.Module) -> tuple[tuple[str, tuple[int, ...], bool, bool], ...]:
    """A block's parameter names, shapes, whether each is trained and whether it is kept in
    float32 (`kept_fp32`)."""
    kept = kept_fp32(block)
    return tuple((n, tuple(p.shape), p.requires_grad, n in kept) for n, p in block.named_parameters())


def kept_fp32(module: nn.Module, *, skip: str | None = None) -> frozenset[str]:
    """The names of `module`'s parameters and buffers that run in float32 whatever the
    compute dtype: where most of its floating parameters' elements (trained or frozen) are
    stored in a lower precision (a model loaded in bfloat16), those it stores in float32, as
    transformers keeps a router's gate and bias (`_keep_in_fp32_modules`) and PEFT its
    adapters. Empty where most are float32 (a float32 model: all of it runs in the compute
    dtype). `skip`: a prefix of names left out of the answer but not of the count (the
    blocks, for pre/post: the whole model decides for them)."""
    def mine(named: Iterator[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        return [(n, t) for n, t in named if skip is None or not n.startswith(skip)]

    params = mine(module.named_parameters())
    floating = [p for p in module.parameters() if p.is_floating_point()]
    wide = sum(p.numel() for p in floating if p.dtype == torch.float32)
    if wide * 2 >= sum(p.numel() for p in floating):
        return frozenset()
    tensors = params + mine(module.named_buffers(remove_duplicate=False))
    kept = frozenset(n for n, t in tensors if t.dtype == torch.float32)
    return kept


def kept_fp32_params(parts: ModelParts) -> int:
    """Elements of the parameters (trained or frozen) held on the compute device in float32
    whatever the compute dtype (`kept_fp32`): the blocks' and pre/post's."""
    prefix = parts.blocks_prefix + "."
    n = sum(p.numel() for name, p in parts.model.named_parameters()
            if not name.startswith(prefix) and name in kept_fp32(parts.model, skip=prefix))
    for b in parts.blocks:
        kept = kept_fp32(b)
        n += sum(p.numel() for name, p in b.named_parameters() if name in kept)
    return n


def flat_named(block: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """A block's parameters in its flat state, streamed and stepped as one: the trained ones
    (requires_grad) in `named_parameters` order, less those kept in float32 (`kept_fp32`:
    held on the device with pre/post's, `resident_named_params`)."""
    kept = kept_fp32(block)
    return [(n, p) for n, p in block.named_parameters() if p.requires_grad and n not in kept]


def frozen_named(block: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """A block's frozen parameters (requires_grad=False) that stream with its layer, in the
    compute dtype: the floating-point ones but those kept in float32 (`kept_fp32`; those and
    any others, an index, are held on the device as they are)."""
    kept = kept_fp32(block)
    return [(n, p) for n, p in block.named_parameters()
            if not p.requires_grad and p.is_floating_point() and n not in kept]


def held_named(block: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """A block's trained parameters kept in float32 (`kept_fp32`), held on the device."""
    kept = kept_fp32(block)
    return [(n, p) for n, p in block.named_parameters() if p.requires_grad and n in kept]


def layer_specs(parts: ModelParts) -> list[list[tuple[str, torch.Size]]]:
    """Each layer's parameters in its flat state (names and shapes, `flat_named`: frozen
    ones, requires_grad=False, stay as they are and those kept in float32 are held with
    pre/post's); layers of one kind share one list."""
    kinds, firsts = layer_kinds(parts.blocks)
    per_kind = [[(n, p.shape) for n, p in flat_named(parts.blocks[f])] for f in firsts]
    return [per_kind[k] for k in kinds]


def layer_numels(parts: ModelParts) -> list[int]:
    """Parameters of each layer."""
    return [sum(s.numel() for _, s in spec) for spec in layer_specs(parts)]


def resident_named_params(parts: ModelParts, *, trained: bool = True) -> list[tuple[str, nn.Parameter]]:
    """Parameters outside the blocks (deduplicated: tied weights appear once) that are
    trained (requires_grad), or with trained=False the frozen ones. The trained ones are
    followed by the blocks' parameters kept in float32 (`held_named`): those are held on the
    device and stepped with pre/post's, not streamed."""
    prefix = parts.blocks_prefix + "."
    outer = [(n, p) for n, p in parts.model.named_parameters()
             if not n.startswith(prefix) and p.requires_grad == trained]
    if not trained:
        return outer
    return outer + [(f"{prefix}{i}.{n}", p) for i, b in enumerate(parts.blocks) for n, p in held_named(b)]


def trained(block: nn.Module) -> list[nn.Parameter]:
    """A block's parameters in its flat state (`flat_named`), in order."""
    return [p for _, p in flat_named(block)]


def layer_values(parts: ModelParts, layer: int, named: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    """The values of layer `layer`'s parameters `named` (pairs from its block's
    `named_parameters`): each as it is, or for one on the meta device read through
    `parts.weights` (cast to the parameter's dtype; ModelError for a missing name or a
    wrong shape)."""
    if not any(p.is_meta for _, p in named):
        return [p.detach() for _, p in named]
    if parts.weights is None:
        raise ModelError(f"model: block {layer}'s parameters are on the meta device and ModelParts.weights is not set")
    read = parts.weights(layer)
    out = []
    for name, p in named:
        if not p.is_meta:
            out.append(p.detach())
            continue
        if name not in read:
            raise ModelError(
                f"model: ModelParts.weights({layer}) has no {name!r} (block {layer}'s parameter on the "
                "meta device); it must give every such parameter by its name in the block"
            )
        t = read[name]
        if tuple(t.shape) != tuple(p.shape):
            raise ModelError(
                f"model: ModelParts.weights({layer})[{name!r}] has shape {tuple(t.shape)}, the block's "
                f"parameter {tuple(p.shape)}"
            )
        out.append(t.detach().to(dtype=p.dtype))
    return out


def materialize_block(parts: ModelParts, layer: int, block: nn.Module, names: Sequence[str] | None = None) -> None:
    """Put real values (`layer_values`) into `block`'s parameters `names` (default: all)
    that are on the meta device; `block` is layer `layer` or a copy of it."""
    named = [(n, p) for n, p in block.named_parameters(remove_duplicate=False)
             if p.is_meta and (names is None or n in names)]
    if not named:
        return
    values = layer_values(parts, layer, named)
    mods = dict(block.named_modules())
    done: dict[int, nn.Parameter] = {}
    for (name, p), v in zip(named, values, strict=True):
        mod_name, _, attr = name.rpartition(".")
        new = done.get(id(p))
        if new is None:
            new = done[id(p)] = nn.Parameter(v, requires_grad=p.requires_grad)
            new.snake_read = True  # type: ignore[attr-defined]  # read through parts.weights
        mods[mod_name]._parameters[attr] = new


def frozen_values(parts: ModelParts) -> dict[str, torch.Tensor]:
    """The model's frozen parameters (requires_grad=False) by name, as `named_parameters`
    lists them, each as it is or, on the meta device, read through `parts.weights`."""
    out = dict(iter_frozen(parts))
    return {n: out[n] for n, p in parts.model.named_parameters() if not p.requires_grad}


def iter_frozen(parts: ModelParts) -> Iterator[tuple[str, torch.Tensor]]:
    """`frozen_values`' (name, value) pairs, those on the meta device read a layer at a
    time as the iteration reaches them (not in `named_parameters`' order)."""
    prefix = parts.blocks_prefix + "."
    yield from ((n, p.detach()) for n, p in parts.model.named_parameters() if not p.requires_grad and not p.is_meta)
    for i, b in enumerate(parts.blocks):
        named = [(n, p) for n, p in b.named_parameters() if not p.requires_grad and p.is_meta]
        if named:
            yield from ((f"{prefix}{i}.{n}", v) for (n, _), v in zip(named, layer_values(parts, i, named), strict=True))


def frozen_in_files(parts: ModelParts, dtype: torch.dtype) -> bool:
    """Whether the blocks' streamed frozen parameters (`frozen_named`) are still in the
    files `parts.weights` reads (on the meta device, of any dtype), or already in a file of
    the compute dtype `dtype` an earlier trainer mapped (`snake_mapped`): the runtime then
    keeps them in a file of its own, mapped, in `dtype`, rather than in CPU memory
    (`Kernels.map_frozen`), and the memory model does not count them."""
    if parts.weights is None:
        return False
    frozen = [p for b in parts.blocks for _, p in frozen_named(b)]
    return bool(frozen) and all(p.is_meta or (getattr(p, "snake_mapped", False) and p.dtype == dtype)
                                for p in frozen)


def real_param(model: nn.Module) -> torch.Tensor:
    """The model's first parameter that is not on the meta device (its device and dtype
    are the model's)."""
    return next(p for p in model.parameters() if not p.is_meta)


def hidden_size(parts: ModelParts) -> int:
    """The width of a described model's block inputs: its embedding's output on one token."""
    model = parts.model
    p = real_param(model)
    with _probing(model):
        return int(parts.pre(model, torch.zeros(1, 1, dtype=torch.long, device=p.device)).shape[-1])


def input_rows(parts: ModelParts) -> int | None:
    """The input ids a described model's `pre` takes, [0, rows): found by trying one token
    at each resident embedding's first id past its table, at the first position and at the
    second (the table that fails at both, while the id before runs, is what indexes the
    inputs; one that fails at one position only, as a table for a leading tag would, is
    not). None where no such embedding is found, or the weights are on a GPU, where an index
    past a table is a device-side assert that breaks the CUDA context rather than an
    error."""
    model = parts.model
    p = real_param(model)
    if p.device.type != "cpu":
        return None
    prefix = parts.blocks_prefix + "."
    tables = sorted({int(mod.num_embeddings) for name, mod in model.named_modules()
                     if isinstance(mod, nn.Embedding) and not name.startswith(prefix)})

    def runs(*ids: int) -> bool:
        try:
            with _probing(model):
                parts.pre(model, torch.tensor([ids], dtype=torch.long))
        except (IndexError, RuntimeError):
            return False
        return True

    for rows in tables:
        if rows > 0 and runs(rows - 1, rows - 1) and not runs(rows, 0) and not runs(0, rows):
            return rows
    return None


def pre_trains(parts: ModelParts) -> bool:
    """Whether `pre` trains a parameter: its output on one token requires grad (a trained
    embedding, or one tied to a trained head)."""
    model = parts.model
    p = real_param(model)
    with _probing(model, grad=True):
        return bool(parts.pre(model, torch.zeros(1, 1, dtype=torch.long, device=p.device)).requires_grad)


def lowest_backward(parts: ModelParts, pre: bool | None = None) -> int:
    """The lowest layer whose backward an iteration runs: 0 where `pre` trains a parameter
    (`pre_trains`, probed where not given); else the lowest block that trains one, as
    autograd runs no backward below it (frozen bottom layers and embedding); the last block
    where none does (the head's gradient ends there)."""
    if pre_trains(parts) if pre is None else pre:
        return 0
    return next((i for i, b in enumerate(parts.blocks) if any(q.requires_grad for q in b.parameters())),
                len(parts.blocks) - 1)


@contextlib.contextmanager
def _probing(model: nn.Module, *, grad: bool = False) -> Iterator[None]:
    """No gradients (unless `grad`) and eval mode while a probe runs the user's functions
    (a running statistic in `pre` is not updated by it); the modes come back after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.set_grad_enabled(grad):
            yield
    finally:
        for m, training in modes:
            m.training = training


def vocab_size(parts: ModelParts) -> int:
    """Logits per token of a described model: its head's output on one hidden state (what
    its targets index)."""
    model = parts.model
    p = real_param(model)
    with _probing(model):  # the embedding's output, in its dtype (not the first parameter's)
        h = parts.pre(model, torch.zeros(1, 1, dtype=torch.long, device=p.device))
        return int(parts.post(model, torch.zeros_like(h)).shape[-1])
