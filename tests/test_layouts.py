"""Layouts that cannot be exchanged fail at construction on every rank, naming parameter and
placements; their nearest supported relatives construct."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from dmuon_fsdp import DMuonFSDP
from dmuon_fsdp._step.layouts import rank_boxes, replica_indices
from tests.support.spawn import run_ranks


def _error(params, **options):
    try:
        DMuonFSDP([{"params": params, **options}])
    except NotImplementedError as e:
        return str(e)
    return None


def unsupported_layouts(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))

    def local(placement, shape=(6, 8)):
        local_shape = (shape[0] // world_size, *shape[1:])
        t = DTensor.from_local(torch.zeros(local_shape), mesh, [placement], shape=shape, stride=(shape[1], 1))
        return [("w", nn.Parameter(t))]

    conv = [("conv", nn.Parameter(distribute_tensor(torch.zeros(4, 6, 8), mesh, [Shard(2)])))]
    return {
        "partial": _error([("w", nn.Parameter(DTensor.from_local(torch.zeros(6, 8), mesh, [Partial()])))]),
        "strided": _error(local(_StridedShard(0, split_factor=2))),
        "conv_flattened": _error(conv),
        "conv_stacked": _error(conv, flatten=False),
        "row_shard": _error(local(Shard(0))),
    }


def test_unsupported_layouts_raise_on_every_rank():
    for errors in run_ranks(unsupported_layouts, 2):
        assert "w" in errors["partial"] and "Partial(sum)" in errors["partial"]
        assert "'w'" in errors["strided"] and "_StridedShard" in errors["strided"]
        assert "'conv'" in errors["conv_flattened"] and "cannot be reassembled" in errors["conv_flattened"]
        assert "Shard(dim=2)" in errors["conv_flattened"]
        # As a stack of 4 matrices (6, 8), dim 2 is each matrix's columns: a rectangle per rank.
        assert errors["conv_stacked"] is None and errors["row_shard"] is None


def test_rank_boxes_match_dtensor_layouts_seen_on_a_2x2_mesh():
    # Read from real (dp=2, tp=2) FSDP2 + TP parameters with torch 2.13 (see tests/test_meshes.py).
    colwise = rank_boxes((13, 9), (2, 2), (_StridedShard(0, split_factor=2), Shard(0)))
    assert [(o[0], s[0]) for o, s in colwise] == [(0, 4), (7, 3), (4, 3), (10, 3)]
    rowwise = rank_boxes((9, 13), (2, 2), (Shard(0), Shard(1)))
    assert rowwise == (((0, 0), (5, 7)), ((0, 7), (5, 6)), ((5, 0), (4, 7)), ((5, 7), (4, 6)))
    hsdp = rank_boxes((5, 3), (2, 3), (Replicate(), Shard(0)))
    assert [s[0] for _, s in hsdp] == [2, 2, 1, 2, 2, 1]
    assert replica_indices((2, 3), (Replicate(), Shard(0))) == (0, 0, 0, 1, 1, 1)
    assert rank_boxes((5, 3), (4,), (Shard(0),))[3] == ((5, 0), (0, 3)), "empty last shard"


def _dtensor_boxes(shape, mesh_shape, placements):
    from itertools import product

    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    boxes = []
    for coordinate in product(*(range(n) for n in mesh_shape)):
        local, offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coordinate), placements
        )
        boxes.append((tuple(offset), tuple(local)))
    return boxes


def test_rank_boxes_agree_with_dtensor_on_random_layouts():
    # Random shapes (small and uneven), 1-D to 3-D meshes, Shard / Replicate on any dims and
    # FSDP2's _StridedShard over a later Shard of the same dim; empty blocks' offsets aside.
    gen = torch.Generator().manual_seed(0)

    def draw(n):
        return int(torch.randint(n, (1,), generator=gen))

    checked = 0
    for _ in range(300):
        shape = tuple(draw(9) for _ in range(1 + draw(3)))
        mesh_shape = tuple(1 + draw(3) for _ in range(1 + draw(3)))
        placements = [Shard(draw(len(shape))) if draw(3) else Replicate() for _ in mesh_shape]
        if len(mesh_shape) > 1 and draw(2) and type(placements[-1]) is Shard:
            dim = placements[-1].dim
            later = [
                n
                for n, p in zip(mesh_shape[1:], placements[1:], strict=True)
                if type(p) is Shard and p.dim == dim
            ]
            placements[0] = _StridedShard(dim, split_factor=math.prod(later))
        placements = tuple(placements)
        ours = rank_boxes(shape, mesh_shape, placements)
        for (offset, size), (d_offset, d_size) in zip(
            ours, _dtensor_boxes(shape, mesh_shape, placements), strict=True
        ):
            assert size == d_size, (shape, mesh_shape, placements)
            assert offset == d_offset or not all(size), (shape, mesh_shape, placements)
        checked += 1
    assert checked == 300


def meshes_of_one_job(rank, world_size):
    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def weight(mesh):
        return nn.Parameter(distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)] * mesh.ndim))

    subs = [(f"on_{'_'.join(mesh.mesh_dim_names)}", weight(mesh)) for mesh in (root["dp"], root["tp"])]
    views = subs + [("on_root", weight(root)), ("on_world", weight(init_device_mesh("cpu", (4,))))]
    ranks = [DMuonFSDP(params).exchange_ranks for params in (subs, views, views[::-1])]
    half = DeviceMesh.from_group(dist.new_subgroups(2)[0], "cpu")  # over [0, 1] or [2, 3], on its own
    try:
        DMuonFSDP(views + [("other", weight(half))])
    except ValueError as e:
        return ranks, str(e)
    return ranks, None


def test_meshes_that_view_one_job_exchange_over_all_its_ranks():
    # Sub-meshes link through their copies (dp's [0, 2] and [1, 3], tp's [0, 1] and [2, 3]); a
    # mesh made over half of the job on its own leaves the parameter on the other half unknown.
    for ranks, error in run_ranks(meshes_of_one_job, 4):
        assert ranks == [(0, 1, 2, 3)] * 3
        assert error is not None and "'other'" in error and "ranks [0, 1, 2, 3]" in error
