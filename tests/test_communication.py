"""What a step sends: two all-to-alls per bucket, the bytes the plan predicts, no gathers, and at
most one device-to-host read."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from dmuon_fsdp import DMuonFSDP
from dmuon_fsdp._step.buffers import SLOTS
from dmuon_fsdp._step.flags import FLAG_ELEMENTS
from dmuon_fsdp._step.run import PHASES
from instruments.counters import CollectiveCalls, HostReads
from tests.support.paired_runs import DIMS, inputs, sharded
from tests.support.spawn import run_ranks


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


def _launched_before_first_ns(prof) -> int | None:
    """All-to-alls launched before the first Newton-Schulz phase began, from a profiler trace
    (the phase is labelled once per bucket, owned matrices or not)."""
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    names = [e.name for e in events if e.name in ("c10d::alltoall_base_", "dmuon_fsdp.newton_schulz")]
    return names.index("dmuon_fsdp.newton_schulz") if "dmuon_fsdp.newton_schulz" in names else None


def counted_step(rank, world_size, overlap, comm_dtype, checks=True):
    model = sharded()
    # Buckets of at most 1 KiB a rank split the twelve matrices into several buckets.
    opt = DMuonFSDP(
        model.parameters(),
        ns_dtype=torch.float32,
        comm_dtype=comm_dtype,
        bucket_bytes=2**10,
        overlap=overlap,
        time_phases=True,
        check_grads=checks,
        nonfinite="raise" if checks else "ignore",
    )
    model(inputs(0)).pow(2).sum().backward()
    steps = []
    for _ in range(2):  # the first step builds the plan, the second is the steady state
        with CollectiveCalls() as calls, HostReads() as reads, torch.profiler.profile() as prof:
            opt.step()
        steps.append(
            {
                "a2a": calls.all_to_alls,
                "all_reduce": calls.calls["all_reduce"],
                "gathers": calls.gathers,
                "ns_matrices": opt.last_step_stats.ns_matrices,
                "host_reads": reads.count,
                "a2a_before_first_ns": _launched_before_first_ns(prof),
            }
        )
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
        "owned_flops": sum(cost for cost, o in zip(plan.costs, plan.owners, strict=True) if o == me),
        "matrices": len(plan.matrices),
        "largest_bucket": max(bucket_bytes(plan, k, me, size) for k in range(len(plan.buckets))),
    }


def bucket_bytes(plan, k, rank, size):
    """Bytes of bucket ``k``'s buffers on ``rank``: its pieces sent and received both ways (comm
    dtype, flags aside) and its owned matrices' fp32 stacks."""
    moved = 0
    for j in plan.buckets[k].matrices:
        m, owner = plan.matrices[j], plan.owners[j]
        others = sum(m.pieces[r].numel for r in range(plan.world_size) if r != owner)
        moved += 2 * (others if owner == rank else m.pieces[rank].numel if rank in plan.senders[j] else 0)
    owned = sum(plan.matrices[j].numel for j in plan.buckets[k].matrices if plan.owners[j] == rank)
    return moved * size + 4 * owned


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
            assert step["all_reduce"] == (1 if checks and index == 0 else 0)
            assert step["gathers"] == 0, f"rank {rank} gathered"
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
        # The buffers hold at least the largest bucket's exchanges and fp32 stacks.
        assert r["largest_bucket"] <= stats.buffer_bytes
        assert set(stats.seconds) <= set(PHASES) and stats.seconds["newton_schulz"] > 0
    assert sum(r["owned"] for r in results) == results[0]["matrices"]


def released_after_wait(rank, world_size):
    """After ``wait`` returns, gloo's worker thread holds nothing of the buffers any more: their
    Python reference counts (a C++ holder keeps one on a tensor's Python object) and their
    storages' counts are where they were before the launch. Returns how many of 200 exchanges
    left something held."""
    import sys

    from dmuon_fsdp._step import comm

    group = comm.exchange_group(range(world_size)).process_group
    held = 0
    for trial in range(200):
        send = torch.full((world_size * 3,), float(rank + trial))
        receive = torch.empty_like(send)

        def counts(*tensors):
            return [
                (sys.getrefcount(t), torch._C._storage_Use_Count(t.untyped_storage()._cdata)) for t in tensors
            ]

        before = counts(send, receive)
        handle = comm.launch(comm.Exchange(send, receive, [3] * world_size, [3] * world_size, group))
        handle.wait()
        del handle
        held += counts(send, receive) != before
        assert torch.equal(receive.view(world_size, 3)[:, 0], torch.arange(world_size) + float(trial))
        # The small collectives (plan agreement, error tables, QK-clip) alike.
        values = torch.full((3,), float(rank + trial))
        before = (sys.getrefcount(values), torch._C._storage_Use_Count(values.untyped_storage()._cdata))
        for _ in range(2):
            comm.all_max(values, group)
            now = (sys.getrefcount(values), torch._C._storage_Use_Count(values.untyped_storage()._cdata))
            held += now != before
        table = comm.all_rows(torch.tensor([float(rank)]), group)
        fresh = torch.zeros(1)  # held by nothing but this frame, as the table should be
        storage_uses = [torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in (table, fresh)]
        held += sys.getrefcount(table) != sys.getrefcount(fresh) or storage_uses[0] != storage_uses[1]
        assert table.flatten().tolist() == [float(r) for r in range(world_size)]
    return held


def test_a_waited_exchange_leaves_nothing_to_release_at_exit():
    """What keeps a job's exit clean: a release by the worker after interpreter finalization
    began would abort the process (see dmuon_fsdp._step.comm.settle)."""
    assert run_ranks(released_after_wait, 2) == [0, 0]


def released_with_a_shared_arena(rank, world_size):
    """Exchanges on views of one arena, while other views of it are made and dropped (other
    programs binding into shared buffers): each wait returns once the worker let go of its
    views, not after the release timeout, and leaves nothing held. Returns (held, slowest wait)."""
    import sys
    import time

    from dmuon_fsdp._step import comm

    group = comm.exchange_group(range(world_size)).process_group
    arena = torch.zeros(64 * world_size)
    held, slowest = 0, 0.0
    for trial in range(50):
        send, receive = arena[: 3 * world_size], arena[32 * world_size : 35 * world_size]
        send.fill_(float(rank + trial))
        before = (sys.getrefcount(send), sys.getrefcount(receive))
        handle = comm.launch(comm.Exchange(send, receive, [3] * world_size, [3] * world_size, group))
        others = [arena[8 * k : 8 * k + 4] for k in range(10)]  # bound meanwhile
        del others[::2]
        start = time.monotonic()
        handle.wait()
        slowest = max(slowest, time.monotonic() - start)
        del handle, others
        held += (sys.getrefcount(send), sys.getrefcount(receive)) != before
        assert torch.equal(receive.view(world_size, 3)[:, 0], torch.arange(world_size) + float(trial))
    return held, slowest


def test_a_wait_on_views_of_a_shared_arena_settles_at_once():
    for held, slowest in run_ranks(released_with_a_shared_arena, 2):
        assert held == 0 and slowest < 1.0, (held, slowest)


def buffers_by_depth(rank, world_size):
    """The buffer bytes of a plain step for the twelve-matrix stack and one four times deeper,
    at the same bucket_bytes."""
    out = []
    for repeat in (1, 4):
        model = sharded(dims=DIMS[:-1] * repeat + DIMS[-1:])
        opt = DMuonFSDP(model.parameters(), ns_dtype=torch.float32, bucket_bytes=2**10)
        model(inputs(0)).pow(2).sum().backward()
        opt.step()
        out.append((opt.last_step_stats.buffer_bytes, len(opt.plan.buckets)))
    return out


def test_buffers_do_not_grow_with_the_depth_of_the_model():
    for (shallow, buckets), (deep, deep_buckets) in run_ranks(buffers_by_depth, 2):
        assert deep_buckets > 2 * buckets > 2 * SLOTS
        assert deep <= 1.5 * shallow, (deep, shallow)


def tensor_lr(rank, world_size, lr_of, overlap_backward=False):
    """Parameters after three steps with Muon's and AdamW's lr given as ``lr_of(value)`` (weight
    decay on), and the device-to-host reads of the last (steady) step."""
    model = sharded()
    groups = [
        {"params": [p for p in model.parameters() if p.ndim == 2], "lr": lr_of(0.02)},
        {"params": [model.scale], "use_muon": False, "lr": lr_of(0.01)},
    ]
    options = dict(weight_decay=0.1, ns_dtype=torch.float32, bucket_bytes=2**10)
    opt = DMuonFSDP(groups, **options, overlap_backward=overlap_backward)
    for step in range(3):
        model(inputs(step)).pow(2).sum().backward()
        with HostReads() as reads:
            opt.step()
        opt.zero_grad()
    return [p.full_tensor() for p in model.parameters()], reads.count, len(opt.plan.buckets)


def test_a_tensor_lr_is_never_read_on_the_host():
    floats = run_ranks(tensor_lr, 2, float)
    tensors = run_ranks(tensor_lr, 2, torch.tensor)
    for (want, float_reads, buckets), (got, tensor_reads, _) in zip(floats, tensors, strict=True):
        assert buckets >= 4
        assert tensor_reads == float_reads == 1  # the verdict
        # the same steps, to float32 rounding (0.02 as a float32 tensor, its products rounded)
        assert max(((a - b).norm() / a.norm()).item() for a, b in zip(want, got, strict=True)) < 1e-5


def shaped(shape, value):
    return torch.tensor(value).reshape(shape)


@pytest.mark.parametrize("overlap_backward", [False, True])
def test_an_lr_of_any_one_element_shape_steps_as_a_0_dim_one(overlap_backward):
    """torch's optimizers take a tensor lr of one element whatever its shape: (1,) and (1, 1)
    step bitwise as () does, through weight decay, the update's scale, AdamW and steps begun in
    backward."""
    runs = [run_ranks(tensor_lr, 2, partial(shaped, shape), overlap_backward) for shape in ((), (1,), (1, 1))]
    for ranks in zip(*runs, strict=True):
        (want, _, _), *others = ranks
        for got, _, _ in others:
            assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def disagreeing_tensor_lr(rank, world_size):
    model = sharded()
    opt = DMuonFSDP([{"params": list(model.parameters()), "lr": torch.tensor(0.02 + 0.01 * rank)}])
    model(inputs(0)).pow(2).sum().backward()
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return None


def test_ranks_whose_tensor_lr_differs_raise_alike_naming_it():
    errors = run_ranks(disagreeing_tensor_lr, 2)
    assert errors[0] == errors[1] and "param group 0's lr" in errors[0], errors
