"""An offload_dir on a file system in memory (tmpfs, ramfs; on Linux >= 6.6 tmpfs takes
O_DIRECT, so nothing else would tell) warns that its "SSD" tier takes CPU memory."""

import warnings
from pathlib import Path

import pytest

from snake import Placement, SnakeConfig, SnakeTrainer
from snake.offload_dir import InMemoryOffloadWarning, memory_fs, scratch_parent
from tests.helpers import batches, tiny_gpt

MOUNTS = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 252:0 / / rw,relatime - ext4 /dev/vda rw
30 27 0:26 / /tmp rw,nosuid - tmpfs tmpfs rw,size=1024k
31 30 252:1 / /tmp/disk rw,relatime - ext4 /dev/vdb rw
32 27 0:27 / /mnt/my\\040ram rw - ramfs ramfs rw
"""


def test_the_mount_table_names_the_file_system_of_a_path():
    assert memory_fs("/home/me/offload", MOUNTS) is None  # ext4 at /
    assert memory_fs("/tmp/offload", MOUNTS) == "tmpfs"
    assert memory_fs("/tmp", MOUNTS) == "tmpfs"
    assert memory_fs("/tmp/disk/offload", MOUNTS) is None  # a disk mounted inside the tmpfs
    assert memory_fs("/tmpx/offload", MOUNTS) is None  # a prefix of the name is not a parent
    assert memory_fs("/mnt/my ram/x", MOUNTS) == "ramfs"  # octal escapes in the table
    assert memory_fs("/x", "") is None


def test_this_machines_table_agrees_with_a_known_mount():
    table = Path("/proc/self/mountinfo").read_text()
    root_fs = next(line.partition(" - ")[2].split()[0] for line in table.splitlines() if line.split()[4] == "/")
    assert memory_fs("/", table) == (root_fs if root_fs in ("tmpfs", "ramfs") else None)


@pytest.mark.asyncio
async def test_an_offload_dir_in_memory_warns_with_the_tiers_size(tmp_path, monkeypatch):
    monkeypatch.setattr("snake.engine.memory_fs", lambda path: "tmpfs")
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path / "a", placement=Placement(param=0.5, ckpt=0.5, opt=0.5),
                      alpha=0.0, device="cpu")
    with pytest.warns(InMemoryOffloadWarning, match=r"is on tmpfs, in memory: its SSD tier \([0-9.]+ MiB\) take CPU"):
        async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(1, 4), config=cfg) as t:
            await t.run(1)
    # nothing on the "SSD": nothing to say
    cfg = SnakeConfig(micro_batches=2, offload_dir=tmp_path / "b", placement=Placement.all_cpu(), alpha=0.0,
                      device="cpu")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        async with SnakeTrainer(tiny_gpt(n_layer=2), data=batches(1, 4), config=cfg) as t:
            await t.run(1)
    assert not [w for w in seen if issubclass(w.category, InMemoryOffloadWarning)]


def test_a_temporary_offload_dir_goes_to_a_disk_where_tmp_is_in_memory(tmp_path):
    """`snake train` without --offload-dir: the system's temporary directory, unless it is a
    tmpfs (as /tmp is on Fedora and Arch), then the next candidate on a disk; None (the
    default, which warns) where none is."""
    tmp, disk, ram = (tmp_path / n for n in ("tmp", "disk", "ram"))
    for d in (tmp, disk, ram):
        d.mkdir()
    table = (f"27 1 252:0 / / rw - ext4 /dev/vda rw\n30 27 0:26 / {tmp} rw - tmpfs tmpfs rw\n"
             f"31 27 0:27 / {ram} rw - ramfs ramfs rw\n")
    assert scratch_parent(table, (str(tmp), str(disk))) == str(disk)
    assert scratch_parent(table, (str(disk), str(tmp))) == str(disk)
    assert scratch_parent(table, (str(tmp), str(ram))) is None
    assert scratch_parent(table, (str(tmp), str(tmp_path / "missing"), str(disk))) == str(disk)
    assert scratch_parent("27 1 252:0 / / rw - ext4 /dev/vda rw\n", (str(tmp), str(disk))) == str(tmp)
