"""overlap_backward=True under faults and odd inputs: every rank reaches the same verdict, no
rank waits on another, nothing stale is committed."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

import dmuon_fsdp
from dmuon_fsdp import DMuonFSDP, NonFiniteGradientError
from tests.support.paired_runs import (
    BUCKET,
    STEPS,
    Stack,
    compare,
    inputs,
    pair,
    plain_step,
    sharded,
    snapshot,
)
from tests.support.spawn import cpu_mesh, run_ranks
from tests.support.training import train


def failing(rank, world_size, fault, nonfinite):
    model = sharded()
    opt = DMuonFSDP(model.parameters(), bucket_bytes=BUCKET, overlap_backward=True, nonfinite=nonfinite)
    for step in range(2):
        plain_step(model, opt, step)
    before = snapshot(model, opt)
    model(inputs(9)).pow(2).sum().backward()
    if rank == 1:
        p = model.layers[0].weight
        if fault == "nonfinite":
            p.grad.to_local()[0, 0] = float("inf")
        else:
            p.grad = None
    try:
        opt.step()
        error = None
    except (NonFiniteGradientError, dmuon_fsdp.GradientMismatchError) as e:
        error = type(e).__name__
    unchanged = all(torch.equal(v, snapshot(model, opt)[n]) for n, v in before.items())
    opt.zero_grad()
    plain_step(model, opt, 10)  # and the job goes on
    return error, unchanged, opt.last_step_stats.started_in_backward


@pytest.mark.parametrize(
    "fault, nonfinite, error",
    [
        ("nonfinite", "raise", "NonFiniteGradientError"),
        ("nonfinite", "skip", None),
        ("missing", "raise", "GradientMismatchError"),
    ],
)
def test_a_fault_on_one_rank_after_backward_gives_every_rank_the_same_verdict(fault, nonfinite, error):
    results = run_ranks(failing, 2, fault, nonfinite, timeout=120, pg_timeout=30)
    assert [r[0] for r in results] == [error, error]
    assert all(unchanged for _, unchanged, _ in results)  # nothing committed


def tensor_parallel_in_rank_order(rank, world_size):
    """DTensor parameters outside FSDP: autograd fires the hooks, in another order on each rank."""
    mesh = cpu_mesh()
    shapes = [(13, 24), (5, 37), (37, 24), (24, 13), (1, 24)] * 2  # several buckets
    calls = []
    original = dist.all_to_all_single

    def recording(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
        calls.append((group.group_name, list(output_split_sizes), list(input_split_sizes)))
        return original(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

    runs = []
    for overlap in (False, True):
        torch.manual_seed(0)
        params = [nn.Parameter(distribute_tensor(torch.randn(s), mesh, [Shard(0)])) for s in shapes]
        opt = DMuonFSDP(params, bucket_bytes=256, overlap_backward=overlap)
        runs.append((params, opt))
    dist.all_to_all_single = recording
    try:
        for step in range(STEPS):
            for params, opt in runs:
                order = range(len(params)) if rank % 2 == 0 else reversed(range(len(params)))
                gen = torch.Generator().manual_seed(step)
                grads = [torch.randn(p.to_local().shape, generator=gen) for p in params]
                sum((params[i].to_local() * grads[i]).sum() for i in order).backward()
                opt.step()
                opt.zero_grad()
    finally:
        dist.all_to_all_single = original
    (p0, _), (p1, o1) = runs
    equal = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(p0, p1, strict=True))
    return equal, calls, o1.last_step_stats.started_in_backward


def test_hooks_firing_in_another_order_on_each_rank_keep_every_group_in_plan_order():
    results = run_ranks(tensor_parallel_in_rank_order, 2)
    assert all(equal and started > 0 for equal, _, started in results)
    (_, calls0, _), (_, calls1, _) = results
    for name in {c[0] for c in calls0}:
        mine = [c for c in calls0 if c[0] == name]
        theirs = [c for c in calls1 if c[0] == name]
        assert len(mine) == len(theirs)
        for (_, receive0, send0), (_, receive1, send1) in zip(mine, theirs, strict=True):
            assert send0[1] == receive1[0] and send1[0] == receive0[1]  # the same exchange on both


def replicated(rank, world_size):
    runs = []
    with warnings.catch_warnings(record=True) as built:
        warnings.simplefilter("always")
        for overlap in (False, True):
            torch.manual_seed(0)
            model = Stack()
            runs.append((model, DMuonFSDP(model.parameters(), bucket_bytes=BUCKET, overlap_backward=overlap)))
    with warnings.catch_warnings(record=True) as stepped:
        warnings.simplefilter("always")
        history = train(runs, STEPS, step=plain_step)
    said = [[str(w.message) for w in caught if "DMuonFSDP" in str(w.message)] for caught in (built, stepped)]
    return compare(runs), history, said


def test_plain_tensors_in_a_job_of_several_ranks_step_plainly_with_a_warning():
    for differing, history, (built, stepped) in run_ranks(replicated, 2):
        assert differing == [] and all(started == 0 for _, started, _ in history)
        # said once, at the first step (at construction the tensors may still be sharded after)
        assert built == [] and len(stepped) == 1, (built, stepped)
        assert "is a plain tensor in a job of 2 ranks" in stepped[0]


def divergent_option(rank, world_size):
    model = sharded()
    opt = DMuonFSDP(model.parameters(), bucket_bytes=BUCKET, overlap_backward=rank == 0)
    model(inputs(0)).pow(2).sum().backward()
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return None


def test_overlap_backward_on_some_ranks_only_raises_on_every_rank():
    messages = run_ranks(divergent_option, 2, timeout=120, pg_timeout=30)
    assert all(m is not None and "overlap_backward" in m for m in messages)


def no_muon_gradients(rank, world_size):
    """AdamW parameters only, then a step whose Muon parameters have no gradient."""
    model = sharded()
    vectors = DMuonFSDP([model.scale], overlap_backward=True)
    opt = DMuonFSDP(model.parameters(), bucket_bytes=BUCKET, overlap_backward=True)
    for step in range(3):
        plain_step(model, vectors, step)
    for layer in model.layers:
        layer.weight.requires_grad_(False)
    for step in range(3):
        plain_step(model, opt, step)
    return opt.last_step_stats.started_in_backward


def test_steps_without_muon_gradients_run():
    assert run_ranks(no_muon_gradients, 2) == [0, 0]


def nan_in_an_early_bucket(rank, world_size):
    model = sharded()
    opt = DMuonFSDP(model.parameters(), bucket_bytes=BUCKET, overlap_backward=True, nonfinite="skip")
    for step in range(2):
        plain_step(model, opt, step)
    before = snapshot(model, opt)
    x = inputs(5)
    x[0, 0] = float("nan") if rank == 1 else x[0, 0]  # every gradient NaN after the reduce-scatter
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x).pow(2).sum().backward()
        opt.step()
    stats = opt.last_step_stats
    unchanged = all(torch.equal(v, snapshot(model, opt)[n]) for n, v in before.items())
    return stats.skipped, stats.redone, stats.started_in_backward, unchanged, len(caught)


def test_a_nan_gradient_in_a_started_bucket_skips_without_a_redo():
    for skipped, redone, started, unchanged, warned in run_ranks(nan_in_an_early_bucket, 2):
        assert skipped and not redone and started > 0 and unchanged and warned == 0


def rebound_on_one_rank(rank, world_size):
    runs = pair(sharded)

    def step_fn(model, opt, step):
        loss = model(inputs(step)).pow(2).sum()
        loss.backward()
        if step == 2 and rank == 1:  # one rank's state tensor replaced: only its program is bound anew
            state = opt.state[model.layers[1].weight]
            state["momentum_buffer"] = state["momentum_buffer"].clone()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    history = train(runs, STEPS, step=step_fn)
    return compare(runs), history


def test_a_program_bound_anew_on_one_rank_between_backward_and_step_keeps_ranks_in_step():
    for differing, history in run_ranks(rebound_on_one_rank, 2, timeout=120, pg_timeout=30):
        assert differing == [] and history[2][2] and history[3][1] > 0  # step 2 redone
