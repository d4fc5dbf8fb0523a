"""What a step sends: two all-to-alls per bucket, the bytes the plan predicts, no gathers."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dmuon_fsdp import DMuonFSDP
from dmuon_fsdp.stats import PHASES

# The package exports the function newton_schulz under the module's name; wrap it in its module.
ns_module = importlib.import_module("dmuon_fsdp.newton_schulz")
from spawn import cpu_mesh, run_ranks
from test_equivalence import ShapesModel, gradients, make_groups

GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "all_reduce",
           "reduce_scatter_tensor", "gather", "scatter")  # fmt: skip


def counted_step(rank, world_size, overlap, comm_dtype, checks=True):
    model = ShapesModel()
    mesh = cpu_mesh()
    for holder in model.holders.values():
        fully_shard(holder, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Buckets of at most 256 KiB split the 12 matrices into several buckets.
    opt = DMuonFSDP(make_groups(model), ns_dtype=torch.float32, comm_dtype=comm_dtype, bucket_bytes=2**18,
                    overlap=overlap, time_phases=True, check_grads=checks, nonfinite="raise" if checks else "ignore")
    grads = {n: g.float() for n, g in gradients(0).items()}
    model(grads).backward()

    calls = {name: 0 for name in GATHERS + ("full_tensor", "redistribute")}
    a2a = []
    ns_rows = []
    events = []
    originals = {}

    def wrap(owner, name, record):
        original = getattr(owner, name)
        originals[(owner, name)] = original

        def wrapper(*args, **kwargs):
            record(*args, **kwargs)
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)

    def record_a2a(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        a2a.append((list(output_split_sizes), list(input_split_sizes), input.element_size()))
        events.append("a2a")

    wrap(dist, "all_to_all_single", record_a2a)
    for name in GATHERS:
        wrap(dist, name, lambda *a, _n=name, **k: calls.__setitem__(_n, calls[_n] + 1))
    for name in ("full_tensor", "redistribute"):
        wrap(DTensor, name, lambda *a, _n=name, **k: calls.__setitem__(_n, calls[_n] + 1))
    wrap(ns_module, "newton_schulz", lambda m, *a, **k: ns_rows.append(m.shape[0]))
    wrap(DMuonFSDP, "_orthogonalize", lambda *a, **k: events.append("ns"))  # once per bucket
    try:
        opt.step()
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)

    entries = [(g, p, None) for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    plan = opt.plan_for(entries)
    expected_splits = []
    for counts in (plan.gather_counts, plan.scatter_counts):
        for bucket in plan.buckets:
            send, receive = counts(bucket, rank)
            expected_splits.append((receive, send))
    sent_elsewhere = sum(sum(inp) - inp[rank] for _, inp, _ in a2a)
    size = torch.empty((), dtype=comm_dtype).element_size()
    return {
        "buckets": len(plan.buckets),
        "a2a": a2a,
        "expected_splits": expected_splits,
        "calls": calls,
        "element_size": size,
        "sent_bytes": sent_elsewhere * size,
        "planned_bytes": plan.elements_moved(rank) * size,
        "a2a_before_first_ns": events.index("ns") if "ns" in events else None,
        "ns_matrices": sum(ns_rows),
        "owned": sum(1 for o in plan.owners if o == rank),
        "stats": opt.last_step_stats,
        "owned_flops": sum(m.cost for m, o in zip(plan.matrices, plan.owners) if o == rank),
        "matrices": len(plan.matrices),
    }


@pytest.mark.parametrize(
    "world_size,overlap,comm_dtype,checks",
    [(3, True, torch.float32, True), (4, False, torch.float32, True), (2, True, torch.bfloat16, False)],
)
def test_step_communication_matches_plan(world_size, overlap, comm_dtype, checks):
    results = run_ranks(counted_step, world_size, overlap, comm_dtype, checks)
    for rank, r in enumerate(results):
        assert r["buckets"] >= 3, "the test should exercise several buckets"
        assert len(r["a2a"]) == 2 * r["buckets"], f"rank {rank}: {len(r['a2a'])} all-to-alls"
        got = sorted((out, inp) for out, inp, _ in r["a2a"])
        assert got == sorted(tuple(e) for e in r["expected_splits"]), f"rank {rank}: split sizes"
        assert all(size == r["element_size"] for _, _, size in r["a2a"]), "comm_dtype on the wire"
        assert r["sent_bytes"] == r["planned_bytes"] > 0
        # All-reduces: the gradient checks' four integers and, on this first step, the check that
        # every rank built the same plan (both off with check_grads=False); no gathers.
        assert r["calls"].pop("all_reduce") == (2 if checks else 0)
        assert not any(r["calls"].values()), f"rank {rank} gathered: {r['calls']}"
        assert r["ns_matrices"] == r["owned"], f"rank {rank} orthogonalized matrices it does not own"
        stats = r["stats"]
        assert stats.bytes_sent == stats.bytes_received == r["planned_bytes"]
        assert stats.collectives == len(r["a2a"]) and stats.ns_flops == r["owned_flops"]
        assert set(stats.seconds) <= set(PHASES) and stats.seconds["newton_schulz"] > 0
        if r["a2a_before_first_ns"] is not None:
            # With overlap, bucket 1's exchange is in flight before bucket 0's NS starts.
            assert r["a2a_before_first_ns"] == (2 if overlap else 1)
    assert sum(r["owned"] for r in results) == results[0]["matrices"]
    assert sum(r["ns_matrices"] for r in results) == results[0]["matrices"]
