"""The compute kernels' plumbing: binding a device slot into the shell block (a weight shared
inside a block is bound at every place it is used) and reproducible per-(iteration, layer,
micro-batch) dropout that leaves the caller's RNG state alone."""

import torch
from torch import nn

from snake import SnakeConfig
from snake.adapters import ModelParts, layer_specs
from snake.kernels import Kernels


class TiedBlock(nn.Module):
    """in and out projections share one weight (transposed on the way out)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.out.weight = self.inp.weight
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.inp(x))) * self.scale


class Tiny(nn.Module):
    def __init__(self, d: int = 8, n: int = 2, vocab: int = 11) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(TiedBlock(d) for _ in range(n))
        self.head = nn.Linear(d, vocab, bias=False)


def _kernels(model: Tiny) -> Kernels:
    parts = ModelParts(
        model=model, blocks=list(model.blocks), blocks_prefix="blocks",
        pre=lambda m, idx: m.emb(idx), post=lambda m, h: m.head(h),
    )
    return Kernels(parts, SnakeConfig(offload_dir=".", micro_batches=1), torch.device("cpu"), 1)


def test_shared_weight_bound_everywhere_and_gradients_match():
    torch.manual_seed(0)
    model = Tiny()
    k = _kernels(model)
    names = [n for n, _ in layer_specs(k.parts)[0]]
    assert sorted(names) == ["inp.weight", "scale"]  # the shared weight appears once
    blk = model.blocks[1]
    slot = torch.cat([p.detach().reshape(-1) for p in blk.parameters()])
    x = torch.randn(2, 3, 8)
    gy = torch.randn_like(x)

    y = k.block_fwd(slot, x, 0, 1, 0)
    torch.testing.assert_close(y, blk(x).detach())

    acc = torch.zeros_like(slot)
    gx = k.block_bwd(slot, x, gy, acc, t=0, layer=1, m=0, accumulate=False)
    xr = x.clone().requires_grad_(True)
    blk(xr).backward(gy)
    want = torch.cat([p.grad.reshape(-1) for p in blk.parameters()])  # tied weight: both uses summed
    torch.testing.assert_close(acc, want)
    torch.testing.assert_close(gx, xr.grad)
    # the shell's two sites hold the same tensor (the slot's view), not a stale copy
    shell = k.calls[0].block
    assert shell.inp.weight is shell.out.weight


def test_rng_is_per_call_and_restores_callers_state():
    k = _kernels(Tiny())
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with k.rng(3, 1, 2):
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)
    with k.rng(3, 1, 2):
        b = torch.rand(4)
    with k.rng(3, 1, 3):
        c = torch.rand(4)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_every_block_call_sees_its_weights_require_a_gradient():
    """The forward, the recompute and an evaluation call a block with weights that require a
    gradient, as PyTorch's training step and eval loss do: torch picks some kernels by it
    (matmul folds a non-contiguous 3-d input for such a weight), and a forward that did not
    stored checkpoints the recompute did not reproduce (a bf16 Mamba on an AMD CPU)."""
    seen: list[bool] = []

    class Probe(TiedBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(self.inp.weight.requires_grad and self.scale.requires_grad)
            return super().forward(x)

    model = Tiny()
    model.blocks = nn.ModuleList(Probe(8) for _ in range(2))
    k = _kernels(model)
    slot = torch.cat([p.detach().reshape(-1) for p in model.blocks[0].parameters()])
    x = torch.randn(2, 3, 8)
    k.block_fwd(slot, x, 0, 0, 0)
    k.block_bwd(slot, x, torch.randn_like(x), torch.zeros_like(slot), t=0, layer=0, m=0, accumulate=False)
    with k.eval_mode():
        k.eval_block(slot, x, 0)
    assert seen == [True, True, True]


def test_a_frozen_tensor_is_compared_a_chunk_at_a_time():
    """`outer_as_computed`'s comparison of the model's tensor with the trainer's copy (in its
    own dtype) goes chunk by chunk, and sees a change in any chunk, the last one too."""
    from snake.kernels import _same_values

    live = torch.randn(5, 7)
    copy = live.to(torch.bfloat16)
    assert _same_values(live, copy, chunk=4)
    changed = live.clone()
    changed[-1, -1] += 1.0
    assert not _same_values(changed, copy, chunk=4)
    assert not _same_values(live.reshape(7, 5), copy, chunk=4)


def test_kernels_go_when_dropped_without_the_cyclic_collector():
    """The planner's probes build kernels and drop them: nothing in them refers back to them
    (a reference cycle through the resident state kept a probe's copies of the embedding and
    head alive until the cyclic collector ran: 110 MiB of RSS at a 16k vocabulary, which took
    a planned run over its cpu_memory_bytes in tests/test_memory_budget.py)."""
    import gc
    import weakref

    k = _kernels(Tiny())
    gone = weakref.ref(k)
    gc.disable()
    try:
        del k
        assert gone() is None
    finally:
        gc.enable()
