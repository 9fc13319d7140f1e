"""Checkpoints written by older snake revisions, with the current code: each loads into a
trainer of the same model (built from the same seed and config), holds the masters the old
trainer saved, resumes for the same steps on the same batches to the old trainer's own
weights (bitwise where the machine is the one that made them, as the README promises of a
resume; within rounding on another: ROUNDING), and exports where `snake export`
applies; where the current code refuses one, it says why and what to do.

The fixtures (tests/fixtures/compat/<revision>/<kind>/: the checkpoint, info.json saying how
it was made, the old trainer's losses and its state_dict() after the more steps as sha256
digests) were written by those revisions themselves: tests/fixtures/compat/make_fixtures.py
says how and which, and makes them again from the git history. These tests only read them."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from snake import SnakeError, SnakeTrainer
from snake.cli import main

# (PEFT reads transformers' deprecated gradient-checkpointing flag when it makes and loads adapters)
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

FIX = Path(__file__).parent / "fixtures" / "compat"
_spec = importlib.util.spec_from_file_location("compat_fixtures", FIX / "make_fixtures.py")
assert _spec is not None and _spec.loader is not None
make = importlib.util.module_from_spec(_spec)
_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ among the fixtures
try:
    _spec.loader.exec_module(make)
finally:
    sys.dont_write_bytecode = _bytecode

CASES = [
    "r4164692/gpt",             # version 1, the first save/load: no model config, no buffers
    "r6113aa5/llama",           # version 1 with the model config (snake export --hf), a Hugging Face model
    "r05ca321/gpt-horizontal",  # version 2 (missed_steps), horizontal schedule
    "r67136c2/gpt-fp16",        # float16, dynamic loss scale in the manifest, clipping, alpha 1
    "r67136c2/lora-bf16",       # PEFT LoRA of a bf16 model: base stored, fp32 adapters streamed, no PEFT record
    "reb619a9/lora-epochs",     # PEFT LoRA without its base, PEFT record, batch shapes, snake.Epochs' data state
]
TIMEOUT = 60


def info(case: str) -> dict:
    return json.loads((FIX / case / "info.json").read_text())


def checkpoint(case: str) -> Path:
    return FIX / case / "checkpoint"


def stored(case: str, prefix: str = "master/") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of one kind (`master/`, `frozen/`, `buffer/`) by parameter name."""
    out = {}
    for f in sorted(checkpoint(case).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update({k[len(prefix):]: st.get_tensor(k) for k in st.keys() if k.startswith(prefix)})
    return out


def build(kind: dict):
    """The fixture's model and data, built as its revision built them (make_fixtures.py),
    with today's tests.helpers and snake."""
    return make.model_for(kind), make.data_for(kind)


def base_of(model) -> torch.nn.Module:
    return getattr(model, "get_base_model", lambda: model)()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


# The fixtures' digests are bitwise for the machine and thread count that made them; another
# machine's kernels (its vector ISA) or another thread count (pytest-xdist gives each worker
# one) round the steps otherwise: measured 1.8e-7 of a tensor's sum at one thread. Where a
# digest differs, its sum and largest magnitude must be within this of the fixture's: a
# state loaded wrong (moments, step counts, the loss scale) moves them by 1e-3 and more.
ROUNDING = 1e-5


def differences(got: dict[str, torch.Tensor], want: dict[str, dict]) -> list[str]:
    """The tensors of `got` that are not the fixture's (`info["expected"]`): bitwise, or where
    the digest differs within ROUNDING of its sum and largest magnitude; with how far off."""
    out = []
    assert got.keys() == want.keys(), (sorted(got.keys() ^ want.keys()))
    for k, w in want.items():
        g = got[k]
        if str(g.dtype).removeprefix("torch.") != w["dtype"] or list(g.shape) != w["shape"]:
            out.append(f"{k}: {g.dtype} {tuple(g.shape)}, the old trainer's {w['dtype']} {tuple(w['shape'])}")
        elif digest(g) != w["sha256"]:
            total, top = float(g.double().sum()), float(g.double().abs().max())
            if (abs(total - w["sum"]) > ROUNDING * max(abs(w["sum"]), 1.0)
                    or abs(top - w["absmax"]) > ROUNDING * max(w["absmax"], 1.0)):
                out.append(f"{k}: sum {total:.9g} vs {w['sum']:.9g}, absmax {top:.9g} vs {w['absmax']:.9g}")
    return out


async def resume(case: str, tmp_path: Path):
    """Load the fixture into a trainer of its model, take the loaded state, run the steps the
    old trainer ran after its save: (loaded state, report, end state, model)."""
    meta = info(case)
    model, data = build(meta)
    cfg = make.snake_config(meta["config"], tmp_path / "off")
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        await asyncio.wait_for(t.load(checkpoint(case)), TIMEOUT)
        loaded = await t.state_dict()
        report = await asyncio.wait_for(t.run(meta["steps_after"]), TIMEOUT)
        end = await t.state_dict()
    return loaded, report, end, model


@pytest.mark.parametrize("case", CASES)
def test_the_fixture_is_there_and_small(case):
    meta = info(case)
    assert (checkpoint(case) / "manifest.json").is_file()
    assert meta["steps_before"] == 2 and meta["steps_after"] == 2 and len(meta["losses"]) == 4
    total = sum(f.stat().st_size for f in FIX.rglob("*") if f.is_file())
    assert total < 1_500_000, f"the compat fixtures take {total} bytes; keep them under 1.5 MB"


def check_loaded(case: str, model, loaded: dict[str, torch.Tensor]) -> None:
    """Right after load(): each trained parameter is its checkpoint master in the model's
    dtype (a tied weight's other name too), each frozen one and each buffer the model's own
    (the frozen ones' digests matched)."""
    meta = info(case)
    masters = stored(case)
    assert set(meta["trained"]) == set(masters), "the checkpoint's masters are not the trained parameters"
    base = base_of(model)
    first: dict[int, str] = {}  # a tied weight's other names -> the name its master is stored under
    for n, p in base.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), n)
    alias = {n: first[id(p)] for n, p in base.named_parameters(remove_duplicate=False)}
    own = base.state_dict()
    wrong = [k for k, v in loaded.items() if not torch.equal(
        v, masters[alias.get(k, k)].to(v.dtype) if alias.get(k, k) in masters else own[k])]
    assert not wrong, f"{case}: loaded tensors that are not the checkpoint's masters (or the model's frozen): {wrong}"


@pytest.mark.asyncio
@pytest.mark.parametrize("case", CASES)
async def test_an_old_checkpoint_loads_and_resumes_to_the_old_trainers_weights(case, tmp_path):
    """The old checkpoint loads its masters (`check_loaded`) at its step and batch count; the
    resumed steps' losses and the end weights are those the old revision's trainer got going
    on from its save (bitwise on the machine that made them, README: resuming gives
    bit-identical weights; elsewhere within ROUNDING); the bf16 LoRA's within a tolerance
    (`check_bf16_lora`)."""
    meta = info(case)
    model, data = build(meta)
    manifest = json.loads((checkpoint(case) / "manifest.json").read_text())
    async with SnakeTrainer(model, data=data, config=make.snake_config(meta["config"], tmp_path / "off")) as t:
        await asyncio.wait_for(t.load(checkpoint(case)), TIMEOUT)
        assert t.engine is not None and t.engine.next_t == manifest["step"] == meta["steps_before"]
        assert t.source.consumed == manifest["consumed_batches"] == meta["steps_before"]
        # (the frozen base weights the model holds are not touched by the trainer: compared after)
        check_loaded(case, model, await t.state_dict())
        report = await asyncio.wait_for(t.run(meta["steps_after"]), TIMEOUT)
        end = await t.state_dict()
    if case == "r67136c2/lora-bf16":
        check_bf16_lora(case, report, end)
        return
    losses = [s.loss for s in report.steps]
    assert losses == pytest.approx(meta["losses"][meta["steps_before"]:], rel=ROUNDING, abs=0), (
        f"{case} (snake {meta['revision'][:7]}): resumed losses {losses}, the old trainer's "
        f"{meta['losses'][meta['steps_before']:]}")
    off = differences(end, meta["expected"])
    assert not off, f"{case} (snake {meta['revision'][:7]}): resumed weights not the old trainer's: {off}"


def check_bf16_lora(case: str, report, end: dict[str, torch.Tensor]) -> None:
    """A LoRA checkpoint of a bf16 model from before round 36, whose fp32 adapters streamed
    with their layer (computed in bf16, with a warning): snake now holds them with pre/post's
    and computes them in fp32 as PyTorch does (README, PEFT), their state read from the old
    layer files. The loaded adapters are the masters bitwise (`check_loaded`); the resumed run
    computes them otherwise, so its adapters are the old trainer's within bf16's rounding of
    two steps' updates (lr 1e-3: an update moves a weight by ~1e-3; bf16 activations round at
    ~4e-3 relative), not bitwise. Measured: the adapters within 3.5e-5 of the old trainer's
    (their largest 0.18), the losses within 1.5e-5 relative; bounds 1e-4 and 1e-4."""
    meta = info(case)
    want = load_file(str(FIX / case / "expected.safetensors"))
    assert want.keys() <= end.keys()
    for k, w in want.items():
        assert end[k].dtype == w.dtype, k
        torch.testing.assert_close(end[k], w, rtol=0, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    losses = [s.loss for s in report.steps]
    assert losses == pytest.approx(meta["losses"][meta["steps_before"]:], rel=1e-4)
    # the frozen bf16 base is the model's as it was
    assert not differences({k: v for k, v in end.items() if k not in want},
                           {k: v for k, v in meta["expected"].items() if k not in want})


# -- snake export of old checkpoints ---------------------------------------------------------
def export(args: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["export", *args])
    return rc, capsys.readouterr().err


def test_export_of_the_first_checkpoints_is_refused_saying_what_to_do(tmp_path, capsys):
    """Before 6113aa5 a checkpoint recorded no model config: export cannot build the model
    and says so (no traceback), with the way to the weights (read_masters)."""
    rc, err = export([str(checkpoint("r4164692/gpt")), "--hf", str(tmp_path / "out")], capsys)
    assert rc == 2 and "does not record its model's config" in err and "read_masters" in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    from snake.export import read_masters

    manifest, masters = read_masters(checkpoint("r4164692/gpt"))
    assert manifest["version"] == 1 and masters.keys() == set(info("r4164692/gpt")["trained"])
    # the refusal of an old PEFT checkpoint says it may be an earlier snake's and to save it
    # again with this one (test below); this one guesses "a custom ModelParts model?" of the
    # built-in GPT's checkpoint and leaves out that a load and save with this snake records
    # the config (which works: test_the_refusals_way_works_save_the_old_checkpoint_again)
    assert "before" in err and "save it again with this snake" in err, (
        "snake export's refusal of a checkpoint without model_config (snake/export.py, export_checkpoint_hf) "
        "says '(a custom ModelParts model?)' of the built-in GPT's checkpoint of an earlier snake (before "
        f"6113aa5 recorded the config) and not that saving it again with this snake makes it exportable: {err}")


@pytest.mark.parametrize("case", ["r6113aa5/llama", "r05ca321/gpt-horizontal", "r67136c2/gpt-fp16"])
def test_export_hf_of_an_old_checkpoint_computes_as_its_masters(case, tmp_path, capsys):
    """`snake export CHECKPOINT --hf DIR` of an old checkpoint: from_pretrained(DIR) holds the
    masters (GPT's as GPT-2's) and gives the logits of the model holding them."""
    from transformers import AutoModelForCausalLM

    meta = info(case)
    rc, err = export([str(checkpoint(case)), "--hf", str(tmp_path / "out")], capsys)
    assert rc == 0, f"{case}: export failed: {err}"
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).float().eval()
    model, _ = build(meta)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(stored(case)[n])
    model.eval()
    x = make.data_for(meta)[0][0]
    with torch.no_grad():
        want = model(x)
        want = getattr(want, "logits", want)
        got = exported(x).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_export_of_a_lora_checkpoint_before_the_peft_record_is_refused_saying_what_to_do(tmp_path, capsys):
    """67136c2's PEFT checkpoints hold no PEFT config (round 37's eb67e59 added it): --peft
    and --hf are refused naming what is missing, not a crash or a base without adapters."""
    ck = str(checkpoint("r67136c2/lora-bf16"))
    for flag in ("--peft", "--hf"):
        rc, err = export([ck, flag, str(tmp_path / flag.strip("-"))], capsys)
        assert rc == 2 and "Traceback" not in err, f"{flag}: {err}"
        assert "PEFT" in err and ck in err, f"{flag}: the refusal does not say what is missing: {err}"


def test_export_peft_of_an_old_lora_checkpoint_loads_into_peft(tmp_path, capsys):
    """eb619a9's LoRA checkpoint (its PEFT config recorded, no base): --peft writes the
    adapters PeftModel.from_pretrained loads onto the same base, as the masters; --hf is
    refused (the base is not stored), saying what to do."""
    from peft import PeftModel

    case = "reb619a9/lora-epochs"
    rc, err = export([str(checkpoint(case)), "--peft", str(tmp_path / "adapters")], capsys)
    assert rc == 0, err
    base = make.llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapters"))
    masters = stored(case)
    got = {n.replace("base_model.model.", "", 1).replace(".default", ""): p
           for n, p in peft_model.named_parameters() if "lora_" in n}
    assert got.keys() == {n.replace(".default", "") for n in masters}
    for n, p in masters.items():
        assert torch.equal(got[n.replace(".default", "")], p), n
    rc, err = export([str(checkpoint(case)), "--hf", str(tmp_path / "merged")], capsys)
    assert rc == 2 and "frozen" in err, err


# -- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize("version", [0, 3])
def test_a_checkpoint_of_a_version_this_snake_does_not_read_is_refused_naming_it(version, tmp_path):
    """README policy (snake/manifest.py): a version outside READS is refused by name, with
    the versions this snake reads, before anything is built."""
    from snake.manifest import READS, read_manifest

    ck = tmp_path / "ck"
    shutil.copytree(checkpoint("r05ca321/gpt-horizontal"), ck)
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["version"] = version
    (ck / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SnakeError) as e:
        read_manifest(ck)
    assert f"version {version}" in str(e.value) and ", ".join(map(str, READS)) in str(e.value)


# -- going on from an old checkpoint with today's snake ------------------------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("case", ["r4164692/gpt", "r67136c2/lora-bf16", "reb619a9/lora-epochs"])
async def test_an_old_checkpoint_saved_again_by_this_snake_goes_on_as_one_run(case, tmp_path, capsys):
    """Load an old checkpoint, one step, save (this snake's format: version 2, the held
    adapters' state in resident.safetensors, the data's state), load that into a new trainer,
    one step: the weights of the old trainer's two steps (bitwise; for the bf16 LoRA those
    of this snake's own two steps from the old checkpoint). The checkpoint saved again
    exports where the old one is refused (no model config; no PEFT config): the way the
    refusals give works."""
    meta = info(case)
    cfg = make.snake_config(meta["config"], tmp_path / "off")
    model, data = build(meta)
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        await asyncio.wait_for(t.load(checkpoint(case)), TIMEOUT)
        await asyncio.wait_for(t.run(1), TIMEOUT)
        await t.save(tmp_path / "again")
    manifest = json.loads((tmp_path / "again" / "manifest.json").read_text())
    assert manifest["version"] == 2 and manifest["step"] == 3 and manifest["model_config"] is not None
    flag = "--hf" if case == "r4164692/gpt" else "--peft"
    rc, err = export([str(tmp_path / "again"), flag, str(tmp_path / "out")], capsys)
    assert rc == 0, f"{case}: the checkpoint saved again by this snake does not export {flag}: {err}"
    model, data = build(meta)
    async with SnakeTrainer(model, data=data, config=make.snake_config(meta["config"], tmp_path / "off2")) as t:
        await asyncio.wait_for(t.load(tmp_path / "again"), TIMEOUT)
        await asyncio.wait_for(t.run(1), TIMEOUT)
        end = await t.state_dict()
    if case == "r67136c2/lora-bf16":
        _, _, want, _ = await resume(case, tmp_path / "direct")
        wrong = [k for k in want if not torch.equal(end[k], want[k])]
        assert not wrong, f"{case}: 1 + 1 steps through a save of this snake differ from 2 steps: {wrong}"
    else:
        off = differences(end, meta["expected"])
        assert not off, f"{case}: 1 + 1 steps through a save of this snake are not the old trainer's 2: {off}"


@pytest.mark.asyncio
async def test_an_old_checkpoint_takes_its_planned_fields_from_its_manifest(tmp_path):
    """micro_batches, alpha and placement left to the planner (None) are the old manifest's,
    and the run resumes bitwise (a version 1 manifest has no resident_optimizer nor grad share)."""
    import dataclasses

    case = "r4164692/gpt"
    meta = info(case)
    model, data = build(meta)
    cfg = dataclasses.replace(make.snake_config(meta["config"], tmp_path / "off"),
                              micro_batches=None, alpha=None, placement=None)
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        await asyncio.wait_for(t.load(checkpoint(case)), TIMEOUT)
        assert (t.config.micro_batches, t.config.alpha) == (2, 0.3)
        p = t.config.placement
        assert p is not None and (p.param, p.ckpt, p.opt) == (0.5, 0.5, 0.5)
        await asyncio.wait_for(t.run(meta["steps_after"]), TIMEOUT)
        end = await t.state_dict()
    assert not differences(end, meta["expected"])


@pytest.mark.asyncio
async def test_an_old_checkpoint_without_batch_shapes_at_its_datas_end(tmp_path):
    """Checkpoints before round 42 record no batch shapes: with data that has no batch after
    the checkpoint's, load() says why and what to do (README); load(skip_data=False) with the
    batches to go on with resumes bitwise."""
    from snake import DataExhausted

    case = "r4164692/gpt"
    meta = info(case)
    model, data = build(meta)
    n = meta["steps_before"]
    async with SnakeTrainer(model, data=data[:n], config=make.snake_config(meta["config"], tmp_path / "o1")) as t:
        with pytest.raises(DataExhausted) as e:
            await asyncio.wait_for(t.load(checkpoint(case)), TIMEOUT)
    assert "records no batch shapes" in str(e.value) and "skip_data=False" in str(e.value), str(e.value)
    model, data = build(meta)
    async with SnakeTrainer(model, data=data[n:], config=make.snake_config(meta["config"], tmp_path / "o2")) as t:
        await asyncio.wait_for(t.load(checkpoint(case), skip_data=False), TIMEOUT)
        await asyncio.wait_for(t.run(meta["steps_after"]), TIMEOUT)
        end = await t.state_dict()
    assert not differences(end, meta["expected"])
