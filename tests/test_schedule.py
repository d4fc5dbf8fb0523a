"""The wire format: every rank's buffers hold exactly what its peers' buffers say, in order."""

from __future__ import annotations

import random

import pytest

from dmuon_fsdp._step.flags import FLAG_ELEMENTS
from dmuon_fsdp._step.layouts import EMPTY, MatrixLayout, Piece
from dmuon_fsdp._step.planner import build_plan
from dmuon_fsdp._step.schedule import check, rank_schedule
from instruments.plans import chunk_row_counts, newton_schulz_flops, replicated, row_sharded_layout


def plan_for(matrices, world_size, bucket_bytes, element_size):
    """The plan with each matrix costed at five standard Newton-Schulz iterations."""
    return build_plan(matrices, costs(matrices), world_size, bucket_bytes, element_size)


def costs(matrices):
    return [newton_schulz_flops(m.rows, m.cols, 5) for m in matrices]


def row_sharded(shapes, world):
    return [row_sharded_layout(f"m{i}", r, c, chunk_row_counts(r, world)) for i, (r, c) in enumerate(shapes)]


def column_blocks(rows, cols, world):
    """Each rank a block of columns (a row-wise TP layout), last ranks possibly empty."""
    pieces, start = [], 0
    for count in chunk_row_counts(cols, world):
        pieces.append(Piece(0, rows, start, count) if count else EMPTY)
        start += count
    return MatrixLayout(f"c{rows}x{cols}", rows, cols, tuple(pieces))


def layouts_for(kind, world, rng):
    shapes = [(rng.randint(1, 3 * world + 5), rng.randint(1, 40)) for _ in range(rng.randint(1, 12))]
    if kind == "rows":
        return row_sharded(shapes, world)
    if kind == "mixed":
        return row_sharded(shapes, world) + [column_blocks(r, c, world) for r, c in shapes[:3]]
    if kind == "hsdp":
        shards = world // 2
        return [replicated(m, 2) for m in row_sharded(shapes, shards)]
    full = [
        MatrixLayout(f"d{i}", r, c, (Piece(0, r, 0, c),) * world, tuple(range(world)))
        for i, (r, c) in enumerate(shapes)
    ]
    return full  # DDP: every rank holds every matrix


CASES = [(kind, world) for kind in ("rows", "mixed") for world in (1, 2, 3, 5)]
CASES += [("hsdp", 4), ("hsdp", 6), ("ddp", 3)]


@pytest.mark.parametrize("kind,world", CASES)
def test_every_segment_matches_the_peer_that_reads_it(kind, world):
    rng = random.Random(f"{kind}{world}")
    plan = plan_for(layouts_for(kind, world, rng), world, rng.choice([200, 2000, 2**30]), 4)
    peers = list(range(world))
    rng.shuffle(peers)  # process-group order need not be mesh order
    schedules = [rank_schedule(plan, r, peers, FLAG_ELEMENTS) for r in range(world)]
    position = {rank: g for g, rank in enumerate(peers)}
    total_sent = 0

    def wires(schedule):  # (name, index, wire) of every exchange, in one order on every rank
        for k, bucket in enumerate(schedule.buckets):
            yield from (("to_owners", k, bucket.to_owners), ("from_owners", k, bucket.from_owners))
        yield from (("relay", g, wire) for g, wire in enumerate(schedule.relays))

    for a in range(world):
        for b in range(world):
            for (wire, k, send), (_, _, receive) in zip(
                wires(schedules[a]), wires(schedules[b]), strict=True
            ):
                assert (send is None) == (receive is None), "every rank launches the same collectives"
                if send is None:
                    continue
                assert send.send[position[b]] == receive.receive[position[a]], (k, wire, a, b)
                assert send.send_counts[position[b]] == receive.receive_counts[position[a]]
                flags = FLAG_ELEMENTS if (wire == "to_owners" and k == 0 and world > 1) else 0
                assert send.flag_elements == flags
                total_sent += sum(t.piece.numel for t in send.send[position[b]])
    kept = sum(m.pieces[o].numel for m, o in zip(plan.matrices, plan.owners, strict=True))
    forward = sum(m.numel for m in plan.matrices) - kept
    held = sum(m.pieces[r].numel for m in plan.matrices for r in range(world))
    assert total_sent == forward + held - kept, "each piece crosses the wire at most once each way"
    for a in range(world):
        owned = [j for b in schedules[a].buckets for j in b.owned]
        assert sorted(owned) == [j for j, o in enumerate(plan.owners) if o == a]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("carrier", [0, 1, 2])
def test_flags_ride_in_the_carriers_exchange_only(world, carrier):
    plan = plan_for(row_sharded([(12, 20), (7, 30), (9, 16)] * 2, world), world, 200, 4)
    assert len(plan.buckets) == 3
    for r in range(world):
        buckets = rank_schedule(plan, r, range(world), FLAG_ELEMENTS, carrier).buckets
        carried = [k for k, b in enumerate(buckets) if b.to_owners is not None and b.to_owners.flag_elements]
        assert carried == [carrier]
        assert buckets[carrier].to_owners.flag_elements == FLAG_ELEMENTS
    with pytest.raises(ValueError, match="carrier 3"):
        rank_schedule(plan, 0, range(world), FLAG_ELEMENTS, 3)


def test_ddp_sends_nothing_forward_and_a_flags_only_first_exchange():
    world = 3
    full = Piece(0, 6, 0, 4)
    plan = plan_for(
        [MatrixLayout(f"m{i}", 6, 4, (full,) * world, tuple(range(world))) for i in range(3)], world, 2**20, 4
    )
    for r in range(world):
        schedule = rank_schedule(plan, r, range(world), FLAG_ELEMENTS)
        (bucket,) = schedule.buckets
        assert bucket.to_owners.send_counts == [FLAG_ELEMENTS] * world, "only the check flags travel forward"
        assert len(bucket.own_pieces) == 1
        # Every replica is one rank: the owner returns each other rank its part, and the parts
        # are relayed (here each rank's part is the matrix it owns: the relay is all of the way
        # back), so that each rank receives the two matrices it does not own once, whole, and
        # sends as much.
        back = [w for w in (bucket.from_owners, *schedule.relays) if w is not None]
        assert sum(sum(w.receive_counts) for w in back) == sum(sum(w.send_counts) for w in back) == 2 * 6 * 4


def test_a_plan_without_matrices_still_carries_the_flags():
    plan = plan_for([], 2, 2**20, 4)
    (bucket,) = rank_schedule(plan, 0, [0, 1], FLAG_ELEMENTS).buckets
    assert bucket.to_owners.send_counts == [FLAG_ELEMENTS] * 2 and bucket.from_owners is None
    (alone,) = rank_schedule(plan_for([], 1, 2**20, 4), 0, [0], FLAG_ELEMENTS).buckets
    assert alone.to_owners is None and alone.from_owners is None, "one rank: no collective at all"


def test_check_rejects_a_schedule_that_loses_a_piece():
    plan = plan_for(row_sharded([(7, 3), (5, 4)], 2), 2, 2**20, 4)
    schedule = rank_schedule(plan, 0, [0, 1], FLAG_ELEMENTS)
    bucket = schedule.buckets[0]
    broken = type(bucket)(bucket.owned, bucket.to_owners, (), bucket.from_owners, bucket.own_results)
    with pytest.raises(RuntimeError, match="covered by"):
        check(plan, type(schedule)(0, schedule.peers, (broken,)))
