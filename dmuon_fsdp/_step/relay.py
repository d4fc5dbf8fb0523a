"""The relay: how each result reaches the replicas other than its owner's. Pure: no collectives,
no tensors (``dmuon_fsdp._step.schedule`` lays the exchanges out, ``planner`` counts them).

[Note: the relay] Under HSDP (and DDP, replicated DTensors, copies of a sub-mesh) every piece of a
matrix is held by one rank in each replica: its *twins* (``Twins``). Returning each result from
its owner to every holder sends R copies of the matrix from one rank, most of them over the slow
links between nodes when replicas are nodes; with fewer matrices than ranks a few owners then
send several times the mean. So the way back has two exchanges. In the first (from owners) the
owner returns whole pieces to the holders in its own replica and, to each holder in another
replica, only its *part*: the rows of its piece that its replica relays. In the second (the
relay) every holder sends its part to its twins in the replicas other than the owner's, and
receives theirs. Parts cut each bucket's pieces of one class of twins, concatenated in bucket
order, by rows into R nearly equal runs of elements (``Cuts``), the run at position c (the
twins' order by replica) for the twin there; so each rank relays about 1/R of its pieces to R - 1
twins whoever owns them, a piece crosses between two replicas exactly once (each rank receives
across replicas what it holds of the matrices owned elsewhere, the least there is), and a part is
a rectangle of rows (a few per rank and bucket, not one per matrix and replica). The runs are not
quite equal: each twin's share of every bucket is sized by what it sends in the step besides
(``even_shares``: an owner, which returns a whole matrix, relays less), so that each rank's
elements sent per step come out even. A matrix whose replicas are cut differently (no twin in
some replica) returns from its owner to every holder.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from dmuon_fsdp._step.layouts import MatrixLayout, Piece, by_layout


@dataclass(frozen=True)
class Twins:
    """The holders of one matrix by piece: ``classes[i]`` the ranks holding one piece, one in
    each replica, by replica index (a rank's *position*); ``of[r]`` = (its class, its position);
    ``position[q]``: the position of replica index q."""

    classes: tuple[tuple[int, ...], ...]
    of: dict[int, tuple[int, int]]
    position: dict[int, int]

    @property
    def count(self) -> int:
        """Replicas (twins in each class)."""
        return len(self.position)


def twins(m: MatrixLayout) -> Twins | None:
    """``m``'s twins, or None when it has one copy or its replicas are cut differently (some piece
    not held once in every replica). Matrices that share their pieces and replicas (one per
    parameter of a shape and layout) share it (``layouts.by_layout``)."""
    return by_layout("twins", m, _find_twins)


def _find_twins(m: MatrixLayout) -> Twins | None:
    replicas = m.replicas
    if replicas is None:
        return None
    by_piece: dict[Piece, list[int]] = {}
    for r, piece in enumerate(m.pieces):
        if piece.numel:
            by_piece.setdefault(piece, []).append(r)
    held = sorted({replicas[r] for ranks in by_piece.values() for r in ranks})
    if len(held) < 2 or held != sorted(set(replicas)):
        return None
    classes = []
    for ranks in by_piece.values():
        ranks.sort(key=lambda r: replicas[r])
        if [replicas[r] for r in ranks] != held:
            return None
        classes.append(_CLASSES.setdefault(tuple(ranks), tuple(ranks)))
    of = {r: (i, c) for i, ranks in enumerate(classes) for c, r in enumerate(ranks)}
    return Twins(tuple(classes), of, {q: c for c, q in enumerate(held)})


# Each class of twins once (by value), so that every layout's classes of the same ranks are one
# tuple: compared, and keyed, by identity.
_CLASSES: dict[tuple[int, ...], tuple[int, ...]] = {}


def sub_piece(piece: Piece, first: int, stop: int) -> Piece:
    """Rows [first, stop) of ``piece`` (counted from its first row) as a piece of the matrix."""
    return Piece(piece.row + first, stop - first, piece.col, piece.cols, piece.local_row + first)


@dataclass(frozen=True)
class Cuts:
    """One class of twins' pieces in one bucket, concatenated (``members``: the matrices, in
    bucket order), cut by rows into one part per position: cut c is (member index, row) where
    part c begins; ``positions`` cuts at most (``Twins.count``), plus the end."""

    members: tuple[int, ...]
    rows: tuple[int, ...]  # of each member's piece
    cuts: tuple[tuple[int, int], ...]
    ranks: tuple[int, ...] = ()  # the class of twins

    @cached_property
    def index(self) -> dict[int, int]:
        """Member index of each matrix."""
        return {j: i for i, j in enumerate(self.members)}

    @classmethod
    def of(
        cls,
        members: Sequence[int],
        shapes: Sequence[tuple[int, int]],
        shares: Sequence[float],
        ranks: tuple[int, ...] = (),
    ) -> Cuts:
        """Cuts of the ``members``' pieces of ``shapes`` (rows, cols), in order, into one run per
        position of about ``shares[c]`` of their elements (fractions that add up to 1), at the
        row boundary nearest each."""
        sizes = [r * c for r, c in shapes]
        total = sum(sizes)
        cuts, i, start, before = [], 0, 0, 0.0
        for share in shares:
            target = round(total * before)
            before += share
            while i < len(sizes) - 1 and start + sizes[i] <= target:
                start += sizes[i]
                i += 1
            rows, cols = shapes[i]
            cuts.append((i, min(rows, round((target - start) / cols)) if cols else 0))
        cuts.append((len(sizes), 0))
        return cls(tuple(members), tuple(r for r, _ in shapes), tuple(cuts), ranks)

    def positions(self, j: int) -> list[int]:
        """The positions whose parts hold rows of matrix ``j`` (found by bisection: a piece
        spans a few parts)."""
        member = self.index[j]
        first = bisect.bisect_right(self.cuts, (member, 0)) - 1  # the part its first row is in
        stop = bisect.bisect_left(self.cuts, (member, self.rows[member]))  # parts starting before its end
        span = range(max(0, first), min(stop, len(self.cuts) - 1))
        return [c for c in span if self.rows_of(j, c)[1] > self.rows_of(j, c)[0]]

    def rows_of(self, j: int, position: int) -> tuple[int, int]:
        """Rows [first, stop) of matrix ``j``'s piece in part ``position``."""
        member = self.index[j]
        return self._at(position, member), self._at(position + 1, member)

    def _at(self, c: int, member: int) -> int:
        i, row = self.cuts[c]
        return self.rows[member] if i > member else 0 if i < member else row


def in_class(m: MatrixLayout, ranks: tuple[int, ...]) -> bool:
    """Whether ``ranks`` (a ``Twins.classes`` entry) are a class of ``m``'s twins (they hold one
    piece of it, one per replica)."""
    copies = twins(m)
    found = copies.of.get(ranks[0]) if copies is not None else None
    return found is not None and copies is not None and copies.classes[found[0]] is ranks


def even_shares(loads: Sequence[int], total: int, fan: int) -> list[float]:
    """The share of ``total`` elements each of ``len(loads)`` twins relays, each part going to
    ``fan`` others, so that load + fan x part is the same for every twin with a part and no
    more than the others' loads (water filling; all equal when the loads are). Fractions adding
    up to 1; float arithmetic on the same numbers in the same order, so every rank's alike."""
    count = len(loads)
    if not total or count < 2:
        return [1.0 / count] * count
    budget = float(fan * total)
    level, filled = 0.0, 0
    ordered = sorted(loads)
    while filled < count:  # raise the level over the lowest loads until the budget is spent
        filled += 1
        level = (budget + sum(ordered[:filled])) / filled
        if filled == count or level <= ordered[filled]:
            break
    parts = [max(0.0, level - load) for load in loads]
    spent = sum(parts)
    return [part / spent for part in parts]
