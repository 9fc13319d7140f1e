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


def test_the_memory_model_counts_an_in_memory_tiers_files():
    """offload_in_memory: each kind's SSD share, the resident state on SSD and the mapped
    frozen layer weights are host memory too (their files in a tmpfs): the footprint at any
    shares is the disk case's plus those bytes."""
    from snake.memory import OPT_BYTES_PER_ELEM, ModelShape, host_memory

    shape = ModelShape(n_layers=4, layer_params=1000, ckpt_elems=300, resident_params=500, tokens_per_micro=16,
                       dtype_bytes=2, vocab_size=50, layer_frozen_params=70, layer_frozen_in_files=True)
    kw = dict(n_micro=3, alpha=0.25, schedule="vertical", workers=2, resident_on_ssd=True)
    disk, ram = host_memory(shape, **kw), host_memory(shape, **kw, offload_in_memory=True)
    totals = {"param": 4 * 1000 * 2, "ckpt": 4 * 3 * 300 * 2, "opt": 4 * 1000 * OPT_BYTES_PER_ELEM}
    files = 500 * OPT_BYTES_PER_ELEM + 4 * 70 * 2
    for x in ((0.0, 0.0, 0.0), (0.5, 0.25, 1.0), (1.0, 1.0, 1.0)):
        on_ssd = sum((1 - xi) * totals[k] for k, xi in zip(("param", "ckpt", "opt"), x, strict=True))
        assert ram.at(*x) == pytest.approx(disk.at(*x) + on_ssd + files)


def test_the_planner_keeps_a_tier_in_memory_in_cpu_memory_or_says_why_not():
    """A budget the model fits in only with shares on SSD: with offload_dir on a disk the
    planner puts them there; in a tmpfs that spares nothing, so the plan is infeasible and
    says to put offload_dir on a disk. With room for everything, in a tmpfs it keeps every
    share in CPU memory (the "SSD" would only cost time)."""
    import dataclasses

    from planner.search import search
    from planner.solve import Infeasible, Plan
    from tests.planner.conftest import synthetic_profile

    base = synthetic_profile()
    tight = search(base)
    assert isinstance(tight, Plan) and min(tight.placement.param, tight.placement.opt) < 1
    short = search(dataclasses.replace(base, offload_in_memory=True))
    assert isinstance(short, Infeasible) and short.resource == "cpu_memory"
    assert "offload_dir on a disk" in short.fix and "tmpfs" in short.fix
    roomy = dataclasses.replace(base, offload_in_memory=True, cpu_memory_bytes=20 * base.cpu_memory_bytes)
    plan = search(roomy)
    assert isinstance(plan, Plan)
    assert (plan.placement.param, plan.placement.ckpt, plan.placement.opt) == (1.0, 1.0, 1.0)


@pytest.mark.asyncio
async def test_a_fixed_placement_counts_its_tier_in_a_tmpfs(tmp_path, monkeypatch):
    """The same placement and budget: it fits with offload_dir on a disk, and in a tmpfs it is
    refused before anything is made, naming offload_dir and the fix."""
    from planner.profile import shape_of_parts
    from snake import ConfigError
    from snake.adapters import describe
    from snake.memory import placement_bytes

    model = tiny_gpt(n_layer=2, bias=False)
    placement = Placement(param=0.0, ckpt=0.0, opt=0.0)
    kw = dict(n_micro=1, alpha=0.0, schedule="vertical", workers=2, device_type="cpu", param=0.0, ckpt=0.0, opt=0.0)
    shape = shape_of_parts(describe(model), 4, 16, "float32")
    disk, ram = placement_bytes(shape, **kw), placement_bytes(shape, **kw, offload_in_memory=True)
    assert ram > disk
    cfg = dict(micro_batches=1, placement=placement, alpha=0.0, device="cpu", cpu_memory_bytes=int((disk + ram) / 2))
    async with SnakeTrainer(model, data=batches(1, 4), config=SnakeConfig(offload_dir=tmp_path / "disk", **cfg)) as t:
        await t.run(1)
    monkeypatch.setattr("snake.trainer.memory_fs", lambda path: "tmpfs")
    with pytest.raises(ConfigError, match=r"offload_dir on a disk: .* is in memory \(tmpfs\)"):
        async with SnakeTrainer(tiny_gpt(n_layer=2, bias=False), data=batches(1, 4),
                                config=SnakeConfig(offload_dir=tmp_path / "ram", **cfg)) as t:
            await t.run(1)
    assert not list((tmp_path / "ram").glob("*.bin"))


def test_the_planner_learns_where_offload_dir_is_from_the_config(tmp_path, monkeypatch):
    from planner.integrate import with_budgets
    from tests.planner.conftest import synthetic_profile

    cfg = SnakeConfig(micro_batches=1, offload_dir=tmp_path, placement=None, alpha=0.0, device="cpu")
    assert not with_budgets(synthetic_profile(), cfg).offload_in_memory  # the test's disk
    monkeypatch.setattr("planner.integrate.memory_fs", lambda path: "tmpfs" if path == tmp_path else None)
    assert with_budgets(synthetic_profile(), cfg).offload_in_memory
