"""Context parallelism's data-parallel side: FSDP2 over the ranks of the data-parallel shard dim
and the context-parallel dim together, each rank holding a slice of each sequence, on 4 CPU ranks.

Two ways meshes are built for it: a (dp_shard, cp) mesh flattened (``_flatten``, torchtitan's
older ``dp_shard_cp``), also under HSDP (dp_replicate, then the flattened dims), and torchtitan
0.3.0's own ``ParallelDims(dp_shard=2, cp=2).build_mesh()``, whose ``fsdp`` mesh is unflattened
from the world mesh, with each rank's slice read from its ``cp`` mesh. The model is token-wise (a
stack of linear layers): torch 2.13's ``context_parallel`` attention has no CPU kernel ("Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered"), and what the optimizer sees, gradients averaged over the folded ranks, is the same
with or without attention between the slices."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tests.support.layout_runs import against_reference, check
from tests.support.paired_runs import DIMS, Stack
from tests.support.spawn import run_ranks

SEQ = 8  # tokens a sequence, SEQ / cp on each rank


def sharded_over(mesh):
    model = Stack()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def meshes(how):
    """The mesh FSDP2 shards over, and this rank's (batch, cp) coordinates."""
    if how == "torchtitan":
        import torchtitan.distributed.parallel_dims as titan_parallel_dims
        from torchtitan.distributed import ParallelDims

        titan_parallel_dims.device_type = "cpu"  # its fallback is "cuda" (see test_torchtitan.py)
        dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=2, tp=1, pp=1, ep=1, world_size=4)
        dims.spmd_backend = "partial_dtensor"
        dims.build_mesh()
        batch, cp = dims.get_mesh("batch").get_local_rank(), dims.get_mesh("cp").get_local_rank()
        return dims.get_mesh("fsdp"), batch, cp
    replicate = 2 if how == "hsdp" else 1
    root = init_device_mesh(
        "cpu", (replicate, 4 // replicate // 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "cp")
    )
    root["dp_shard", "cp"]._flatten("dp_shard_cp")
    batch = root["dp_replicate", "dp_shard"]._flatten("batch").get_local_rank()
    mesh = root["dp_replicate", "dp_shard_cp"] if how == "hsdp" else root["dp_shard_cp"]
    return mesh, batch, root["cp"].get_local_rank()


def context_parallel_run(rank, world_size, how):
    mesh, batch, cp = meshes(how)
    model = sharded_over(mesh)

    def loss(step):  # this rank's slice of its batch's sequences
        gen = torch.Generator().manual_seed(100 * step + batch)
        x = torch.randn(2, SEQ, DIMS[0], generator=gen)
        return model(x.chunk(2, dim=1)[cp]).pow(2).mean()

    placements = {type(pl).__name__ for p in model.parameters() for pl in p.placements}
    return (*against_reference(model, list(model.named_parameters()), loss), tuple(mesh.shape), placements)


@pytest.mark.parametrize("how", ["flattened", "hsdp", "torchtitan"])
def test_fsdp_over_data_and_context_parallel_ranks_steps_exactly(how):
    if how == "torchtitan":
        pytest.importorskip("torchtitan", reason="torchtitan is not installed: the scale extra brings it")
    results = run_ranks(context_parallel_run, 4, how)
    assert {r[2] for r in results} == {(2, 2) if how == "hsdp" else (4,)}  # (replicas,) folded ranks
    placements = results[0][3]
    assert placements == ({"Replicate", "Shard"} if how == "hsdp" else {"Shard"})
    check([r[:2] for r in results], min_owners=2 if how == "hsdp" else 4)
