"""Where vertical keeps the delayed (alpha) gradients between the backward and the next
iteration's delayed step (GreedySnake 4.4): in the memory of the layer's CPU-resident
delayed parameters, which are stale meanwhile, and in dedicated memory only for the rest.
The runtime's allocation must match the planner's memory model, and training must still
match plain PyTorch (tests/test_parity.py covers alpha > 0 for every placement)."""

import pytest
import torch

from snake import Placement, SnakeConfig, SnakeTrainer
from snake.actors.optimizer import _aligned
from snake.memory import ModelShape, host_memory
from tests.helpers import assert_close_state, batches, reference, tiny_gpt


def _room(engine):
    """(bytes inside the param store's CPU memory, dedicated bytes) of all delayed rooms."""
    store = engine.stores["param"]
    lo = store.cpu.untyped_storage().data_ptr()
    hi = lo + store.cpu_bytes()
    inside = dedicated = 0
    for room in engine.delayed_grads:
        for piece in room:
            nbytes = piece.numel() * 4
            if lo <= piece.data_ptr() < hi:
                assert piece.data_ptr() + nbytes <= hi
                inside += nbytes
            else:
                dedicated += nbytes
    return inside, dedicated


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("param", "dtype", "dedicated_fraction"),
    [(1.0, "float32", 0.0), (0.5, "float32", 0.5), (0.0, "float32", 1.0), (1.0, "bfloat16", 0.5)],
)
@pytest.mark.parametrize("alpha", [0.25, 1.0])
async def test_delayed_gradients_reuse_param_memory(tmp_path, param, dtype, dedicated_fraction, alpha):
    model = tiny_gpt(n_layer=3, n_embd=64, bias=False)
    cfg = SnakeConfig(
        micro_batches=2, offload_dir=tmp_path, placement=Placement(param=param, ckpt=1.0, opt=0.5),
        alpha=alpha, schedule="vertical", device="cpu", dtype=dtype,
    )
    async with SnakeTrainer(model, data=batches(3, 4), config=cfg) as trainer:
        await trainer.run(2)
        e = trainer.engine
        assert e is not None
        inside, dedicated = _room(e)
        n_del = e.layer_parts[0][1]
        total = e.N * n_del * 4
        assert inside + dedicated == total
        # a few elements of slack per layer: rounding of the head and 4-byte alignment
        assert dedicated == pytest.approx(dedicated_fraction * total, abs=8 * e.N)
        # the planner's model charges the same dedicated bytes
        db = torch.empty((), dtype=e.dtype).element_size()
        shape = ModelShape(n_layers=e.N, layer_params=e.P, ckpt_elems=e.ckpt_elems, resident_params=0,
                           tokens_per_micro=1, dtype_bytes=db, vocab_size=0)
        with_alpha = host_memory(shape, n_micro=2, alpha=e.alpha, schedule="vertical", workers=2)
        without = host_memory(shape, n_micro=2, alpha=0.0, schedule="vertical", workers=2)
        x = (param, 1.0, 0.5)
        modelled = with_alpha.at(*x) - without.at(*x)
        assert modelled == pytest.approx(dedicated, rel=0.02, abs=8 * e.N)


async def _vertical(tmp_path, data, steps, micro, alpha, dtype):
    cfg = SnakeConfig(
        micro_batches=micro, offload_dir=tmp_path, placement=Placement(param=1.0, ckpt=1.0, opt=0.5),
        alpha=alpha, schedule="vertical", device="cpu", dtype=dtype,
    )
    async with SnakeTrainer(tiny_gpt(n_layer=3, n_embd=64, bias=False), data=data, config=cfg) as trainer:
        await trainer.run(steps)
        return await trainer.state_dict()


@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_delayed_steps_from_reused_memory_match_undelayed(tmp_path, dtype):
    """Several iterations, so every delayed step reads gradients that were written over the
    delayed parameters, and the forward after it reads the parameters written back: the
    weights equal those of alpha = 0 (AdamW is element-wise), and fp32 equals PyTorch."""
    steps, micro = 4, 2
    data = batches(steps, 4)
    delayed = await _vertical(tmp_path / "a", data, steps, micro, 0.4, dtype)
    undelayed = await _vertical(tmp_path / "b", data, steps, micro, 0.0, dtype)
    assert_close_state(delayed, undelayed, rtol=0, atol=0)
    if dtype == "float32":
        want, _ = reference(tiny_gpt(n_layer=3, n_embd=64, bias=False), data, micro)
        assert_close_state(delayed, want)


def test_aligned_cuts_at_every_boundary():
    a = torch.arange(10.0)
    runs = [[a[:4], a[4:]], [a[:0], a[:7], a[7:]], [a[:2], a[2:5], a[5:10]]]
    cuts = _aligned(runs)
    assert [c[0].numel() for c in cuts] == [2, 2, 1, 2, 3]
    for c in cuts:
        assert all(torch.equal(c[0], t) for t in c[1:])
    with pytest.raises(AssertionError):
        _aligned([[a[:3]], [a[:4]]])
