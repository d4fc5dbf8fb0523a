"""The planner alone: no processes, no collectives."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dmuon_fsdp._step.layouts import MatrixLayout, Piece
from dmuon_fsdp._step.pipeline import BUCKET_HOST_FLOPS, Load, cut_flops, step_flops
from dmuon_fsdp._step.planner import assign_owners, build_plan
from instruments.plans import (
    assignment_lower_bound,
    chunk_row_counts,
    makespan_lower_bound,
    newton_schulz_flops,
    rank_loads,
    replicated,
    row_sharded_layout,
)
from tests.support.models import LLAMA_SHAPES


def plan_for(matrices, world_size, bucket_bytes, element_size):
    """The plan with each matrix costed at five standard Newton-Schulz iterations."""
    return build_plan(matrices, costs(matrices), world_size, bucket_bytes, element_size)


def costs(matrices):
    return [newton_schulz_flops(m.rows, m.cols, 5) for m in matrices]


def layouts(shapes, world_size):
    return [
        row_sharded_layout(f"m{i}", r, c, chunk_row_counts(r, world_size)) for i, (r, c) in enumerate(shapes)
    ]


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 7, 18, 37, 64, 100])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8, 16])
def test_row_counts_follow_torch_chunk(rows, world_size):
    chunks = [c.shape[0] for c in torch.empty(rows, 1).chunk(world_size)] if rows else []
    expected = chunks + [0] * (world_size - len(chunks))
    assert list(chunk_row_counts(rows, world_size)) == expected


def test_row_counts_documented_examples():
    assert chunk_row_counts(5, 4) == (2, 2, 1, 0)
    assert chunk_row_counts(18, 8) == (3, 3, 3, 3, 3, 3, 0, 0)


SHAPE_MIX = [(5, 256), (1, 128), (37, 64), (768, 256), (256, 768), (64, 64), (64, 64), (6, 27)]


def shares(plan, bucket):
    """Each rank's shares of a bucket, in elements, from what the plan says moves: the matrices it
    holds whole (as their owner), sends to their owners and takes as one, returns and gets back."""
    out = {}

    def add(which, rank, n):
        out[which, rank] = out.get((which, rank), 0) + n

    for j in bucket.matrices:
        m, owner = plan.matrices[j], plan.owners[j]
        add("held", owner, m.numel)
        for r in plan.senders[j] - {owner}:
            add("sent to owners", r, m.pieces[r].numel)
            add("taken by owners", owner, m.pieces[r].numel)
        for r, piece in enumerate(m.pieces):
            first, stop = plan.returned(j, r)
            if r != owner and stop > first:
                add("sent back", owner, (stop - first) * piece.cols)
                add("received back", r, (stop - first) * piece.cols)
    return out


def check_buckets(plan, limit):
    """Every matrix in one bucket; no rank holds or moves more than ``limit`` elements in a bucket,
    or its largest matrix when larger; and each bucket spread over as many owners as the matrices
    left can have."""
    in_buckets = sorted(j for b in plan.buckets for j in b.matrices)
    assert in_buckets == list(range(len(plan.matrices))), "each matrix in exactly one bucket"
    left = set(in_buckets)
    for k, bucket in enumerate(plan.buckets):
        allowance = max(limit, max(plan.matrices[j].numel for j in bucket.matrices))
        over = {key: n for key, n in shares(plan, bucket).items() if n > allowance}
        assert not over, f"bucket {k}: shares over {allowance} elements: {over}"
        owners = {plan.owners[j] for j in bucket.matrices}
        assert len(owners) == min(plan.world_size, len({plan.owners[j] for j in left})), f"bucket {k}"
        left -= set(bucket.matrices)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_every_matrix_has_one_owner_and_splits_match(world_size):
    plan = plan_for(layouts(SHAPE_MIX, world_size), world_size, bucket_bytes=3_000, element_size=4)
    check_buckets(plan, 3_000 // 4)
    assert all(0 <= o < world_size for o in plan.owners)
    total = sum(m.numel for m in plan.matrices)
    moved = sum(plan.elements_moved(r) for r in range(world_size))
    kept = sum(m.pieces[plan.owners[j]].numel for j, m in enumerate(plan.matrices))
    assert moved == 2 * (total - kept)


@pytest.mark.parametrize("model", ["gpt2-124m", "llama3-8b", "llama3-70b"])
@pytest.mark.parametrize("world_size", [2, 3, 8, 64, 256, 1024])
def test_llama_buckets_spread_over_every_owner_within_the_bound(model, world_size):
    """The default 128 MiB in bf16: each bucket holds about that much per owner, on every owner
    that has matrices left; the 70B MLP matrices (448 MiB) go one per owner."""
    matrices = layouts(LLAMA_SHAPES[model], world_size)
    plan = plan_for(matrices, world_size, 128 * 2**20, 2)
    check_buckets(plan, 64 * 2**20)
    loads = rank_loads(plan)
    assert max(loads) <= 1.05 * makespan_lower_bound(costs(matrices), world_size)


def test_among_equal_costs_the_last_layers_come_first():
    """So the first bucket's gradients land first in backward (overlap_backward starts it there)."""
    matrices = layouts(LLAMA_SHAPES["llama3-8b"], 8)
    plan = plan_for(matrices, 8, 128 * 2**20, 2)
    first = plan.buckets[0].matrices
    layers = [j // 7 for j in first]
    assert len(first) == 8 and min(layers) >= 29, layers  # the MLP matrices of the last layers


def _plan_signature(world_size):
    matrices = layouts(LLAMA_SHAPES["gpt2-124m"], world_size)
    plans = [build_plan(matrices, costs(matrices), world_size, 2**24, 2, flops_per_byte=r) for r in (0, 1e4)]
    return [[list(plan.owners), [list(b.matrices) for b in plan.buckets]] for plan in plans]


def test_plans_identical_across_simulated_ranks():
    # Each rank builds its plan in its own interpreter; different hash seeds must not matter.
    code = "import json; from test_planner import _plan_signature; print(json.dumps(_plan_signature(16)))"
    tests = os.path.dirname(os.path.abspath(__file__))
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": tests}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
        ).stdout
        outputs.add(out.strip())
    assert len(outputs) == 1
    assert json.loads(outputs.pop()) == _plan_signature(16)


@pytest.mark.parametrize("model", sorted(LLAMA_SHAPES))
@pytest.mark.parametrize("world_size", [8, 16, 64])
def test_busiest_rank_near_assignment_lower_bound(model, world_size):
    matrices = layouts(LLAMA_SHAPES[model], world_size)
    plan = plan_for(matrices, world_size, 2**30, 2)
    loads = rank_loads(plan)
    bound = assignment_lower_bound(costs(matrices), world_size)
    assert sum(loads) == sum(costs(matrices))
    assert max(loads) <= 1.05 * bound, f"busiest {max(loads)} vs bound {bound}"


def test_lower_bound_terms():
    assert assignment_lower_bound([4, 4, 4], 2) == 8  # two of three equal matrices share a rank
    assert assignment_lower_bound([10, 1, 1], 2) == 10  # the largest matrix alone
    assert assignment_lower_bound([3, 3, 3, 3], 2) == 6  # the mean


def test_rejects_pieces_that_do_not_tile_the_matrix():
    with pytest.raises(ValueError, match="'w'.*2 ranks"):
        plan_for([row_sharded_layout("w", 5, 3, (2, 3))], 3, 2**20, 4)
    with pytest.raises(ValueError, match="'w'.*replica 0 hold 12 elements, not 15"):
        plan_for([row_sharded_layout("w", 5, 3, (2, 2))], 2, 2**20, 4)


@pytest.mark.parametrize("replicas,shards", [(2, 2), (3, 2), (2, 3)])
def test_replicated_matrices_gather_one_copy_and_scatter_to_all(replicas, shards):
    world = replicas * shards
    matrices = [
        replicated(row_sharded_layout(f"m{i}", 7 + i, 5, chunk_row_counts(7 + i, shards)), replicas)
        for i in range(2 * world)
    ]
    plan = plan_for(matrices, world, 2**20, 4)
    assert sorted(set(plan.owners)) == list(range(world)), "owners spread over every replica"
    for j, (m, owner) in enumerate(zip(plan.matrices, plan.owners, strict=True)):
        senders = plan.senders[j]
        assert {m.replica(r) for r in senders} == {m.replica(owner)}
        assert sum(m.pieces[r].numel for r in senders) == m.numel
    # Forward: one copy of each matrix (from the owner's replica); reverse: each rank gets its
    # pieces of all of them. In elements sent over the job, own pieces excluded:
    kept = sum(m.pieces[owner].numel for m, owner in zip(plan.matrices, plan.owners, strict=True))
    forward = sum(m.numel for m in matrices) - kept
    backward = sum(m.pieces[r].numel for m in matrices for r in range(world)) - kept
    assert sum(plan.elements_moved(r) for r in range(world)) == forward + backward


def test_ddp_layout_sends_only_results():
    world, rows, cols = 3, 6, 4
    full = Piece(0, rows, 0, cols)
    matrices = [MatrixLayout(f"m{i}", rows, cols, (full,) * world, tuple(range(world))) for i in range(3)]
    plan = plan_for(matrices, world, 2**20, 4)
    assert sorted(plan.owners) == [0, 1, 2]
    for r in range(world):
        assert all(plan.senders[j] == {plan.owners[j]} for j in range(3)), "the owner holds the whole matrix"
        # It sends the result to the two others: 2 * rows * cols elements.
        assert plan.elements_moved(r) == 2 * rows * cols


def _optimal_makespan(costs, world_size):
    best = [float("inf")]

    def place(i, loads):
        if max(loads) >= best[0]:
            return
        if i == len(costs):
            best[0] = max(loads)
            return
        for r in range(world_size):
            if r and loads[r] == loads[r - 1]:
                continue  # symmetric
            loads[r] += costs[i]
            place(i + 1, loads)
            loads[r] -= costs[i]

    place(0, [0] * world_size)
    return best[0]


@pytest.mark.parametrize("seed", range(30))
def test_lower_bounds_never_exceed_the_optimum(seed):
    gen = torch.Generator().manual_seed(seed)
    world = int(torch.randint(2, 4, (1,), generator=gen))
    costs = torch.randint(1, 50, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen).tolist()
    optimum = _optimal_makespan(sorted(costs, reverse=True), world)
    simple, l2 = assignment_lower_bound(costs, world), makespan_lower_bound(costs, world)
    assert simple <= l2 <= optimum + 1e-9
    owners, _ = assign_owners(costs, world)
    lpt = max(sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(world))
    assert optimum <= lpt <= 4 / 3 * optimum


def test_l2_bound_explains_the_70b_case_at_256_ranks():
    # 240 MLP matrices and 160 attention squares: 240 ranks carry one MLP each, so the other 16
    # must take the squares; the simple bound cannot see this, the bin-packing bound can.
    matrices = layouts(LLAMA_SHAPES["llama3-70b"], 256)
    flops = costs(matrices)
    busiest = max(rank_loads(plan_for(matrices, 256, 2**40, 2)))
    assert busiest > 1.15 * assignment_lower_bound(flops, 256)
    assert busiest <= 1.001 * makespan_lower_bound(flops, 256)


def test_replicated_experts_are_owned_where_they_live():
    # Expert parallel inside HSDP: (replicas 2, shards 4) and 4 experts, expert e whole on shard e
    # of each replica. Each expert is owned by one of its two holders, and only the result moves
    # (to the other replica's holder); no rank owns two.
    world, rows, cols = 8, 6, 5
    experts = []
    for e in range(4):
        counts = [rows if s == e else 0 for s in range(4)]
        experts.append(replicated(row_sharded_layout(f"e{e}", rows, cols, counts), 2))
    plan = plan_for(experts, world, 2**20, 4)
    for e, owner in enumerate(plan.owners):
        assert owner in (e, 4 + e)
        assert plan.senders[e] == {owner}
    assert len(set(plan.owners)) == 4
    assert sum(plan.elements_moved(r) for r in range(world)) == 4 * rows * cols


# The bucket pipeline: the planner's cost model and the ramp it shapes buckets into.


def test_the_pipeline_model_overlaps_a_bucket_exchange_with_the_ns_before_it():
    one = Load(to_owners=10, back=10, ns={0: 100, 1: 100})
    assert step_flops([one], 1.0) == 10 + 100 + 10  # alone: nothing to overlap
    small, large = Load(2, 2, {0: 50, 1: 50}), Load(10, 10, {0: 100, 1: 100})
    # to 0 and to 1 back to back; NS 0 hides to 1; back 0 rides under NS 1; back 1 is exposed
    assert step_flops([small, large], 1.0) == 2 + 50 + 100 + 10
    # a link too slow to hide bucket 1's exchange behind NS 0: NS 1 waits for it on the link,
    # after to 0 (back 0 rides under NS 1)
    assert step_flops([small, large], 10.0) == 20 + 100 + 100 + 100


def predicted(plan, flops_per_byte, element_size=2):
    """The planner's own prediction of ``plan``'s step (``pipeline.step_flops``), from the shares."""
    loads = []
    for bucket in plan.buckets:
        totals, ns = shares(plan, bucket), {}
        for j in bucket.matrices:
            ns[plan.owners[j]] = ns.get(plan.owners[j], 0) + plan.costs[j]
        kinds = ("sent to owners", "taken by owners", "sent back", "received back")
        busiest = {w: max((n for (which, _), n in totals.items() if which == w), default=0) for w in kinds}
        to_owners = max(busiest["sent to owners"], busiest["taken by owners"])
        loads.append(Load(to_owners, max(busiest["sent back"], busiest["received back"]), ns))
    return step_flops(loads, flops_per_byte * element_size), loads


@pytest.mark.parametrize("model", ["llama-1b", "llama3-8b", "llama3-70b"])
@pytest.mark.parametrize("world_size", [3, 8, 16, 64, 1024])
def test_the_ramp_keeps_the_bounds_and_is_never_predicted_slower(model, world_size):
    matrices = layouts(LLAMA_SHAPES[model], world_size)
    plain = plan_for(matrices, world_size, 128 * 2**20, 2)
    ramped = build_plan(matrices, costs(matrices), world_size, 128 * 2**20, 2, flops_per_byte=1e4)
    assert ramped.owners == plain.owners  # owners stay LPT over all matrices
    in_buckets = sorted(j for b in ramped.buckets for j in b.matrices)
    assert in_buckets == list(range(len(matrices)))
    for k, bucket in enumerate(ramped.buckets):
        allowance = max(64 * 2**20, max(ramped.matrices[j].numel for j in bucket.matrices))
        over = {key: n for key, n in shares(ramped, bucket).items() if n > allowance}
        assert not over, f"bucket {k}: shares over {allowance} elements: {over}"
    (_, ramped_loads), (_, plain_loads) = predicted(ramped, 1e4), predicted(plain, 1e4)
    assert cut_flops(ramped_loads, 2e4) <= cut_flops(plain_loads, 2e4)


def test_buckets_too_small_to_pay_for_their_host_work_stay_as_cut():
    """A model whose whole step is less than a bucket's host work (``BUCKET_HOST_FLOPS``) on
    the model's terms: the ramp would shorten the exchanges, by less than another bucket costs."""
    shapes = [(16, 16), (8, 16), (8, 16), (16, 16), (32, 16), (32, 16), (16, 32)] * 12
    matrices = layouts(shapes, 2)
    plain = plan_for(matrices, 2, 128 * 2**20, 2)
    assert predicted(plain, 1e4)[0] < BUCKET_HOST_FLOPS
    ramped = build_plan(matrices, costs(matrices), 2, 128 * 2**20, 2, flops_per_byte=1e4)
    assert ramped.buckets == plain.buckets and len(plain.buckets) == 1


def test_the_ramp_shortens_the_first_exchange_and_the_last_return():
    """Eight Llama-3-8B layers at W=8, at 10^4 NS flops per link byte: the plain cut's first
    bucket is an MLP matrix per owner, its last the attention matrices. The ramp starts and ends
    with a square matrix per owner, whose exchange is a quarter of an MLP matrix's and whose NS
    hides the next bucket's; the link's time left exposed falls to a tenth of its busy time."""
    shapes = LLAMA_SHAPES["llama3-8b"][: 8 * 7]
    matrices = layouts(shapes, 8)
    plain = plan_for(matrices, 8, 128 * 2**20, 2)
    ramped = build_plan(matrices, costs(matrices), 8, 128 * 2**20, 2, flops_per_byte=1e4)
    mlp = {(14336, 4096), (4096, 14336)}
    assert {(plain.matrices[j].rows, plain.matrices[j].cols) for j in plain.buckets[0].matrices} <= mlp
    first, last = ramped.buckets[0].matrices, ramped.buckets[-1].matrices
    assert {(ramped.matrices[j].rows, ramped.matrices[j].cols) for j in first + last} == {(4096, 4096)}
    assert sorted(ramped.owners[j] for j in first) == list(range(8)) == sorted(ramped.owners[j] for j in last)
    # q and o of the last four layers: their gradients land first in backward
    assert sorted(j // 7 for j in first) == [4, 4, 5, 5, 6, 6, 7, 7]
    (plain_step, plain_loads), (step, loads) = predicted(plain, 1e4), predicted(ramped, 1e4)
    assert loads[0].to_owners * 3 < plain_loads[0].to_owners and loads[-1].back * 2 < plain_loads[-1].back
    floor = max(rank_loads(ramped))
    busy = sum(b.to_owners + b.back for b in loads) * 2 * 1e4
    assert (step - floor) <= 0.1 * busy < (plain_step - floor)
