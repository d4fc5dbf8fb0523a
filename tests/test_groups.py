"""The process groups the optimizer needs are made so that eager NCCL initialization (a device
bound to the default group, where torch makes each new group by splitting the default
communicator, a collective of every rank of the job) cannot hang: every rank makes the same
groups in the same order, or none ([Note: groups] in ``dmuon_fsdp._step.comm``). Each test records the
groups made from the optimizer's construction on, with steps begun in backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dmuon_fsdp import DMuonFSDP, param_groups
from instruments.counters import GroupCalls
from tests.support.layout_runs import SHAPES, Weights, against_reference, check
from tests.support.moe import moe_block
from tests.support.paired_runs import BUCKET, DIMS, STEPS, Stack, compare, plain_step, sharded
from tests.support.spawn import run_ranks
from tests.support.training import train


def models(layout):
    """Two copies of the layout's model (built before recording: DeviceMesh makes its groups
    collectively), the options of its optimizers and its step."""
    if layout == "fsdp":
        return [sharded(), sharded()], {}, plain_step
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        return [sharded(mesh), sharded(mesh)], {}, plain_step
    if layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

        def make():
            model = Stack((24, 16, 24) * 3)
            plan = {f"layers.{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(6)}
            parallelize_module(model, mesh["tp"], plan)
            fully_shard(model, mesh=mesh["dp"])
            return model

        return [make(), make()], {}, plain_step
    if layout == "moe":

        def moe_step(model, opt, step):
            loss = model(step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        return [moe_block("unflatten", 3, 2, 2) for _ in range(2)], {"stacked": "experts"}, moe_step
    # pipeline stages as torchtitan builds them: a (pp, dp) mesh, each stage's model sharded over
    # its dp sub-mesh with an optimizer of its own (stages differ in their matrices)
    root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    dims = DIMS if root.get_coordinate()[0] == 0 else (24, 16, 24) * 3
    return [sharded(root["dp"], dims), sharded(root["dp"], dims)], {}, plain_step


def group_calls(rank, world_size, layout):
    """The groups this rank made while it built and stepped a plain and an ``overlap_backward``
    optimizer, the tensors in which the two runs differ, and the steps' history."""
    pair, grouping, step = models(layout)
    with GroupCalls() as made:
        runs = []
        for model, overlap in zip(pair, (False, True), strict=True):
            groups = param_groups(model, **grouping) if grouping else model.parameters()
            runs.append((model, DMuonFSDP(groups, lr=0.02, bucket_bytes=BUCKET, overlap_backward=overlap)))
        history = train(runs, STEPS, step=step)
    return made.calls, compare(runs), history


@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "fsdp_tp", "moe", "pipeline"])
def test_every_rank_makes_the_same_groups_or_none(layout):
    results = run_ranks(group_calls, 4, layout)
    calls = [made for made, _, _ in results]
    assert all(made == calls[0] for made in calls), calls
    # a stage's ranks take their mesh's group; over the whole job, one group made by every rank
    assert calls[0] == ([] if layout == "pipeline" else [("new_group", (0, 1, 2, 3), False)])
    for _, differing, history in results:
        assert differing == []
        assert all(started > 0 for _, started, _ in history[1:])  # the hooks launched exchanges


def unflattened_stage(rank, world_size, eager):
    """Ranks 0-3: an HSDP stage (2 x 2, no dim spanning it, not flattened) of a 5-rank job;
    rank 4: a stage of its own. With ``eager``, a device bound to the default group is
    emulated while the optimizer is built: the stage's ranks cannot make a group of their own,
    and say so; else (communicators made lazily) they make it and step exactly."""
    stage = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("replicate", "shard"))
    solo = DeviceMesh("cpu", [4])
    model = Weights(SHAPES if rank < 4 else {"w5": (5, 16)})
    fully_shard(model, mesh=stage if rank < 4 else solo)
    if not eager:
        with GroupCalls() as made:
            result = against_reference(model, list(model.named_parameters()), model)
        return result, made.calls
    bound = dist.ProcessGroup.__dict__["bound_device_id"]
    dist.ProcessGroup.bound_device_id = property(lambda self: torch.device("cuda", 0))
    try:
        DMuonFSDP(model.named_parameters())
        return None
    except ValueError as e:
        return str(e)
    finally:
        dist.ProcessGroup.bound_device_id = bound


def test_a_stage_no_mesh_dim_spans_makes_its_group_where_communicators_are_lazy():
    results = run_ranks(unflattened_stage, 5, False)
    check([result for result, _ in results[:4]], min_owners=2)
    assert [made for _, made in results] == [[("new_group", (0, 1, 2, 3), True)]] * 4 + [[]]


def test_a_stage_no_mesh_dim_spans_is_refused_at_construction_under_eager_init():
    errors = run_ranks(unflattened_stage, 5, True)
    assert errors[4] is None  # a stage of one rank needs no group
    assert len(set(errors[:4])) == 1 and errors[0] is not None
    assert "global ranks [0, 1, 2, 3]" in errors[0] and "_flatten" in errors[0]
