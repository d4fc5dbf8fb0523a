"""The exchange plan: who orthogonalizes which matrix, and in which bucket.

Pure Python: no collectives and no tensors. Every rank derives the identical plan from the same
matrix layouts (see ``layouts``), Newton-Schulz costs (flops of the form each matrix runs, see
``newton_schulz.segments_flops``) and options, so no rank has to ask another. Owners balance the
NS flops (``assign_owners``); buckets bound what a rank holds or moves (``Cutter``) and are
shaped by the bucket pipeline's cost model (``ramp``, ``dmuon_fsdp._step.pipeline``).
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from dmuon_fsdp._step.cutter import RELAY_KINDS, Cut, Cutter, shares_of
from dmuon_fsdp._step.layouts import MatrixLayout, by_layout, holding
from dmuon_fsdp._step.pipeline import cut_flops
from dmuon_fsdp._step.relay import Cuts, even_shares, in_class, twins


@dataclass(frozen=True)
class Bucket:
    """Matrices (indices into ``Plan.matrices``) exchanged by one pair of all-to-alls."""

    matrices: tuple[int, ...]


@dataclass(frozen=True)
class Relay:
    """Matrices (of one bucket, with twins) whose parts one relay carries, once bucket ``bucket``'s
    way back arrived ([Note: the relay] in ``dmuon_fsdp._step.relay``)."""

    matrices: tuple[int, ...]
    bucket: int


@dataclass(frozen=True)
class Plan:
    """Owners and buckets for a list of matrices over ``world_size`` ranks; ``costs[j]`` is matrix
    j's Newton-Schulz flops and ``param_of[j]`` the index of the parameter it belongs to (a
    parameter may hold several matrices).

    Exchange to the owners (gather): each sender of matrix j sends its piece to j's owner. Way
    back: the owner returns every holder its piece of the result (``returned``) but, where the
    matrix has twins in other replicas (``dmuon_fsdp._step.relay``), only their parts to the
    holders outside its own replica, which then receive the rest from their twins in one of
    ``relays``, the relays after its bucket (``relayed``, ``relays_to``). Ranks are numbered by
    exchange-mesh index; how the pieces sit in the buffers of each all-to-all is
    ``dmuon_fsdp._step.schedule``'s business.
    """

    matrices: tuple[MatrixLayout, ...]
    costs: tuple[int, ...]
    owners: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    world_size: int
    param_of: tuple[int, ...]
    relays: tuple[Relay, ...] = ()
    _cuts: dict[tuple[int, int], Cuts] = field(default_factory=dict, compare=False, hash=False, repr=False)
    _shares: dict[int, list[float]] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @cached_property
    def senders(self) -> tuple[frozenset[int], ...]:
        """Ranks sending their piece of each matrix to its owner."""
        return tuple(frozenset(m.senders(o)) for m, o in zip(self.matrices, self.owners, strict=True))

    @cached_property
    def relay_of(self) -> tuple[int, ...]:
        """The relay of each matrix (-1: none)."""
        out = [-1] * len(self.matrices)
        for g, relay in enumerate(self.relays):
            for j in relay.matrices:
                out[j] = g
        return tuple(out)

    def owned_by(self, bucket: Bucket, rank: int) -> list[int]:
        return [j for j in bucket.matrices if self.owners[j] == rank]

    def cuts(self, g: int, ranks: tuple[int, ...]) -> Cuts:
        """The parts of the class of twins ``ranks`` in relay ``g`` (``relay.Cuts``): each twin's
        share of every relay is the same, sized by what it sends in the step besides
        (``loads``), so that its elements sent in the step come out as even as they can."""
        key = (g, id(ranks))  # (a class of twins is one tuple: relay.Twins)
        if key not in self._cuts:
            first = ranks[0]
            if id(ranks) not in self._shares:
                held = sum(m.pieces[first].numel for m in self.matrices if in_class(m, ranks))
                loads = self.loads
                self._shares[id(ranks)] = even_shares([loads.get(r, 0) for r in ranks], held, len(ranks) - 1)
            members = [j for j in self.relays[g].matrices if in_class(self.matrices[j], ranks)]
            shapes = [
                (self.matrices[j].pieces[first].rows, self.matrices[j].pieces[first].cols) for j in members
            ]
            self._cuts[key] = Cuts.of(members, shapes, self._shares[id(ranks)], ranks)
        return self._cuts[key]

    @cached_property
    def loads(self) -> dict[int, int]:
        """The elements each rank sends in the step's exchanges to and from the owners, about
        (the way back: the other pieces of the owner's replica, and (R - 1) / R of the matrix as
        parts to the other replicas)."""
        loads: dict[int, int] = {}
        for j, (m, owner) in enumerate(zip(self.matrices, self.owners, strict=True)):
            for r in self.senders[j] - {owner}:
                loads[r] = loads.get(r, 0) + m.pieces[r].numel
            copies = twins(m)
            parts = m.numel - m.numel // copies.count if copies is not None else 0
            loads[owner] = loads.get(owner, 0) + m.numel - m.pieces[owner].numel + parts
        return loads

    def relayed(self, j: int, rank: int) -> tuple[int, int]:
        """Rows [first, stop) of ``rank``'s piece of matrix j that it relays to its twins (its
        part); (0, 0) when j has no twins or ``rank`` holds none of it."""
        t = twins(self.matrices[j])
        if t is None or rank not in t.of or self.relay_of[j] < 0:
            return 0, 0
        c, position = t.of[rank]
        return self.cuts(self.relay_of[j], t.classes[c]).rows_of(j, position)

    def in_owners_replica(self, j: int, rank: int) -> bool:
        m = self.matrices[j]
        return m.replica(rank) == m.replica(self.owners[j])

    def returned(self, j: int, rank: int) -> tuple[int, int]:
        """Rows [first, stop) of ``rank``'s piece of matrix j that j's owner returns to it: all
        of them in the owner's replica and for matrices without twins, else its part."""
        rows = self.matrices[j].pieces[rank].rows
        if self.relay_of[j] < 0 or self.in_owners_replica(j, rank):
            return 0, rows
        return self.relayed(j, rank)

    def relayed_from(self, j: int, rank: int) -> list[tuple[int, int, int]]:
        """(twin, first, stop): the rows [first, stop) of ``rank``'s piece of matrix j that each
        twin relays to it; none in the owner's replica (it got them all from the owner)."""
        t = twins(self.matrices[j])
        if t is None or rank not in t.of or self.relay_of[j] < 0 or self.in_owners_replica(j, rank):
            return []
        c, me = t.of[rank]
        ranks = t.classes[c]
        cuts = self.cuts(self.relay_of[j], ranks)
        return [(ranks[p], *cuts.rows_of(j, p)) for p in cuts.positions(j) if p != me]

    def relays_to(self, j: int, rank: int) -> tuple[int, ...]:
        """The twins ``rank`` relays its part of matrix j to: those outside the owner's replica."""
        t = twins(self.matrices[j])
        if t is None or rank not in t.of or self.relay_of[j] < 0:
            return ()
        owner_replica = self.matrices[j].replica(self.owners[j])
        m = self.matrices[j]
        return tuple(r for r in t.classes[t.of[rank][0]] if r != rank and m.replica(r) != owner_replica)

    def signature(self) -> int:
        """A checksum of everything ranks must agree on to exchange, the matrices' names included
        (same-shaped parameters listed in another order on one rank would otherwise exchange
        rows of different matrices)."""
        shapes = [(m.name, m.rows, m.cols, _layout_digest(m)) for m in self.matrices]
        buckets = [b.matrices for b in self.buckets]
        relays = [(r.matrices, r.bucket) for r in self.relays]
        return zlib.crc32(repr((shapes, self.costs, self.owners, buckets, relays)).encode())

    def elements_moved(self, rank: int) -> int:
        """Elements ``rank`` sends to other ranks in one step, all three exchanges together: its
        piece of each matrix it sends to another owner, what it returns of each matrix it owns,
        and the part of each piece it relays to its twins.

        Each piece crosses the wire at most once each way between the owner's replica and the
        owner, and each rank receives exactly the rows it holds, once: no schedule that runs
        each matrix's NS on one rank moves less across replicas. A cost model: the wire format
        itself (buffer order, split sizes) is ``dmuon_fsdp._step.schedule``'s, which checks its
        totals against this.
        """
        total = 0
        for j, (m, owner) in enumerate(zip(self.matrices, self.owners, strict=True)):
            piece = m.pieces[rank]
            if owner != rank and rank in self.senders[j]:
                total += piece.numel
            if owner == rank:
                for r, other in enumerate(m.pieces):
                    if r != rank and other.numel:
                        first, stop = self.returned(j, r)
                        total += (stop - first) * other.cols
            if piece.numel:
                first, stop = self.relayed(j, rank)
                if stop > first:
                    total += (stop - first) * piece.cols * len(self.relays_to(j, rank))
        return total


def _layout_digest(m: MatrixLayout) -> int:
    """A checksum of ``m``'s pieces and replicas (made once per layout)."""
    return by_layout("digest", m, lambda _: zlib.crc32(repr((m.pieces, m.replicas)).encode()))


def assign_owners(
    costs: Sequence[int],
    world_size: int,
    allowed: Sequence[Sequence[int] | None] | None = None,
    replicas: Sequence[tuple[int, ...] | None] | None = None,
    classes: Sequence[dict[int, int] | None] | None = None,
    sizes: Sequence[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Longest-processing-time-first: biggest matrix first, each to the least-loaded rank; among
    ranks equally loaded, the one whose replica (``replicas[j][r]``: matrix j's replica index of
    rank r; None: one copy) owns the fewest elements so far (``sizes[j]``: matrix j's), then the
    one whose twins (``classes[j][r]``: the first rank of its class of twins, ``relay.Twins``)
    do, so that with fewer matrices than ranks the owners, and the exchanges to and from them,
    spread over every replica and every class of twins instead of filling the first ones (the
    relay then has twins without an owner's load to give the most of it to).

    ``allowed[j]``, when given, restricts matrix j's owner to those ranks; matrices allowed on one
    rank only are placed first, so the others are balanced around them. Ties break on matrix
    index (the later first) and rank number, so the result depends only on the inputs.
    Returns (owner of each matrix, matrix indices in assignment order).
    """
    allowed = allowed or [None] * len(costs)
    replicas = replicas or [None] * len(costs)
    classes = classes or [None] * len(costs)
    sizes = sizes or [0] * len(costs)
    order = sorted(range(len(costs)), key=lambda j: (-costs[j], -j))
    loads = [0] * world_size
    owned: dict[tuple[str, int], int] = {}  # elements owned by each replica and class of twins
    owners = [0] * len(costs)

    def key(rank: int, j: int) -> tuple[int, int, int, int]:
        of, twins_of = replicas[j], classes[j]
        replica = owned.get(("replica", of[rank]), 0) if of else 0
        twin = owned.get(("twins", twins_of[rank]), 0) if twins_of and rank in twins_of else 0
        return loads[rank], replica, twin, rank

    # Entries may be stale (a rank's load, or what its replica or twins own, grew since): each is
    # at most its true key, and the top is fixed until it is true, so the top is the least.
    heap = [(0, 0, 0, rank) for rank in range(world_size)]
    for j in [j for j in order if (a := allowed[j]) is not None and len(a) == 1] + [
        j for j in order if (a := allowed[j]) is None or len(a) > 1
    ]:
        ranks = allowed[j]
        if ranks is None:
            while heap[0] != (true := key(heap[0][3], j)):
                heapq.heapreplace(heap, true)
            rank = heap[0][3]
        else:
            rank = min(ranks, key=lambda r: key(r, j))
        owners[j] = rank
        loads[rank] += costs[j]
        of, twins_of = replicas[j], classes[j]
        if of:
            owned["replica", of[rank]] = owned.get(("replica", of[rank]), 0) + sizes[j]
        if twins_of and rank in twins_of:
            owned["twins", twins_of[rank]] = owned.get(("twins", twins_of[rank]), 0) + sizes[j]
        heapq.heappush(heap, key(rank, j))
    return owners, order


def build_plan(
    matrices: Sequence[MatrixLayout],
    costs: Sequence[int],
    world_size: int,
    bucket_bytes: int,
    element_size: int,
    param_of: Sequence[int] | None = None,
    flops_per_byte: float = 0.0,
    forward_relays: bool = False,
    homes: Sequence[int | None] | None = None,
) -> Plan:
    """Assign owners by NS cost (``costs[j]``, matrix j's flops) over all matrices and cut them
    into buckets in which no rank holds or moves more than ``bucket_bytes`` (in elements of
    ``element_size`` bytes; ``Cutter.cut``), shaped into a pipeline that ramps (``ramp``) when
    ``flops_per_byte`` (the NS flops a rank runs in the time its link moves one byte) is given;
    then each bucket's matrices with twins into relays in which no rank relays or receives by
    relay more than ``bucket_bytes`` (a bucket's relays follow its way back one by one), or, with
    ``forward_relays``, all of them in parameter order (``param_of``; the next forward's order when
    the parameters are listed in model order), after every bucket.

    A matrix that some ranks hold whole (a 1-row matrix, an expert of an expert-sharded stack,
    also when replicated) is owned by one of them: nothing is sent to its owner; one with a home
    (``homes[j]``: ``_allowed``) there. Buckets follow the assignment order (largest first, and
    among equal costs the later matrix first): each next matrix goes to the least-loaded rank, so
    a bucket holds about ``bucket_bytes`` of matrices per owner, on every owner, and its NS work
    is about the same on each; while one bucket's NS runs, the next bucket's exchange is in
    flight. The ramp may take a first and a last bucket out of that order. Among the matrices of
    one shape (a model's layers), the last layers' come first: their gradients land first in
    backward, so that the first bucket can start there (``overlap_backward``)."""
    _check_tiles(matrices, costs, world_size)
    owners, order = assign_owners(
        costs,
        world_size,
        _allowed(matrices, world_size, homes),
        [m.replicas for m in matrices],
        [_class_ids(m) for m in matrices],
        [m.numel for m in matrices],
    )
    param_of = tuple(param_of) if param_of is not None else tuple(range(len(matrices)))
    limit = max(1, bucket_bytes // element_size)
    shares = [shares_of(m, o) for m, o in zip(matrices, owners, strict=True)]
    cutter = Cutter(shares, costs, owners, limit, world_size, relays_in_step=not forward_relays)
    if flops_per_byte > 0 and len(matrices) > 1:
        cut = ramp(matrices, costs, order, cutter, flops_per_byte * element_size)
    else:
        cut = cutter.cut(order).buckets
    buckets = tuple(Bucket(b) for b in cut)
    if forward_relays:
        relayed = sorted(
            (j for j in range(len(matrices)) if twins(matrices[j])), key=lambda j: (param_of[j], j)
        )
        groups = [(len(buckets) - 1, cutter.cut(relayed, RELAY_KINDS).buckets)]
    else:
        groups = [
            (k, cutter.cut([j for j in b.matrices if twins(matrices[j])], RELAY_KINDS).buckets)
            for k, b in enumerate(buckets)
        ]
    relays = tuple(Relay(group, k) for k, groups_of in groups for group in groups_of)
    return Plan(tuple(matrices), tuple(costs), tuple(owners), buckets, world_size, param_of, relays)


def _allowed(
    matrices: Sequence[MatrixLayout], world_size: int, homes: Sequence[int | None] | None
) -> list[Sequence[int] | None]:
    """Where each matrix may be owned: its home (the rank holding its main weight, [Note: main
    weights] in ``dmuon_fsdp._step.state``; the others are balanced around it), else the ranks
    holding it whole (all: any)."""
    return [
        (home,) if home is not None else m.full_holders if 0 < len(m.full_holders) < world_size else None
        for m, home in zip(matrices, homes or [None] * len(matrices), strict=True)
    ]


def _check_tiles(matrices: Sequence[MatrixLayout], costs: Sequence[int], world_size: int) -> None:
    """Every matrix has a cost and a piece for each rank, and each replica's pieces tile it."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if len(costs) != len(matrices):
        raise ValueError(f"{len(costs)} costs for {len(matrices)} matrices")
    for m in matrices:
        if len(m.pieces) != world_size:
            raise ValueError(f"matrix {m.name!r} has pieces for {len(m.pieces)} ranks, not {world_size}")
        h = holding(m)
        held = np.bincount(h.replica, weights=h.numel)
        wrong = np.nonzero(held != m.numel)[0]
        if len(wrong):
            raise ValueError(
                f"matrix {m.name!r} ({m.rows}x{m.cols}): the pieces of replica {int(wrong[0])} hold "
                f"{int(held[wrong[0]])} elements, not {m.numel}"
            )


def _class_ids(m: MatrixLayout) -> dict[int, int] | None:
    """Each holder of ``m``'s class of twins, by its first rank (None: no twins)."""
    copies = twins(m)
    if copies is None:
        return None
    return by_layout("class ids", m, lambda _: {r: copies.classes[c][0] for r, (c, _) in copies.of.items()})


def ramp(
    matrices: Sequence[MatrixLayout],
    costs: Sequence[int],
    order: Sequence[int],
    cutter: Cutter,
    flops_per_element: float,
) -> tuple[tuple[int, ...], ...]:
    """The cut of ``order`` whose step the pipeline's cost model (``pipeline.cut_flops``)
    predicts fastest, among: the plain cut, and the same with a first bucket, then also a last
    one, of one matrix of a shape per owner that has one (the first bucket's exchange and the
    last one's return are all the pipeline leaves exposed: with a shape whose own exchange is
    short and whose NS hides its neighbour's, both shrink). Each shape is tried in turn, the
    first bucket's before the last one's; ties keep the earlier cut (fewer buckets). Arithmetic
    on the plan's own numbers: every rank picks the same cut."""
    owners = cutter.owners

    def one_per_owner(sequence: Sequence[int], shape: tuple[int, int, int]) -> Cut:
        """The first matrix of ``shape`` of each owner in ``sequence``, within the bucket bound
        (none when ``sequence`` holds no matrix of ``shape``)."""
        picked, seen = [], set()
        for j in sequence:
            if (matrices[j].rows, matrices[j].cols, costs[j]) == shape and owners[j] not in seen:
                seen.add(owners[j])
                picked.append(j)
        first = cutter.cut(picked)
        return Cut(first.buckets[:1], first.loads[:1])

    def with_ends(first: Cut, last: Cut) -> Cut:
        chosen = {j for b in first.buckets + last.buckets for j in b}
        return first + cutter.cut([j for j in order if j not in chosen]) + last

    def cost(cut: Cut) -> float:
        return cut_flops(cut.loads, flops_per_element)

    shapes = list(dict.fromkeys((matrices[j].rows, matrices[j].cols, costs[j]) for j in order))
    none = Cut((), ())
    plain = best = cutter.cut(order)
    best_cost, first = cost(best), none
    # (an end bucket whose exchange is no shorter than every plain bucket's cannot shorten it)
    longest_to, longest_back = max(b.to_owners for b in plain.loads), max(b.back for b in plain.loads)
    for shape in shapes:
        picked = one_per_owner(order, shape)
        if picked.loads and picked.loads[0].to_owners < longest_to:
            candidate = with_ends(picked, none)
            if (c := cost(candidate)) < best_cost:
                best, best_cost, first = candidate, c, picked
    taken = {j for b in first.buckets for j in b}
    rest = [j for j in reversed(order) if j not in taken]
    for shape in shapes:
        last = one_per_owner(rest, shape)
        if last.loads and last.loads[0].back < longest_back:
            members = set(last.buckets[0])
            ordered = Cut((tuple(j for j in order if j in members),), last.loads)
            candidate = with_ends(first, ordered)
            if (c := cost(candidate)) < best_cost:
                best, best_cost = candidate, c
    return best.buckets
