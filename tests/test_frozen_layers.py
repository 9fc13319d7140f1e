"""Layers that train nothing they stream: frozen layers (the usual fine-tune that freezes
the bottom of the model), and layers whose only trained parameters are held on the device
in float32 (PEFT's adapters of a bfloat16 model, tests/test_peft.py). Their frozen weights
stream with the layer; their loads, steps and saves move no trained element, and the
weights are plain PyTorch's for every schedule, placement and delay ratio."""

import pytest
import torch

from snake import AdamW, ModelError, Placement
from snake.engine import Engine
from tests.helpers import (
    assert_close_state,
    batches,
    reference,
    schedule_alpha_placement,
    straight_and_resumed,
    tiny_gpt,
    train,
)


def frozen(layers: tuple[int, ...], n_layer: int = 4, embeddings: tuple[str, ...] = (), **kw):
    """tiny_gpt with blocks `layers` frozen, and of its embeddings those named ("wte",
    tied to the head, and "wpe")."""
    model = tiny_gpt(n_layer=n_layer, bias=False, **kw)
    for i in layers:
        for p in model.blocks[i].parameters():
            p.requires_grad_(False)
    for name in embeddings:
        getattr(model, name).weight.requires_grad_(False)
    return model


async def train_seeing_stages(model, data, steps: int, **config):
    """`train`, also returning the layers whose backward the iteration ran."""
    import asyncio

    from snake import SnakeConfig, SnakeTrainer

    async with SnakeTrainer(model, data=data, config=SnakeConfig(device="cpu", **config)) as t:
        report = await asyncio.wait_for(t.run(steps), timeout=120)
        state = await t.state_dict()
        assert t.engine is not None
        bwd = sorted({s.layer for s in t.engine.stages if s.phase == "bwd"})
    return state, report, bwd


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha,placement", schedule_alpha_placement())
@pytest.mark.parametrize("layers", [(0, 2), (1, 2, 3), (0, 1, 2, 3)])
async def test_frozen_layers_match_plain_pytorch(tmp_path, schedule, alpha, placement, layers):
    model = frozen(layers)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = batches(3, 6)
    want, want_losses = reference(model, data, 3)
    got, report, _ = await train(model, data, 3, micro_batches=3, offload_dir=tmp_path / "off",
                                 placement=placement, alpha=alpha, schedule=schedule)
    assert_close_state(got, want)
    assert [s.loss for s in report.steps] == pytest.approx(want_losses, abs=1e-5)
    for k, v in got.items():
        if any(k.startswith(f"blocks.{i}.") for i in layers):
            assert torch.equal(v, before[k]), k  # frozen: bit for bit as they were
        elif k.startswith("blocks."):
            assert not torch.equal(v, before[k]), k


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha,placement", schedule_alpha_placement())
@pytest.mark.parametrize("layers,embeddings,lowest", [
    ((0, 1), ("wte", "wpe"), 2),  # nothing trains below layer 2: no backward there
    ((0, 1), ("wpe",), 0),        # the token embedding (tied to the head) trains: down to pre
    ((0, 1, 2, 3), ("wte", "wpe"), 3),  # only the final norm trains: the top layer's backward, no recompute
])
async def test_no_backward_below_what_trains(tmp_path, schedule, alpha, placement, layers, embeddings, lowest):
    """With the embedding frozen too, the backward stops at the lowest layer that trains
    anything, as autograd's does (no recompute, backward or input gradient below it: a third
    of a frozen layer's compute in the forward only); the weights are plain PyTorch's."""
    model = frozen(layers, embeddings=embeddings)
    data = batches(3, 6)
    want, want_losses = reference(model, data, 3)
    got, report, bwd = await train_seeing_stages(model, data, 3, micro_batches=3, offload_dir=tmp_path / "off",
                                                 placement=placement, alpha=alpha, schedule=schedule)
    assert bwd == list(range(lowest, 4))
    assert_close_state(got, want)
    assert [s.loss for s in report.steps] == pytest.approx(want_losses, abs=1e-5)


@pytest.mark.asyncio
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("embeddings", [(), ("wte", "wpe")], ids=["embeddings-trained", "embeddings-frozen"])
async def test_frozen_layers_on_the_paths_a_gpu_takes(tmp_path, monkeypatch, alpha, embeddings):
    """With the CPU device's shortcuts off (the optimizer on its worker threads, gradients
    and stores copied, not aliased), as on a GPU: the zero-element steps and copies too."""
    for flag in ("optimizer_on_compute", "grads_in_slots", "inline_stores", "keep_unit_views"):
        monkeypatch.setattr(Engine, flag, False)
    model = frozen((0, 2), embeddings=embeddings)
    data = batches(3, 6)
    want, _ = reference(model, data, 3)
    got, _, _ = await train(model, data, 3, micro_batches=3, offload_dir=tmp_path / "off",
                            placement=Placement(param=0.5, ckpt=0.3, opt=0.6), alpha=alpha)
    assert_close_state(got, want)


@pytest.mark.asyncio
@pytest.mark.parametrize("embeddings", [(), ("wte", "wpe")], ids=["embeddings-trained", "embeddings-frozen"])
async def test_frozen_layers_with_clipping_match_plain_pytorch(tmp_path, embeddings):
    """The global gradient norm over what is trained: the frozen layers add nothing (and
    with the embeddings frozen, the layers without a backward are not waited for)."""
    model = frozen((0, 2), embeddings=embeddings)
    data = batches(3, 6)
    norms: list[float] = []
    want, _ = reference(model, data, 3, max_norm=0.3, norms=norms)
    got, report, _ = await train(model, data, 3, micro_batches=3, offload_dir=tmp_path / "off",
                                 placement=Placement(param=0.5, ckpt=0.3, opt=0.6), alpha=1.0,
                                 optimizer=AdamW(max_grad_norm=0.3))
    assert_close_state(got, want)
    assert [s.grad_norm for s in report.steps] == pytest.approx(norms, rel=1e-5)


@pytest.mark.asyncio
@pytest.mark.parametrize("embeddings", [(), ("wte", "wpe")], ids=["embeddings-trained", "embeddings-frozen"])
async def test_frozen_layers_resume_where_they_stopped(tmp_path, embeddings):
    model = frozen((0, 2), embeddings=embeddings)
    data = batches(4, 6)
    straight, resumed, _, _ = await straight_and_resumed(
        tmp_path, model, data, 2, 2, micro_batches=3, placement=Placement(param=0.5, ckpt=0.3, opt=0.6), alpha=0.3)
    assert_close_state(resumed, straight, rtol=0, atol=0)


@pytest.mark.asyncio
async def test_frozen_layers_evaluate_the_trained_model(tmp_path):
    """evaluate() streams a layer of no trained elements as training does: its loss is
    plain PyTorch's on the trained weights."""
    import asyncio

    from snake import SnakeConfig, SnakeTrainer

    model = frozen((0, 2), embeddings=("wte", "wpe"))
    data, held_out = batches(2, 6), batches(2, 6, seed=5)
    want, _ = reference(model, data, 3)
    cfg = SnakeConfig(device="cpu", offload_dir=tmp_path / "off", micro_batches=3, alpha=0.3,
                      placement=Placement(param=0.5, ckpt=0.3, opt=0.6))
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        await asyncio.wait_for(t.run(2), timeout=60)
        report = await t.evaluate(held_out)
    trained = frozen((0, 2), embeddings=("wte", "wpe"))
    trained.load_state_dict(want)
    with torch.no_grad():
        logits = torch.cat([trained(x) for x, _ in held_out])
    targets = torch.cat([y for _, y in held_out])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    assert report.loss == pytest.approx(float(loss), abs=1e-5)


@pytest.mark.asyncio
async def test_a_model_that_trains_nothing_is_refused(tmp_path):
    model = tiny_gpt(n_layer=2)
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ModelError, match=r"no parameter requires grad.*requires_grad_\(True\)"):
        await train(model, batches(1, 2), 1, micro_batches=1, offload_dir=tmp_path / "off")
    assert not (tmp_path / "off").exists()


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["load_hf", "stream_hf"])
async def test_a_hugging_face_fine_tune_of_the_top_layers(tmp_path, how):
    """Llama with its embedding and bottom layer frozen (the head untied, trained): the
    backward stops at layer 1; loaded whole or streamed from its files (the frozen layer's
    weights through snake's mapped file). Plain PyTorch's weights."""
    from snake.hf import load_hf, stream_hf
    from tests.test_hf import VOCAB, assert_matches, make
    from tests.test_hf import reference as hf_reference

    make("llama").save_pretrained(str(tmp_path / "m"))

    def tuned(model):
        model.model.embed_tokens.requires_grad_(False)
        model.model.layers[0].requires_grad_(False)
        return model

    data = batches(3, 4, seq=16, vocab=VOCAB)
    want = hf_reference(tuned(load_hf(tmp_path / "m")), data, 2)
    model = tuned(load_hf(tmp_path / "m") if how == "load_hf" else stream_hf(tmp_path / "m"))
    got, _, bwd = await train_seeing_stages(model, data, 3, micro_batches=2, offload_dir=tmp_path / "off",
                                            placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.3)
    assert bwd == [1, 2]
    assert_matches(got, want)


async def _top_fine_tune(tmp_path, schedule: str, alpha: float, placement: Placement) -> dict:
    """Three steps of `frozen((0, 1))` with its embeddings frozen too (the backward down to
    layer 2): the last iteration's traffic, the weights and PyTorch's, each layer's
    checkpoint SSD bytes (its tails) and a checkpoint's bytes."""
    import asyncio

    from snake import SnakeConfig, SnakeTrainer

    model = frozen((0, 1), embeddings=("wte", "wpe"))
    data = batches(3, 6)
    want, _ = reference(model, data, 3)
    cfg = SnakeConfig(device="cpu", offload_dir=tmp_path / "off", micro_batches=3, alpha=alpha, schedule=schedule,
                      placement=placement)
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        await asyncio.wait_for(t.run(3), timeout=60)
        store = t.engine.stores["ckpt"]
        out = {"traffic": t.traffic(), "got": await t.state_dict(), "want": want,
               "tails": {layer: sum(store.tail_bytes(u) for (lay, _m), u in store.units.items() if lay == layer)
                         for layer in range(4)},
               "unit": t.engine.ckpt_elems * store.esize}
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_checkpoints_no_backward_reads_are_not_written_to_ssd(tmp_path, schedule):
    """Below the lowest layer with a backward a checkpoint only feeds the next forward
    stage, from CPU memory: its SSD part is handed on unwritten. The SSD writes of the last
    iteration are the checkpoints of the layers with a backward, and nothing is read back
    but theirs; the weights are PyTorch's."""
    run = await _top_fine_tune(tmp_path, schedule, 0.0, Placement(param=1.0, ckpt=0.0, opt=1.0))
    tails = run["tails"]
    assert all(tails.values())  # every checkpoint has an SSD part
    assert run["traffic"][("cpu", "ssd", "ckpt")] == tails[2] + tails[3]
    assert run["traffic"][("ssd", "cpu", "ckpt")] == tails[2] + tails[3]
    assert_close_state(run["got"], run["want"])


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_only_the_checkpoints_a_stage_loads_are_stored(tmp_path, schedule):
    """Below the lowest layer with a backward a checkpoint is stored only where the next
    forward stage loads it (vertical: not the micro-batch that stays on the device between
    the stages; horizontal: none, the output stays on the device), and layer 0's input not
    at all: the device-to-host checkpoint bytes of the last iteration are those."""
    run = await _top_fine_tune(tmp_path, schedule, 0.3, Placement(param=0.5, ckpt=0.5, opt=0.5))
    # layers 2 and 3 (a backward each): every micro-batch's input; layer 1: vertical's two
    # loaded by its forward stage; layer 0: none
    stored = 2 * 3 + (2 if schedule == "vertical" else 0)
    assert run["traffic"][("gpu", "cpu", "ckpt")] == stored * run["unit"]
    assert_close_state(run["got"], run["want"])


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_float16_dynamic_scale_with_no_backward_below_layer_1(tmp_path, schedule):
    """float16's dynamic loss scale decides from the norms of the layers with a backward
    and the head's: the same skipped steps, scales and weights as torch.amp.GradScaler."""
    from snake import Placement as P
    from tests.helpers import mixed_reference
    from tests.test_loss_scale import OVERFLOWS, assert_masters, fp16_gpt, grad_scaler

    model = fp16_gpt(n_layer=3)
    for p in [model.wte.weight, model.wpe.weight, *model.blocks[0].parameters()]:
        p.requires_grad_(False)
    data = batches(6, 4)
    scales: list[tuple[float, bool]] = []
    want = mixed_reference(model, data, 2, scaler=grad_scaler(OVERFLOWS), scales=scales, fused=True)
    assert any(s for _, s in scales) and not all(s for _, s in scales)
    got, report, bwd = await train_seeing_stages(model, data, 6, micro_batches=2, offload_dir=tmp_path / "off",
                                                 placement=P(param=0.5, ckpt=0.3, opt=0.6), alpha=1.0,
                                                 schedule=schedule, dtype="float16", loss_scale=OVERFLOWS)
    assert bwd == [1, 2]
    assert [(s.loss_scale, s.skipped) for s in report.steps] == scales
    assert_masters(got, want)
