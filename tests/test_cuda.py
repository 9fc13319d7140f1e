"""The CUDA path (pinned buffers, copy stream, kvikio when its driver is there): parity with
plain PyTorch on the same GPU. Skipped on machines without CUDA (CI has none)."""

import pytest
import torch

from snake import AdamW, Placement, SnakeConfig, SnakeTrainer
from tests.helpers import assert_tracks_updates, batches, mixed_reference, reference, tiny_gpt

PLACEMENTS = {
    "mixed": (Placement(param=0.5, ckpt=0.5, opt=0.5), 0.3),
    # a Placement gives the CPU share: 0 is all on SSD
    "all-ssd": (Placement(param=0.0, ckpt=0.0, opt=0.0), 0.0),
    "all-cpu": (Placement(param=1.0, ckpt=1.0, opt=1.0), 0.5),
    "all-delayed": (Placement(param=0.5, ckpt=0.5, opt=0.5), 1.0),  # no now-step elements
    # the waiting gradients beyond the stale params on SSD, through pinned staging buffers
    "grads-on-ssd": (Placement(param=0.5, ckpt=0.5, opt=0.5, grad=0.0), 1.0),
}


@pytest.mark.cuda
@pytest.mark.asyncio
@pytest.mark.parametrize("where", sorted(PLACEMENTS))
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_parity_on_cuda(tmp_path, schedule, where):
    await _parity(tmp_path, schedule, where, "auto")


@pytest.mark.cuda
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["posix", "kvikio"])
async def test_parity_on_cuda_with_each_storage_backend(tmp_path, backend):
    """auto picks kvikio where it works: posix (O_DIRECT into pinned buffers) on CUDA too.
    Where kvikio or its driver is missing, asking for it is a ConfigError naming the field."""
    from snake import ConfigError
    from snake.io.kvikio_file import kvikio_usable

    if backend == "kvikio" and not kvikio_usable():
        with pytest.raises(ConfigError, match="storage_backend"):
            await _parity(tmp_path, "vertical", "all-ssd", backend)
        return
    await _parity(tmp_path, "vertical", "all-ssd", backend)


@pytest.mark.cuda
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["posix", "auto"])
async def test_resident_optimizer_on_ssd_on_cuda(tmp_path, monkeypatch, backend):
    """The embedding's and head's optimizer state on SSD: chunks staged in pinned buffers,
    gradients copied from the device and masters back per chunk; the weights of PyTorch."""
    monkeypatch.setattr("snake.memory.RESIDENT_CHUNK_ELEMS", 1024)
    await _parity(tmp_path, "vertical", "mixed", backend, resident_optimizer="ssd")


@pytest.mark.cuda
@pytest.mark.asyncio
@pytest.mark.parametrize("resident", ["cpu", "ssd"])
async def test_lr_schedule_and_no_decay_on_cuda(tmp_path, monkeypatch, resident):
    """A learning-rate schedule and a group without weight decay step the streamed layers
    and the resident state (staged through the pinned gradient buffer, or on SSD) as torch's
    AdamW with LambdaLR and two parameter groups does."""
    from snake.optim import biases_and_norms

    monkeypatch.setattr("snake.memory.RESIDENT_CHUNK_ELEMS", 1024)
    await _parity(tmp_path, "vertical", "mixed", "auto", resident_optimizer=resident,
                  lr_lambda=lambda i: (1.0, 0.1, 2.0, 0.5)[i], no_decay=biases_and_norms)


@pytest.mark.cuda
@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("resident", ["cpu", "ssd"])
async def test_clipping_on_cuda(tmp_path, monkeypatch, schedule, resident):
    """Clipping by the global norm: each layer's norms from the gradient's host copy, the
    resident ones on the GPU, every step delayed (alpha = 1)."""
    monkeypatch.setattr("snake.memory.RESIDENT_CHUNK_ELEMS", 1024)
    await _parity(tmp_path, schedule, "all-delayed", "auto", resident_optimizer=resident, max_norm=0.3)


async def _parity(tmp_path, schedule, where, backend, *, width=64, micro=3, batch=6, seq=16,  # type: ignore[no-untyped-def]
                  resident_optimizer="cpu", lr_lambda=None, no_decay=None, max_norm=None, frozen=(), embeddings=()):
    """Three iterations of snake and of PyTorch on the GPU: the same losses and weights.
    `frozen` blocks and `embeddings` ("wte", "wpe") frozen. Returns snake's trace spans."""
    placement, alpha = PLACEMENTS[where]
    model = tiny_gpt(n_layer=4, n_embd=width, bias=False)
    for i in frozen:
        model.blocks[i].requires_grad_(False)
    for name in embeddings:
        getattr(model, name).weight.requires_grad_(False)
    data = batches(3, batch, seq=seq)
    # the reference runs on the same GPU: against a CPU reference, cuBLAS's rounding moved
    # one weight in 16,384 by 4e-5 after 3 AdamW steps (Adam divides by sqrt(v), so a tiny
    # gradient difference in a weight with a tiny v is magnified)
    wd = 0.01 if no_decay is None else 0.5  # large: a weight decayed or not differs far beyond the tolerance
    norms: list[float] = []
    want, want_losses = reference(model, data, micro, device="cuda", lr_lambda=lr_lambda, no_decay=no_decay, wd=wd,
                                  max_norm=max_norm, norms=norms)
    cfg = SnakeConfig(
        micro_batches=micro, offload_dir=tmp_path, placement=placement, alpha=alpha, schedule=schedule, device="cuda",
        storage_backend=backend, resident_optimizer=resident_optimizer, optimizer=AdamW(weight_decay=wd, lr_schedule=lr_lambda, no_decay=no_decay, max_grad_norm=max_norm),
    )
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        report = await trainer.run(3)
        if resident_optimizer == "ssd":
            assert trainer.engine.kernels.resident.gstage.is_pinned()
        got = await trainer.state_dict()
        spans = list(trainer.trace.spans)
    assert [s.loss for s in report.steps] == pytest.approx(want_losses, rel=1e-5)
    if max_norm is not None:
        assert [s.grad_norm for s in report.steps] == pytest.approx(norms, rel=1e-5)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    return spans


@pytest.mark.cuda
@pytest.mark.asyncio
@pytest.mark.parametrize("where", sorted(PLACEMENTS))
@pytest.mark.parametrize("embeddings", [(), ("wte", "wpe")], ids=["embeddings-trained", "embeddings-frozen"])
async def test_frozen_layers_on_cuda(tmp_path, where, embeddings):
    """Frozen blocks (layers of no trained elements: their frozen weights through the
    pinned slots, zero-element copies and steps) and, with the embeddings frozen, no
    backward below layer 2 (tests/test_frozen_layers.py on the CPU)."""
    await _parity(tmp_path, "vertical", where, "auto", frozen=(0, 1), embeddings=embeddings,
                  max_norm=0.3 if PLACEMENTS[where][1] == 1.0 else None)


@pytest.mark.cuda
@pytest.mark.asyncio
async def test_copy_directions_have_their_own_threads_on_cuda(tmp_path):
    """Host -> device loads do not queue behind device -> host copies (and horizontal's CPU
    gradient adds) on CUDA; on a CPU device both share one thread (tests/test_threads.py)."""
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=Placement(param=0.5, ckpt=0.5, opt=0.5),
                      alpha=0.0, schedule="horizontal", device="cuda")
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(2, 4), config=cfg) as trainer:
        await trainer.run(2)
        ex = trainer.engine.executors
        assert ex["h2d"] is not ex["copy"]
        assert trainer.engine.grad_staging is not None and trainer.engine.grad_staging.is_pinned()


@pytest.mark.cuda
@pytest.mark.asyncio
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
async def test_mixed_precision_on_cuda_tracks_fp32(tmp_path, dtype):
    """Low-precision compute on the GPU with fp32 masters on the CPU stays close to PyTorch's
    fp32 training on the same GPU (the bound of the CPU test, tests/test_parity.py)."""
    model = tiny_gpt(n_layer=2, bias=False)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = batches(3, 4)
    want, want_losses = reference(model, data, 2, device="cuda")
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=PLACEMENTS["mixed"][0], alpha=0.3,
                      dtype=dtype, device="cuda")
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        report = await trainer.run(3)
        got = await trainer.state_dict()
    assert all(v.dtype == torch.float32 for v in got.values())
    assert [s.loss for s in report.steps] == pytest.approx(want_losses, abs=5e-3)
    assert_tracks_updates({k: v.cpu() for k, v in got.items()}, {k: v.cpu() for k, v in want.items()}, init)


@pytest.mark.cuda
@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_dynamic_loss_scale_on_cuda_skips_the_steps_grad_scaler_skips(tmp_path, schedule):
    """float16 on the GPU with a dynamic loss scale (tests/test_loss_scale.py on a CPU): the
    steps torch.amp.GradScaler skips on the same GPU are skipped, at the same scales, and the
    weights follow its (its AdamW runs on the GPU, snake's on the CPU: not to the bit)."""
    from tests.test_loss_scale import OVERFLOWS, fp16_gpt

    model = fp16_gpt()
    init = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    data = batches(6, 4)
    scales: list[tuple[float, bool]] = []
    scaler = torch.amp.GradScaler("cuda", init_scale=OVERFLOWS.init_scale, growth_interval=OVERFLOWS.growth_interval)
    want = mixed_reference(model, data, 2, scaler=scaler, scales=scales, fused=True, device="cuda")
    assert any(s for _, s in scales) and not all(s for _, s in scales)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=PLACEMENTS["mixed"][0], alpha=1.0,
                      schedule=schedule, dtype="float16", device="cuda", loss_scale=OVERFLOWS)
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        report = await trainer.run(6)
        got = await trainer.state_dict()
    assert [(s.loss_scale, s.skipped) for s in report.steps] == scales
    assert_tracks_updates({k: got[k].cpu() for k in want}, want, {k: init[k] for k in want}, overall=0.01, each=0.05)


@pytest.mark.cuda
@pytest.mark.asyncio
@pytest.mark.parametrize("alpha", [0.0, 1.0])
async def test_a_static_scale_that_overflows_fails_on_cuda_before_any_step(tmp_path, alpha):
    """float16 at a static scale on the GPU (tests/test_loss_scale.py on a CPU): the gradient
    that overflowed is found on its host copy, and the run fails naming the fix."""
    from snake import ActorFailed, GradientOverflow
    from tests.test_loss_scale import OVERFLOWS, fp16_gpt

    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=PLACEMENTS["mixed"][0], alpha=alpha,
                      dtype="float16", device="cuda", loss_scale=OVERFLOWS.init_scale)
    trainer = SnakeTrainer(fp16_gpt(), data=batches(3, 4), config=cfg)
    try:
        with pytest.raises(ActorFailed) as err:
            await trainer.run(3)
        assert isinstance(err.value.__cause__, GradientOverflow)
        assert "DynamicLossScale()" in str(err.value.__cause__)
    finally:
        await trainer.close()


@pytest.mark.cuda
@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_queued_jobs_on_cuda_match_pytorch_and_trace_gpu_time(tmp_path, schedule):
    """The compute thread queues jobs without waiting for the GPU (snake.actors.compute): with
    wider blocks and more micro-batches than the parity tests, so that kernels are still
    running while the next job is queued and loads and copies run on the copy stream beside
    them, the weights still match PyTorch on the same GPU; checkpoints leave the GPU only
    after the forward that made them."""
    from collections import Counter

    trace = await _parity(tmp_path, schedule, "mixed", "auto", width=512, micro=8, batch=16, seq=32)
    spans = [s for s in trace if s.actor == "compute" and s.name.split()[0] in ("fwd", "bwd")]
    copies = [s for s in trace if s.actor == "d2h" and s.name.startswith("ckpt ")]
    assert len(spans) == 3 * 2 * 4 * 8
    made: dict[str, list] = {}
    for sp in spans:
        made.setdefault(sp.name, []).append(sp)
    seen: Counter[str] = Counter()
    for cp in copies:
        _, layer, mb = cp.name.split()
        if layer != "L0":
            src = f"fwd L{int(layer[1:]) - 1} {mb}"
            assert cp.start_s >= made[src][seen[src]].end_s, cp.name
            seen[src] += 1


@pytest.mark.cuda
@pytest.mark.asyncio
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_frozen_layer_weights_stream_on_cuda(tmp_path, schedule):
    """A LoRA-style model on the GPU: the frozen base weights come from pinned CPU memory
    into each layer's slot (not held on the device); the same weights as PyTorch on the GPU."""
    from tests.helpers import StackLM, kinds_parts
    from tests.test_parity import _LoraBlock

    torch.manual_seed(0)
    model = StackLM(_LoraBlock)
    data = batches(3, 4)
    want, _ = reference(model, data, 2, device="cuda")
    parts = kinds_parts(model)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=Placement(param=0.5, ckpt=0.5, opt=0.5),
                      alpha=0.3, schedule=schedule, device="cuda")
    async with SnakeTrainer(parts, data=data, config=cfg) as trainer:
        await trainer.run(3)
        got = await trainer.state_dict()
        k = trainer.engine.kernels
        assert all(f is not None and f.is_pinned() for f in k.frozen_host)
        assert k.layer_frozen == [[], [], []]
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.cuda
@pytest.mark.asyncio
@pytest.mark.parametrize("where", sorted(PLACEMENTS))
async def test_evaluate_on_cuda_matches_pytorch(tmp_path, where):
    """SnakeTrainer.evaluate on the GPU (layers loaded into device slots, hidden states in the
    idle pinned CPU memory between layers, several batches a pass or one): PyTorch's
    eval-mode loss of the same weights on the same GPU."""
    from tests.test_evaluate import held_out, torch_eval_loss

    placement, alpha = PLACEMENTS[where]
    model = tiny_gpt(n_layer=3, dropout=0.1)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=placement, alpha=alpha, device="cuda")
    async with SnakeTrainer(model, data=batches(3, 4), config=cfg) as t:
        await t.run(2)
        report = await t.evaluate(held_out())
        single = await t.evaluate(held_out(), batches_per_pass=1)  # one pass per batch
        state = await t.state_dict()
    data = [(x.cuda(), y.cuda()) for x, y in held_out()]
    want, count = torch_eval_loss(model.cuda(), {k: v.cuda() for k, v in state.items()}, data)
    assert report.tokens == single.tokens == count
    assert single.passes == 2
    assert report.loss == pytest.approx(want, rel=1e-4)
    assert single.loss == pytest.approx(want, rel=1e-4)


@pytest.mark.cuda
@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
async def test_fp32_adapters_of_a_bf16_model_on_cuda(tmp_path):
    """PEFT's fp32 adapters of a bf16 model held on the GPU in fp32 while the frozen base
    weights stream (tests/test_peft.py on the CPU): the updates of plain mixed precision
    on the same GPU."""
    import dataclasses

    from tests.test_hf import VOCAB, snake_config
    from tests.test_peft import lora

    model = lora(dtype=torch.bfloat16)
    base = model.get_base_model()
    init = {n: p.detach().float().clone() for n, p in base.named_parameters() if p.requires_grad}
    data = batches(3, 4, seq=16, vocab=VOCAB)
    want = mixed_reference(base, data, 2, fused=True, device="cuda")
    cfg = dataclasses.replace(snake_config(tmp_path, dtype="bfloat16"), device="cuda")
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        await trainer.run(3)
        assert trainer.engine.layer_P == [0] * 3
        got = await trainer.state_dict()
    assert_tracks_updates({k: got[k].cpu().float() for k in init}, {k: want[k] for k in init}, init,
                          overall=0.01, each=0.05)


@pytest.mark.cuda
@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
async def test_lora_of_a_streamed_bf16_model_on_cuda(tmp_path):
    """PEFT's adapters on a bf16 model from stream_hf (snake initialises them; the frozen
    base streams from a mapped file, which is not pinned) train on the GPU as the same
    model loaded in memory does there (tests/test_peft.py on the CPU)."""
    import dataclasses

    from peft import LoraConfig, get_peft_model

    from snake.hf import load_hf, stream_hf
    from tests.test_hf import VOCAB, make, snake_config
    from tests.test_peft import LORA

    make("llama").to(torch.bfloat16).save_pretrained(str(tmp_path / "m"))
    config = {**LORA, "init_lora_weights": "gaussian"}
    data = batches(3, 4, seq=16, vocab=VOCAB)
    got = {}
    for name, load in [("loaded", load_hf), ("streamed", stream_hf)]:
        torch.manual_seed(5)
        model = get_peft_model(load(tmp_path / "m", dtype=torch.bfloat16), LoraConfig(**config))
        torch.manual_seed(5)  # the streamed model's adapters draw when its trainer is made
        cfg = dataclasses.replace(snake_config(tmp_path / name, dtype="bfloat16"), device="cuda")
        async with SnakeTrainer(model, data=data, config=cfg) as trainer:
            await trainer.run(3)
            assert trainer.engine.kernels.frozen_mapped == (name == "streamed")
            got[name] = await trainer.state_dict(trained_only=True)
    assert got["loaded"].keys() == got["streamed"].keys()
    for n, v in got["loaded"].items():
        torch.testing.assert_close(got["streamed"][n], v, rtol=0, atol=0, msg=n)


@pytest.mark.cuda
def test_host_buffers_are_pinned_exactly():
    """snake's pinned host memory is a mapping of its own, registered with cudaHostRegister
    at its size (torch's pin_memory=True reserves the next power of two, and keeps it
    cached): page-locked (`is_pinned`), outside torch's host allocator, copied both ways on
    a side stream, and still registered while a view of it is alive (registering its range
    again is refused then)."""
    import gc

    from snake.buffers import alloc_host, alloc_host_tensor
    from snake.device import register_host_memory, wait_stream

    def torch_pinned() -> tuple[int, int]:  # what torch's own pinned allocator holds
        stats = torch.cuda.host_memory_stats()
        return stats["allocated_bytes.current"], stats["num_host_alloc"]

    before = torch_pinned()
    n = (8 << 20) // 4 + 1024  # 8 MiB + 4 KiB of float32: torch would reserve 16 MiB
    t = alloc_host_tensor(n, torch.float32, pin=True)
    buf = alloc_host(8 << 20, pin=True)
    assert t.is_pinned() and buf.data.is_pinned()
    assert torch_pinned() == before  # registered mappings, not a fallback to torch's allocator
    src = torch.arange(n, dtype=torch.float32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        t.copy_(src, non_blocking=True)
    wait_stream(side)
    assert torch.equal(t, src.cpu())
    back = torch.empty_like(src)
    with torch.cuda.stream(side):
        back.copy_(t, non_blocking=True)
    wait_stream(side)
    assert torch.equal(back, src)
    ptr, nbytes = t.data_ptr(), n * 4
    view = t[10:]
    del t
    gc.collect()
    assert register_host_memory(ptr, nbytes) is None  # still registered: its view is alive
    del view
    gc.collect()
    x = torch.ones(4, device="cuda")  # the refused registration left no error for the next launch
    assert float((x * 2).sum()) == 8.0


@pytest.mark.cuda
@pytest.mark.asyncio
async def test_only_what_crosses_the_link_is_pinned_on_cuda(tmp_path):
    """The parameter and checkpoint heads and their staging buffers are page-locked; the
    optimizer state (the CPU optimizer's alone, 12 bytes per parameter of its CPU share)
    and the optimizer's staging buffers are not."""
    cfg = SnakeConfig(device="cuda", offload_dir=tmp_path, micro_batches=2, alpha=0.5,
                      placement=Placement(param=0.5, ckpt=0.5, opt=0.5, grad=0.5))
    async with SnakeTrainer(tiny_gpt(), data=batches(2, 4), config=cfg) as t:
        await t.run(1)
        e = t.engine
        assert e.stores["param"].cpu.is_pinned() and e.stores["ckpt"].cpu.is_pinned()
        assert not e.stores["opt"].cpu.is_pinned()
        for name in ("param_in", "ckpt_in", "ckpt_out"):
            pool = e.pools[name]
            assert pool is not None and all(b.data.is_pinned() for b in pool._free._queue), name
        for name in ("opt", "param_out", "grad_out", "grad_in"):
            pool = e.pools.get(name)
            assert pool is None or not any(b.data.is_pinned() for b in pool._free._queue), name


@pytest.mark.cuda
@pytest.mark.asyncio
async def test_evaluate_loads_the_next_layer_while_one_runs_on_cuda(tmp_path):
    """evaluate()'s loads copied on the I/O thread's default stream, the compute stream:
    each copy queued behind the layer running and waited for it, so a load ended only with
    the layer before (`eval param L{l+1}` ending after `eval fwd L{l}`). On a stream of
    their own they end while it runs, for a model whose layers' compute is long beside its
    parameters (a wide batch of a narrow model)."""
    model = tiny_gpt(n_layer=6, n_embd=64)
    cfg = SnakeConfig(micro_batches=1, offload_dir=tmp_path, device="cuda",
                      placement=Placement(param=1.0, ckpt=1.0, opt=1.0))
    big = [(x.repeat(64, 1), y.repeat(64, 1)) for x, y in batches(2, 8)]
    async with SnakeTrainer(model, data=batches(2, 8), config=cfg) as t:
        await t.run(1)
        await t.evaluate(big, batches_per_pass=2)
        spans = {s.name: s for s in t.trace.spans if s.name.startswith(("eval param L", "eval fwd L"))}
    early = [layer for layer in range(5)
             if spans[f"eval param L{layer + 1}"].end_s < spans[f"eval fwd L{layer}"].end_s]
    assert len(early) >= 4, {k: (round(s.start_s, 4), round(s.end_s, 4)) for k, s in spans.items()}


@pytest.mark.cuda
@pytest.mark.asyncio
async def test_data_drawn_from_the_global_generator_is_left_alone_on_cuda(tmp_path):
    """On CUDA dropout draws from the device's generator, and the compute thread no longer
    seeds torch's global CPU one around each block: a source drawing from it (nanoGPT's
    get_batch) gets the batches it gives read alone, without taking turns with compute."""
    import asyncio

    from tests.test_data_rng import random_windows

    steps = 12
    torch.manual_seed(1234)
    want = [x for x, _ in random_windows(steps)]
    model = tiny_gpt(n_layer=4, dropout=0.2)
    torch.manual_seed(1234)
    seen: list[torch.Tensor] = []
    cfg = SnakeConfig(device="cuda", micro_batches=4, alpha=0.5, offload_dir=tmp_path)
    async with SnakeTrainer(model, data=random_windows(steps, seen), config=cfg) as t:
        await asyncio.wait_for(t.run(steps), 120)
        assert t.engine.kernels.rng_lock is None
    assert all(torch.equal(a, b) for a, b in zip(seen, want, strict=True))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_trainer_on_the_second_gpu_sets_up_nothing_on_the_first(tmp_path):
    """torch's host-registration bindings take no device: the engine's build registered its
    buffers with the build thread's current device, cuda:0, creating its context there
    (about 0.5 GiB, or a failure in exclusive-process mode) for a run on cuda:1."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import asyncio, torch
        from snake import SnakeConfig, SnakeTrainer
        from tests.helpers import batches, tiny_gpt
        async def main():
            cfg = SnakeConfig(device="cuda:1", micro_batches=2, offload_dir={str(tmp_path)!r})
            async with SnakeTrainer(tiny_gpt(), data=batches(2, 4), config=cfg) as t:
                await t.run(2)
        asyncio.run(main())
        assert not torch._C._cuda_hasPrimaryContext(0), "cuda:0 has a context"
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
