"""The wire format: every rank's buffers hold exactly what its peers' buffers say, in order."""

from __future__ import annotations

import random

import pytest

from dmuon_fsdp.layouts import EMPTY, MatrixLayout, Piece, chunk_row_counts, replicated
from dmuon_fsdp.newton_schulz import standard_segments
from dmuon_fsdp.planner import build_plan
from dmuon_fsdp.schedule import FLAG_ELEMENTS, check, rank_schedule

FIVE = standard_segments(5)  # five standard Newton-Schulz iterations


def row_sharded(shapes, world):
    return [MatrixLayout.row_sharded(f"m{i}", r, c, chunk_row_counts(r, world), FIVE) for i, (r, c) in enumerate(shapes)]


def column_blocks(rows, cols, world):
    """Each rank a block of columns (a row-wise TP layout), last ranks possibly empty."""
    pieces, start = [], 0
    for count in chunk_row_counts(cols, world):
        pieces.append(Piece(0, rows, start, count) if count else EMPTY)
        start += count
    return MatrixLayout(f"c{rows}x{cols}", rows, cols, tuple(pieces), FIVE)


def layouts_for(kind, world, rng):
    shapes = [(rng.randint(1, 3 * world + 5), rng.randint(1, 40)) for _ in range(rng.randint(1, 12))]
    if kind == "rows":
        return row_sharded(shapes, world)
    if kind == "mixed":
        return row_sharded(shapes, world) + [column_blocks(r, c, world) for r, c in shapes[:3]]
    if kind == "hsdp":
        shards = world // 2
        return [replicated(m, 2) for m in row_sharded(shapes, shards)]
    full = [MatrixLayout(f"d{i}", r, c, (Piece(0, r, 0, c),) * world, FIVE, tuple(range(world))) for i, (r, c) in enumerate(shapes)]
    return full  # DDP: every rank holds every matrix


CASES = [(kind, world) for kind in ("rows", "mixed") for world in (1, 2, 3, 5)]
CASES += [("hsdp", 4), ("hsdp", 6), ("ddp", 3)]


@pytest.mark.parametrize("kind,world", CASES)
def test_every_segment_matches_the_peer_that_reads_it(kind, world):
    rng = random.Random(f"{kind}{world}")
    plan = build_plan(layouts_for(kind, world, rng), world, rng.choice([200, 2000, 2**30]), 4)
    peers = list(range(world))
    rng.shuffle(peers)  # process-group order need not be mesh order
    schedules = [rank_schedule(plan, r, peers) for r in range(world)]
    position = {rank: g for g, rank in enumerate(peers)}
    total_sent = 0
    for k in range(len(schedules[0].buckets)):
        for a in range(world):
            for b in range(world):
                bucket_a, bucket_b = schedules[a].buckets[k], schedules[b].buckets[k]
                for wire in ("gather", "scatter"):
                    send, receive = getattr(bucket_a, wire), getattr(bucket_b, wire)
                    assert (send is None) == (receive is None), "every rank launches the same collectives"
                    if send is None:
                        continue
                    assert send.send[position[b]] == receive.receive[position[a]], (k, wire, a, b)
                    assert send.send_counts[position[b]] == receive.receive_counts[position[a]]
                    flags = FLAG_ELEMENTS if (wire == "gather" and k == 0 and world > 1) else 0
                    assert send.flags == flags
                    total_sent += sum(t.piece.numel for t in send.send[position[b]])
    kept = sum(m.pieces[o].numel for m, o in zip(plan.matrices, plan.owners))
    forward = sum(m.numel for m in plan.matrices) - kept
    held = sum(m.pieces[r].numel for m in plan.matrices for r in range(world))
    assert total_sent == forward + held - kept, "each piece crosses the wire at most once each way"
    for a in range(world):
        owned = [j for b in schedules[a].buckets for j in b.owned]
        assert sorted(owned) == [j for j, o in enumerate(plan.owners) if o == a]


def test_ddp_sends_nothing_forward_and_a_flags_only_first_exchange():
    world = 3
    full = Piece(0, 6, 0, 4)
    plan = build_plan([MatrixLayout(f"m{i}", 6, 4, (full,) * world, FIVE, tuple(range(world))) for i in range(3)],
                      world, 2**20, 4)  # fmt: skip
    for r in range(world):
        (bucket,) = rank_schedule(plan, r, range(world)).buckets
        assert bucket.gather.send_counts == [FLAG_ELEMENTS] * world, "only the check flags travel forward"
        assert len(bucket.gather_local) == 1 and sum(bucket.scatter.send_counts) == 2 * 6 * 4


def test_a_plan_without_matrices_still_carries_the_flags():
    plan = build_plan([], 2, 2**20, 4)
    (bucket,) = rank_schedule(plan, 0, [0, 1]).buckets
    assert bucket.gather.send_counts == [FLAG_ELEMENTS] * 2 and bucket.scatter is None
    (alone,) = rank_schedule(build_plan([], 1, 2**20, 4), 0, [0]).buckets
    assert alone.gather is None and alone.scatter is None, "one rank: no collective at all"


def test_check_rejects_a_schedule_that_loses_a_piece():
    plan = build_plan(row_sharded([(7, 3), (5, 4)], 2), 2, 2**20, 4)
    schedule = rank_schedule(plan, 0, [0, 1])
    bucket = schedule.buckets[0]
    broken = type(bucket)(bucket.owned, bucket.gather, (), bucket.scatter, bucket.scatter_local)
    with pytest.raises(RuntimeError, match="covered by"):
        check(plan, type(schedule)(0, schedule.peers, (broken,)))
