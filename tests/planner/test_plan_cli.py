"""`snake plan` through plan_main, with a pre-made profile (no measuring); and once in a
fresh process, with a cached profile."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from conftest import synthetic_profile

from planner.cli import parse_model, parse_size, plan_main
from planner.profile import _MEASURED, _cache_key, cache_path, shape_of

MODEL = "gpt:n_layer=24,n_embd=2048,n_head=16,vocab_size=50304,block_size=1024"
KEYS = {
    "micro_batches",
    "alpha",
    "placement",
    "predicted_iteration_seconds",
    "predicted_tokens_per_s",
    "binding",
}


def _args(tmp_path, *extra):
    return ["--model", MODEL, "--micro-batch-size", "4", "--offload-dir", str(tmp_path), *extra]


def test_json_output_has_the_plan(tmp_path, capsys):
    rc = plan_main(_args(tmp_path, "--json", "--cpu-memory", "16GiB"), profile=synthetic_profile())
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert KEYS <= set(d)
    assert set(d["placement"]) == {"param", "ckpt", "opt", "grad"}
    assert d["micro_batches"] >= 1 and 0 <= d["alpha"] <= 0.5
    assert isinstance(d["binding"], list) and d["binding"]
    assert d["predicted_tokens_per_s"] > 0
    # the text's "host memory" total is a key of its own
    assert d["host_total_bytes"] == pytest.approx(d["host_memory_bytes"] + d["host_off_budget_bytes"])


def test_table_output_and_plot(tmp_path, capsys):
    png = tmp_path / "roofline.png"
    rc = plan_main(_args(tmp_path, "--plot", str(png)), profile=synthetic_profile())
    assert rc == 0
    out = capsys.readouterr().out
    assert "micro-batches" in out and "binding" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_infeasible_goes_to_stderr_with_status_2(tmp_path, capsys):
    rc = plan_main(_args(tmp_path, "--cpu-memory", "1GiB"), profile=synthetic_profile())
    assert rc == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "CPU memory: need" in captured.err and "have 1.00 GiB" in captured.err


def test_bad_arguments_return_2(tmp_path, capsys):
    assert plan_main(["--model", "llama:n_layer=2", "--micro-batch-size", "1",
                      "--offload-dir", str(tmp_path)]) == 2
    assert plan_main(_args(tmp_path, "--cpu-memory", "lots")) == 2
    assert "not a size" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "value"),
    [("8GiB", 8 * 2**30), ("500MB", 5e8), ("500MB/s", 5e8), ("1.5 KiB", 1536), ("1024", 1024),
     ("2gb", 2e9)],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_parse_model():
    cfg = parse_model("gpt:n_layer=2,n_embd=64,n_head=2,vocab_size=100,block_size=32,bias=false")
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.block_size) == (2, 64, 2, 100, 32)
    assert cfg.bias is False


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (["--model", "gpt:n_layer=-2"], "argument --model: model field n_layer=-2 must be an integer >= 1"),
        (["--model", "gpt:n_layer=0"], "argument --model: model field n_layer=0 must be an integer >= 1"),
        (["--model", "gpt:n_head=0"], "argument --model: model field n_head=0 must be an integer >= 1"),
        (["--micro-batch-size", "0"], "argument --micro-batch-size: 0 must be an integer >= 1"),
        (["--micro-batch-size", "-1"], "argument --micro-batch-size: -1 must be an integer >= 1"),
        (["--max-micro-batches", "0"], "argument --max-micro-batches: 0 must be an integer >= 1"),
        (["--seq-len", "2048"], "snake plan: --seq-len=2048 must be <= the model's block_size=1024"),
        (["--ssd-bandwidth", "0"], "argument --ssd-bandwidth: '0' must be at least 1MB/s"),
        (["--cpu-memory", "0"], "argument --cpu-memory: '0' must be at least 1 byte"),
        (["--device-memory", "0"], "argument --device-memory: '0' must be at least 1 byte"),
        (["--device", "mps"], "argument --device: 'mps' is not 'cpu', 'cuda' or 'cuda:N'"),
        (["--device", "cuda:99"], "argument --device: device='cuda:99'"),
        (["--plot", "roofline.txt"], "snake plan: --plot='roofline.txt' has a suffix matplotlib cannot write"),
    ],
)
def test_bad_values_return_2_with_the_option_named(tmp_path, capsys, change, says):
    argv = _args(tmp_path)
    for i in range(0, len(change), 2):  # replace the option if it is there, else add it
        if change[i] in argv:
            argv[argv.index(change[i]) + 1] = change[i + 1]
        else:
            argv += change[i : i + 2]
    assert plan_main(argv, profile=synthetic_profile()) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert says in captured.err


def test_bad_paths_are_refused_before_measuring_or_printing(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert plan_main(_args(tmp_path / "off", "--plot", str(afile / "r.png")), profile=synthetic_profile()) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # the plan is not printed before failing on --plot
    assert captured.err.startswith(f"snake plan: --plot='{afile / 'r.png'}' is in {afile}, which is not a directory")
    # no profile given: the offload dir is checked before anything is measured
    argv = ["--model", MODEL, "--micro-batch-size", "4", "--offload-dir", str(afile)]
    assert plan_main(argv) == 2
    assert capsys.readouterr().err == (
        f"snake plan: offload_dir='{afile}' is a file, not a directory (pass a directory path)\n"
    )


def test_json_on_stdout_is_only_json(tmp_path):
    """In a fresh process, where HiGHS prints its banner on the C-level stdout when the first
    solver is built: stdout must still parse as JSON. The profile comes from a cache file
    written here, so nothing is measured."""
    model = "gpt:n_layer=2,n_embd=64,n_head=2,vocab_size=96,block_size=32"
    shape = shape_of(parse_model(model), 2, 32, "float32")
    measured = dataclasses.asdict(synthetic_profile())
    cache = cache_path(tmp_path, _cache_key(shape, "cpu", "float32", None))
    cache.write_text(json.dumps({k: measured[k] for k in _MEASURED}))
    argv = ["plan", "--model", model, "--micro-batch-size", "2", "--offload-dir", str(tmp_path), "--json"]
    done = subprocess.run([sys.executable, "-m", "snake.cli", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["micro_batches"] >= 1


@pytest.mark.parametrize("kind", ["llama", "dense-and-sparse"])
def test_hf_model_directory_is_planned_for_all_its_layers(tmp_path, capsys, monkeypatch, kind):
    """`--model hf:DIR`: a Hugging Face model known by its config.json (no weights). The
    probes time the model built from its config with its first layer (all layers alike),
    or with its first layers up to one of each kind, averaged over the whole model's
    layers (a mixture of experts whose layers 0 and 5 are dense); the plan's shape is the
    full model's, as the trainer would see it (layers, parameters per layer: the largest
    kind's, resident parameters, hidden size, vocabulary)."""
    import transformers

    import planner.cli as cli
    from planner.profile import measure_profile, shape_of_parts
    from snake.adapters import describe

    common = dict(hidden_size=64, num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2, vocab_size=200,
                  max_position_embeddings=64)
    if kind == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=172, **common)
        blocks, counts = 1, None
    else:
        cfg = transformers.Qwen3MoeConfig(intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, mlp_only_layers=[0, 5], **common)
        blocks, counts = 2, [2, 10]
    d = tmp_path / kind
    cfg.save_pretrained(d)
    seen = {}

    def fast(model, **kw):  # the real probes, shortened
        seen["blocks"], seen["counts"] = len(model.blocks), kw.get("kind_counts")
        return measure_profile(model, **{**kw, "io_bytes": 16 << 20, "seconds_per_probe": 0.05})

    monkeypatch.setattr(cli, "measure_profile", fast)
    argv = ["--model", f"hf:{d}", "--seq-len", "32", "--micro-batch-size", "2", "--offload-dir", str(tmp_path / "off"),
            "--json", "--cpu-memory", "4GiB"]
    assert plan_main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["micro_batches"] >= 1 and set(plan["placement"]) == {"param", "ckpt", "opt", "grad"}
    assert (seen["blocks"], seen["counts"]) == (blocks, counts)  # the layers built and timed
    # the same shape the trainer plans with
    full = describe(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"))
    got = {}
    real_search = cli.search
    monkeypatch.setattr(cli, "search", lambda profile, **kw: got.setdefault("shape", profile.shape) and real_search(profile, **kw))
    assert plan_main(argv) == 0
    assert got["shape"] == shape_of_parts(full, 2, 32, "float32")


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT's
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("stream", [False, True])
def test_lora_of_an_hf_model_is_planned_with_the_trainers_shape(tmp_path, capsys, monkeypatch, stream, dtype):
    """`--lora RANK` plans a LoRA fine-tune of an hf: model: the shape searched is the one
    the trainer plans with for PEFT's adapters on the model loaded in the compute dtype
    (loaded whole, or from `stream_hf` with `--stream`, whose layers' frozen weights stay in
    the files, outside the budget; in bfloat16 PEFT's float32 adapters are held with the
    embedding, not streamed); the output says what is trained and what is frozen.
    `--lora-targets` adapts fewer modules."""
    import peft
    import transformers

    import planner.cli as cli
    from planner.profile import measure_profile, shape_of_parts
    from snake.adapters import describe
    from snake.hf import load_hf, stream_hf

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=12, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=200, max_position_embeddings=64)
    d = tmp_path / "llama"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    monkeypatch.setattr(cli, "measure_profile", lambda model, **kw: measure_profile(
        model, **{**kw, "io_bytes": 16 << 20, "seconds_per_probe": 0.05}))
    got = {}
    real_search = cli.search
    monkeypatch.setattr(cli, "search", lambda profile, **kw: got.setdefault("shape", profile.shape) and real_search(profile, **kw))
    argv = ["--model", f"hf:{d}", "--seq-len", "32", "--micro-batch-size", "2", "--offload-dir", str(tmp_path / "off"),
            "--cpu-memory", "4GiB", "--lora", "4", "--dtype", dtype, *(["--stream"] if stream else [])]
    assert plan_main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    model = (stream_hf if stream else load_hf)(str(d), dtype=getattr(torch, dtype))
    trainer_sees = describe(peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear")))
    shape = shape_of_parts(trainer_sees, 2, 32, dtype)
    assert (shape.layer_params == 0) is (dtype == "bfloat16")  # the float32 adapters held, not streamed
    assert got["shape"] == shape and shape.layer_frozen_in_files is stream
    trained = sum(p.numel() for p in trainer_sees.model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in trainer_sees.model.parameters() if not p.requires_grad)
    assert (plan["trained_params"], plan["frozen_params"], plan["frozen_in_files"]) == (trained, frozen, stream)
    assert plan_main(argv) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("parameters"))
    assert row.split(None, 1)[1] == (f"{trained / 1e6:.4g} M trained, {frozen / 1e6:.4g} M frozen"
                                     + (" (the layers' mapped from the model's files)" if stream else ""))
    assert plan_main([*argv, "--json", "--lora-targets", "q_proj, v_proj"]) == 0
    fewer = json.loads(capsys.readouterr().out)
    per_layer = 4 * (64 + 64) + 4 * (64 + 32)  # q_proj 64 -> 64, v_proj 64 -> 32 (two key-value heads)
    assert fewer["trained_params"] == 12 * per_layer < plan["trained_params"]


def test_lora_weights_left_in_their_files_plan_where_loaded_ones_do_not_fit(tmp_path, capsys, monkeypatch):
    """A budget that cannot hold a LoRA's frozen base in CPU memory: loaded (`load_hf`) the
    fine-tune is infeasible, and the error says so; streamed (`--stream`) it plans, with
    the frozen weights read from the SSD at every load of a layer (more than the page cache
    the budget leaves would keep)."""
    import transformers

    import planner.cli as cli
    from planner.profile import measure_profile

    monkeypatch.setattr(cli, "measure_profile", lambda model, **kw: measure_profile(
        model, **{**kw, "io_bytes": 16 << 20, "seconds_per_probe": 0.05}))
    transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256
                             ).save_pretrained(tmp_path / "llama")
    argv = ["--model", f"hf:{tmp_path / 'llama'}", "--seq-len", "128", "--micro-batch-size", "2", "--lora", "8",
            "--offload-dir", str(tmp_path / "off"), "--json", "--max-micro-batches", "1", "--alpha", "0"]
    assert plan_main([*argv, "--stream"]) == 0
    roomy = json.loads(capsys.readouterr().out)
    frozen_bytes = roomy["frozen_params"] * 4
    # the streamed run's need (one micro-batch, as every plan here), and half the base
    budget = str(int(roomy["host_total_bytes"] + frozen_bytes / 2))
    assert plan_main([*argv, "--cpu-memory", budget]) == 2
    assert "snake plan: infeasible: CPU memory" in capsys.readouterr().err
    assert plan_main([*argv, "--cpu-memory", budget, "--stream"]) == 0
    tight = json.loads(capsys.readouterr().out)
    assert tight["frozen_from_disk"] and tight["host_total_bytes"] <= int(budget)
    assert tight["ssd_bytes_per_iteration"] >= frozen_bytes * 0.9  # the layers' share of them, read once each


@pytest.mark.parametrize(
    ("model", "extra", "says"),
    [
        ("hf:{tmp}/none", ["--seq-len", "32"], "is not a directory with a config.json"),
        ("hf:{tmp}/llama", [], "snake plan: --seq-len is required with an hf: model ("),
        ("hf:{tmp}/llama", ["--seq-len", "100"], "must be <= the model's max_position_embeddings=64"),
        # what training refuses in the whole model, though its first layer alone would plan
        ("hf:{tmp}/router-loss", ["--seq-len", "32"], "output_router_logits=True"),
        ("gpt:n_layer=2", ["--lora", "4"], "snake plan: --lora plans a model from a Hugging Face directory only ("),
        ("gpt:n_layer=2", ["--stream"], "snake plan: --stream plans a model from a Hugging Face directory only ("),
        ("hf:{tmp}/llama", ["--seq-len", "32", "--lora-targets", "q_proj"],
         "snake plan: --lora-targets names the modules of a LoRA fine-tune (give --lora RANK with it"),
        ("hf:{tmp}/llama", ["--seq-len", "32", "--lora", "4", "--lora-targets", "nothing"],
         "snake plan: --lora-targets='nothing' cannot take LoRA adapters: "),
        ("hf:{tmp}/llama", ["--seq-len", "32", "--lora", "0"], "argument --lora: 0 must be an integer >= 1"),
        ("hf:{tmp}/llama", ["--seq-len", "32", "--lora", "4", "--lora-targets", "q_proj,,v_proj"],
         "is not a comma-separated list of module names"),
        # PEFT's all-linear adapts fused experts as parameters, which snake does not train
        ("hf:{tmp}/moe", ["--seq-len", "32", "--lora", "4"],
         "snake plan: --lora-targets='all-linear' makes PEFT adapt this model's fused experts as parameters"),
    ],
)
def test_hf_model_mistakes_return_2(tmp_path, capsys, model, extra, says):
    import transformers
    transformers.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                             vocab_size=200, max_position_embeddings=64).save_pretrained(tmp_path / "llama")
    moe = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=200, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    transformers.Qwen3MoeConfig(**moe, output_router_logits=True).save_pretrained(tmp_path / "router-loss")
    transformers.Qwen3MoeConfig(**moe).save_pretrained(tmp_path / "moe")
    argv = ["--model", model.format(tmp=tmp_path), "--micro-batch-size", "2", "--offload-dir", str(tmp_path / "o"), *extra]
    assert plan_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and says in captured.err
    assert not (tmp_path / "o").exists()  # refused before anything was measured


def test_resident_optimizer_goes_to_ssd_where_only_that_fits(tmp_path, capsys):
    """`--resident-optimizer auto` (the default) puts the embedding's and head's optimizer
    state on SSD where the CPU budget holds the run only so, and says so; `cpu` is then
    infeasible, with `resident_optimizer='ssd'` in its fix."""
    from snake.memory import placement_bytes

    prof = synthetic_profile()
    kw = dict(n_micro=1, alpha=0.0, schedule="vertical", workers=2, device_type="cuda")

    def least(on_ssd):  # linear in the shares: the smallest footprint is at a corner
        return min(placement_bytes(prof.shape, **kw, param=p, ckpt=c, opt=o, resident_on_ssd=on_ssd)
                   for p in (0.0, 1.0) for c in (0.0, 1.0) for o in (0.0, 1.0))

    budget = int((least(True) + least(False)) / 2)
    assert plan_main(_args(tmp_path, "--json", "--cpu-memory", str(budget)), profile=prof) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["resident_optimizer"] == "ssd" and d["host_total_bytes"] <= budget
    assert plan_main(_args(tmp_path, "--cpu-memory", "64GiB"), profile=prof) == 0
    assert "resident optimizer    cpu" in capsys.readouterr().out  # the SSD's traffic costs time
    assert plan_main(_args(tmp_path, "--cpu-memory", str(budget), "--resident-optimizer", "cpu"), profile=prof) == 2
    assert "resident_optimizer='ssd'" in capsys.readouterr().err


def test_alpha_plans_for_clipping_with_the_waiting_gradients_on_ssd(tmp_path, capsys):
    """`--alpha 1`: the plan a clipped run needs, every step waiting for the whole gradient;
    under a budget that cannot hold the fp32 gradients it puts part of them on SSD (grad
    share in the table), where the best alpha needed none of them."""
    assert plan_main(_args(tmp_path, "--json", "--cpu-memory", "12GiB"), profile=synthetic_profile()) == 0
    free = json.loads(capsys.readouterr().out)
    assert plan_main(_args(tmp_path, "--json", "--cpu-memory", "12GiB", "--alpha", "1"),
                     profile=synthetic_profile()) == 0
    clipped = json.loads(capsys.readouterr().out)
    assert free["alpha"] < 1.0 and clipped["alpha"] == 1.0
    assert clipped["placement"]["grad"] < 1.0
    assert plan_main(_args(tmp_path, "--cpu-memory", "12GiB", "--alpha", "1"), profile=synthetic_profile()) == 0
    assert "grad " in capsys.readouterr().out.split("CPU share")[1].splitlines()[0]
    assert plan_main(_args(tmp_path, "--alpha", "2"), profile=synthetic_profile()) == 2
    assert "--alpha: 2.0 must be in [0, 1]" in capsys.readouterr().err
