"""The exchange plan: who orthogonalizes which matrix, and in which bucket.

Pure Python: no collectives and no tensors. Every rank derives the identical plan from the same
matrix layouts (see ``layouts``) and Newton-Schulz costs (flops of the form each matrix runs, see
``newton_schulz.segments_flops``), so no rank has to ask another.
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from dmuon_fsdp._step.layouts import MatrixLayout


@dataclass(frozen=True)
class Bucket:
    """Matrices (indices into ``Plan.matrices``) exchanged by one pair of all-to-alls."""

    matrices: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """Owners and buckets for a list of matrices over ``world_size`` ranks; ``costs[j]`` is matrix
    j's Newton-Schulz flops and ``param_of[j]`` the index of the parameter it belongs to (a
    parameter may hold several matrices).

    Forward exchange (gather): each sender of matrix j sends its piece to j's owner. Reverse
    exchange (scatter): the owner sends every rank that holds a piece of j that piece of the
    result, replicas included. Ranks are numbered by exchange-mesh index; how the pieces sit in
    the buffers of each all-to-all is ``dmuon_fsdp._step.schedule``'s business.
    """

    matrices: tuple[MatrixLayout, ...]
    costs: tuple[int, ...]
    owners: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    world_size: int
    param_of: tuple[int, ...]

    @cached_property
    def senders(self) -> tuple[frozenset[int], ...]:
        """Ranks sending their piece of each matrix to its owner."""
        return tuple(frozenset(m.senders(o)) for m, o in zip(self.matrices, self.owners, strict=True))

    def owned_by(self, bucket: Bucket, rank: int) -> list[int]:
        return [j for j in bucket.matrices if self.owners[j] == rank]

    def signature(self) -> int:
        """A checksum of everything ranks must agree on to exchange, the matrices' names included
        (same-shaped parameters listed in another order on one rank would otherwise exchange
        rows of different matrices)."""
        shapes = [(m.name, m.rows, m.cols, m.pieces, m.replicas) for m in self.matrices]
        buckets = [b.matrices for b in self.buckets]
        return zlib.crc32(repr((shapes, self.costs, self.owners, buckets)).encode())

    def elements_moved(self, rank: int) -> int:
        """Elements ``rank`` sends to other ranks in one step, both exchanges together: its
        piece of each matrix it sends to another owner, and every other holder's piece of each
        matrix it owns.

        Each piece crosses the wire at most once each way: one copy of every matrix reaches its
        owner, and each rank receives exactly the pieces it holds; no schedule that runs each
        matrix's NS on one rank moves less. A cost model: the wire format itself (buffer order,
        split sizes) is ``dmuon_fsdp._step.schedule``'s, which checks its totals against this.
        """
        total = 0
        for j, (m, owner) in enumerate(zip(self.matrices, self.owners, strict=True)):
            if owner != rank and rank in self.senders[j]:
                total += m.pieces[rank].numel
            if owner == rank:
                total += sum(piece.numel for r, piece in enumerate(m.pieces) if r != rank)
        return total


def assign_owners(
    costs: Sequence[int], world_size: int, allowed: Sequence[Sequence[int] | None] | None = None
) -> tuple[list[int], list[int]]:
    """Longest-processing-time-first: biggest matrix first, each to the least-loaded rank.

    ``allowed[j]``, when given, restricts matrix j's owner to those ranks; matrices allowed on one
    rank only are placed first, so the others are balanced around them. Ties break on matrix
    index (the later first) and rank number, so the result depends only on the inputs.
    Returns (owner of each matrix, matrix indices in assignment order).
    """
    allowed = allowed or [None] * len(costs)
    order = sorted(range(len(costs)), key=lambda j: (-costs[j], -j))
    loads = [0] * world_size
    owners = [0] * len(costs)
    heap = [(0, rank) for rank in range(world_size)]  # may hold stale entries; loads is the truth
    for j in [j for j in order if (a := allowed[j]) is not None and len(a) == 1] + [
        j for j in order if (a := allowed[j]) is None or len(a) > 1
    ]:
        ranks = allowed[j]
        if ranks is None:
            while heap[0][0] != loads[heap[0][1]]:
                heapq.heappop(heap)
            rank = heap[0][1]
        else:
            rank = min(ranks, key=lambda r: (loads[r], r))
        owners[j] = rank
        loads[rank] += costs[j]
        heapq.heappush(heap, (loads[rank], rank))
    return owners, order


def build_plan(
    matrices: Sequence[MatrixLayout],
    costs: Sequence[int],
    world_size: int,
    bucket_bytes: int,
    element_size: int,
    param_of: Sequence[int] | None = None,
) -> Plan:
    """Assign owners by NS cost (``costs[j]``, matrix j's flops) over all matrices and cut them
    into buckets in which no rank holds or moves more than ``bucket_bytes`` (in elements of
    ``element_size`` bytes; ``cut_buckets``).

    A matrix that some ranks hold whole (a 1-row matrix, an expert of an expert-sharded stack,
    also when replicated) is owned by one of them: nothing is sent to its owner. Buckets follow
    the assignment order (largest first, and among equal costs the later matrix first): each next
    matrix goes to the least-loaded rank, so a bucket holds about ``bucket_bytes`` of matrices
    per owner, on every owner, and its NS work is about the same on each; while one bucket's NS
    runs, the next bucket's exchange is in flight. Among the matrices of one shape (a model's
    layers), the last layers' come first: their gradients land first in backward, so that the
    first bucket can start there (``overlap_backward``).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if len(costs) != len(matrices):
        raise ValueError(f"{len(costs)} costs for {len(matrices)} matrices")
    for m in matrices:
        if len(m.pieces) != world_size:
            raise ValueError(f"matrix {m.name!r} has pieces for {len(m.pieces)} ranks, not {world_size}")
        for replica in set(m.replicas or (0,)):
            held = sum(p.numel for r, p in enumerate(m.pieces) if m.replica(r) == replica)
            if held != m.numel:
                raise ValueError(
                    f"matrix {m.name!r} ({m.rows}x{m.cols}): the pieces of replica {replica} hold "
                    f"{held} elements, not {m.numel}"
                )
    allowed = [m.full_holders if 0 < len(m.full_holders) < world_size else None for m in matrices]
    owners, order = assign_owners(costs, world_size, allowed)
    param_of = tuple(param_of) if param_of is not None else tuple(range(len(matrices)))
    buckets = cut_buckets(matrices, owners, order, max(1, bucket_bytes // element_size))
    return Plan(tuple(matrices), tuple(costs), tuple(owners), buckets, world_size, param_of)


def bucket_shares(m: MatrixLayout, owner: int) -> list[tuple[int, int, int]]:
    """What matrix ``m``, owned by ``owner``, adds to the ranks' shares of a bucket, as (one of
    ``SHARES``, rank, elements): the whole matrix in its owner's stack, each sender's piece in
    the exchange to the owner, and every other holder's piece in the exchange back (sent by the
    owner, received by the holder)."""
    mine, returned = m.replica(owner), 0
    out = [(HELD, owner, m.numel)]
    for r, piece in enumerate(m.pieces):
        if r != owner and piece.numel:
            if m.replica(r) == mine:
                out.append((SENT, r, piece.numel))
            out.append((RECEIVED, r, piece.numel))
            returned += piece.numel
    if returned:
        out.append((RETURNED, owner, returned))
    return out


HELD, SENT, RETURNED, RECEIVED = range(4)


SHARES = ("held", "sent to owners", "sent back", "received back")  # what a rank holds or moves


def cut_buckets(
    matrices: Sequence[MatrixLayout], owners: Sequence[int], order: Sequence[int], limit: int
) -> tuple[Bucket, ...]:
    """Cut ``order`` into consecutive buckets in which no rank holds whole matrices of more than
    ``limit`` elements (its stacks; what it receives is part of them), nor sends or receives more
    than ``limit`` in either exchange; a bucket holding a matrix larger than ``limit`` allows that
    matrix's size instead (so that such matrices still spread over the owners: one each). A
    matrix joins the current bucket unless it would take some rank's share, not empty yet, past
    the bucket's allowance; then the bucket closes and the matrix starts the next one."""
    world = len(matrices[0].pieces) if matrices else 0
    shares = [[0] * world for _ in SHARES]
    buckets: list[Bucket] = []
    current: list[int] = []
    touched: list[tuple[int, int, int]] = []
    allowance = limit
    for j in order:
        added = bucket_shares(matrices[j], owners[j])
        grown = max(allowance, matrices[j].numel)
        if current and any(shares[w][r] and shares[w][r] + n > grown for w, r, n in added):
            buckets.append(Bucket(tuple(current)))
            for w, r, _ in touched:
                shares[w][r] = 0
            current, touched, grown = [], [], max(limit, matrices[j].numel)
        current.append(j)
        touched += added
        allowance = grown
        for w, r, n in added:
            shares[w][r] += n
    if current:
        buckets.append(Bucket(tuple(current)))
    return tuple(buckets)
