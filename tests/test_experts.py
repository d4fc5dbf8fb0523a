"""Mixture-of-Experts as torchtitan lays it out: one DMuonFSDP over the dense and the expert
meshes (views of one job's ranks) equals the float64 reference Muon per expert, for both expert
placements, the flattened mesh style, a dead expert and a step without the MoE block, HSDP x EP;
its state resumes through DCP on another world size; a layer's E experts cost O(1) ops."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dmuon_fsdp import DMuonFSDP, param_groups
from instruments.counters import OpCounter
from tests.support import checkpoints
from tests.support.layout_runs import against_reference, check
from tests.support.moe import moe_block
from tests.support.reference import relative_error
from tests.support.spawn import run_ranks
from tests.support.training import full, train

# step -> (use the MoE block, dead expert): a dead expert gets a zero gradient, a skipped block none.
SCHEDULE = [(True, None), (False, None), (True, 0), (True, None)]


def _scheduled(model):
    """The block's loss as a function of the step, as ``SCHEDULE`` (repeated) has it."""
    return lambda step: model(step, *SCHEDULE[step % len(SCHEDULE)])


def experts_vs_reference(rank, world_size, style, experts, efsdp, ep):
    model = moe_block(style, experts, efsdp, ep)
    placements = {n: tuple(type(pl).__name__ for pl in p.placements) for n, p in model.named_parameters()}

    # The expert stacks form a group with flatten=False: the reference takes each expert alone.
    groups = param_groups(model, stacked="experts")
    errors, counts = against_reference(model, groups, _scheduled(model), steps=len(SCHEDULE))
    return errors, counts, placements["experts.w1"]


@pytest.mark.parametrize(
    "style,experts,efsdp,ep,placements",
    [
        ("unflatten", 3, 2, 2, ("Shard", "Shard")),  # Shard(1) on efsdp; 2 and 1 experts per ep rank
        ("unflatten", 8, 2, 2, ("_StridedShard", "Shard")),  # whole experts: 2 per rank
        ("flatten", 3, 2, 2, ("Shard", "Shard")),  # the dense mesh flattened from (efsdp, ep)
    ],
)
def test_one_optimizer_over_dense_and_expert_meshes(style, experts, efsdp, ep, placements):
    results = run_ranks(experts_vs_reference, efsdp * ep, style, experts, efsdp, ep)
    assert results[0][2] == placements
    check([r[:2] for r in results], min_owners=efsdp * ep)


def test_hsdp_times_expert_parallel_on_8_ranks():
    results = run_ranks(experts_vs_reference, 8, "hsdp", 3, 2, 2, timeout=300)
    assert results[0][2] == ("Replicate", "Shard", "Shard")
    check([r[:2] for r in results], min_owners=8)


def _snapshot(model, opt):
    out = {n: full(p).detach() for n, p in model.named_parameters()}
    out.update(
        {f"state:{n}:{k}": full(v) for n, p in model.named_parameters() for k, v in opt.state[p].items()}
    )
    return out


def save_then_continue(rank, world_size, path):
    model = moe_block("unflatten", 4, 2, 2)
    opt = DMuonFSDP(param_groups(model, stacked="experts"), ns_dtype=torch.float32)
    train([(model, opt)], range(3), loss=_scheduled(model))
    checkpoints.save(model, opt, path)
    train([(model, opt)], range(3, 5), loss=_scheduled(model))
    return _snapshot(model, opt)


def load_then_continue(rank, world_size, path):
    model = moe_block("unflatten", 4, 1, 2)  # 2 ranks: experts over ep only, dense over both
    opt = DMuonFSDP(param_groups(model, stacked="experts"), ns_dtype=torch.float32)
    checkpoints.load(model, opt, path)
    train([(model, opt)], range(3, 5), loss=_scheduled(model))
    return _snapshot(model, opt)


def test_checkpoint_reshards_from_4_to_2_ranks(tmp_path):
    original = run_ranks(save_then_continue, 4, str(tmp_path))[0]
    resumed = run_ranks(load_then_continue, 2, str(tmp_path))[0]
    assert original.keys() == resumed.keys()
    errors = {k: relative_error(resumed[k], original[k]) for k in original}
    assert max(errors.values()) <= 1e-6, errors


def _expert_layer_ops(experts):
    torch.manual_seed(0)
    params = [(n, nn.Parameter(torch.randn(experts, 6, 4))) for n in ("w1", "w3")]
    params.append(("w2", nn.Parameter(torch.randn(experts, 4, 6))))
    opt = DMuonFSDP([{"params": params, "flatten": False}])
    for _, p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    with OpCounter() as counter:
        opt.step()
    return sum(counter.ops.values()), opt.last_step_stats.ns_matrices


def test_a_layer_of_experts_costs_the_same_ops_for_8_or_64_experts():
    (ops8, ns8), (ops64, ns64) = _expert_layer_ops(8), _expert_layer_ops(64)
    assert (ns8, ns64) == (24, 192)
    assert ops8 == ops64, (ops8, ops64)
