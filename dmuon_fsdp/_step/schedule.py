"""The wire schedule: what every all-to-all of a plan carries on one rank. Pure: no
collectives and no tensors (``dmuon_fsdp._step.comm`` runs them, ``dmuon_fsdp._step.buffers``
lays them into buffers).

The wire format (``rank_schedule``; the one place it is worked out): per bucket, the
exchange *to owners* brings each owner one copy of every piece of the matrices it owns (from
the owner's replica), the exchange *from owners* brings every holder its piece of each
orthogonalized matrix (``Plan.returned``: outside the owner's replica, of a matrix with twins,
only its part), and the *relay* brings each such holder the rest of its piece from its twins
in the other replicas ([Note: the relay] in ``dmuon_fsdp._step.relay``). Each is one
``all_to_all_single`` whose buffer holds one
segment per peer in process-group order; a segment is ``flag_elements`` check elements (in the
exchange that carries them only, own segment included; see ``dmuon_fsdp._step.flags``) followed by
the pieces in bucket order. A piece of a matrix whose rows carry numbers of their own (a row
variant's, see [Note: row variants] in ``dmuon_fsdp.variants``) is followed by them: to the
owner, its rows' state once per row (with the pieces that hold the matrix's first column);
back, the new state and the rows' factors. Pieces that stay on this rank never enter a buffer
(``own_pieces``, ``own_results``). Split sizes are derived from these lists, and the lists are
checked when they are built (``check``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dmuon_fsdp._step.layouts import Piece
from dmuon_fsdp._step.planner import Bucket, Plan, Relay
from dmuon_fsdp._step.relay import sub_piece, twins


@dataclass(frozen=True)
class PerRow:
    """The matrices whose per-row numbers (a row variant's, float32) travel with their pieces,
    each number taking ``width`` wire elements: its bits, 2 on a 16-bit wire, so that they travel
    exactly whatever the wire's dtype. To the owner, one number per row (its state), with the
    pieces that start the rows (one copy of each row's, however the rows' columns are cut); back,
    two (the row's new state and its factor), with every piece."""

    matrices: frozenset[int] = frozenset()
    width: int = 1

    @classmethod
    def on_wire(cls, matrices: frozenset[int], itemsize: int) -> PerRow:
        """The numbers of ``matrices`` on a wire of ``itemsize``-byte elements (float32 bits)."""
        return cls(matrices, width=2 if itemsize == 2 else 1)

    def to_owner(self, j: int, piece: Piece) -> int:
        return self.width if j in self.matrices and piece.col == 0 else 0

    def back(self, j: int) -> int:
        return 2 * self.width if j in self.matrices else 0


@dataclass(frozen=True)
class Transfer:
    """One piece on the move: the rectangle ``piece`` of matrix ``matrix``, followed by
    ``per_row`` wire elements per row of it (its per-row numbers, see ``PerRow``)."""

    matrix: int
    piece: Piece
    per_row: int = 0

    @property
    def numel(self) -> int:
        return self.piece.numel + self.per_row * self.piece.rows


Segments = tuple[tuple[Transfer, ...], ...]


@dataclass(frozen=True)
class Wire:
    """One ``all_to_all_single`` seen from one rank: the pieces sent to and received from each
    peer (process-group order), each segment after ``flag_elements`` check elements."""

    send: Segments
    receive: Segments
    flag_elements: int

    @property
    def send_counts(self) -> list[int]:
        return [self.flag_elements + sum(t.numel for t in segment) for segment in self.send]

    @property
    def receive_counts(self) -> list[int]:
        return [self.flag_elements + sum(t.numel for t in segment) for segment in self.receive]


@dataclass(frozen=True)
class BucketSchedule:
    """One bucket from one rank: the matrices it orthogonalizes and the three exchanges. A wire
    is None when nothing crosses it anywhere in the job and it carries no flags (no collective)."""

    owned: tuple[int, ...]
    to_owners: Wire | None
    own_pieces: tuple[Transfer, ...]  # own pieces of own matrices: straight into the stack
    from_owners: Wire | None
    own_results: tuple[Transfer, ...]  # own pieces of own results: applied from the stack


@dataclass(frozen=True)
class RankSchedule:
    """Every exchange of a plan seen from plan rank ``rank``; ``peers[g]`` is the plan rank of
    process-group rank g. The exchange to owners of bucket ``carrier`` carries the step's check
    flags when the job has more than one rank: the first bucket's, or for a step started in
    backward the first one launched at ``step`` (see ``dmuon_fsdp._step.run``, the bucket loop);
    a plan without matrices gets one empty bucket for them. ``per_row``: which matrices'
    per-row numbers travel; ``relays[g]``: the wire of the plan's relay g (``Plan.relays``)."""

    rank: int
    peers: tuple[int, ...]
    buckets: tuple[BucketSchedule, ...]
    per_row: PerRow = PerRow()
    carrier: int = 0
    relays: tuple[Wire | None, ...] = ()

    @property
    def wires(self) -> list[Wire]:
        """Every exchange's wire this rank takes part in."""
        ways = [w for b in self.buckets for w in (b.to_owners, b.from_owners)] + list(self.relays)
        return [w for w in ways if w is not None]

    def elements(self, sent: bool) -> int:
        """Matrix elements sent to (or received from) other ranks per step (without the flags
        and the per-row numbers)."""
        total = 0
        for wire in self.wires:
            segments = wire.send if sent else wire.receive
            total += sum(t.piece.numel for segment in segments for t in segment)
        return total


def _sends_to_owners(plan: Plan, bucket: Bucket, me: int, per_row: PerRow) -> dict[int, list[Transfer]]:
    """Owner -> this rank's pieces it sends there (one copy: senders are the owner's replica)."""
    out: dict[int, list[Transfer]] = {}
    for j in bucket.matrices:
        if me in plan.senders[j]:
            piece = plan.matrices[j].pieces[me]
            out.setdefault(plan.owners[j], []).append(Transfer(j, piece, per_row.to_owner(j, piece)))
    return out


def _receives_as_owner(plan: Plan, bucket: Bucket, me: int, per_row: PerRow) -> dict[int, list[Transfer]]:
    """Sender -> the pieces of this rank's matrices it sends here."""
    out: dict[int, list[Transfer]] = {}
    for j in plan.owned_by(bucket, me):
        for src in sorted(plan.senders[j]):
            piece = plan.matrices[j].pieces[src]
            out.setdefault(src, []).append(Transfer(j, piece, per_row.to_owner(j, piece)))
    return out


def _returns_as_owner(plan: Plan, bucket: Bucket, me: int, per_row: PerRow) -> dict[int, list[Transfer]]:
    """Holder -> what it gets of the results this rank owns (``Plan.returned``)."""
    out: dict[int, list[Transfer]] = {}
    for j in plan.owned_by(bucket, me):
        for dst, piece in enumerate(plan.matrices[j].pieces):
            if piece.numel:
                first, stop = plan.returned(j, dst)
                if stop > first:
                    out.setdefault(dst, []).append(
                        Transfer(j, sub_piece(piece, first, stop), per_row.back(j))
                    )
    return out


def _returns_from_owners(plan: Plan, bucket: Bucket, me: int, per_row: PerRow) -> dict[int, list[Transfer]]:
    """Owner -> what this rank gets of the results it owns (``Plan.returned``)."""
    out: dict[int, list[Transfer]] = {}
    for j in bucket.matrices:
        piece = plan.matrices[j].pieces[me]
        if piece.numel:
            first, stop = plan.returned(j, me)
            if stop > first:
                transfer = Transfer(j, sub_piece(piece, first, stop), per_row.back(j))
                out.setdefault(plan.owners[j], []).append(transfer)
    return out


def _relays(
    plan: Plan, relay: Relay, me: int, per_row: PerRow
) -> tuple[dict[int, list[Transfer]], dict[int, list[Transfer]]]:
    """(twin -> this rank's parts it relays there, twin -> the parts it relays here)."""
    sends: dict[int, list[Transfer]] = {}
    receives: dict[int, list[Transfer]] = {}
    for j in relay.matrices:
        piece = plan.matrices[j].pieces[me]
        if not piece.numel:
            continue
        first, stop = plan.relayed(j, me)
        if stop > first:
            transfer = Transfer(j, sub_piece(piece, first, stop), per_row.back(j))
            for twin in plan.relays_to(j, me):
                sends.setdefault(twin, []).append(transfer)
        for twin, first, stop in plan.relayed_from(j, me):
            receives.setdefault(twin, []).append(Transfer(j, sub_piece(piece, first, stop), per_row.back(j)))
    return sends, receives


def _moves(plan: Plan, bucket: Bucket | Relay, kind: str) -> bool:
    """Whether anything crosses between two ranks in this bucket's exchange ``kind`` ("to owners",
    "back"), or in this relay ("relay"), anywhere in the job."""
    for j in bucket.matrices:
        owner, m = plan.owners[j], plan.matrices[j]
        if kind == "to owners" and plan.senders[j] - {owner}:
            return True
        if kind == "relay":
            if _relays_anywhere(plan, j):
                return True
            continue
        holders = [r for r, piece in enumerate(m.pieces) if piece.numel]
        if kind == "back" and any(r != owner and _rows(plan.returned(j, r)) for r in holders):
            return True
    return False


def _relays_anywhere(plan: Plan, j: int) -> bool:
    """Whether some twin relays part of matrix j: with three replicas or more each part goes to
    a twin (every non-empty one; some is); with two only the owner's replica's parts do."""
    copies = twins(plan.matrices[j])
    if copies is None or plan.relay_of[j] < 0:
        return False
    if copies.count > 2:
        return True
    home = copies.position[plan.matrices[j].replica(plan.owners[j])]
    return any(_rows(plan.relayed(j, ranks[home])) for ranks in copies.classes)


def _rows(span: tuple[int, int]) -> int:
    return span[1] - span[0]


def _wire(
    sends: dict, receives: dict, peers: Sequence[int], me: int, flag_elements: int, needed: bool
) -> Wire | None:
    if not (needed or flag_elements):
        return None
    send = tuple(tuple(sends.get(q, ())) if q != me else () for q in peers)
    receive = tuple(tuple(receives.get(q, ())) if q != me else () for q in peers)
    return Wire(send, receive, flag_elements)


def rank_schedule(
    plan: Plan,
    rank: int,
    peers: Sequence[int],
    flag_elements: int = 0,
    carrier: int = 0,
    per_row: PerRow = PerRow(),
) -> RankSchedule:
    """``rank``'s schedule for ``plan`` (see ``RankSchedule``), with ``flag_elements`` check elements per
    segment of bucket ``carrier``'s exchange to the owners and the per-row numbers of the rows of the
    matrices ``per_row``, checked before it is returned."""
    peers = tuple(peers)
    if sorted(peers) != list(range(plan.world_size)) or not 0 <= rank < plan.world_size:
        raise ValueError(f"peers {peers} and rank {rank} do not number the plan's {plan.world_size} ranks")
    multi = plan.world_size > 1
    buckets = []
    planned = plan.buckets or (Bucket(()),)
    if not 0 <= carrier < len(planned):
        raise ValueError(f"the flags' carrier {carrier} is not one of the plan's {len(planned)} buckets")
    for k, bucket in enumerate(planned):
        carried = flag_elements if k == carrier and multi else 0
        sends, receives = (
            _sends_to_owners(plan, bucket, rank, per_row),
            _receives_as_owner(plan, bucket, rank, per_row),
        )
        returns, returned = (
            _returns_as_owner(plan, bucket, rank, per_row),
            _returns_from_owners(plan, bucket, rank, per_row),
        )
        if sends.get(rank, []) != receives.get(rank, []) or returns.get(rank, []) != returned.get(rank, []):
            raise RuntimeError(f"exchange schedule: rank {rank}'s pieces to itself disagree in bucket {k}")
        buckets.append(
            BucketSchedule(
                owned=tuple(plan.owned_by(bucket, rank)),
                to_owners=_wire(sends, receives, peers, rank, carried, _moves(plan, bucket, "to owners")),
                own_pieces=tuple(receives.get(rank, ())),
                from_owners=_wire(returns, returned, peers, rank, 0, _moves(plan, bucket, "back")),
                own_results=tuple(returned.get(rank, ())),
            )
        )
    relays = []
    for relay in plan.relays:
        relays_out, relays_in = _relays(plan, relay, rank, per_row)
        relays.append(_wire(relays_out, relays_in, peers, rank, 0, _moves(plan, relay, "relay")))
    schedule = RankSchedule(rank, peers, tuple(buckets), per_row, carrier, tuple(relays))
    check(plan, schedule)
    return schedule


def check(plan: Plan, schedule: RankSchedule) -> None:
    """Invariants of one rank's schedule; a failure is a bug in the layouts or the planner.

    Every owned matrix is covered exactly by what arrives (area and bounds of the pieces), and
    its per-row numbers, where they travel, once per row; every held piece comes back exactly
    once, from its owner or in parts by relay (rows of it whose areas add up to it, each with
    its rows' new numbers and factors, where they travel); the buffers are consumed exactly by
    their pieces, and the elements moved equal the planner's own count
    (``Plan.elements_moved``).
    """
    me = schedule.rank

    def fail(message: str) -> None:
        raise RuntimeError(f"exchange schedule of rank {me} is inconsistent: {message}")

    held: dict[int, int] = {}
    for k, bucket in enumerate(schedule.buckets):
        covered = {j: 0 for j in bucket.owned}
        stat_rows = {j: 0 for j in bucket.owned}
        arriving = bucket.to_owners.receive if bucket.to_owners else ()
        for t in [t for segment in arriving for t in segment] + list(bucket.own_pieces):
            m, p = plan.matrices[t.matrix], t.piece
            if t.matrix not in covered or p.row + p.rows > m.rows or p.col + p.cols > m.cols:
                fail(
                    f"bucket {k} receives {p} of matrix {t.matrix}, which it does not own or which lies "
                    "outside it"
                )
            covered[t.matrix] += p.numel
            stat_rows[t.matrix] += p.rows if t.per_row else 0
        for j, area in covered.items():
            if area != plan.matrices[j].numel:
                fail(f"bucket {k}: matrix {j} is covered by {area} elements, not {plan.matrices[j].numel}")
            if stat_rows[j] != (plan.matrices[j].rows if j in schedule.per_row.matrices else 0):
                fail(f"bucket {k}: matrix {j} receives per-row numbers for {stat_rows[j]} rows")
    returned = [t for b in schedule.buckets if b.from_owners for seg in b.from_owners.receive for t in seg]
    returned += [t for b in schedule.buckets for t in b.own_results]
    returned += [t for wire in schedule.relays if wire for seg in wire.receive for t in seg]
    for t in returned:
        extra, mine, p = schedule.per_row.back(t.matrix), plan.matrices[t.matrix].pieces[me], t.piece
        inside = mine.row <= p.row <= p.row + p.rows <= mine.row + mine.rows
        if (p.col, p.cols) != (mine.col, mine.cols) or not inside:
            fail(f"{t} returned, not rows of this rank's piece {mine}")
        if t.per_row != extra or p.local_row - mine.local_row != p.row - mine.row:
            fail(f"{t} returned with {t.per_row} numbers per row, not {extra}, or misplaced")
        held[t.matrix] = held.get(t.matrix, 0) + p.numel
    for wire in schedule.wires:
        if len(wire.send) != len(schedule.peers):
            fail(f"an exchange has {len(wire.send)} segments for {len(schedule.peers)} peers")
    expected = {j: m.pieces[me].numel for j, m in enumerate(plan.matrices) if m.pieces[me].numel}
    if held != expected:
        fail(f"results returned {held} elements of each matrix, expected {expected}")
    if schedule.elements(sent=True) != plan.elements_moved(me):
        fail(f"sends {schedule.elements(sent=True)} elements, the plan counts {plan.elements_moved(me)}")
