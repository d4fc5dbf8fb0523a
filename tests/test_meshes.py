"""HSDP, DDP / replicated, FSDP + TP and expert-sharded layouts: each equals the float64 reference
Muon on full matrices, every matrix is orthogonalized exactly once in the whole job, and a step
moves exactly the bytes its plan predicts with no gathers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from dmuon_fsdp import DMuonFSDP
from tests.support.layout_runs import SHAPES, STEPS, Weights, against_reference, check, given_gradients
from tests.support.spawn import run_ranks
from tests.support.training import train


def hsdp(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = Weights(SHAPES)
    fully_shard(model, mesh=mesh)
    assert model.ws["w13"].placements == (Replicate(), Shard(0))
    return against_reference(model, list(model.named_parameters()), model)


def test_hsdp_orthogonalizes_each_matrix_once_in_the_job():
    check(run_ranks(hsdp, 4), min_owners=4)


def ddp(rank, world_size, replicate_dtensor):
    model = Weights(SHAPES)
    if replicate_dtensor:
        mesh = init_device_mesh("cpu", (world_size,))
        for name, p in list(model.ws.items()):
            model.ws[name] = nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()]))
        loss = model
    else:
        loss = DistributedDataParallel(model)
    return against_reference(model, list(model.named_parameters()), loss)


@pytest.mark.parametrize("world_size,replicate_dtensor", [(2, False), (3, False), (2, True)])
def test_replicated_parameters_split_ns_across_ranks(world_size, replicate_dtensor):
    results = run_ranks(ddp, world_size, replicate_dtensor)
    check(results, min_owners=world_size)
    # Every rank holds the whole gradient: only orthogonalized matrices travel, owner to others.
    for _rank, (_, counts) in enumerate(results):
        assert counts["sent"] > 0


def ddp_lower_precision_wire(rank, world_size, variant, ns_dtype, comm_dtype):
    model = Weights(SHAPES)
    loss = DistributedDataParallel(model)
    opt = DMuonFSDP(model.parameters(), lr=0.05, ns_dtype=ns_dtype, comm_dtype=comm_dtype, variant=variant)
    train([(model, opt)], STEPS, loss=loss)
    return {n: p.detach() for n, p in model.named_parameters()} | {
        f"state {n} {k}": v for n, p in model.named_parameters() for k, v in opt.state[p].items()
    }


@pytest.mark.parametrize(
    "variant,ns_dtype,comm_dtype",
    [
        ("muon", torch.float32, torch.bfloat16),
        ("normuon", torch.float32, torch.bfloat16),
        ("normuon", torch.bfloat16, torch.bfloat16),  # CUDA's default: NS and wire in bf16
        ("normuon", torch.float32, torch.float16),
    ],
)
def test_replicas_stay_equal_with_a_lower_precision_wire(variant, ns_dtype, comm_dtype):
    # bf16 on the wire, fp32 NS: an owner's own copy of a result is rounded through bf16 like the
    # copy it sends, and NorMuon's float32 row statistics travel as their bits: DDP replicas stay
    # bitwise equal, state included (and finite: an fp16 wire carries the statistics exactly).
    first, second = run_ranks(ddp_lower_precision_wire, 2, variant, ns_dtype, comm_dtype)
    for name, value in first.items():
        assert torch.equal(value, second[name]) and value.isfinite().all(), name


class TensorParallelMLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(9, hidden, bias=False)  # column-wise: rows over tp, then over dp
        self.down = nn.Linear(hidden, 9, bias=False)  # row-wise: columns over tp, rows over dp
        self.head = nn.Linear(9, 5, bias=False)  # not tensor-parallel: on the dp sub-mesh only

    def forward(self, x):
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


def fsdp_tp(rank, world_size, hidden):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = TensorParallelMLP(hidden)
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    placements = {n: tuple(type(pl).__name__ for pl in p.placements) for n, p in model.named_parameters()}

    def forward_loss(step):
        x = torch.randn(4, 9, generator=torch.Generator().manual_seed(step))
        return model(x).pow(2).sum()

    loss = forward_loss if hidden % 2 == 0 else given_gradients(model)
    return (*against_reference(model, list(model.named_parameters()), loss), placements)


@pytest.mark.parametrize("hidden", [14, 13])
def test_fsdp_tp_2d_mesh_row_and_column_wise(hidden):
    # hidden 14: tp splits evenly (7/7), dp unevenly (4/3 rows of each tp block; 5/4 rows of
    # down); hidden 13: uneven on both mesh dims (7/6 over tp, then 4/3 and 3/3 over dp).
    results = run_ranks(fsdp_tp, 4, hidden)
    placements = results[0][2]
    assert placements["up.weight"] == ("_StridedShard", "Shard") and placements["down.weight"] == (
        "Shard",
        "Shard",
    )
    assert placements["head.weight"] == ("Shard",)
    check([r[:2] for r in results], min_owners=3, reuses_slots=False)


def experts(rank, world_size, dim):
    # (3, 8, 12): Shard(0) puts whole experts on ranks 0-2 and none on rank 3; Shard(1) cuts each
    # expert's 8 rows over the 4 ranks, Shard(2) its 12 columns (FSDP2 needs even splits there).
    model = Weights({"experts": (3, 8, 12), "w13": (13, 9)})
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(dim if p.ndim == 3 else 0))
    groups = [
        {"params": [("experts", model.ws["experts"])], "flatten": False},
        {"params": [("w13", model.ws["w13"])]},
    ]
    return against_reference(model, groups, model)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_expert_stacks_sharded_on_experts_rows_or_columns(dim):
    check(run_ranks(experts, 4, dim), min_owners=3, reuses_slots=False)


def pipeline_stages(rank, world_size):
    # Two pipeline stages with different weights and meshes: stage 0 HSDP on (rep=1, shard=2),
    # stage 1 FSDP on shard=2, each a sub-mesh of the (pp, rep, shard) job mesh covering half the
    # ranks. Matrices must be exchanged inside a stage only, and process groups created for one
    # stage must not shift the job's later groups.
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "rep", "shard"))
    stage = mesh.get_coordinate()[0]
    if stage == 0:
        model = Weights({"w5": (5, 16), "w13": (13, 9)})
        fully_shard(model, mesh=mesh["rep", "shard"])
    else:
        model = Weights({"tall": (40, 8), "conv": (6, 3, 3, 3), "w9": (9, 13)})
        fully_shard(model, mesh=mesh["shard"])
    result = against_reference(model, list(model.named_parameters()), model)
    everyone = torch.ones(1)
    dist.all_reduce(everyone, group=dist.new_group([0, 1, 2, 3]))
    return (*result, stage, everyone.item())


def test_pipeline_stage_submeshes_exchange_within_their_stage():
    results = run_ranks(pipeline_stages, 4, timeout=120, pg_timeout=30)
    for stage in (0, 1):
        check([r[:2] for r in results if r[2] == stage], min_owners=2, reuses_slots=False)
    assert all(r[3] == 4 for r in results)


def permuted_meshes(rank, world_size, mesh_ranks, placements):
    # Mesh coordinates that do not follow rank order: plans number ranks by coordinate, the
    # all-to-all by process group rank. (Only 2-D: torch itself mis-shards a permuted 1-D mesh,
    # whose single dim group orders ranks unlike the mesh.)
    names = ("a", "b")[: len(placements)]
    mesh = DeviceMesh("cpu", mesh_ranks, mesh_dim_names=names)
    model = Weights(SHAPES)
    for name, p in list(model.ws.items()):
        model.ws[name] = nn.Parameter(distribute_tensor(p.detach(), mesh, placements))
    return against_reference(model, list(model.named_parameters()), model)


@pytest.mark.parametrize(
    "mesh_ranks,placements",
    [([[0, 2], [1, 3]], [Replicate(), Shard(0)]), ([[0, 2], [1, 3]], [Shard(1), Shard(0)])],
)
def test_meshes_whose_coordinates_do_not_follow_rank_order(mesh_ranks, placements):
    check(run_ranks(permuted_meshes, 4, mesh_ranks, placements), min_owners=2)


def mismatched_plain(rank, world_size):
    shape = (8, 6) if rank == 0 else (5, 7)
    w = nn.Parameter(torch.ones(shape))
    opt = DMuonFSDP([w])
    w.grad = torch.ones(shape)
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return None


def test_plain_tensors_that_differ_across_ranks_raise_on_every_rank():
    # Plain tensors under a process group are replicated (DDP): ranks holding different ones
    # build different plans, which must fail everywhere rather than garble or hang.
    for error in run_ranks(mismatched_plain, 2, timeout=60, pg_timeout=20):
        assert error is not None and "built different plans" in error
