"""Bad input raises a clear error naming the field, before anything starts."""

import asyncio

import pytest
import torch

from snake import AdamW, ConfigError, DataError, ModelError, Placement, SnakeConfig, SnakeTrainer
from snake.adapters import input_rows
from tests.helpers import batches, tiny_gpt


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(micro_batches=0), "micro_batches"),
        (dict(micro_batches=-2), "micro_batches"),
        (dict(micro_batches=2.5), "micro_batches"),
        (dict(alpha=1.01), "alpha"),
        (dict(alpha=-0.1), "alpha"),
        (dict(alpha=float("nan")), "alpha"),
        (dict(dtype="int8"), "dtype"),
        (dict(device="tpu"), "device"),
        (dict(schedule="diagonal"), "schedule"),
        (dict(ssd_bandwidth_bytes_per_s=0), "ssd_bandwidth_bytes_per_s"),
        (dict(device_link_bytes_per_s=-5.0), "device_link_bytes_per_s"),
        (dict(device_link_bytes_per_s=float("nan")), "device_link_bytes_per_s"),
        (dict(device_link_bytes_per_s=1), "device_link_bytes_per_s"),
        (dict(device_link_bytes_per_s=999_999.0), "device_link_bytes_per_s"),
        (dict(cpu_memory_bytes=-1), "cpu_memory_bytes"),
        (dict(optimizer_workers=0), "optimizer_workers"),
        (dict(offload_dir=""), "offload_dir"),
        (dict(storage_backend="gds"), "storage_backend"),
        # bools are not numbers, infinities are not finite, and each range has a bound
        (dict(seed=True), "seed"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**63), "seed"),
        (dict(optimizer_workers=True), "optimizer_workers"),
        (dict(io_threads=True), "io_threads"),
        (dict(cpu_memory_bytes=True), "cpu_memory_bytes"),
        (dict(device_memory_bytes=True), "device_memory_bytes"),
        (dict(ssd_bandwidth_bytes_per_s=True), "ssd_bandwidth_bytes_per_s"),
        (dict(loss_scale=True), "loss_scale"),
        (dict(loss_scale=float("inf")), "loss_scale"),
        (dict(stall_timeout_s=True), "stall_timeout_s"),
        (dict(device="cuda:\u0663"), "device"),  # an Arabic-Indic digit: str.isdigit() says yes
    ],
)
def test_config_fields(tmp_path, changes, field):
    kw = dict(micro_batches=2, offload_dir=tmp_path)
    kw.update(changes)
    with pytest.raises(ConfigError) as e:
        SnakeConfig(**kw)
    assert e.value.field == field
    assert field in str(e.value)


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(io_threads=65), r"io_threads=65 must be <= 64"),
        (dict(ssd_bandwidth_bytes_per_s=float("inf")), r"ssd_bandwidth_bytes_per_s=inf .*use None for no cap"),
        (dict(ssd_bandwidth_bytes_per_s=1000), r"ssd_bandwidth_bytes_per_s=1000 must be >= 1000000 bytes/s \(1 MB/s\)"),
        (dict(seed=2**70), r"seed=\d+ must be an integer in \[0, 2\*\*63 - 1"),
    ],
)
def test_config_bounds_say_the_rule(tmp_path, changes, match):
    with pytest.raises(ConfigError, match=match):
        SnakeConfig(offload_dir=tmp_path, **changes)


def test_config_edges_still_accepted(tmp_path):
    SnakeConfig(offload_dir=tmp_path, seed=2**63 - 1, io_threads=64, ssd_bandwidth_bytes_per_s=1e6, device="cuda:12")


@pytest.mark.parametrize("name,value", [("param", 1.2), ("ckpt", -0.5), ("opt", float("inf"))])
def test_placement_outside_unit_interval(name, value):
    with pytest.raises(ConfigError, match=rf"placement\.{name}=.*\(CPU share"):
        Placement(**{name: value})


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(lr=-1.0), "optimizer.lr"),
        (dict(betas=(0.9, 1.5)), "optimizer.betas"),
        (dict(eps=0), "optimizer.eps"),
        (dict(eps=float("inf")), "optimizer.eps"),
        (dict(weight_decay=float("inf")), "optimizer.weight_decay"),
        (dict(lr=True), "optimizer.lr"),
        (dict(eps=True), "optimizer.eps"),
        (dict(betas=(False, 0.99)), "optimizer.betas"),
    ],
)
def test_optimizer_fields(kw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        AdamW(**kw)


def test_cuda_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    cfg = SnakeConfig(micro_batches=1, offload_dir=tmp_path, device="cuda")
    with pytest.raises(ConfigError, match="device"):
        SnakeTrainer(tiny_gpt(), data=batches(1, 2), config=cfg)


def test_offload_dir_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="offload_dir.*is a file"):
        SnakeTrainer(tiny_gpt(), data=batches(1, 2), config=SnakeConfig(offload_dir=f))


def test_offload_dir_cannot_be_created():
    with pytest.raises(ConfigError, match="offload_dir.*cannot be created"):
        SnakeTrainer(tiny_gpt(), data=batches(1, 2), config=SnakeConfig(offload_dir="/proc/snake-offload"))


def test_model_without_blocks(tmp_path):
    with pytest.raises(ModelError, match="ModelParts"):
        SnakeTrainer(torch.nn.Linear(4, 4), data=batches(1, 2), config=SnakeConfig(offload_dir=tmp_path))


def test_config_must_be_snakeconfig(tmp_path):
    with pytest.raises(ConfigError, match="config"):
        SnakeTrainer(tiny_gpt(), data=batches(1, 2), config={"micro_batches": 2})


def test_data_not_iterable(tmp_path):
    with pytest.raises(DataError, match="iterable"):
        SnakeTrainer(tiny_gpt(), data=42, config=SnakeConfig(offload_dir=tmp_path))


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "batch,match",
    [
        (batches(1, 6)[0], "not divisible by micro_batches=4"),
        ((torch.zeros(4, 16, dtype=torch.long),), "pair"),
        ((torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16)), "int64"),
        ((torch.zeros(4, 16, dtype=torch.long), torch.zeros(3, 16, dtype=torch.long)), "disagree"),
        ((torch.full((4, 16), 500), torch.zeros(4, 16, dtype=torch.long)), r"\[0, 96\)"),
        (([1, 2], torch.zeros(4, 16, dtype=torch.long)), "torch.Tensor"),
        # token ids: integers of shape (batch, seq), targets of the same shape, some tokens
        ((torch.zeros(4, 16), torch.zeros(4, 16, dtype=torch.long)), r"inputs must be integer token ids.*float32"),
        ((torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 16, dtype=torch.long)), r"inputs must be integer.*uint8"),
        ((torch.zeros(4, 16, dtype=torch.bool), torch.zeros(4, 16, dtype=torch.long)), r"inputs must be integer.*bool"),
        ((torch.full((4, 16), 500.0), torch.zeros(4, 16, dtype=torch.long)), r"inputs must be integer"),
        ((torch.zeros(16, dtype=torch.long), torch.zeros(16, dtype=torch.long)), r"inputs must have shape \(batch, seq\), got \(16,\)"),
        ((torch.zeros(4, 16, 2, dtype=torch.long), torch.zeros(4, 16, 2, dtype=torch.long)), r"shape \(batch, seq\)"),
        ((torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long)), r"disagree in shape: \(4, 16\) vs \(4, 8\)"),
        ((torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, dtype=torch.long)), r"targets must have the inputs' shape"),
        ((torch.zeros(0, 16, dtype=torch.long), torch.zeros(0, 16, dtype=torch.long)), r"0 tokens"),
        ((torch.zeros(4, 0, dtype=torch.long), torch.zeros(4, 0, dtype=torch.long)), r"0 tokens"),
        (batches(1, 4, seq=40)[0], r"sequence length 40 exceeds the model's block_size=32"),
        # -100 is "not trained on"; other negatives are not targets, and a batch needs one to train on
        ((torch.zeros(4, 16, dtype=torch.long), torch.full((4, 16), -5)), r"\[0, 96\) \(the model's logits per token\) or -100.*min -5"),
        ((torch.zeros(4, 16, dtype=torch.long), torch.full((4, 16), -100)), r"every target of the batch is -100"),
    ],
)
async def test_bad_batches_fail_before_anything_starts(tmp_path, batch, match):
    off = tmp_path / "off"
    cfg = SnakeConfig(micro_batches=4, offload_dir=off, device="cpu")
    async with SnakeTrainer(tiny_gpt(), data=[batch], config=cfg) as trainer:
        with pytest.raises(DataError, match=match):
            await asyncio.wait_for(trainer.run(1), 30)
    assert not any(off.iterdir()), "no state may be written before the input is checked"


@pytest.mark.asyncio
async def test_int32_inputs_train(tmp_path):
    x, y = batches(1, 4)[0]
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, device="cpu")
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=[(x.int(), y)], config=cfg) as trainer:
        report = await asyncio.wait_for(trainer.run(1), 30)
    assert report.steps[0].loss == report.steps[0].loss  # not NaN


@pytest.mark.asyncio
async def test_later_batch_with_wrong_targets_shape_is_a_data_error(tmp_path):
    x, y = batches(1, 4)[0]
    data = [(x, y), (x, y[:, :8])]
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, device="cpu")
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=data, config=cfg) as trainer:
        with pytest.raises(DataError) as e:
            await asyncio.wait_for(trainer.run(2), 30)
        assert len(e.value.report.steps) == 1  # the first batch's step, kept
        assert trainer.engine is not None and trainer.engine.next_t == 1
    assert "disagree in shape: (4, 16) vs (4, 8)" in str(e.value)


@pytest.mark.asyncio
async def test_steps_must_be_positive(tmp_path):
    async with SnakeTrainer(tiny_gpt(), data=batches(1, 2), config=SnakeConfig(offload_dir=tmp_path)) as t:
        with pytest.raises(ConfigError, match="steps"):
            await t.run(0)


@pytest.mark.asyncio
async def test_not_enough_disk_fails_before_files(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    import snake.engine

    usage = namedtuple("usage", "total used free")
    # fake inside this test only: a disk with 1 MiB free
    monkeypatch.setattr(snake.engine.shutil, "disk_usage", lambda p: usage(2**30, 2**30 - 2**20, 2**20))
    assert shutil.disk_usage is snake.engine.shutil.disk_usage
    off = tmp_path / "off"
    cfg = SnakeConfig(micro_batches=2, offload_dir=off, placement=Placement.all_ssd(), device="cpu")
    async with SnakeTrainer(tiny_gpt(n_embd=128), data=batches(1, 4), config=cfg) as trainer:
        with pytest.raises(ConfigError, match=r"offload_dir.*[GM]iB free but the SSD tier needs"):
            await asyncio.wait_for(trainer.run(1), 30)
    assert not list(off.glob("*.bin"))


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "backend,match",
    [
        ("kvikio", r"storage_backend.*needs a CUDA device.*use 'auto'"),  # on a CPU device
        ("posix", r"storage_backend.*O_DIRECT.*'buffered'"),  # where O_DIRECT is refused (faked below)
    ],
)
async def test_storage_backend_that_cannot_run_fails_before_files(tmp_path, monkeypatch, backend, match):
    import snake.engine

    monkeypatch.setattr(snake.engine, "o_direct_works", lambda d: False)  # fake: a tmpfs offload_dir
    off = tmp_path / "off"
    cfg = SnakeConfig(micro_batches=2, offload_dir=off, placement=Placement.all_ssd(), device="cpu",
                      storage_backend=backend)
    async with SnakeTrainer(tiny_gpt(), data=batches(1, 4), config=cfg) as trainer:
        with pytest.raises(ConfigError, match=match):
            await asyncio.wait_for(trainer.run(1), 30)
    assert not list(off.glob("*.bin"))


def test_offload_dir_dangling_symlink(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="symlink to .*nowhere, which does not exist"):
        SnakeTrainer(tiny_gpt(), data=batches(1, 2), config=SnakeConfig(offload_dir=link))


@pytest.mark.asyncio
async def test_offload_dir_symlink_to_elsewhere_is_followed(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    cfg = SnakeConfig(micro_batches=2, offload_dir=link, placement=Placement.all_ssd(), device="cpu")
    async with SnakeTrainer(tiny_gpt(), data=batches(1, 4), config=cfg) as trainer:
        await asyncio.wait_for(trainer.run(1), 30)
        assert {f.name for f in real.glob("*.bin")} == {"param.bin", "opt.bin", "ckpt.bin"}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "inputs,match",
    [
        (torch.full((4, 16), float("nan")), "NaN"),
        (torch.zeros(4, 16, dtype=torch.long, device="meta"), "on meta"),
    ],
)
async def test_nan_or_wrong_device_inputs(tmp_path, inputs, match):
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, device="cpu")
    data = [(inputs, torch.zeros(4, 16, dtype=torch.long))]
    async with SnakeTrainer(tiny_gpt(), data=data, config=cfg) as trainer:
        with pytest.raises(DataError, match=match):
            await asyncio.wait_for(trainer.run(1), 30)


@pytest.mark.asyncio
async def test_failed_setup_leaves_nothing_behind(tmp_path):
    import threading

    bad = [(torch.zeros(3, 16, dtype=torch.long), torch.zeros(3, 16, dtype=torch.long))]
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, device="cpu")
    async with SnakeTrainer(tiny_gpt(), data=bad, config=cfg) as trainer:
        with pytest.raises(DataError):
            await asyncio.wait_for(trainer.run(1), 30)
        assert not [t for t in threading.enumerate() if t.name.startswith("snake-")]
        # the offload_dir is not left locked: a corrected trainer can use it at once
        async with SnakeTrainer(tiny_gpt(), data=batches(1, 4), config=cfg) as fixed:
            await asyncio.wait_for(fixed.run(1), 30)


@pytest.mark.asyncio
async def test_a_setup_cancelled_while_it_writes_the_initial_weights_can_be_retried(tmp_path, monkeypatch):
    """The first run() writes every layer's initial weights to the stores; cancelled there
    (each layer here takes 0.2 s to read) it stops before the next layer and leaves nothing
    behind: no thread, no offload file, no lock, the config as given. The next run() sets up
    again and trains to the weights of a run never cancelled."""
    import threading

    import snake.engine

    cfg = SnakeConfig(offload_dir=tmp_path / "off", device="cpu", placement=Placement(param=0.5, ckpt=0.5, opt=0.5),
                      alpha=0.3)  # micro_batches left to the planner
    data = batches(2, 4)
    real, read = snake.engine.layer_values, []
    loop, first = asyncio.get_running_loop(), asyncio.Event()

    def slow(parts, layer, named):
        read.append(layer)
        loop.call_soon_threadsafe(first.set)
        threading.Event().wait(0.2)
        return real(parts, layer, named)

    async with SnakeTrainer(tiny_gpt(n_layer=6), data=data, config=cfg) as trainer:
        with monkeypatch.context() as m:
            m.setattr(snake.engine, "layer_values", slow)
            task = asyncio.create_task(trainer.run(2))
            await first.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert read == [0]
        assert trainer.engine is None and trainer.config == cfg
        assert not [t for t in threading.enumerate() if t.name.startswith("snake-")]
        assert not list((tmp_path / "off").glob("*.bin"))
        async with SnakeTrainer(tiny_gpt(n_layer=6), data=batches(1, 4), config=cfg) as other:  # not locked
            await asyncio.wait_for(other.run(1), 60)
        await asyncio.wait_for(trainer.run(2), 60)
        got = await trainer.state_dict()
    async with SnakeTrainer(tiny_gpt(n_layer=6), data=data, config=cfg) as straight:
        await asyncio.wait_for(straight.run(2), 60)
        want = await straight.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.asyncio
async def test_state_dict_during_run_is_refused(tmp_path):
    from snake import SnakeError

    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path, device="cpu")
    async with SnakeTrainer(tiny_gpt(), data=batches(20, 4), config=cfg) as trainer:
        task = asyncio.ensure_future(trainer.run(20))
        await asyncio.sleep(0.5)
        with pytest.raises(SnakeError, match="in progress"):
            await trainer.state_dict()
        await asyncio.wait_for(task, 120)


def test_targets_without_a_known_vocabulary():
    """A model snake cannot read a vocabulary from (ModelParts): -100 targets still count as
    not trained on, other negative ones are a DataError before the kernels see them."""
    from snake.data import Vocab, split_batch

    x = torch.zeros(4, 8, dtype=torch.long)
    y = torch.ones(4, 8, dtype=torch.long)
    y[0, :3] = -100
    kw = dict(micro_batches=2, device=torch.device("cpu"), expect_shape=None, vocab=Vocab())
    ins, tgs, tokens, trained = split_batch((x, y), **kw)
    assert (len(ins), len(tgs), tokens, trained) == (2, 2, 32, 29)
    assert split_batch((x, torch.ones(4, 8, dtype=torch.long)), **kw)[3] is None  # none ignored
    y[1, 0] = -5
    with pytest.raises(DataError, match=r">= 0 or -100 \(not trained on\), got min -5"):
        split_batch((x, y), **kw)


class _NoConfigLM(torch.nn.Module):
    """A language model snake cannot read a vocabulary from: no `config`, 40 input ids and
    24 logits per token (its head is narrower than its embedding)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(40, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU())
                                          for _ in range(2))
        self.head = torch.nn.Linear(16, 24)


def _no_config_parts():
    from snake import ModelParts

    m = _NoConfigLM()
    return ModelParts(model=m, blocks=list(m.layers), blocks_prefix="layers",
                      pre=lambda m, i: m.embed(i), post=lambda m, h: m.head(h))


@pytest.mark.asyncio
async def test_targets_past_the_heads_width_are_a_data_error_without_a_config(tmp_path):
    """A ModelParts model without `config.vocab_size`: a target id past its head's width
    (measured: 24 logits per token) was an IndexError deep in the loss (ActorFailed, after
    the engine had written its state); now a DataError before anything starts. Input ids
    past the head's width but inside the embedding (40 rows) still train."""
    x = torch.randint(0, 40, (4, 8), generator=torch.Generator().manual_seed(0))
    off = tmp_path / "off"
    cfg = SnakeConfig(micro_batches=2, offload_dir=off, device="cpu", placement=Placement(), alpha=0.0)
    async with SnakeTrainer(_no_config_parts(), data=[(x, torch.full((4, 8), 24))], config=cfg) as trainer:
        with pytest.raises(DataError, match=r"target ids must be in \[0, 24\) \(the model's logits per token\)"):
            await asyncio.wait_for(trainer.run(1), 30)
    assert not any(off.iterdir()), "no state may be written before the input is checked"
    y = torch.randint(0, 24, (4, 8), generator=torch.Generator().manual_seed(1))
    async with SnakeTrainer(_no_config_parts(), data=[(x, y)], config=cfg) as trainer:
        report = await asyncio.wait_for(trainer.run(1), 30)
    assert report.steps[0].loss == report.steps[0].loss  # not NaN


@pytest.mark.asyncio
async def test_input_ids_past_the_embedding_are_a_data_error_without_a_config(tmp_path):
    """The same model's inputs: an id past its embedding's 40 rows was an IndexError in the
    compute actor (ActorFailed); now a DataError naming the range, before anything is
    written. Its head is narrower (24), so the inputs' range is the embedding's own."""
    parts = _no_config_parts()
    assert input_rows(parts) == 40
    x = torch.randint(0, 40, (4, 8), generator=torch.Generator().manual_seed(0))
    x[1, 3] = 40
    off = tmp_path / "off"
    cfg = SnakeConfig(micro_batches=2, offload_dir=off, device="cpu", placement=Placement(), alpha=0.0)
    async with SnakeTrainer(parts, data=[(x, torch.zeros(4, 8, dtype=torch.long))], config=cfg) as trainer:
        with pytest.raises(DataError, match=r"token ids must be in \[0, 40\), got min \d+, max 40"):
            await asyncio.wait_for(trainer.run(1), 30)
    assert not any(off.iterdir()), "no state may be written before the input is checked"


class _TaggedLM(_NoConfigLM):
    """The first token of a row is a language tag from a 4-row table, the rest are tokens of
    the 40-row one; `pre` also keeps a running statistic."""

    def __init__(self) -> None:
        super().__init__()
        self.tags = torch.nn.Embedding(4, 16)
        self.norm = torch.nn.BatchNorm1d(16)

    def pre(self, idx):
        h = torch.cat([self.tags(idx[:, :1]), self.embed(idx[:, 1:])], dim=1)
        return self.norm(h.transpose(1, 2)).transpose(1, 2)


def test_input_rows_is_not_misled_by_a_table_for_the_first_position():
    """An audit's find: the one-token probe took the 4-row tag table for the inputs' range
    and refused valid data (ids up to 39 past position 0). A table must fail at the first
    and the second position to bound the inputs; the probes run in eval mode, so the
    running statistics of `pre` are not moved by them."""
    from snake import ModelParts

    m = _TaggedLM()
    parts = ModelParts(model=m, blocks=list(m.layers), blocks_prefix="layers",
                       pre=lambda m, i: m.pre(i), post=lambda m, h: m.head(h))
    before = m.norm.running_mean.clone()
    assert input_rows(parts) is None
    assert input_rows(_no_config_parts()) == 40
    assert torch.equal(m.norm.running_mean, before) and m.training
