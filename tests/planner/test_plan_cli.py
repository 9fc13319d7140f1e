"""`snake plan` through plan_main, with a pre-made profile (no measuring)."""

from __future__ import annotations

import json

import pytest
from conftest import synthetic_profile

from planner.cli import parse_model, parse_size, plan_main

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
    assert set(d["placement"]) == {"param", "ckpt", "opt"}
    assert d["micro_batches"] >= 1 and 0 <= d["alpha"] <= 0.5
    assert isinstance(d["binding"], list) and d["binding"]
    assert d["predicted_tokens_per_s"] > 0


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
