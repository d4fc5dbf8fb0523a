"""The exchange: what every all-to-all of a plan carries on one rank, the buffers it runs in,
and each transfer's views in them. No collectives (``dmuon_fsdp.comm`` runs them).

The wire format (``rank_schedule``; pure, the one place it is worked out): per bucket, the
exchange *to owners* brings each owner one copy of every piece of the matrices it owns (from
the owner's replica), and the exchange *from owners* brings every holder, replicas included, its
piece of each orthogonalized matrix. Each is one ``all_to_all_single`` whose buffer holds one
segment per peer in process-group order; a segment is ``flag_elements`` check elements (in the
exchange that carries them only, own segment included; see ``dmuon_fsdp.checks``) followed by
the pieces in bucket order. A piece of a matrix whose rows carry numbers of their own (a row
variant's, see [Note: row variants] in ``dmuon_fsdp.variants``) is followed by them: to the
owner, its rows' state once per row (with the pieces that hold the matrix's first column);
back, the new state and the rows' factors. Pieces that stay on this rank never enter a buffer
(``own_pieces``, ``own_results``). Split sizes are derived from these lists, and the lists are
checked when they are built (``check``). ``wired`` lays a wire into a buffer: per transfer, its
piece (rows x cols) and its per-row numbers (``Slot``).

[Note: slots] The buffers are a few arenas that every bucket of every kept program takes its
views from. A step runs its buckets one after another, and at most ``SLOTS`` of them hold
buffers at once: bucket k takes its views from slot ``k % SLOTS``. A slot has two arenas, one
for the bucket's way to its owners (send and receive buffers, the stacks of owned matrices,
staging and scratch: alive from making its NS inputs to collecting its results) and one for
its way back (send and receive buffers, a row variant's numbers, own results kept for the update: alive
from its Newton-Schulz to its update). With two slots, bucket k+1 travels while bucket k's NS
runs, and bucket k+2 takes bucket k's arenas once k is through with them; the bucket loop
(``dmuon_fsdp.program``) orders its work so. One more arena holds the NS workspace, used by one
batch at a time. So the buffers are a small multiple of the largest bucket (``bucket_bytes``),
whatever the depth of the model, and the programs kept for other gradient sets share them
(one program runs at a time). A program is bound into the pool as it is (``Region.take`` hands
out views in order); if some arena was too small, binding asked for meta tensors past its end,
and the pool grows to what was asked, with headroom (``Pool.grow``), before binding again.
Growing replaces arenas: the kept programs let go of them first, so that each is freed before
its successor is made, and bind anew when next used (``Pool.generation`` tells them apart).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon_fsdp import comm
from dmuon_fsdp.layouts import Piece
from dmuon_fsdp.planner import Bucket, Plan


@dataclass(frozen=True)
class PerRow:
    """The matrices whose per-row numbers (a row variant's, float32) travel with their pieces,
    each number taking ``width`` wire elements: its bits, 2 on a 16-bit wire, so that they travel
    exactly whatever the wire's dtype. To the owner, one number per row (its state), with the
    pieces that start the rows (one copy of each row's, however the rows' columns are cut); back,
    two (the row's new state and its factor), with every piece."""

    matrices: frozenset[int] = frozenset()
    width: int = 1

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
    """One bucket from one rank: the matrices it orthogonalizes and the two exchanges. A wire is
    None when nothing crosses it anywhere in the job and it carries no flags (no collective)."""

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
    backward the first one launched at ``step`` (see ``dmuon_fsdp.program``, the bucket loop);
    a plan without matrices gets one empty bucket for them. ``per_row``: which matrices'
    per-row numbers travel."""

    rank: int
    peers: tuple[int, ...]
    buckets: tuple[BucketSchedule, ...]
    per_row: PerRow = PerRow()
    carrier: int = 0

    def elements(self, sent: bool) -> int:
        """Matrix elements sent to (or received from) other ranks per step (without the flags
        and the per-row numbers)."""
        total = 0
        for bucket in self.buckets:
            for wire in (bucket.to_owners, bucket.from_owners):
                if wire is not None:
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
    """Holder -> its pieces of the results this rank owns."""
    out: dict[int, list[Transfer]] = {}
    for j in plan.owned_by(bucket, me):
        for dst, piece in enumerate(plan.matrices[j].pieces):
            if piece.numel:
                out.setdefault(dst, []).append(Transfer(j, piece, per_row.back(j)))
    return out


def _returns_from_owners(plan: Plan, bucket: Bucket, me: int, per_row: PerRow) -> dict[int, list[Transfer]]:
    """Owner -> this rank's pieces of the results it owns."""
    out: dict[int, list[Transfer]] = {}
    for j in bucket.matrices:
        piece = plan.matrices[j].pieces[me]
        if piece.numel:
            out.setdefault(plan.owners[j], []).append(Transfer(j, piece, per_row.back(j)))
    return out


def _moves(plan: Plan, bucket: Bucket, to_owners: bool) -> bool:
    """Whether any piece crosses between two ranks in this exchange, anywhere in the job."""
    for j in bucket.matrices:
        owner = plan.owners[j]
        if to_owners and plan.senders[j] - {owner}:
            return True
        if not to_owners and any(
            piece.numel for r, piece in enumerate(plan.matrices[j].pieces) if r != owner
        ):
            return True
    return False


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
                to_owners=_wire(sends, receives, peers, rank, carried, _moves(plan, bucket, True)),
                own_pieces=tuple(receives.get(rank, ())),
                from_owners=_wire(returns, returned, peers, rank, 0, _moves(plan, bucket, False)),
                own_results=tuple(returned.get(rank, ())),
            )
        )
    schedule = RankSchedule(rank, peers, tuple(buckets), per_row, carrier)
    check(plan, schedule)
    return schedule


def check(plan: Plan, schedule: RankSchedule) -> None:
    """Invariants of one rank's schedule; a failure is a bug in the layouts or the planner.

    Every owned matrix is covered exactly by what arrives (area and bounds of the pieces), and
    its per-row numbers, where they travel, once per row; every held piece comes back exactly
    once (with its rows' new numbers and factors, where they travel); the buffers are
    consumed exactly by their pieces, and the elements moved equal the planner's own count
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
        returned = bucket.from_owners.receive if bucket.from_owners else ()
        for t in [t for segment in returned for t in segment] + list(bucket.own_results):
            extra = schedule.per_row.back(t.matrix)
            if t.piece != plan.matrices[t.matrix].pieces[me] or t.per_row != extra:
                fail(f"bucket {k} returns {t}, not this rank's piece with {extra} numbers per row")
            held[t.matrix] = held.get(t.matrix, 0) + 1
        for wire in (bucket.to_owners, bucket.from_owners):
            if wire is not None and len(wire.send) != len(schedule.peers):
                fail(f"bucket {k} has {len(wire.send)} segments for {len(schedule.peers)} peers")
    expected = {j for j, m in enumerate(plan.matrices) if m.pieces[me].numel}
    if set(held) != expected or any(n != 1 for n in held.values()):
        fail(f"results returned {held}, expected each of {sorted(expected)} once")
    if schedule.elements(sent=True) != plan.elements_moved(me):
        fail(f"sends {schedule.elements(sent=True)} elements, the plan counts {plan.elements_moved(me)}")


@dataclass(frozen=True)
class Slot:
    """Where a transfer sits in a buffer: its piece (rows, cols) and its per-row numbers (None
    when none travel, see ``PerRow``): to the owner, the rows' state; back, the new state
    (``row_state``) and then the rows' factors (``row_factors``), as the wire holds float32
    numbers (``as_wire``: on a 16-bit wire, their bits as ``int16``)."""

    transfer: Transfer
    piece: Tensor
    per_row: Tensor | None

    @property
    def row_state(self) -> Tensor:
        assert self.per_row is not None  # asked of slots whose transfer carries per-row numbers
        return self.per_row[: self.per_row.numel() // 2]

    @property
    def row_factors(self) -> Tensor:
        assert self.per_row is not None  # asked of slots whose transfer carries per-row numbers
        return self.per_row[self.per_row.numel() // 2 :]


def as_wire(numbers: Tensor, dtype: torch.dtype) -> Tensor:
    """Per-row numbers as a wire of ``dtype`` carries them exactly: float32 numbers themselves
    (a copy into a 32- or 64-bit wire converts them, exactly), or on a 16-bit wire their bits,
    as ``int16``: float32 numbers two elements each, and the wire's own elements (float16 or
    bfloat16) seen as ``int16`` too, so that every copy between them moves bits. A copy between
    16-bit float views need not: CUDA's foreach copy converts each element to float and back,
    which turns every NaN bit pattern (a float32's lower half spells one now and then) into the
    canonical NaN."""
    return numbers.view(torch.int16) if dtype.itemsize == 2 else numbers


@dataclass(frozen=True)
class Wired:
    """One wire bound to buffers: the exchange and each transfer's send and receive slots."""

    exchange: comm.Exchange | None
    sent: list[Slot]
    received: list[Slot]


def piece_of(local: Tensor, piece: Piece) -> Tensor:
    """A rank's piece inside a tensor shaped like its local shard (a view)."""
    return local.view(-1, piece.cols)[piece.local_row : piece.local_row + piece.rows]


def rows_of(local: Tensor, piece: Piece) -> Tensor:
    """A rank's piece's rows in a tensor of one number per local row (a row variant's state)."""
    return local.view(-1)[piece.local_row : piece.local_row + piece.rows]


def slots(buffer: Tensor, segments: Sequence[Sequence[Transfer]], flag_elements: int) -> list[list[Slot]]:
    """Each transfer's slot in a flat buffer laid out segment after segment, flags first."""
    out: list[list[Slot]] = []
    offset = 0
    for segment in segments:
        offset += flag_elements
        out.append([])
        for t in segment:
            p = t.piece
            piece = buffer[offset : offset + p.numel].view(p.rows, p.cols)
            numbers = buffer[offset + p.numel : offset + t.numel]
            extra = as_wire(numbers, buffer.dtype) if t.per_row else None
            out[-1].append(Slot(t, piece, extra))
            offset += t.numel
    if offset != buffer.numel():
        raise RuntimeError(f"exchange buffer of {buffer.numel()} elements, its pieces and flags use {offset}")
    return out


def staging(transfers: Sequence[Transfer], dtype: torch.dtype, region: Region) -> list[Slot]:
    """A buffer of ``dtype`` from ``region`` holding ``transfers`` (own pieces passing through the
    wire's dtype)."""
    return slots(region.take(sum(t.numel for t in transfers), dtype), [transfers], 0)[0]


def wired(wire: Wire | None, dtype: torch.dtype, region: Region, group: dist.ProcessGroup | None) -> Wired:
    """``wire``'s send and receive buffers (from ``region``) and exchange over ``group``."""
    if wire is None:
        return Wired(None, [], [])
    buffers = []
    for counts, segments in ((wire.send_counts, wire.send), (wire.receive_counts, wire.receive)):
        buffer = region.take(sum(counts), dtype)
        buffers.append(
            (buffer, [slot for segment in slots(buffer, segments, wire.flag_elements) for slot in segment])
        )
    (send, sent), (receive, received) = buffers
    return Wired(comm.Exchange(send, receive, wire.send_counts, wire.receive_counts, group), sent, received)


def in_shape(view: Tensor, local: Tensor) -> Tensor | None:
    """``view`` seen in the local shard's shape, when it is the whole shard and can be."""
    if view.shape == local.shape:
        return view
    return view.view(local.shape) if view.numel() == local.numel() and view.is_contiguous() else None


SLOTS = 2  # buckets whose buffers are alive at once (see [Note: slots])
ALIGN = 64  # bytes: every view starts on such a boundary (any dtype's, and vector loads')

TO, BACK, WORK = "to owners", "back", "workspace"


def arena_names() -> list[tuple[str, int]]:
    return [(way, s) for s in range(SLOTS) for way in (TO, BACK)] + [(WORK, 0)]


class Region:
    """Views of one arena, handed out from its start; past its end, meta tensors (the binding
    is then only measured: ``used`` says how much it needed)."""

    def __init__(self, arena: Tensor | None, device: torch.device) -> None:
        self.arena, self.device = arena, device
        self.used = 0

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        if not numel:  # a real tensor: an exchange with nothing to move is still a collective
            return torch.empty(0, dtype=dtype, device=self.device)
        start = -(-self.used // ALIGN) * ALIGN
        self.used = start + numel * dtype.itemsize
        if self.arena is None or self.used > self.arena.numel():
            return torch.empty(numel, dtype=dtype, device="meta")
        return self.arena[start : self.used].view(dtype)


class Pool:
    """The arenas of ``arena_names()`` on one device (bytes, zeroed when made: a binding writes
    nothing into them, so that binding anew never touches an exchange in flight; every view is
    written before it is read). ``release`` drops every view of the pool its owner keeps (the
    kept programs), so that an arena replaced when the pool grows is freed before its larger
    successor is made; a program in flight (one begun in backward) keeps its arenas alive
    until it is done with them."""

    def __init__(self, device: torch.device, release: Callable[[], None] = lambda: None) -> None:
        self.device = device
        self.release = release
        self.arenas: dict[tuple[str, int], Tensor] = {}
        self.generation = 0
        self.nbytes = 0  # of every arena

    def regions(self) -> dict[tuple[str, int], Region]:
        """A fresh region per arena (one bucket's binding, or the workspace's)."""
        return {name: Region(self.arenas.get(name), self.device) for name in arena_names()}

    def fits(self, needed: dict[tuple[str, int], int]) -> bool:
        return all(n <= self.size(name) for name, n in needed.items())

    def size(self, name: tuple[str, int]) -> int:
        arena = self.arenas.get(name)
        return arena.numel() if arena is not None else 0

    def grow(self, needed: dict[tuple[str, int], int]) -> None:
        """Make the arenas that are smaller than ``needed`` anew, with headroom (``GROWTH`` times
        their old size, at least what is needed: a run whose programs grow a little at a time
        makes few arenas); every program bound before goes stale (``generation`` moves on), and
        the owner's views go first (``release``)."""
        self.release()
        for name, n in needed.items():
            old = self.size(name)
            if n > old:
                self.arenas.pop(name, None)  # freed (nothing else views it) before the larger one is made
                size = max(n, math.ceil(old * GROWTH))
                self.arenas[name] = torch.zeros(size, dtype=torch.uint8, device=self.device)
        self.generation += 1
        self.nbytes = sum(arena.numel() for arena in self.arenas.values())


GROWTH = 1.5  # an arena that grows takes at least this many times its old size
