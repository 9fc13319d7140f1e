"""`snake plan`: measure the machine (cached), search a plan, print it.

    snake plan --model gpt:n_layer=24,n_embd=2048,n_head=16,vocab_size=50304,block_size=1024 \\
        --micro-batch-size 4 --cpu-memory 8GiB --offload-dir /ssd/snake [--json] [--plot r.png]
    snake plan --model hf:path/to/model --seq-len 2048 --micro-batch-size 1 ...

`hf:DIR` is a Hugging Face model directory (its config.json; no weights are read, nothing
is downloaded): the probes time a copy of the model built from its config with one
layer, fresh weights (its own layer, embedding and head), and the plan is for all of its
layers. `--lora RANK [--lora-targets q_proj,v_proj]` plans a LoRA fine-tune of it (PEFT's
adapters on its layers' linear modules, the rest frozen); `--stream`, for a model that
`snake.hf.stream_hf` loads, whose layers' frozen weights stay in its files, mapped:

    snake plan --model hf:path/to/model --seq-len 2048 --micro-batch-size 1 --lora 16 --stream ...

Exit status: 0 with a plan, 2 when no configuration fits (the reason on stderr) or the
arguments are wrong.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from planner.profile import MachineProfile, measure_profile
from planner.roofline import plot_roofline, roofline
from planner.search import search
from planner.solve import Infeasible, Plan, off_budget, predict_horizontal
from snake.cli_args import device_name, positive_int
from snake.config import MIN_SSD_BANDWIDTH
from snake.errors import MISSING, ConfigError, ModelError
from snake.models.gpt import GPTConfig
from snake.offload_dir import memory_fs

_UNITS = {
    "": 1, "b": 1,
    "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*(?:/s)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> float:
    """'8GiB' -> 8 * 2**30, '500MB' -> 5e8, '500MB/s' -> 5e8, '1024' -> 1024 (bytes)."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 8GiB, 500MB or 1024")
    size = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(size):
        raise argparse.ArgumentTypeError(f"{text!r} is too large a size")
    return size


def _positive_size(text: str) -> float:
    """`parse_size`, and more than 0 bytes: a budget or a bandwidth."""
    size = parse_size(text)
    if not size >= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1 byte")
    return size


def _alpha(text: str) -> float:
    """A delayed share in [0, 1] (--alpha)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 1] (1 for clipping or float16's dynamic scale)")
    return value


def _bool(key: str, value: str) -> bool:
    """A model field's boolean: 1/true/yes or 0/false/no."""
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"model field {key}={value!r} must be true or false (1/0, yes/no)")


def _names(text: str) -> tuple[str, ...]:
    """Comma-separated module names (--lora-targets)."""
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of module names")
    return names


def _ssd_bandwidth(text: str) -> float:
    """`parse_size`, at least SnakeConfig's lowest cap (1 MB/s): below it the SSD probe
    does not finish (at 1 B/s it hangs)."""
    size = parse_size(text)
    if not size >= MIN_SSD_BANDWIDTH:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1MB/s (a cap, in bytes/s)")
    return size


@dataclasses.dataclass(frozen=True)
class HFModel:
    """`--model hf:DIR`: a Hugging Face causal LM known by its config alone."""

    path: str
    config: Any  # a transformers PretrainedConfig
    lora: int | None = None  # --lora: the adapters' rank
    lora_targets: tuple[str, ...] = ("all-linear",)  # --lora-targets: PEFT's target_modules
    stream: bool = False  # --stream: the layers' frozen weights stay in the files, mapped
    dtype: str = "float32"  # --dtype: with --lora, the base is loaded in it

    @property
    def n_layer(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def block_size(self) -> int | None:
        n = getattr(self.config, "max_position_embeddings", None)
        return int(n) if isinstance(n, int) else None

    def title(self) -> str:
        lora = f", LoRA r={self.lora}" if self.lora else ""
        return f"{self.config.model_type} {self.n_layer} x {self.config.hidden_size}{lora}"

    def _built(self, load_hf: Any, config: Any) -> Any:
        """`load_hf(config)`, where transformers' refusal of the config (heads that do not
        divide the width, an empty vocabulary) is a ModelError naming the directory."""
        vocab = getattr(config, "vocab_size", None)
        if isinstance(vocab, int) and vocab < 1:
            raise ModelError(f"model 'hf:{self.path}': its config.json has vocab_size={vocab}; it must be >= 1")
        try:
            return load_hf(config)
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
            raise ModelError(f"model 'hf:{self.path}': transformers cannot build the model of its config.json "
                             f"({type(e).__name__}: {e})") from e

    def _adapted(self, model: Any) -> Any:
        """The model with the LoRA adapters --lora asks for in it, as PEFT's `get_peft_model`
        puts them (its base model, which snake trains), or the model itself. The base is in
        the compute dtype, as one loads it for a bfloat16 fine-tune: PEFT's adapters of it
        stay in float32, which snake holds with the embedding and head rather than streams."""
        if self.lora is None:
            return model
        from snake.kernels import TORCH_DTYPES
        from snake.train_source import with_lora

        return with_lora(model.to(TORCH_DTYPES[self.dtype]), self.lora, self.lora_targets)

    def sample(self) -> tuple[Any, list[int] | None]:
        """(ModelParts of the model cut to its first layers, fresh weights: what the probes
        time; None, or where its layers are of several kinds the count of each kind in the
        whole model). The cut keeps the layers up to the first of the last kind to appear
        (the first layer alone where all are alike); lists with an entry per layer
        (`layer_types`, `mlp_layer_types`) are cut to match."""
        import copy

        from snake.adapters import describe, layer_kinds, param_signature
        from snake.hf import load_hf

        whole = self._meta_parts()
        kinds, firsts = layer_kinds(whole.blocks)
        keep = max(firsts) + 1
        cfg = copy.deepcopy(self.config)
        cfg.num_hidden_layers = keep
        for name, value in vars(cfg).items():
            if isinstance(value, list) and len(value) == self.n_layer and "layer" in name:
                setattr(cfg, name, value[:keep])
        parts = describe(self._adapted(self._built(load_hf, cfg)))
        cut, _ = layer_kinds(parts.blocks)
        if cut != kinds[:keep] or any(
                param_signature(a) != param_signature(b) for a, b in zip(parts.blocks, whole.blocks[:keep], strict=True)
        ):
            raise ModelError(
                f"model: snake plan cannot time the layer kinds of {type(whole.model).__name__} in its first "
                f"{keep} layers (cut to them, they come out of other kinds); plan it in the trainer "
                "(SnakeTrainer without placement, alpha and micro_batches), which times the whole model"
            )
        if len(firsts) == 1:
            return parts, None
        return parts, [kinds.count(k) for k in range(len(firsts))]

    def whole_shape(self, shape: Any, *, pre: bool, dtype: str) -> Any:
        """`shape` (the ModelShape of `sample`'s cut model, which the probes timed) with the
        whole model's parameters counted (`planner.profile.param_counts`) on the meta
        device; `pre`: whether its embedding trains a parameter (the sample's). With
        --stream its layers' frozen weights are in the files, mapped, as `stream_hf` leaves
        them (`ModelShape.layer_frozen_in_files`): the memory model does not count them."""
        from planner.profile import param_counts

        counts = param_counts(self._meta_parts(), dtype, pre=pre)
        counts["layer_frozen_in_files"] = self.stream and counts["layer_frozen_params"] > 0
        return dataclasses.replace(shape, **counts)

    def _meta_parts(self) -> Any:
        """The whole model's ModelParts on the meta device (shapes, no data)."""
        import torch

        from snake.hf import describe_hf, load_hf

        with torch.device("meta"):
            model = self._adapted(self._built(load_hf, self.config))
        parts = describe_hf(model)
        if parts is None:
            from snake.hf import supported

            raise ModelError(
                f"model: snake does not know how the layers of {type(model).__name__} compose "
                f"(it recognises {supported()})"
            )
        return parts

    def check_layers(self) -> None:
        """ModelError for what training would refuse in the whole model (options snake
        cannot stream, layers without parameters): its every layer built on the meta
        device, which holds shapes and no data."""
        from snake.adapters import check_blocks

        check_blocks(list(self._meta_parts().blocks))


def _parse_hf(path: str) -> HFModel:
    d = Path(path).expanduser()
    if not (d / "config.json").is_file():
        raise argparse.ArgumentTypeError(
            f"model 'hf:{path}': {str(d)!r} is not a directory with a config.json; give a local "
            "Hugging Face model directory (only its config is read, nothing is downloaded)"
        )
    try:
        from transformers import AutoConfig
    except ImportError as e:
        raise argparse.ArgumentTypeError(
            "model 'hf:...' needs transformers: pip install 'snake[hf]'"
        ) from e
    try:
        config = AutoConfig.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - its validators raise their own kinds (huggingface_hub's, say)
        raise argparse.ArgumentTypeError(f"model 'hf:{path}': transformers cannot read its config: "
                                         f"{' '.join(str(e).split())}") from e
    if not isinstance(getattr(config, "num_hidden_layers", None), int):
        raise argparse.ArgumentTypeError(f"model 'hf:{path}': its config has no num_hidden_layers")
    return HFModel(str(d), config)


def parse_model(text: str) -> GPTConfig | HFModel:
    """'gpt:n_layer=4,n_embd=128' -> GPTConfig(n_layer=4, n_embd=128, ...); 'hf:DIR' ->
    HFModel (DIR's config.json)."""
    kind, _, rest = text.partition(":")
    if kind == "hf" and rest:
        return _parse_hf(rest)
    if kind != "gpt":
        raise argparse.ArgumentTypeError(
            f"model {kind!r}: 'gpt:key=value,...' (the built-in GPT) or 'hf:DIR' (a Hugging Face model directory)"
        )
    defaults = GPTConfig()
    fields = [f.name for f in dataclasses.fields(GPTConfig)]
    kw: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in fields:
            raise argparse.ArgumentTypeError(f"model field {key!r} is not one of {fields}")
        if key in kw:
            raise argparse.ArgumentTypeError(f"model field {key!r} is given twice")
        conv: Any = type(getattr(defaults, key))
        try:
            kw[key] = _bool(key, value) if conv is bool else conv(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"model field {key}={value!r}: {e}") from e
        if conv is int and kw[key] < 1:
            raise argparse.ArgumentTypeError(f"model field {key}={kw[key]} must be an integer >= 1")
        if key == "dropout" and not 0 <= kw[key] < 1:
            raise argparse.ArgumentTypeError(f"model field dropout={kw[key]} must be in [0, 1)")
    try:
        return GPTConfig(**kw)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="snake plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=parse_model, required=True,
                   help="gpt:n_layer=..,n_embd=..,... or hf:DIR (a Hugging Face model directory)")
    p.add_argument("--micro-batch-size", type=positive_int, required=True)
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="default: the model's block_size (gpt:); required with hf:")
    p.add_argument("--cpu-memory", type=_positive_size, default=None, help="host budget; default: available")
    p.add_argument("--device-memory", type=_positive_size, default=None)
    p.add_argument("--offload-dir", required=True, help="SSD tier directory (probe and cache)")
    p.add_argument("--ssd-bandwidth", type=_ssd_bandwidth, default=None, help="cap, bytes/s (reads+writes)")
    p.add_argument("--device", type=device_name, default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--schedule", default="vertical", choices=("vertical", "horizontal"))
    p.add_argument("--max-micro-batches", type=positive_int, default=64)
    p.add_argument("--alpha", type=_alpha, default=None,
                   help="plan at this delayed share: 1 for clipping (--max-grad-norm) or float16's dynamic "
                        "loss scale, whose steps all wait for the whole gradient; default: the best one")
    p.add_argument("--resident-optimizer", default="auto", choices=("auto", "cpu", "ssd"),
                   help="where the embeddings' and head's optimizer state lives (auto: the planner chooses)")
    p.add_argument("--lora", type=positive_int, default=None, metavar="RANK",
                   help="plan a LoRA fine-tune of an hf: model: PEFT's adapters of this rank, the rest frozen")
    p.add_argument("--lora-targets", type=_names, default=None, metavar="NAMES",
                   help="the modules --lora adapts, comma-separated (default: all-linear)")
    p.add_argument("--stream", action="store_true",
                   help="the hf: model is loaded with snake.hf.stream_hf: its layers' frozen weights "
                        "stay in its files, mapped, outside the CPU budget")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", default=None, help="save the roofline plot to this image file")
    p.add_argument("--remeasure", action="store_true", help="ignore the cached profile")
    return p


def plan_json(plan: Plan, profile: MachineProfile, horizontal_seconds: float) -> dict:
    pl, shape = plan.placement, profile.shape
    return {
        # what the plan trains and what it holds frozen (a LoRA's base); layers of several
        # kinds are counted at their mean
        "trained_params": shape.n_layers * shape.layer_params + shape.resident_params,
        "frozen_params": shape.n_layers * shape.layer_frozen_params + shape.frozen_params,
        "frozen_in_files": shape.layer_frozen_in_files,
        "schedule": plan.schedule,
        "micro_batches": plan.n_micro,
        "alpha": plan.alpha,
        "placement": {"param": pl.param, "ckpt": pl.ckpt, "opt": pl.opt, "grad": pl.grad},
        "resident_optimizer": plan.resident_optimizer,
        "predicted_iteration_seconds": plan.predicted_iteration_seconds,
        "predicted_tokens_per_s": plan.predicted_tokens_per_s,
        "binding": list(plan.binding),
        "layer_seconds": plan.layer_seconds,
        # placed data and its buffers; the rest of the process (runtime overhead, a CPU
        # device's working set); their sum, what cpu_memory_bytes bounds
        "host_memory_bytes": plan.host_memory_bytes,
        "host_off_budget_bytes": off_budget(profile, plan.n_micro),
        "host_total_bytes": plan.host_memory_bytes + off_budget(profile, plan.n_micro),
        "ssd_bytes_per_iteration": plan.ssd_bytes_per_iteration,
        "frozen_from_disk": plan.frozen_from_disk,
        "horizontal_iteration_seconds_same_placement": horizontal_seconds,
        "profile": profile.to_json(),
    }


def format_table(d: dict) -> str:
    p, prof = d["placement"], d["profile"]
    gib, rows = 2.0**30, []
    frozen = (f", {d['frozen_params'] / 1e6:.4g} M frozen"
              + (" (the layers' mapped from the model's files)" if d["frozen_in_files"] else "")
              if d["frozen_params"] else "")
    rows += [
        ("parameters", f"{d['trained_params'] / 1e6:.4g} M trained{frozen}"),
        ("schedule", d["schedule"]),
        ("micro-batches", str(d["micro_batches"])),
        ("alpha (delayed step)", f"{d['alpha']:.2f}"),
        ("CPU share", f"param {p['param']:.1%}  ckpt {p['ckpt']:.1%}  opt {p['opt']:.1%}"
         + (f"  grad {p['grad']:.1%}" if d["alpha"] > 0 and d["schedule"] == "vertical" else "")),
        ("resident optimizer", f"{d['resident_optimizer']} (embeddings' and head's state)"),
        ("iteration", f"{d['predicted_iteration_seconds']:.4g} s"),
        ("throughput", f"{d['predicted_tokens_per_s']:.4g} tokens/s"),
        ("binding", ", ".join(d["binding"]) or "-"),
        ("host memory", f"{d['host_total_bytes'] / gib:.2f} of {prof['cpu_memory_bytes'] / gib:.2f} GiB "
         f"({d['host_memory_bytes'] / gib:.2f} placed data and buffers, the rest runtime"
         f"{' and the CPU device' if prof.get('device') == 'cpu' else ''})"),
        ("SSD traffic", f"{d['ssd_bytes_per_iteration'] / gib:.3f} GiB/iteration"
         + (" (the mapped frozen weights, more than the page cache keeps, read at every load)"
            if d.get("frozen_from_disk") else "")),
        ("horizontal, same", f"{d['horizontal_iteration_seconds_same_placement']:.4g} s/iteration"),
        ("measured", f"fwd {prof['fwd_seconds'] * 1e3:.3g} ms, recompute "
         f"{prof['recompute_seconds'] * 1e3:.3g} ms, bwd {prof['bwd_seconds'] * 1e3:.3g} ms"),
        ("", f"SSD read {prof['ssd_read_bytes_per_s'] / 1e6:.4g} MB/s, write "
         f"{prof['ssd_write_bytes_per_s'] / 1e6:.4g} MB/s, Adam "
         f"{prof['adam_elems_per_s'] / 1e9:.3g} G elem/s"),
    ]
    return "\n".join(f"{k:<22}{v}" for k, v in rows)


def _check_lora(args: argparse.Namespace) -> None:
    """--lora, --lora-targets and --stream: of an hf: model, --lora-targets with --lora."""
    if not isinstance(args.model, HFModel):
        for flag, value in (("--lora", args.lora), ("--lora-targets", args.lora_targets), ("--stream", args.stream)):
            if value:
                raise ConfigError(flag, MISSING, "plans a model from a Hugging Face directory only",
                                  "give --model hf:DIR, or leave it out for the built-in GPT")
    if args.lora_targets is not None and args.lora is None:
        raise ConfigError("--lora-targets", MISSING, "names the modules of a LoRA fine-tune",
                          "give --lora RANK with it, e.g. --lora 16")


def _check_args(args: argparse.Namespace, *, measure: bool) -> None:
    """What argparse cannot check one option at a time, before measuring: a ConfigError
    naming the option. Creates --offload-dir (0700) when it will be measured into."""
    from snake.offload_dir import check_offload_dir

    block = args.model.block_size
    if isinstance(args.model, HFModel):
        if args.seq_len is None:
            raise ConfigError("--seq-len", MISSING, "is required with an hf: model",
                              "give the sequence length you will train on, e.g. --seq-len 2048")
        if block is not None and args.seq_len > block:
            raise ConfigError("--seq-len", args.seq_len, f"must be <= the model's max_position_embeddings={block}",
                              "use a shorter sequence")
    elif args.seq_len is not None and args.seq_len > block:
        raise ConfigError("--seq-len", args.seq_len, f"must be <= the model's block_size={block}",
                          "use a shorter sequence or a larger block_size in --model")
    if args.plot is not None:
        from matplotlib.backend_bases import FigureCanvasBase

        plot = Path(args.plot).expanduser()
        fix = "pick a file in an existing directory you can write to"
        if plot.is_dir():
            raise ConfigError("--plot", args.plot, "is a directory, not an image file", fix)
        kinds = FigureCanvasBase.get_supported_filetypes()
        if plot.suffix and plot.suffix[1:].lower() not in kinds:
            raise ConfigError("--plot", args.plot, f"has a suffix matplotlib cannot write; it can write {sorted(kinds)}",
                              "e.g. roofline.png")
        if not plot.parent.is_dir():
            raise ConfigError("--plot", args.plot, f"is in {plot.parent}, which is not a directory", fix)
        if not os.access(plot.parent, os.W_OK | os.X_OK):
            raise ConfigError("--plot", args.plot, f"is in {plot.parent}, which is not writable", fix)
    if measure:
        check_offload_dir(args.offload_dir)


def _user_paths(args: argparse.Namespace) -> None:
    """--offload-dir and --plot with a leading ~ expanded (a shell leaves `--plot=~/r.png`
    as it is), checked and used as one path; an empty --offload-dir is refused, not taken as
    the current directory."""
    if not args.offload_dir.strip():
        raise ConfigError("--offload-dir", args.offload_dir, "is empty",
                          "give the directory on the disk the SSD tier will use")
    args.offload_dir = str(Path(args.offload_dir).expanduser())
    if args.plot is not None:
        args.plot = str(Path(args.plot).expanduser())


def plan_main(argv: list[str], *, profile: MachineProfile | None = None) -> int:
    """Entry point of `snake plan`. `profile`: use it instead of measuring (tests)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help, or argparse's own error message
        return int(e.code or 0)
    try:
        _user_paths(args)
        _check_lora(args)
        if isinstance(args.model, HFModel):
            args.model = dataclasses.replace(args.model, lora=args.lora, stream=args.stream, dtype=args.dtype,
                                             lora_targets=args.lora_targets or ("all-linear",))
            args.model.check_layers()  # before anything is written
        _check_args(args, measure=profile is None)
        if profile is None:
            if isinstance(args.model, HFModel):
                model, counts = args.model.sample()
            else:
                model, counts = args.model, None
            profile = measure_profile(
                model, micro_batch_size=args.micro_batch_size, kind_counts=counts,
                seq_len=args.seq_len or args.model.block_size, device=args.device, dtype=args.dtype,
                offload_dir=args.offload_dir, ssd_bandwidth_bytes_per_s=args.ssd_bandwidth,
                remeasure=args.remeasure,
            )
            if isinstance(args.model, HFModel):  # timed with the first layers; planned with all of them
                from snake.adapters import pre_trains

                profile = dataclasses.replace(profile, shape=args.model.whole_shape(
                    profile.shape, pre=pre_trains(model), dtype=args.dtype))
        budgets = {"cpu_memory_bytes": args.cpu_memory, "device_memory_bytes": args.device_memory}
        # an offload_dir in memory (tmpfs) spares no CPU memory: the trainer's planner counts it so
        # (`planner.integrate.with_budgets`), and a plan made here must be one the trainer takes
        profile = dataclasses.replace(profile, **{k: v for k, v in budgets.items() if v is not None},
                                      offload_in_memory=memory_fs(args.offload_dir) is not None)
    except (ConfigError, ModelError) as e:
        print(f"snake plan: {e}", file=sys.stderr)
        return 2
    resident = None if args.resident_optimizer == "auto" else args.resident_optimizer
    plan = search(profile, schedule=args.schedule, max_n=args.max_micro_batches, resident=resident,
                  alphas=None if args.alpha is None else (args.alpha,))
    if isinstance(plan, Infeasible):
        print(f"snake plan: infeasible: {plan.message}", file=sys.stderr)
        return 2
    # horizontal at the same placement, at alpha 0 (ZeRO-Infinity) or at the alpha asked for
    # (clipping's steps wait in either schedule)
    d = plan_json(plan, profile, predict_horizontal(profile, plan.n_micro, plan.placement,
                                                    alpha=args.alpha or 0.0, resident=plan.resident_optimizer))
    print(json.dumps(d, indent=1) if args.json else format_table(d))
    if args.plot:
        ns = range(1, max(16, 2 * plan.n_micro) + 1)
        m = args.model
        what = m.title() if isinstance(m, HFModel) else f"GPT {m.n_layer} x {m.n_embd}"
        title = f"{what}, micro-batch {args.micro_batch_size}, {args.dtype}"
        plot_roofline(roofline(profile, ns), args.plot, title=title)
    return 0
