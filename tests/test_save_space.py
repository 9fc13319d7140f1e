"""A save() that cannot fit on its disk is refused before anything changes: the checkpoint
(counted by `snake.checkpoint_files.checkpoint_bytes`, a lower bound of its files) and, with the
resident optimizer state on SSD, the scratch copy a save makes of it in the offload_dir."""

import errno
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from snake import Placement, SnakeConfig, SnakeTrainer
from snake.checkpoint_files import checkpoint_bytes
from snake.errors import StorageError
from snake.manifest import MANIFEST, RNG
from tests.helpers import batches, tiny_gpt

Usage = namedtuple("Usage", "total used free")


def _free_at(monkeypatch, tmp_path: Path, free: int) -> None:
    """shutil.disk_usage reports `free` bytes for every path under tmp_path."""
    real = shutil.disk_usage

    def usage(p):  # type: ignore[no-untyped-def]
        if Path(p).resolve().is_relative_to(tmp_path.resolve()):
            return Usage(1 << 40, (1 << 40) - free, free)
        return real(p)

    monkeypatch.setattr(shutil, "disk_usage", usage)


def _cfg(tmp_path: Path, **kw) -> SnakeConfig:
    base = dict(micro_batches=2, offload_dir=tmp_path / "off", placement=Placement(param=0.5, ckpt=0.3, opt=0.6),
                alpha=0.3, device="cpu")
    return SnakeConfig(**{**base, **kw})


def _frozen_head(model):  # type: ignore[no-untyped-def]
    model.blocks[0].attn.c_attn.weight.requires_grad_(False)  # a frozen block weight, saved as it is
    return model


@pytest.mark.asyncio
async def test_checkpoint_bytes_is_a_tight_lower_bound_of_the_files(tmp_path):
    model = _frozen_head(tiny_gpt(n_layer=3, bias=False))
    async with SnakeTrainer(model, data=batches(2, 4), config=_cfg(tmp_path)) as t:
        await t.run(1)
        await t.save(tmp_path / "ckpt")
        want = checkpoint_bytes(t.parts)
    files = [f for f in (tmp_path / "ckpt").iterdir() if f.name not in (MANIFEST, RNG)]
    got = sum(f.stat().st_size for f in files)
    assert want <= got <= want + 4096 * len(files), (want, got)  # the rest: each file's header


@pytest.mark.asyncio
async def test_a_save_that_does_not_fit_is_refused_and_changes_nothing(tmp_path, monkeypatch):
    """Room for less than the checkpoint: a StorageError (ENOSPC) naming the disk and the
    sizes; the delayed steps were not applied, the earlier checkpoint is there as it was, no
    temporary directory is left, and the run goes on to the weights of one never saved."""
    data = batches(3, 4)
    async with SnakeTrainer(tiny_gpt(n_layer=3, bias=False), data=data, config=_cfg(tmp_path)) as t:
        await t.run(1)
        await t.save(tmp_path / "ckpt")
        before = {f.name: f.read_bytes() for f in (tmp_path / "ckpt").iterdir()}
        await t.run(1)
        need = checkpoint_bytes(t.parts)
        with monkeypatch.context() as m:
            _free_at(m, tmp_path, need - 1)
            with pytest.raises(StorageError, match="needs at least") as e:
                await t.save(tmp_path / "ckpt")
        await t.run(1)
        got = await t.state_dict()
    assert e.value.errno == errno.ENOSPC
    assert str(tmp_path) in str(e.value) and "the checkpoint" in str(e.value) and "free space there" in str(e.value)
    assert {f.name: f.read_bytes() for f in (tmp_path / "ckpt").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    async with SnakeTrainer(tiny_gpt(n_layer=3, bias=False), data=data, config=_cfg(tmp_path / "b")) as t:
        await t.run(3)
        want = await t.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.asyncio
async def test_room_for_the_checkpoint_saves(tmp_path, monkeypatch):
    """Exactly the counted bytes free: the check lets the save through (the write itself is
    what fails on a disk that is really full)."""
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(2, 4), config=_cfg(tmp_path)) as t:
        await t.run(1)
        _free_at(monkeypatch, tmp_path, checkpoint_bytes(t.parts) + 8192)
        await t.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / MANIFEST).is_file()


@pytest.mark.asyncio
async def test_the_resident_state_on_ssd_counts_its_scratch_copy(tmp_path, monkeypatch):
    """With resident_optimizer="ssd" a save also reads that state into a scratch file in the
    offload_dir (12 bytes per resident parameter). Here on the checkpoint's disk: room for the
    checkpoint alone is refused, naming both."""
    async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(2, 4),
                            config=_cfg(tmp_path, resident_optimizer="ssd")) as t:
        await t.run(1)
        need = checkpoint_bytes(t.parts)
        scratch = 12 * sum(s.numel() for s in t.engine.kernels.res_shapes)
        with monkeypatch.context() as m:
            _free_at(m, tmp_path, need + scratch - 1)
            with pytest.raises(StorageError, match="scratch copy of the resident optimizer state") as e:
                await t.save(tmp_path / "ckpt")
            assert "the checkpoint" in str(e.value)
            _free_at(m, tmp_path, need + scratch + 8192)
            await t.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / MANIFEST).is_file()
