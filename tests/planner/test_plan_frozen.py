"""The planner's time model of a fine-tune of the top layers: the layers below the lowest
one that trains anything run no backward (`snake.adapters.lowest_backward`), so the
profile's recompute and backward seconds count them as none, the backward phase loads
neither their frozen weights nor their checkpoints, and those checkpoints are not written
to SSD."""

from __future__ import annotations

import dataclasses

import pytest

from planner import probes
from planner.model import vertical_phases
from planner.profile import shape_of_parts
from planner.solve import predict
from snake import Placement
from snake.adapters import describe
from tests.helpers import tiny_gpt
from tests.planner.conftest import synthetic_profile


def frozen_bottom(n_frozen: int, n_layer: int = 4):
    model = tiny_gpt(n_layer=n_layer, bias=False)
    model.wte.requires_grad_(False)
    model.wpe.requires_grad_(False)
    for blk in model.blocks[:n_frozen]:
        blk.requires_grad_(False)
    return model


def test_the_shape_counts_the_layers_with_a_backward():
    assert shape_of_parts(describe(frozen_bottom(1)), 2, 16, "float32").bwd_layers == 3
    assert shape_of_parts(describe(frozen_bottom(0)), 2, 16, "float32").bwd_layers is None  # all of them
    trained_embedding = tiny_gpt(n_layer=4)
    trained_embedding.blocks[0].requires_grad_(False)  # the gradient flows through it to the embedding
    assert shape_of_parts(describe(trained_embedding), 2, 16, "float32").bwd_layers is None


def test_block_times_count_no_backward_below_the_lowest_trained_layer(monkeypatch):
    """Per layer over all of them: every layer's forward, the recompute and backward of
    those with one (a frozen kind and a trained kind, timed on their own; fake times)."""
    times = {True: (1.0, 2.0, 4.0), False: (1.0, 1.0, 1.0)}  # trained kind, frozen kind

    def fake(parts, layers, *a, **kw):
        return times[any(p.requires_grad for p in parts.blocks[layers[0]].parameters())]

    monkeypatch.setattr(probes, "_kind_seconds", fake)
    parts = describe(frozen_bottom(1))  # layer 0 frozen, no backward; layers 1-3 trained
    fwd, rec, bwd = probes.block_seconds(None, 2, 16, "cpu", None, 0.1, parts=parts)
    assert (fwd, rec, bwd) == (1.0, 3 * 2.0 / 4, 3 * 4.0 / 4)
    mid = tiny_gpt(n_layer=4, bias=False)
    mid.blocks[1].requires_grad_(False)  # a frozen layer above a trained one runs its backward
    fwd, rec, bwd = probes.block_seconds(None, 2, 16, "cpu", None, 0.1, parts=describe(mid))
    assert (fwd, rec, bwd) == (1.0, (3 * 2.0 + 1.0) / 4, (3 * 4.0 + 1.0) / 4)


def test_the_backward_loads_only_the_layers_that_have_one():
    """Where the host->device link binds the backward, a quarter of the layers without one
    take a quarter of its frozen weights' and checkpoints' bytes off it."""
    base = synthetic_profile(h2d_bytes_per_s=1e8, d2h_bytes_per_s=1e8)
    shape = dataclasses.replace(base.shape, layer_frozen_params=base.shape.layer_params, layer_params=0)
    full = dataclasses.replace(base, shape=shape)
    top = dataclasses.replace(base, shape=dataclasses.replace(shape, bwd_layers=18))
    (f_full, b_full), (f_top, b_top) = vertical_phases(full, 4, 0.0), vertical_phases(top, 4, 0.0)
    assert b_top.traffic.h2d_bytes == 0.75 * b_full.traffic.h2d_bytes
    assert b_top.traffic.ssd_read[1] == 0.75 * b_full.traffic.ssd_read[1]
    # their checkpoints only feed the next forward stage: not written to SSD
    assert f_top.traffic.ssd_write[1] == 0.75 * f_full.traffic.ssd_write[1]
    cb = shape.ckpt_elems * shape.ckpt_bytes  # and the one kept on the device between stages is not stored
    assert f_top.traffic.d2h_bytes == f_full.traffic.d2h_bytes - 0.25 * cb
    fast, slow = (predict(p, 4, Placement(param=1.0, ckpt=1.0, opt=1.0), 0.0, "vertical") for p in (top, full))
    assert fast < slow
    for schedule in ("vertical", "horizontal"):  # no bwd_layers: the model as before
        same = dataclasses.replace(base, shape=dataclasses.replace(shape, bwd_layers=24))
        x = Placement(param=0.5, ckpt=0.5, opt=0.5)
        assert predict(same, 4, x, 0.3, schedule) == predict(full, 4, x, 0.3, schedule)


def test_a_block_without_parameters_is_timed():
    """A parameterless block (a layer of no elements) is probed as any other: it failed
    building its device slot from no tensors (an audit's find)."""
    import torch

    from tests.test_model_checks import Tiny, parts

    m = Tiny()
    m.layers[1] = torch.nn.Identity()
    fwd, rec, bwd = probes.block_seconds(None, 2, 16, torch.device("cpu"), torch.float32, 0.02, parts=describe(parts(m)))
    assert all(t > 0 for t in (fwd, rec, bwd))


def lora_profile(**changes):
    """A LoRA-style fine-tune of a streamed model: few trained elements per layer, most of
    it frozen weights mapped from a file (2.4 GB over the 24 layers), which the memory model
    leaves to the page cache."""
    p = synthetic_profile()
    shape = dataclasses.replace(p.shape, layer_params=1 << 20, layer_frozen_params=50 << 20, layer_frozen_in_files=True)
    return dataclasses.replace(p, shape=shape, **changes)


def test_mapped_frozen_weights_read_from_disk_cost_their_reads_at_every_load():
    """Where the page cache cannot hold them, each load of a layer reads its frozen weights
    from the SSD: vertically once in the forward and once in the backward."""
    from planner.model import horizontal_phases, mapped_frozen_bytes

    prof = lora_profile()
    frozen = prof.shape.layer_frozen_params * prof.shape.dtype_bytes
    assert mapped_frozen_bytes(prof.shape) == 24 * frozen
    x = (0.5, 0.5, 0.5, 1.0)
    for name, cached, disk in zip(("fwd", "bwd"), vertical_phases(prof, 4, 0.0), vertical_phases(prof, 4, 0.0, True),
                                  strict=True):
        ssd = {b.name: b for b in cached.bounds}[f"ssd_{name}"]
        ssd_disk = {b.name: b for b in disk.bounds}[f"ssd_{name}"]
        assert ssd_disk.at(x) - ssd.at(x) == pytest.approx(frozen / prof.ssd_read_bytes_per_s)
        assert disk.ssd_bytes_at(x) - cached.ssd_bytes_at(x) == pytest.approx(frozen)
    # horizontal: at every micro-batch's forward and backward
    extra = sum(ph.count * (d.ssd_bytes_at(x) - ph.ssd_bytes_at(x))
                for ph, d in zip(horizontal_phases(prof, 4, 0.0), horizontal_phases(prof, 4, 0.0, True), strict=True))
    assert extra == pytest.approx(2 * 4 * frozen)


def test_the_plan_leaves_the_page_cache_room_or_counts_the_reads():
    """With the memory to hold them beside the placement, the plan is the one without them;
    where the placement's budget leaves less than they take, the plan is the faster of
    leaving them room (a smaller budget) and reading them at every load, which it says."""
    from planner.model import mapped_frozen_bytes
    from planner.solve import Plan, _solve_at, off_budget, solve

    roomy = lora_profile(ssd_read_bytes_per_s=0.3e9, ssd_write_bytes_per_s=0.3e9)  # an SSD that can bind
    mapped = mapped_frozen_bytes(roomy.shape)
    kw = dict(n_micro=4, alpha=0.0, schedule="vertical", workers=2, placement=None, resident_on_ssd=False, hint=False)
    full = _solve_at(roomy, **kw)
    assert isinstance(full, Plan) and roomy.cpu_memory_bytes - off_budget(roomy, 4) - full.host_memory_bytes > mapped
    assert solve(roomy, n_micro=4, alpha=0.0) == full  # room to spare: as without them
    # a budget that holds that placement and 1 GiB beside it, less than the 2.4 GB they take
    tight = dataclasses.replace(roomy, cpu_memory_bytes=full.host_memory_bytes + off_budget(roomy, 4) + 2**30)
    room = _solve_at(dataclasses.replace(tight, cpu_memory_bytes=tight.cpu_memory_bytes - mapped), **kw)
    disk = _solve_at(tight, frozen_from_disk=True, **kw)
    assert isinstance(room, Plan) and isinstance(disk, Plan)
    assert disk.frozen_from_disk and not room.frozen_from_disk
    assert disk.ssd_bytes_per_iteration - full.ssd_bytes_per_iteration >= 2 * mapped * (1 - 1e-9)
    chosen = solve(tight, n_micro=4, alpha=0.0)
    assert isinstance(chosen, Plan)
    assert chosen == min((room, disk), key=lambda p: p.predicted_iteration_seconds)
    assert chosen.predicted_iteration_seconds > full.predicted_iteration_seconds  # what the old plan missed
