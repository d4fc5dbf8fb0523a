"""What a step sends: two all-to-alls per bucket, the bytes the plan predicts, no gathers, and at
most one device-to-host read."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from bench_host import HostReads
from dmuon_fsdp import DMuonFSDP
from dmuon_fsdp.program import Batch
from dmuon_fsdp.schedule import FLAG_ELEMENTS
from dmuon_fsdp.stats import PHASES, StepStats

from spawn import cpu_mesh, run_ranks
from test_equivalence import ShapesModel, gradients, make_groups

GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "all_reduce",
           "reduce_scatter_tensor", "gather", "scatter")  # fmt: skip


def expected_splits(plan, rank, world, flags):
    """Split sizes of every all-to-all this rank should launch, worked out from the plan alone:
    [(receive counts, send counts)], matrix pieces plus ``flags`` check elements in the first one."""
    out = []
    for k, bucket in enumerate(plan.buckets):
        for gather in (True, False):
            send, receive, moves = [0] * world, [0] * world, False
            for j in bucket.matrices:
                m, owner = plan.matrices[j], plan.owners[j]
                holders = plan.senders[j] if gather else [r for r in range(world) if m.pieces[r].numel]
                moves |= any(r != owner for r in holders)
                if owner != rank and rank in holders:
                    (send if gather else receive)[owner] += m.pieces[rank].numel
                if owner == rank:
                    for r in holders:
                        if r != rank:
                            (receive if gather else send)[r] += m.pieces[r].numel
            extra = flags if gather and k == 0 else 0
            if moves or extra:
                out.append(([n + extra for n in receive], [n + extra for n in send]))
    return out


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
    steps = []
    for _ in range(2):  # the first step builds the plan, the second is the steady state
        calls = {name: 0 for name in GATHERS + ("full_tensor", "redistribute")}
        a2a, ns_rows, events, originals = [], [], [], {}

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

        def record_ns(batch):  # once per batch of same-shape matrices
            ns_rows.append(batch.stack.shape[0])

        def record_phase(stats, name):  # the NS phase comes once per bucket, owned matrices or not
            if name == "newton_schulz":
                events.append("ns")

        wrap(dist, "all_to_all_single", record_a2a)
        for name in GATHERS:
            wrap(dist, name, lambda *a, _n=name, **k: calls.__setitem__(_n, calls[_n] + 1))
        for name in ("full_tensor", "redistribute"):
            wrap(DTensor, name, lambda *a, _n=name, **k: calls.__setitem__(_n, calls[_n] + 1))
        wrap(Batch, "orthogonalize", record_ns)
        wrap(StepStats, "phase", record_phase)
        try:
            with HostReads() as reads:
                opt.step()
        finally:
            for (owner, name), original in originals.items():
                setattr(owner, name, original)
        steps.append({"a2a": a2a, "calls": calls, "ns_matrices": sum(ns_rows), "host_reads": reads.count,
                      "a2a_before_first_ns": events.index("ns") if "ns" in events else None})  # fmt: skip
    plan, me = opt.plan, opt.exchange_rank
    size = torch.empty((), dtype=comm_dtype).element_size()
    return {
        "steps": steps,
        "buckets": len(plan.buckets),
        "flags": FLAG_ELEMENTS if checks else 0,  # with both checks off, no flags travel
        "expected_splits": expected_splits(plan, me, world_size, FLAG_ELEMENTS if checks else 0),
        "element_size": size,
        "planned_bytes": plan.elements_moved(me) * size,
        "owned": sum(1 for o in plan.owners if o == me),
        "stats": opt.last_step_stats,
        "owned_flops": sum(m.cost for m, o in zip(plan.matrices, plan.owners) if o == me),
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
        for index, step in enumerate(r["steps"]):
            got = sorted((out, inp) for out, inp, _ in step["a2a"])
            assert got == sorted(r["expected_splits"]), f"rank {rank}, step {index}: split sizes"
            assert all(size == r["element_size"] for _, _, size in step["a2a"]), "comm_dtype on the wire"
            flags = r["flags"] * (world_size - 1)  # the check flags, to every other rank
            sent = sum(sum(inp) - inp[rank] for _, inp, _ in step["a2a"]) - flags
            assert sent * r["element_size"] == r["planned_bytes"] > 0
            # The only all-reduce: on the first step, the check that every rank built the same
            # plan (none with check_grads=False); no gathers.
            assert step["calls"].pop("all_reduce") == (1 if checks and index == 0 else 0)
            assert not any(step["calls"].values()), f"rank {rank} gathered: {step['calls']}"
            assert step["ns_matrices"] == r["owned"], f"rank {rank} orthogonalized matrices it does not own"
            if index == 1:  # steady state: one device-to-host read with the checks on, none without
                assert step["host_reads"] == (1 if checks else 0)
            if step["a2a_before_first_ns"] is not None:
                # With overlap, bucket 1's exchange is in flight before bucket 0's NS starts.
                assert step["a2a_before_first_ns"] == (2 if overlap else 1)
        stats = r["stats"]
        assert stats.bytes_sent == stats.bytes_received == r["planned_bytes"]
        assert stats.collectives == len(r["steps"][1]["a2a"]) and stats.ns_flops == r["owned_flops"]
        assert stats.flag_bytes == r["flags"] * world_size * r["element_size"]
        assert set(stats.seconds) <= set(PHASES) and stats.seconds["newton_schulz"] > 0
    assert sum(r["owned"] for r in results) == results[0]["matrices"]


def released_after_wait(rank, world_size):
    """After ``wait`` returns, gloo's worker thread holds nothing of the buffers any more: their
    Python reference counts (a C++ holder keeps one on a tensor's Python object) and their
    storages' counts are where they were before the launch. Returns how many of 200 exchanges
    left something held."""
    import sys

    from dmuon_fsdp import comm

    group = comm.exchange_group(None).group
    held = 0
    for trial in range(200):
        send = torch.full((world_size * 3,), float(rank + trial))
        receive = torch.empty_like(send)

        def counts():
            return [(sys.getrefcount(t), torch._C._storage_Use_Count(t.untyped_storage()._cdata)) for t in (send, receive)]

        before = counts()
        handle = comm.launch(send, receive, [3] * world_size, [3] * world_size, group)
        handle.wait()
        del handle
        held += counts() != before
        assert torch.equal(receive.view(world_size, 3)[:, 0], torch.arange(world_size) + float(trial))
    return held


def test_a_waited_exchange_leaves_nothing_to_release_at_exit():
    """What keeps a job's exit clean: a release by the worker after interpreter finalization
    began would abort the process (see dmuon_fsdp.comm.settle)."""
    assert run_ranks(released_after_wait, 2) == [0, 0]
