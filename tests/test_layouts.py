"""Layouts this release does not exchange fail at construction, naming parameter and placements."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dmuon_fsdp import DMuonFSDP
from spawn import run_ranks


def _error(make_params):
    try:
        DMuonFSDP(make_params())
    except NotImplementedError as e:
        return str(e)
    return None


def unsupported_layouts(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    hsdp_mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))

    def hsdp():
        model = nn.Linear(8, 6)
        fully_shard(model, mesh=hsdp_mesh)
        return model.named_parameters()

    def dtensor(placement):
        return lambda: [("w", nn.Parameter(distribute_tensor(torch.zeros(6, 8), mesh, [placement])))]

    return {
        "hsdp": _error(hsdp),
        "replicate": _error(dtensor(Replicate())),
        "shard1": _error(dtensor(Shard(1))),
        "plain": _error(lambda: [("plain.weight", nn.Parameter(torch.zeros(4, 4)))]),
    }


def test_unsupported_layouts_raise_on_every_rank():
    for errors in run_ranks(unsupported_layouts, 2):
        assert "'weight'" in errors["hsdp"] and "Replicate()" in errors["hsdp"] and "Shard(dim=0)" in errors["hsdp"]
        assert "'w'" in errors["replicate"] and "Replicate()" in errors["replicate"]
        assert "'w'" in errors["shard1"] and "Shard(dim=1)" in errors["shard1"]
        assert "plain.weight" in errors["plain"] and "2 ranks" in errors["plain"]
