"""Yardsticks for plans, used by the tests and the paper model (not by the optimizer): FSDP2's
row chunking, layouts made by hand, each rank's load and lower bounds on the busiest one, and the
flops of standard Newton-Schulz."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dmuon_fsdp._step.layouts import EMPTY, MatrixLayout, Piece
from dmuon_fsdp._step.planner import Plan
from dmuon_fsdp.newton_schulz import segments_flops, standard_segments

if TYPE_CHECKING:
    from instruments.traffic import Network


def chunk_row_counts(rows: int, world_size: int) -> tuple[int, ...]:
    """Rows per rank under ``torch.chunk`` semantics, as FSDP2 shards dim 0.

    Chunks of ceil(rows / W) rows; the remainder goes to the earlier ranks, and the last ranks
    may hold none: 5 rows over 4 ranks -> (2, 2, 1, 0).
    """
    size = -(-rows // world_size) if rows else 0
    return tuple(max(0, min(size, rows - r * size)) for r in range(world_size))


def row_sharded_layout(name: str, rows: int, cols: int, row_counts: Sequence[int]) -> MatrixLayout:
    """A matrix cut into consecutive row blocks, ``row_counts[r]`` rows on rank r (FSDP2)."""
    pieces, start = [], 0
    for count in row_counts:
        pieces.append(Piece(start, count, 0, cols) if count and cols else EMPTY)
        start += count
    return MatrixLayout(name, rows, cols, tuple(pieces))


def replicated(layout: MatrixLayout, copies: int) -> MatrixLayout:
    """``layout`` held by ``copies`` replica groups, replica index outermost in rank order (HSDP
    on a (copies, shards) mesh); for simulations and tests."""
    shards = len(layout.pieces)
    replicas = tuple(r for r in range(copies) for _ in range(shards))
    return MatrixLayout(layout.name, layout.rows, layout.cols, layout.pieces * copies, replicas)


def rank_loads(plan: Plan) -> list[int]:
    """NS flops assigned to each rank of ``plan``."""
    out = [0] * plan.world_size
    for cost, owner in zip(plan.costs, plan.owners, strict=True):
        out[owner] += cost
    return out


def one_owner_bound(plan: Plan, last: Sequence[int], flops_s: float, network: Network) -> float:
    """Seconds under which no step of ``plan`` with one owner per matrix ends, whatever its buckets
    and launch order, on ``network``: the busiest rank's NS, and for each matrix of ``last`` (those
    whose gradients land last) its way to the owner (the pieces it takes, each over the link it
    crosses), its NS and its way back: the owner sends its node-mates their pieces over its link
    within the node, and every other node holding some of the matrix takes in at least that much
    (each element once) over its GPUs' links to other nodes, as does the owner's node sending it
    out. ``flops_s``: seconds per NS flop."""
    from instruments.traffic import covered  # (the paper model's; plans of older packages import this module)

    nodes = network.nodes(plan.world_size)
    near_s, far_s = network.element_s(near=True), network.element_s(near=False)
    chain = 0.0
    for j in last:
        m, owner = plan.matrices[j], plan.owners[j]
        home = nodes[owner]
        taken = {True: 0, False: 0}
        for r in plan.senders[j] - {owner}:
            taken[bool(nodes[r] == home)] += m.pieces[r].numel
        way_to = max(taken[True] * near_s, taken[False] * far_s)
        mates = sum(p.numel for r, p in enumerate(m.pieces) if r != owner and nodes[r] == home)
        held: dict[int, set[tuple[int, int, int, int]]] = {}  # the pieces each other node holds
        gpus: dict[int, int] = {}
        for r, p in enumerate(m.pieces):
            if p.numel and nodes[r] != home:
                held.setdefault(int(nodes[r]), set()).add((p.row, p.rows, p.col, p.cols))
                gpus[int(nodes[r])] = gpus.get(int(nodes[r]), 0) + 1
        into = max(
            (covered(rects, m.rows, m.cols) * far_s / gpus[n] for n, rects in held.items()), default=0.0
        )
        away = set().union(*held.values()) if held else set()
        out = covered(away, m.rows, m.cols) * far_s / network.gpus_per_node
        chain = max(chain, way_to + plan.costs[j] * flops_s + max(mates * near_s, into, out))
    return max(chain, max(rank_loads(plan)) * flops_s)


def assignment_lower_bound(costs: Sequence[int], world_size: int) -> float:
    """Least possible busiest-rank cost when whole matrices are assigned to ranks.

    max(mean load, largest matrix, W-th + (W+1)-th largest): with more than W matrices, two of
    the W+1 largest share a rank.
    """
    ordered = sorted(costs, reverse=True)
    bound = max(sum(ordered) / world_size, ordered[0] if ordered else 0)
    if len(ordered) > world_size:
        bound = max(bound, ordered[world_size - 1] + ordered[world_size])
    return bound


def _bins_needed(costs_desc: Sequence[int], capacity: float) -> int:
    """Martello-Toth L2 lower bound on the bins of ``capacity`` that hold all items (sorted desc)."""
    best = 0
    for alpha in sorted({c for c in costs_desc if c <= capacity / 2} | {0}):
        big = [c for c in costs_desc if c > capacity - alpha]
        medium = [c for c in costs_desc if capacity / 2 < c <= capacity - alpha]
        small = sum(c for c in costs_desc if alpha <= c <= capacity / 2)
        spare = len(medium) * capacity - sum(medium)
        best = max(best, len(big) + len(medium) + max(0, math.ceil((small - spare) / capacity)))
    return best


def makespan_lower_bound(costs: Sequence[int], world_size: int) -> float:
    """A tighter bound than ``assignment_lower_bound``: the least capacity for which the L2 bin
    packing bound does not exceed ``world_size`` bins (bisection to 0.1%)."""
    ordered = sorted(costs, reverse=True)
    low = assignment_lower_bound(ordered, world_size)
    high = max(low, sum(ordered))
    if not ordered or _bins_needed(ordered, low) <= world_size:
        return low
    while high - low > 1e-3 * low:
        mid = (low + high) / 2
        if _bins_needed(ordered, mid) > world_size:
            low = mid
        else:
            high = mid
    return low


def newton_schulz_flops(rows: int, cols: int, ns_steps: int) -> int:
    """Flops (2 per multiply-add) of standard Newton-Schulz on one rows x cols matrix."""
    return segments_flops(rows, cols, standard_segments(ns_steps))
