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

from dmuon_fsdp._step.layouts import MatrixLayout
from dmuon_fsdp._step.pipeline import Load, cut_flops
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
    _cuts: dict[tuple[int, tuple[int, ...]], Cuts] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )
    _shares: dict[tuple[int, ...], list[float]] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )

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
        key = (g, ranks)
        if key not in self._cuts:
            first = ranks[0]
            if ranks not in self._shares:
                held = sum(m.pieces[first].numel for m in self.matrices if in_class(m, ranks))
                loads = self.loads
                self._shares[ranks] = even_shares([loads.get(r, 0) for r in ranks], held, len(ranks) - 1)
            members = [j for j in self.relays[g].matrices if in_class(self.matrices[j], ranks)]
            shapes = [
                (self.matrices[j].pieces[first].rows, self.matrices[j].pieces[first].cols) for j in members
            ]
            self._cuts[key] = Cuts.of(members, shapes, self._shares[ranks])
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
        shapes = [(m.name, m.rows, m.cols, m.pieces, m.replicas) for m in self.matrices]
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
                total += (stop - first) * piece.cols * len(self.relays_to(j, rank))
        return total


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
    also when replicated) is owned by one of them: nothing is sent to its owner. Buckets follow
    the assignment order (largest first, and among equal costs the later matrix first): each next
    matrix goes to the least-loaded rank, so a bucket holds about ``bucket_bytes`` of matrices
    per owner, on every owner, and its NS work is about the same on each; while one bucket's NS
    runs, the next bucket's exchange is in flight. The ramp may take a first and a last bucket
    out of that order. Among the matrices of one shape (a model's layers), the last layers' come
    first: their gradients land first in backward, so that the first bucket can start there
    (``overlap_backward``).
    """
    _check_tiles(matrices, costs, world_size)
    allowed = [m.full_holders if 0 < len(m.full_holders) < world_size else None for m in matrices]
    owners, order = assign_owners(
        costs,
        world_size,
        allowed,
        [m.replicas for m in matrices],
        [_class_ids(m) for m in matrices],
        [m.numel for m in matrices],
    )
    param_of = tuple(param_of) if param_of is not None else tuple(range(len(matrices)))
    limit = max(1, bucket_bytes // element_size)
    shares = [bucket_shares(m, o) for m, o in zip(matrices, owners, strict=True)]
    cutter = Cutter(shares, costs, owners, limit, world_size, relays_in_step=not forward_relays)
    if flops_per_byte > 0 and len(matrices) > 1:
        buckets = ramp(matrices, costs, order, cutter, flops_per_byte * element_size)
    else:
        buckets = cutter.cut(order).buckets
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
    relays = tuple(Relay(group.matrices, k) for k, cut in groups for group in cut)
    return Plan(tuple(matrices), tuple(costs), tuple(owners), buckets, world_size, param_of, relays)


def _check_tiles(matrices: Sequence[MatrixLayout], costs: Sequence[int], world_size: int) -> None:
    """Every matrix has a cost and a piece for each rank, and each replica's pieces tile it."""
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


def _class_ids(m: MatrixLayout) -> dict[int, int] | None:
    """Each holder of ``m``'s class of twins, by its first rank (None: no twins)."""
    copies = twins(m)
    return {r: copies.classes[c][0] for r, (c, _) in copies.of.items()} if copies is not None else None


def bucket_shares(m: MatrixLayout, owner: int) -> list[tuple[int, int, int]]:
    """What matrix ``m``, owned by ``owner``, adds to the ranks' shares of a bucket, as (one of
    ``SHARES``, rank, elements): the whole matrix in its owner's stack, each sender's piece in
    the exchange to the owner (sent by it, taken by the owner), what the owner returns to each
    other holder (``Plan.returned``: its piece, or its part outside the owner's replica), and,
    for a matrix with twins, about (R - 1) / R of each holder's piece relayed and received by
    relay (the parts' exact rows depend on the bucket: ``Plan.relayed``)."""
    replicas = m.replicas or (0,) * len(m.pieces)
    copies = twins(m)
    parts = copies.count if copies is not None else 1
    mine, returned, taken = replicas[owner], 0, 0
    out = [(HELD, owner, m.numel)]
    for r, piece in enumerate(m.pieces):
        n = piece.rows * piece.cols  # (``numel``, inline: the planner's hottest loop at scale)
        if not n:
            continue
        home = replicas[r] == mine
        if r != owner:
            if home:
                out.append((SENT, r, n))
                taken += n
            back = n if home else -(-n // parts)
            out.append((RECEIVED, r, back))
            returned += back
        if copies is not None:
            out.append((RELAYED, r, n - n // parts))
            if not home:
                out.append((RELAYED_IN, r, n - n // parts))
    if taken:
        out.append((TAKEN, owner, taken))
    if returned:
        out.append((RETURNED, owner, returned))
    return out


HELD, SENT, TAKEN, RETURNED, RECEIVED, RELAYED, RELAYED_IN = range(7)


SHARES = (  # a rank's, per bucket
    "held",
    "sent to owners",
    "taken by owners",
    "sent back",
    "received back",
    "relayed",
    "received by relay",
)

OWNER_KINDS = (HELD, TAKEN, RETURNED)  # the owner's alone
SPREAD_KINDS = (SENT, RECEIVED, RELAYED, RELAYED_IN)  # every holder's
BUCKET_KINDS = frozenset((HELD, TAKEN, RETURNED, SENT, RECEIVED))  # the shares a bucket bounds
RELAY_KINDS = frozenset((RELAYED, RELAYED_IN))  # and a relay

Shares = Sequence[Sequence[tuple[int, int, int]]]  # ``bucket_shares`` of every matrix


@dataclass(frozen=True)
class Cut:
    """Buckets cut from a sequence of matrices, each with its ``pipeline.Load``."""

    buckets: tuple[Bucket, ...]
    loads: tuple[Load, ...]

    def __add__(self, other: Cut) -> Cut:
        return Cut(self.buckets + other.buckets, self.loads + other.loads)


class Cutter:
    """Cuts sequences of a plan's matrices into buckets (``cut``), given every matrix's shares
    (``bucket_shares``), NS cost and owner, over ``world_size`` ranks, with at most ``limit``
    elements in any rank's share of a bucket."""

    def __init__(
        self,
        shares: Shares,
        costs: Sequence[int],
        owners: Sequence[int],
        limit: int,
        world_size: int,
        relays_in_step: bool = True,
    ) -> None:
        self.costs, self.owners, self.limit, self.world_size = costs, owners, limit, world_size
        self.relays_in_step = relays_in_step  # (else a bucket's load has no relay: the forward's)
        # Per matrix: its owner's shares (held, taken, returned: kinds of one rank each) and, per
        # kind of ``SPREAD_KINDS``, the pieces other ranks move, with the largest.
        self.at_owner: list[list[int]] = []
        self.spread: list[list[tuple[list[tuple[int, int]], int]]] = []
        for added in shares:
            at_owner = [0] * len(SHARES)
            moved: dict[int, list[tuple[int, int]]] = {w: [] for w in SPREAD_KINDS}
            for w, r, n in added:
                if w in moved:
                    moved[w].append((r, n))
                else:
                    at_owner[w] += n
            self.at_owner.append(at_owner)
            self.spread.append([(moved[w], max((n for _, n in moved[w]), default=0)) for w in SPREAD_KINDS])

    def cut(self, order: Sequence[int], bounded: frozenset[int] = BUCKET_KINDS) -> Cut:
        """Cut ``order`` into consecutive buckets in which no rank holds whole matrices of more
        than ``limit`` elements (its stacks; what it takes is part of them), nor sends or receives
        more than ``limit`` in its exchanges to and from the owners (the kinds of share in
        ``bounded``; ``RELAY_KINDS``: cut into relays); a bucket holding a matrix larger than
        ``limit`` allows that matrix's size instead (so that such matrices still spread over the
        owners: one each). A matrix joins the current bucket unless it would take some rank's
        share, not empty yet, past the bucket's allowance; then the bucket closes and the matrix
        starts the next one."""
        world = self.world_size
        buckets: list[Bucket] = []
        loads: list[Load] = []
        current: list[int] = []
        totals: list[list[int]] = []
        peaks: list[int] = []  # the largest of each kind's totals in the current bucket
        ns: dict[int, int] = {}

        allowance = self.limit
        for j in order:
            owner, at_owner, spread = self.owners[j], self.at_owner[j], self.spread[j]
            grown = max(allowance, at_owner[HELD])  # (a matrix's own share is its size)
            if not current or self._over(j, totals, peaks, grown, bounded):
                if current:
                    buckets.append(Bucket(tuple(current)))
                    loads.append(_load(peaks, ns, self.relays_in_step))
                current, ns = [], {}
                totals, peaks = [[0] * world for _ in SHARES], [0] * len(SHARES)
                grown = max(self.limit, at_owner[HELD])
            current.append(j)
            allowance = grown
            ns[owner] = ns.get(owner, 0) + self.costs[j]
            for w in OWNER_KINDS:
                totals[w][owner] += at_owner[w]
                peaks[w] = max(peaks[w], totals[w][owner])
            for w, (pieces, _) in zip(SPREAD_KINDS, spread, strict=True):
                total, peak = totals[w], peaks[w]
                for r, n in pieces:
                    total[r] += n
                    if total[r] > peak:
                        peak = total[r]
                peaks[w] = peak
        if current:
            buckets.append(Bucket(tuple(current)))
            loads.append(_load(peaks, ns, self.relays_in_step))
        return Cut(tuple(buckets), tuple(loads))

    def _over(
        self, j: int, totals: list[list[int]], peaks: list[int], bound: int, bounded: frozenset[int]
    ) -> bool:
        """Whether matrix j would take some rank's share of a kind in ``bounded``, not empty yet,
        past ``bound`` (the kinds' ``totals`` per rank and ``peaks`` so far)."""
        owner, at_owner = self.owners[j], self.at_owner[j]
        for w in OWNER_KINDS:
            if w in bounded and totals[w][owner] and totals[w][owner] + at_owner[w] > bound:
                return True
        for w, (pieces, largest) in zip(SPREAD_KINDS, self.spread[j], strict=True):
            total = totals[w]
            if (
                w in bounded
                and peaks[w] + largest > bound
                and any(total[r] and total[r] + n > bound for r, n in pieces)
            ):
                return True
        return False


def _load(peaks: Sequence[int], ns: dict[int, int], relays: bool = True) -> Load:
    """A bucket's ``pipeline.Load`` from the peaks of its shares and its owners' NS flops (and
    its relays', when they follow it in the step)."""
    relay = max(peaks[RELAYED], peaks[RELAYED_IN]) if relays else 0
    return Load(max(peaks[SENT], peaks[TAKEN]), max(peaks[RETURNED], peaks[RECEIVED]), ns, relay)


def ramp(
    matrices: Sequence[MatrixLayout],
    costs: Sequence[int],
    order: Sequence[int],
    cutter: Cutter,
    flops_per_element: float,
) -> tuple[Bucket, ...]:
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
        chosen = {j for b in first.buckets + last.buckets for j in b.matrices}
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
    taken = {j for b in first.buckets for j in b.matrices}
    rest = [j for j in reversed(order) if j not in taken]
    for shape in shapes:
        last = one_per_owner(rest, shape)
        if last.loads and last.loads[0].back < longest_back:
            members = set(last.buckets[0].matrices)
            ordered = Cut((Bucket(tuple(j for j in order if j in members)),), last.loads)
            candidate = with_ends(first, ordered)
            if (c := cost(candidate)) < best_cost:
                best, best_cost = candidate, c
    return best.buckets
