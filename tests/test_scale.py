"""A 1024-rank job without a cluster (and an HSDP job of 4096: 512 replicas of 8, the relay across
them included): a few of its ranks, each a process of its own under torch's fake process group
(collectives do nothing), record what every collective of two steps would move. Every rank
issues the same collectives in the same order, and every pair of sampled ranks agrees on what
each all-to-all moves between them: what one sends the other expects."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dmuon_fsdp import DMuonFSDP, param_groups
from instruments.counters import GATHERS, _Patches
from tests.support.layout_runs import Weights
from tests.support.moe import moe_block
from tests.support.spawn import run_sampled

WORLD = 1024
SAMPLED = [0, 1, 2, 511, 700, 1023]
HSDP_WORLD = 4096  # 512 replicas of 8: ranks 8 apart are twins
HSDP_SAMPLED = [0, 1, 8, 9, 2048, 4095]
# Rows from fewer than one per rank to a few per rank: most ranks hold empty shards of some
SHAPES = {"a": (2048, 24), "b": (700, 48), "c": (1030, 16), "d": (96, 300), "e": (3000, 8), "f": (5, 64)}


def given_gradients(model) -> None:
    for i, p in enumerate(model.parameters()):
        local = torch.randn(p.to_local().shape, generator=torch.Generator().manual_seed(i))
        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


class Collectives(_Patches):
    """Every collective called while active: (name, the global ranks of its group, receive
    counts, send counts); all-to-alls are recorded only (torch's fake backend refuses one that
    sends nothing while it receives, which is no error: they would do nothing anyway)."""

    targets = ((dist, ("all_to_all_single", "all_reduce", *GATHERS)),)

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []

    def wrap(self, name, original):
        def call(*args, **kwargs):
            ranks = tuple(dist.get_process_group_ranks(kwargs.get("group") or dist.group.WORLD))
            if name != "all_to_all_single":
                self.calls.append((name, ranks, (), ()))
                return original(*args, **kwargs)
            self.calls.append((name, ranks, tuple(args[2]), tuple(args[3])))
            return None

        return call


def recorded(rank, world_size, layout):
    """Every collective of two steps on this rank (``Collectives``)."""
    if layout == "moe":  # torchtitan's meshes, HSDP x EP: (2, 512) dense and (2, 4, 128) experts
        model = moe_block("hsdp", 128, 4, 128)
        groups = param_groups(model, stacked="experts")
    else:
        model = Weights(SHAPES)
        if layout == "fsdp":
            mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",))
        elif layout == "hsdp":
            mesh = init_device_mesh("cpu", (8, WORLD // 8), mesh_dim_names=("replicate", "shard"))
        else:  # HSDP across nodes: a replica a node of 8
            mesh = init_device_mesh("cpu", (world_size // 8, 8), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
        groups = model.named_parameters()
    # no check flags: a fake exchange brings none back, and the steps must run every bucket
    opt = DMuonFSDP(groups, bucket_bytes=2**12, check_grads=False, nonfinite="ignore")
    with Collectives() as collectives:
        for _ in range(2):
            given_gradients(model)
            opt.step()
    return collectives.calls


@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "moe", "hsdp4096"])
def test_every_pair_of_ranks_agrees_on_what_moves_between_them(layout):
    world, sampled = (HSDP_WORLD, HSDP_SAMPLED) if layout == "hsdp4096" else (WORLD, SAMPLED)
    results = run_sampled(recorded, world, sampled, layout, timeout=300)
    records = dict(zip(sampled, results, strict=True))
    sequences = {tuple((name, ranks) for name, ranks, _, _ in calls) for calls in records.values()}
    assert len(sequences) == 1, "the ranks issue different collectives"
    assert any(name == "all_to_all_single" for name, _ in next(iter(sequences)))
    moved: dict[tuple[int, int], int] = {}
    for a, b in itertools.permutations(sampled, 2):
        for (name, ranks, _, sent), (_, _, received, _) in zip(records[a], records[b], strict=True):
            if name == "all_to_all_single" and a in ranks and b in ranks:
                assert sent[ranks.index(b)] == received[ranks.index(a)], (a, b)
                moved[a, b] = moved.get((a, b), 0) + sent[ranks.index(b)]
    assert sum(moved.values()) > 0, "the sampled ranks exchange nothing: the check would see nothing"
    if layout == "hsdp4096":  # twins in other replicas (nodes) relay to each other
        assert sum(n for (a, b), n in moved.items() if a % 8 == b % 8) > 0
