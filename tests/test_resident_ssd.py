"""The resident (pre/post) optimizer state on SSD (`SnakeConfig.resident_optimizer="ssd"`):
the same weights as plain PyTorch and bitwise those of the state in CPU memory, checkpoints
across both, the planner's choice, what it costs in memory and traffic, and its faults."""

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from snake import ActorFailed, ConfigError, Placement, SnakeConfig, SnakeError, SnakeTrainer
from snake.errors import StorageError
from snake.faults import StorageFaults, inject_storage
from snake.memory import (
    OPT_BYTES_PER_ELEM,
    RUNTIME_OVERHEAD_BYTES,
    host_memory,
    resident_chunk,
    resident_host_bytes,
)
from tests.helpers import assert_close_state, batches, optimizer_options, reference, tiny_gpt, train
from tests.test_fault_injection import _bin_fds, _snake_threads

MIXED = Placement(param=0.5, ckpt=0.3, opt=0.6)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 1024 elements: the tiny GPT's embedding (96 x 64) and position table
    (32 x 64) take several each, and the final norm (64) one short one."""
    monkeypatch.setattr("snake.memory.RESIDENT_CHUNK_ELEMS", 1024)


def _resident_numel(model) -> int:
    from snake.adapters import describe, resident_named_params

    return sum(p.numel() for _, p in resident_named_params(describe(model)))


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha,placement,io_threads", [
    ("vertical", 0.0, Placement.all_ssd(), 2),
    ("vertical", 0.3, MIXED, 1),  # the step's reads and writes queue on one SSD thread
    ("horizontal", 0.0, MIXED, 2),
    ("horizontal", 0.3, Placement.all_cpu(), 3),
])
async def test_matches_plain_pytorch_and_the_cpu_state_bitwise(tmp_path, small_chunks, schedule, alpha, placement,
                                                               io_threads):
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(3, 4)
    want, want_losses = reference(model, data, 2)
    kw = dict(micro_batches=2, placement=placement, alpha=alpha, schedule=schedule, io_threads=io_threads)
    got, report, traffic = await train(model, data, 3, offload_dir=tmp_path / "ssd", resident_optimizer="ssd", **kw)
    cpu, _, cpu_traffic = await train(model, data, 3, offload_dir=tmp_path / "cpu", **kw)
    assert_close_state(got, want)
    assert [s.loss for s in report.steps] == pytest.approx(want_losses, abs=1e-5)
    for k in cpu:  # chunks at multiples of 1024 elements: the fused AdamW's rounding is the whole tensor's
        assert torch.equal(got[k], cpu[k]), k
    # one read and one write of master, m and v per iteration, counted as optimizer traffic
    resident = _resident_numel(model) * OPT_BYTES_PER_ELEM
    for link in (("ssd", "cpu", "opt"), ("cpu", "ssd", "opt")):
        assert traffic.get(link, 0) - cpu_traffic.get(link, 0) == resident, link


@pytest.mark.asyncio
async def test_state_lives_in_the_file_not_in_memory(tmp_path, small_chunks):
    model = tiny_gpt(n_layer=2, bias=False)
    n = _resident_numel(model)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=Placement.all_cpu(), alpha=0.0, device="cpu",
                      resident_optimizer="ssd")
    async with SnakeTrainer(model, data=batches(2, 4), config=cfg) as trainer:
        before = await trainer.state_dict()  # read from the file before the first step: the model's values
        for k, v in model.state_dict().items():
            if k in before:
                assert torch.equal(before[k], v.float()), k
        await trainer.run(2)
        k = trainer.engine.kernels.resident
        assert k.master == [] and k.m == [] and k.v == []
        store = trainer.engine.stores["resident"]
        assert store.cpu_bytes() == 0 and (tmp_path / "resident.bin").stat().st_size == store.file_bytes
        c = resident_chunk(n)
        assert c == 1024 and store.file_bytes >= 3 * n * 4
        # what the memory model charges is what the runtime holds for it: the staging buffers
        held = sum(b.nbytes for b in k.stages) + k.gstage.numel() * 4
        assert held == resident_host_bytes(n, True) == 7 * c * 4
        after = await trainer.state_dict()
    assert not (tmp_path / "resident.bin").exists()  # scratch: removed at close
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_memory_model_charges_chunks_instead_of_12_bytes_per_parameter():
    from planner.profile import shape_of
    from snake.models.gpt import GPTConfig

    shape = shape_of(GPTConfig(n_layer=2, n_head=4, n_embd=256, vocab_size=50_000, block_size=64), 1, 64, "float32")
    kw = dict(n_micro=2, alpha=0.0, schedule="vertical", workers=2)
    cpu, ssd = host_memory(shape, **kw), host_memory(shape, **kw, resident_on_ssd=True)
    assert shape.resident_params > resident_chunk(shape.resident_params)
    c = resident_chunk(shape.resident_params)
    assert cpu.fixed_bytes - ssd.fixed_bytes == shape.resident_params * 12 - 28 * c
    assert cpu.per_share == ssd.per_share
    # on a GPU the state in memory also stages the gradients a chunk at a time
    gpu = host_memory(shape, **kw, grad_staging=True)
    gpu_ssd = host_memory(shape, **kw, grad_staging=True, resident_on_ssd=True)
    assert gpu.fixed_bytes - gpu_ssd.fixed_bytes == shape.resident_params * 12 + 4 * c - 28 * c


@pytest.mark.asyncio
@pytest.mark.parametrize("first,second", [("ssd", "cpu"), ("cpu", "ssd"), ("ssd", "ssd")])
async def test_checkpoints_resume_bitwise_across_cpu_and_ssd(tmp_path, small_chunks, first, second):
    data = batches(4, 4)

    def cfg(where, resident):
        return SnakeConfig(micro_batches=2, offload_dir=where, placement=MIXED, alpha=0.3, device="cpu",
                           resident_optimizer=resident)

    # rows of 48 elements: chunks of 1024 start and end inside rows (the load reads rows)
    async with SnakeTrainer(tiny_gpt(n_layer=3, n_embd=48, bias=False), data=data,
                            config=cfg(tmp_path / "a", "cpu")) as t:
        await t.run(4)
        want = await t.state_dict()
    async with SnakeTrainer(tiny_gpt(n_layer=3, n_embd=48, bias=False), data=data,
                            config=cfg(tmp_path / "b", first)) as t:
        await t.run(2)
        await t.save(tmp_path / "ckpt")
    async with SnakeTrainer(tiny_gpt(n_layer=3, n_embd=48, bias=False, seed=5), data=data,
                            config=cfg(tmp_path / "c", second)) as t:
        await t.load(tmp_path / "ckpt")
        await t.run(2)
        got = await t.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.asyncio
async def test_a_checkpoint_saved_before_the_first_step_holds_the_model(tmp_path, small_chunks):
    model = tiny_gpt(n_layer=2, bias=False)
    data = batches(3, 4)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path / "a", placement=MIXED, alpha=0.0, device="cpu",
                      resident_optimizer="ssd")
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        await t.run(1)
        await t.save(tmp_path / "ckpt")
        await t.run(1)
        want = await t.state_dict()
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False, seed=3), data=data,
                            config=dataclasses.replace(cfg, offload_dir=tmp_path / "b")) as t:
        await t.load(tmp_path / "ckpt")
        await t.run(1)
        got = await t.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_bad_value_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match="resident_optimizer.*'ssd'"):
        SnakeConfig(offload_dir=tmp_path, resident_optimizer="nvme")


def _profile(cpu_bytes: float):
    from planner.profile import MachineProfile, shape_of
    from snake.models.gpt import GPTConfig

    shape = shape_of(GPTConfig(n_layer=8, n_head=4, n_embd=256, vocab_size=200_000, block_size=64), 4, 64,
                     "float32")
    return MachineProfile(
        fwd_seconds=2e-3, bwd_seconds=4e-3, recompute_seconds=2e-3, pre_post_seconds=5e-3,
        h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10, ssd_read_bytes_per_s=1e9, ssd_write_bytes_per_s=1e9,
        adam_elems_per_s=1e9, cpu_memory_bytes=cpu_bytes, device_memory_bytes=8e9, shape=shape, device="cuda",
    )


def test_planner_puts_the_resident_state_on_ssd_only_where_it_must():
    from planner.search import search
    from planner.solve import Infeasible, Plan, predict, resident_ssd_seconds

    roomy = _profile(16e9)
    plan = search(roomy, resident=None)
    assert isinstance(plan, Plan) and plan.resident_optimizer == "cpu"  # the SSD's traffic costs time
    r = roomy.shape.resident_params
    assert r * 12 > 0.6e9  # the embedding's state in memory: 0.61 GB
    # a budget the layers fit in with everything on SSD, but not with the resident state in
    # memory (it is 6 of its 12 bytes per parameter short)
    tight = _profile(host_memory(roomy.shape, n_micro=1, alpha=0.0, schedule="vertical", workers=2,
                                 grad_staging=True).at(0, 0, 0) + RUNTIME_OVERHEAD_BYTES - r * 6)
    fixed_cpu = search(tight, resident="cpu")
    assert isinstance(fixed_cpu, Infeasible) and "resident_optimizer='ssd'" in fixed_cpu.message
    chosen = search(tight, resident=None)
    assert isinstance(chosen, Plan) and chosen.resident_optimizer == "ssd"
    assert chosen.host_memory_bytes <= tight.cpu_memory_bytes
    # its time: the layers' plus the state's read and write at the iteration's end
    extra = resident_ssd_seconds(tight)
    assert extra == pytest.approx(2 * r * OPT_BYTES_PER_ELEM / 1e9)
    base = predict(tight, chosen.n_micro, chosen.placement, chosen.alpha, "vertical")
    assert chosen.predicted_iteration_seconds == pytest.approx(base + extra)
    assert predict(tight, chosen.n_micro, chosen.placement, chosen.alpha, "vertical", "ssd") == pytest.approx(
        base + extra)
    assert chosen.ssd_bytes_per_iteration >= 2 * r * OPT_BYTES_PER_ELEM


@pytest.mark.asyncio
async def test_trainer_plans_ssd_under_a_budget_the_cpu_state_does_not_fit(tmp_path, small_chunks):
    """resident_optimizer=None: the planner's choice reaches the trainer, and training runs."""
    from planner.profile import shape_of_parts
    from snake.adapters import describe
    from snake.memory import placement_bytes

    model = tiny_gpt(n_layer=2, bias=False)
    data = batches(2, 4)
    shape = shape_of_parts(describe(model), 4, 16, "float32")
    kw = dict(n_micro=1, alpha=0.0, schedule="vertical", workers=2, device_type="cpu")

    def least(on_ssd):  # the smallest footprint: linear in the shares, so at a corner
        return min(placement_bytes(shape, **kw, param=p, ckpt=c, opt=o, resident_on_ssd=on_ssd)
                   for p in (0.0, 1.0) for c in (0.0, 1.0) for o in (0.0, 1.0))

    ssd_need, cpu_need = least(True), least(False)
    assert cpu_need > ssd_need
    budget = int((ssd_need + cpu_need) / 2)
    cfg = SnakeConfig(micro_batches=1, offload_dir=tmp_path, placement=None, alpha=0.0, device="cpu",
                      cpu_memory_bytes=budget, resident_optimizer=None)
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        await asyncio.wait_for(t.run(1), 120)
        assert t.config.resident_optimizer == "ssd"
        assert "resident" in t.engine.stores


@pytest.mark.asyncio
async def test_a_fixed_placement_over_the_budget_names_resident_optimizer(tmp_path):
    model = tiny_gpt(n_layer=2, bias=False)
    cfg = SnakeConfig(micro_batches=1, offload_dir=tmp_path, placement=Placement.all_ssd(), alpha=0.0, device="cpu",
                      cpu_memory_bytes=1 << 20)
    with pytest.raises(ConfigError, match="resident_optimizer='ssd'"):
        async with SnakeTrainer(model, data=batches(1, 4), config=cfg) as t:
            await t.run(1)


@pytest.mark.asyncio
@pytest.mark.parametrize("faults,match", [
    (StorageFaults(seed=1, read_error=1.0), "Input/output error"),
    (StorageFaults(seed=2, no_space=1.0), "disk is full"),
    (StorageFaults(seed=3, flip=1.0), "checksum mismatch"),
])
async def test_storage_faults_in_the_resident_step_fail_cleanly(tmp_path, small_chunks, faults, match):
    model = tiny_gpt(n_layer=2, bias=False)
    data = batches(6, 4)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path / "off", placement=MIXED, alpha=0.3, device="cpu",
                      stall_timeout_s=5.0, resident_optimizer="ssd")
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        await trainer.run(1)
        await trainer.save(tmp_path / "ckpt")
        inject_storage(trainer.engine.stores["resident"].file, faults)
        with pytest.raises(ActorFailed) as e:
            await asyncio.wait_for(trainer.run(2), 30)
    assert e.value.actor == "compute", e.value
    assert isinstance(e.value.__cause__, StorageError) and "resident.bin" in str(e.value.__cause__)
    assert match in str(e.value)
    assert not _snake_threads() and not _bin_fds()
    assert not (tmp_path / "off" / "resident.bin").exists()
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False, seed=4), data=data,
                            config=dataclasses.replace(cfg, offload_dir=tmp_path / "off2")) as t2:
        await t2.load(tmp_path / "ckpt")
        await asyncio.wait_for(t2.run(1), 30)


@pytest.mark.asyncio
async def test_disk_preflight_counts_the_resident_file(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    model = tiny_gpt(n_layer=2, bias=False)
    usage = namedtuple("usage", "total used free")
    cfg = SnakeConfig(micro_batches=1, offload_dir=tmp_path, placement=Placement.all_cpu(), alpha=0.0, device="cpu",
                      resident_optimizer="ssd")
    # room for nothing: the layers' shares are all in CPU memory, so only the resident file asks for disk
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 4096))
    with pytest.raises(ConfigError, match="offload_dir.*SSD tier needs"):
        async with SnakeTrainer(model, data=batches(1, 4), config=cfg) as t:
            await t.run(1)
    async with SnakeTrainer(model, data=batches(1, 4), config=dataclasses.replace(cfg, resident_optimizer="cpu")) as t:
        await asyncio.wait_for(t.run(1), 60)


def test_adamw_in_chunks_of_1024_multiples_is_the_whole_step_bitwise():
    """What the chunked resident step rests on: `adamw_step` over pieces cut at multiples of
    1024 elements gives the whole tensor's result, bit for bit, over several steps."""
    from snake.config import AdamW
    from snake.optim import adamw_step

    n = 100_003  # a remainder past the last full vector

    def run(cuts):
        g = torch.Generator().manual_seed(0)
        p, m, v = torch.randn(n, generator=g), torch.zeros(n), torch.zeros(n)
        for step in range(1, 6):
            grad = torch.randn(n, generator=g)
            for a, b in zip([0, *cuts], [*cuts, n], strict=True):
                adamw_step([p[a:b]], [grad[a:b]], [m[a:b]], [v[a:b]], step=step, opt=AdamW(weight_decay=0.1), lr=1e-3)
        return p, m, v

    whole = run([])
    for got, want in zip(run(list(range(4096, n, 4096))), whole, strict=True):
        assert torch.equal(got, want)


def _maps() -> str:
    return Path("/proc/self/maps").read_text()


@pytest.mark.asyncio
async def test_save_reads_the_state_into_a_file_mapping_not_into_memory(tmp_path, small_chunks, monkeypatch):
    """A save of the state on SSD goes through a shared mapping of an unlinked scratch file in
    offload_dir (pages the kernel may write back and drop), which is gone afterwards."""
    from snake import resident

    seen = []
    real = resident.ResidentState.snapshot

    def spy(self, directory):
        out = real(self, directory)
        maps = _maps()
        seen.append(("resident-save.bin (deleted)" in maps, directory, [p.name for p in directory.iterdir()]))
        return out

    monkeypatch.setattr(resident.ResidentState, "snapshot", spy)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path / "off", placement=MIXED, alpha=0.0, device="cpu",
                      resident_optimizer="ssd")
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(2, 4), config=cfg) as t:
        await t.run(1)
        await t.save(tmp_path / "ckpt")
    assert len(seen) == 1
    mapped, directory, names = seen[0]
    assert mapped and directory == (tmp_path / "off").resolve() and "resident-save.bin" not in names
    assert "resident-save.bin (deleted)" not in _maps()  # unmapped with the tensors


@pytest.mark.asyncio
async def test_bfloat16_and_a_frozen_embedding(tmp_path, small_chunks):
    """bf16 compute: the device copies are cast from the chunks as from the whole masters
    (bitwise); and with every resident parameter frozen there is nothing to store or stage."""
    model = tiny_gpt(n_layer=2, bias=False)
    data = batches(3, 4)
    kw = dict(micro_batches=2, placement=MIXED, alpha=0.3, dtype="bfloat16")
    got, _, _ = await train(model, data, 3, offload_dir=tmp_path / "a", resident_optimizer="ssd", **kw)
    cpu, _, _ = await train(model, data, 3, offload_dir=tmp_path / "b", **kw)
    for k in cpu:
        assert torch.equal(got[k], cpu[k]), k
    frozen = tiny_gpt(n_layer=2, bias=False)
    for name, p in frozen.named_parameters():
        p.requires_grad_(name.startswith("blocks."))
    want = reference(frozen, data, 2)[0]
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path / "c", placement=MIXED, alpha=0.0, device="cpu",
                      resident_optimizer="ssd")
    async with SnakeTrainer(frozen, data=data, config=cfg) as t:
        await asyncio.wait_for(t.run(3), 60)
        assert t.engine.stores["resident"].file is None and t.engine.kernels.resident.stage is None
        state = await t.state_dict()
    assert_close_state({k: state[k] for k in want}, want)


@pytest.mark.asyncio
async def test_slow_and_short_transfers_in_the_pipelined_step_change_nothing(tmp_path, small_chunks):
    """The step reads the next chunk while it steps and writes this one: with transfers that
    stall (latency spikes) or move half their bytes (short transfers), a buffer is still never
    refilled before its write has ended; the weights are bitwise those of the CPU state."""
    model = tiny_gpt(n_layer=2, bias=False)
    data = batches(3, 4)
    kw = dict(micro_batches=2, placement=MIXED, alpha=0.3)
    cpu, _, _ = await train(model, data, 3, offload_dir=tmp_path / "cpu", **kw)
    cfg = SnakeConfig(device="cpu", offload_dir=tmp_path / "ssd", resident_optimizer="ssd", **kw)
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        await t.run(1)
        inject_storage(t.engine.stores["resident"].file, StorageFaults(seed=9, spike=0.5, spike_s=0.01, short=0.3))
        await asyncio.wait_for(t.run(2), 60)
        got = await t.state_dict()
    for k in cpu:
        assert torch.equal(got[k], cpu[k]), k


@pytest.mark.asyncio
async def test_state_in_memory_with_staged_gradients_is_bitwise_the_whole_step(tmp_path, small_chunks):
    """On a GPU the state in CPU memory is stepped a chunk at a time through one pinned
    gradient buffer (`ResidentState._step_staged`); here that path is forced on the CPU device
    after the first step: the weights are bitwise those of the whole-tensor step."""
    from snake.buffers import alloc_host_tensor

    model = tiny_gpt(n_layer=2, bias=False)
    data = batches(3, 4)
    kw = dict(micro_batches=2, placement=MIXED, alpha=0.3)
    want, _, _ = await train(model, data, 3, offload_dir=tmp_path / "a", **kw)
    cfg = SnakeConfig(device="cpu", offload_dir=tmp_path / "b", **kw)
    async with SnakeTrainer(model, data=data, config=cfg) as t:
        await t.run(1)
        k = t.engine.kernels.resident
        assert k.gstage is None  # a CPU device steps the host gradients whole
        k.gstage = alloc_host_tensor(1024, torch.float32, pin=False)
        calls = []
        real = k._step_staged
        k._step_staged = lambda on, step, skips: (calls.append(step), real(on, step, skips))[1]
        await asyncio.wait_for(t.run(2), 60)
        got = await t.state_dict()
    assert calls == [2, 3]
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.asyncio
async def test_a_slow_step_that_progresses_is_not_a_stall(tmp_path, small_chunks):
    """The step on SSD is one piece of the compute actor's work however long it takes; each
    chunk it finishes counts as progress for the stall watchdog (`Tracer.progress`). Every
    transfer of the resident file stalls 0.25 s, the step takes seconds, the watchdog 1 s."""
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=Placement.all_cpu(), alpha=0.0, device="cpu",
                      stall_timeout_s=1.0, resident_optimizer="ssd")
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(3, 4), config=cfg) as t:
        await t.run(1)
        inject_storage(t.engine.stores["resident"].file, StorageFaults(seed=1, spike=1.0, spike_s=0.25))
        report = await asyncio.wait_for(t.run(1), 60)
    assert report.steps[0].seconds > 1.5  # longer than the watchdog's limit, as one piece of work


@pytest.mark.asyncio
async def test_every_resident_parameter_frozen_saves_and_loads(tmp_path, small_chunks):
    """A LoRA-style model (embeddings and head frozen) with resident_optimizer="ssd": nothing
    is stored, and a checkpoint saves and resumes."""
    def model():
        m = tiny_gpt(n_layer=2, bias=False)
        for name, p in m.named_parameters():
            p.requires_grad_(name.startswith("blocks."))
        return m

    data = batches(3, 4)
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path / "a", placement=MIXED, alpha=0.0, device="cpu",
                      resident_optimizer="ssd")
    async with SnakeTrainer(model(), data=data, config=cfg) as t:
        await t.run(1)
        await t.save(tmp_path / "ckpt")
        await t.run(1)
        want = await t.state_dict()
    async with SnakeTrainer(model(), data=data, config=dataclasses.replace(cfg, offload_dir=tmp_path / "b")) as t:
        await t.load(tmp_path / "ckpt")
        await t.run(1)
        got = await t.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.asyncio
async def test_an_unplannable_resident_optimizer_is_the_field_named(tmp_path):
    """Only resident_optimizer left to the planner, and nothing fits: the ConfigError names
    that field, and does not suggest the SSD the planner already tried."""
    cfg = SnakeConfig(micro_batches=2, placement=Placement.all_cpu(), alpha=0.0, offload_dir=tmp_path, device="cpu",
                      resident_optimizer=None, cpu_memory_bytes=1 << 20)
    with pytest.raises(ConfigError, match="resident_optimizer=None cannot be planned") as e:
        async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(2, 4), config=cfg) as t:
            await t.run(1)
    assert "resident_optimizer='ssd'" not in str(e.value)


@pytest.mark.asyncio
async def test_a_cancelled_run_stops_the_step_on_ssd_at_its_next_chunk(tmp_path, small_chunks):
    """Cancelling run() in the resident step on SSD does not wait for the rest of the step:
    the engine's stop event (set as the compute actor's blocking work is cancelled) ends it
    at its next chunk. Every transfer of the resident file stalls 0.2 s; of the step's
    transfers (a read and a write per chunk) at most the ones in flight and one more start
    after the cancellation, and the trainer closes with no thread or file left."""
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, placement=Placement.all_cpu(), alpha=0.0, device="cpu",
                      resident_optimizer="ssd")
    model = tiny_gpt(n_layer=2, bias=False)
    t = SnakeTrainer(model, data=batches(3, 4), config=cfg)
    await t.run(1)
    n_chunks = sum(len(units) for units in t.engine.kernels.resident.units)
    assert n_chunks >= 8
    f = t.engine.stores["resident"].file
    inject_storage(f, StorageFaults(seed=1, spike=1.0, spike_s=0.2))
    inner = getattr(f, "inner", f)
    calls: list[str] = []
    loop, under_way = asyncio.get_running_loop(), asyncio.Event()  # only the step touches the resident file

    def count(kind: str) -> None:
        calls.append(kind)
        if len(calls) == 3:
            loop.call_soon_threadsafe(under_way.set)

    real_r, real_w = inner._preadv, inner._pwritev
    inner._preadv = lambda *a: (count("r"), real_r(*a))[1]
    inner._pwritev = lambda *a: (count("w"), real_w(*a))[1]
    task = asyncio.create_task(t.run(1))
    await asyncio.wait_for(under_way.wait(), 30)
    before = len(calls)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    after = len(calls) - before
    assert after <= 3, (before, after, n_chunks)
    assert len(calls) < 2 * n_chunks
    with pytest.raises(SnakeError, match="closed|broken|unusable"):
        await t.run(1)
    await t.close()
    assert not _snake_threads() and not _bin_fds()


@pytest.mark.asyncio
async def test_the_stop_event_ends_both_chunked_steps(tmp_path, small_chunks):
    """With the engine's stop event set, the chunked resident steps (on SSD, and in memory
    through the staged gradient buffer a GPU uses) raise Stopped before their next chunk."""
    from snake.buffers import alloc_host_tensor
    from snake.errors import Stopped

    kw = dict(micro_batches=2, placement=MIXED, alpha=0.0, device="cpu")
    for resident in ("ssd", "cpu"):
        cfg = SnakeConfig(offload_dir=tmp_path / resident, resident_optimizer=resident, **kw)
        async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(2, 4), config=cfg) as t:
            await t.run(1)
            k = t.engine.kernels.resident
            if resident == "cpu":
                k.gstage = alloc_host_tensor(1024, torch.float32, pin=False)
            step = k._step_ssd if resident == "ssd" else k._step_staged
            t.engine.stop.set()
            with pytest.raises(Stopped):
                step(list(range(len(k.shapes))), 2, [0] * len(k.shapes))


@pytest.mark.asyncio
@pytest.mark.parametrize("option", sorted(optimizer_options()))
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
async def test_each_optimizer_option_steps_the_state_on_ssd(tmp_path, small_chunks, option, schedule):
    """A learning-rate schedule, parameters without weight decay, clipping: the embeddings'
    and head's step chunk by chunk from SSD takes each as torch's AdamW does."""
    opt, ref, alpha = optimizer_options()[option]
    model = tiny_gpt(n_layer=2, bias=False)
    data = batches(4, 4)
    want, _ = reference(model, data, 2, **ref)
    got, _, _ = await train(model, data, 4, micro_batches=2, offload_dir=tmp_path, placement=MIXED, alpha=alpha,
                            schedule=schedule, resident_optimizer="ssd", optimizer=opt)
    assert_close_state(got, want)
