"""Byte counters against the formulas of GreedySnake section 3."""

import pytest

from snake import Placement
from tests.helpers import batches, tiny_gpt, train

N, M = 4, 4


def _layer_bytes(model, esize=4):
    return model.config.block_params() * esize


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,loads", [("vertical", 2), ("horizontal", 2 * M)])
async def test_parameter_loads_per_iteration(tmp_path, schedule, loads):
    model = tiny_gpt(n_layer=N, bias=False)
    _, _, traffic = await train(
        model, batches(2, 2 * M), 2, micro_batches=M, offload_dir=tmp_path, placement=Placement.all_cpu(),
        alpha=0.0, schedule=schedule,
    )
    p = _layer_bytes(model)
    # vertical: each layer's parameters reach the device twice (forward, backward);
    # horizontal: twice per micro-batch
    assert traffic[("cpu", "gpu", "param")] == loads * N * p
    # gradients: once per layer (vertical) vs once per micro-batch and layer (horizontal)
    grad_moves = 1 if schedule == "vertical" else M
    assert traffic[("gpu", "cpu", "grad")] == grad_moves * N * p


@pytest.mark.asyncio
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_optimizer_states_on_ssd_read_and_written_once(tmp_path, alpha, schedule):
    model = tiny_gpt(n_layer=N, bias=False)
    _, _, traffic = await train(
        model, batches(3, 2 * M), 3, micro_batches=M, offload_dir=tmp_path,
        placement=Placement(param=1.0, ckpt=1.0, opt=0.0), alpha=alpha, schedule=schedule,
    )
    opt_bytes = N * model.config.block_params() * 12  # master + m + v, fp32
    assert traffic[("ssd", "cpu", "opt")] == opt_bytes
    assert traffic[("cpu", "ssd", "opt")] == opt_bytes
    assert ("ssd", "cpu", "param") not in traffic


@pytest.mark.asyncio
async def test_checkpoint_traffic_vertical(tmp_path):
    """Vertical: every block input is offloaded once; the forward reloads all but the
    carried one per layer after the first; the backward reloads all of them."""
    model = tiny_gpt(n_layer=N, bias=False)
    _, _, traffic = await train(
        model, batches(2, 2 * M), 2, micro_batches=M, offload_dir=tmp_path,
        placement=Placement(param=1.0, ckpt=0.5, opt=1.0), alpha=0.0,
    )
    ck = 2 * 16 * model.config.n_embd * 4  # micro-batch 2 x seq 16 x hidden, fp32
    assert traffic[("gpu", "cpu", "ckpt")] == N * M * ck
    assert traffic[("cpu", "gpu", "ckpt")] == (N - 1) * (M - 1) * ck + N * M * ck
    ssd_share = traffic[("cpu", "ssd", "ckpt")] / traffic[("gpu", "cpu", "ckpt")]
    assert ssd_share == pytest.approx(0.5, abs=0.01)
    # the SSD part of each checkpoint is read back once, for the recompute: the next
    # forward stage takes it from the CPU copy of the write (GreedySnake 4.2)
    assert traffic[("ssd", "cpu", "ckpt")] == traffic[("cpu", "ssd", "ckpt")]
    # inter-layer gradients: every one but the carried, through CPU memory only
    assert traffic[("cpu", "gpu", "act_grad")] == N * (M - 1) * ck
    assert not any(k[2] == "act_grad" and "ssd" in k[:2] for k in traffic)


@pytest.mark.asyncio
async def test_vertical_moves_less_than_horizontal(tmp_path):
    model = tiny_gpt(n_layer=N, n_embd=128, bias=False)
    kw = dict(micro_batches=M, placement=Placement(param=0.5, ckpt=0.5, opt=0.5), alpha=0.0)
    _, _, tv = await train(model, batches(2, M), 2, offload_dir=tmp_path / "v", schedule="vertical", **kw)
    _, _, th = await train(model, batches(2, M), 2, offload_dir=tmp_path / "h", schedule="horizontal", **kw)

    def gpu_link(t):
        return sum(v for (s, d, _), v in t.items() if "gpu" in (s, d))

    assert gpu_link(tv) < gpu_link(th) / 2


async def _d2h_activation_spans(tmp_path, placement, link=None):
    """Run 2 vertical steps; (traffic, d2h spans that copied a checkpoint or inter-layer gradient)."""
    import asyncio

    from snake import SnakeConfig, SnakeTrainer

    model = tiny_gpt(n_layer=N, bias=False)
    cfg = SnakeConfig(device="cpu", micro_batches=M, offload_dir=tmp_path, placement=placement, alpha=0.0,
                      device_link_bytes_per_s=link)
    async with SnakeTrainer(model, data=batches(2, 2 * M), config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(2), timeout=120)
        spans = [s for s in trainer.trace.spans if s.actor == "d2h" and s.name.startswith(("ckpt", "act_grad"))]
        return trainer.traffic(), spans


@pytest.mark.asyncio
@pytest.mark.parametrize("ckpt_share,link,d2h_units", [(1.0, None, 0), (0.5, None, N * M // 2), (1.0, 1e12, 0)])
async def test_cpu_device_writes_cpu_activations_on_the_compute_thread(tmp_path, ckpt_share, link, d2h_units):
    """On a CPU device the compute job writes activations whose units live wholly in CPU
    memory into them itself (Engine.inline_store): d2h copies none of them, also under an
    emulated link (test_link_cap checks that the link still charges them). Checkpoint units
    on SSD (whole units: half of them at share 0.5) still go through d2h. The bytes counted
    are the same either way (parity tests check the bytes themselves)."""
    traffic, spans = await _d2h_activation_spans(
        tmp_path, Placement(param=1.0, ckpt=ckpt_share, opt=1.0), link=link)
    ck = 2 * 16 * tiny_gpt(n_layer=N, bias=False).config.n_embd * 4
    assert traffic[("gpu", "cpu", "ckpt")] == N * M * ck
    assert traffic[("gpu", "cpu", "act_grad")] > 0
    ckpt_spans = [s for s in spans if s.name.startswith("ckpt")]
    grad_spans = [s for s in spans if s.name.startswith("act_grad")]
    assert len(ckpt_spans) == 2 * d2h_units  # two steps
    # inter-layer gradients always live in CPU memory: d2h never copies them
    assert not grad_spans


@pytest.mark.asyncio
@pytest.mark.parametrize("in_slots", [True, False])
async def test_cpu_device_optimizer_steps_from_the_gradient_slot(tmp_path, monkeypatch, in_slots):
    """Vertical on a CPU device: each layer's accumulated gradient reaches its optimizer
    worker in the gradient slot it was accumulated in (Engine.slot_grads), so d2h makes no
    copy of it (with `grads_in_slots` off it copies each layer once per step); the bytes
    counted and the weights are the same either way, with a delayed share that the step
    scatters out of the slot, and every slot is back in its pool at the end."""
    import asyncio

    from snake import SnakeConfig, SnakeTrainer
    from snake.engine import Engine
    from tests.helpers import assert_close_state, reference

    monkeypatch.setattr(Engine, "grads_in_slots", in_slots)
    model = tiny_gpt(n_layer=N, bias=False)
    data = batches(2, 2 * M)
    want, _ = reference(model, data, M)
    cfg = SnakeConfig(device="cpu", micro_batches=M, offload_dir=tmp_path, alpha=0.3,
                      placement=Placement(param=1.0, ckpt=1.0, opt=0.5))
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(2), timeout=120)
        spans = [s for s in trainer.trace.spans if s.actor == "d2h" and s.name.startswith("grads")]
        traffic = trainer.traffic()
        got = await trainer.state_dict()
    assert len(spans) == (0 if in_slots else 2 * N)
    assert traffic[("gpu", "cpu", "grad")] == N * _layer_bytes(model)
    assert_close_state(got, want)


@pytest.mark.asyncio
@pytest.mark.parametrize("keep", [True, False])
async def test_cpu_device_makes_each_unit_view_once(tmp_path, monkeypatch, keep):
    """On a CPU device h2d hands compute views of the stores (parameters, checkpoints and
    inter-layer gradients in CPU memory) and compute writes activations into views of
    their units: each is made on first use and kept (Engine.unit_views), so a second run
    makes none on the event loop, and still trains as PyTorch does. With
    `keep_unit_views` off (the benchmarks' A/B) every use makes its own."""
    import asyncio

    import snake.actors.device_mover as dm
    from snake import SnakeConfig, SnakeTrainer
    from snake.engine import Engine
    from tests.helpers import assert_close_state, reference

    monkeypatch.setattr(Engine, "keep_unit_views", keep)

    model = tiny_gpt(n_layer=N, bias=False)
    data = batches(2, 2 * M)
    want, _ = reference(model, data, M)
    made = []
    real = dm.alias
    monkeypatch.setattr(dm, "alias", lambda *a: made.append(a) or real(*a))
    cfg = SnakeConfig(device="cpu", micro_batches=M, offload_dir=tmp_path, alpha=0.0, placement=Placement.all_cpu())
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(1), timeout=120)
        first = len(made)
        engine = trainer.engine
        assert engine is not None
        views = dict(engine.unit_views)
        await asyncio.wait_for(trainer.run(1), timeout=120)
        assert engine.unit_views.keys() == views.keys()
        assert all(engine.unit_views[k] is v for k, v in views.items())
        got = await trainer.state_dict()
    assert first > 0
    assert len(made) == (first if keep else 2 * first)
    assert_close_state(got, want)
