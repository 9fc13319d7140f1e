"""The offload_dir's lock: one trainer per directory, and no lock file left behind."""

from __future__ import annotations

import asyncio
import os

import pytest

import snake.offload_dir
from snake import ConfigError, SnakeConfig, SnakeTrainer
from snake.offload_dir import DirLock
from tests.helpers import batches, tiny_gpt


@pytest.mark.asyncio
async def test_a_closed_trainer_leaves_no_lock_file(tmp_path):
    """Closing a trainer removes `.snake.lock` with its store files: the offload_dir is as
    empty as before the trainer (the lock file was left in every one)."""
    off = tmp_path / "off"
    cfg = SnakeConfig(micro_batches=2, device="cpu", offload_dir=off)
    async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(2, 4), config=cfg) as t:
        await asyncio.wait_for(t.run(1), 60)
        assert (off / ".snake.lock").exists()
        with pytest.raises(ConfigError, match="in use by another snake trainer"):
            async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(2, 4), config=cfg) as other:
                await other.run(1)
    assert [p.name for p in off.iterdir()] == []


def test_a_lock_released_as_another_opens_it_is_taken_again(tmp_path, monkeypatch):
    """A trainer closing (its lock file removed, then unlocked) just as another opens that
    file: the other's flock succeeds on the removed file, which it sees (the path names
    another file, or none) and tries again; a third trainer is then refused. Without the
    check two trainers would each hold a lock, one on the removed file."""
    first = DirLock(tmp_path)
    real_open = os.open
    opened = []

    def opening(path, flags, mode=0o777):  # type: ignore[no-untyped-def]
        fd = real_open(path, flags, mode)
        if not opened:
            first.release()  # the file this one just opened is removed and unlocked
        opened.append(path)
        return fd

    monkeypatch.setattr(snake.offload_dir.os, "open", opening)
    second = DirLock(tmp_path)
    monkeypatch.undo()
    assert len(opened) == 2  # tried again
    with pytest.raises(ConfigError, match="in use by another snake trainer"):
        DirLock(tmp_path)
    second.release()
    assert not (tmp_path / ".snake.lock").exists()
    DirLock(tmp_path).release()
