"""Buckets (and relays) cut so that no rank holds or moves more than ``bucket_bytes`` in one: each
matrix's shares of a bucket (``shares_of``: what it adds to each rank's stacks and exchanges) and
the cutter (``Cutter``), which also predicts each bucket's ``pipeline.Load``.

Pure: no collectives and no tensors; the shares are numpy arrays over the ranks, each matrix's
made of a part every matrix of its layout shares (``layouts.Holding``) and a few ranks of its
own (its owner's replica), so that a cut takes time and memory that grow with matrices plus
ranks, not their product.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dmuon_fsdp._step.layouts import MatrixLayout, by_layout, holding
from dmuon_fsdp._step.pipeline import Load
from dmuon_fsdp._step.relay import twins

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


@dataclass(frozen=True)
class Spread:
    """One kind of a matrix's share over the ranks: ``base`` (an array over the ranks that every
    matrix of its layout shares; None: nothing) with ``add`` added at ``ranks``; ``largest``: the
    largest rank's."""

    base: np.ndarray | None
    ranks: np.ndarray
    add: np.ndarray
    largest: int


@dataclass(frozen=True)
class Shares:
    """A matrix's shares of a bucket: its owner's (``owner[kind]`` for ``OWNER_KINDS``) and the
    ranks' (``spread``, one per ``SPREAD_KINDS``)."""

    owner: tuple[int, ...]
    spread: tuple[Spread, ...]


_NONE = np.empty(0, dtype=np.int64)


def shares_of(m: MatrixLayout, owner: int) -> Shares:
    """What matrix ``m``, owned by ``owner``, adds to the ranks' shares of a bucket: the whole
    matrix in its owner's stack, each sender's piece in the exchange to the owner (sent by it,
    taken by the owner), what the owner returns to each other holder (``Plan.returned``: its
    piece, or about 1/R of it outside the owner's replica for a matrix with twins), and, with
    twins, about (R - 1) / R of each holder's piece relayed and received by relay (the parts'
    exact rows depend on the relay: ``Plan.relayed``)."""
    h = holding(m)
    numel, copies = h.numel, twins(m)
    home = h.holders.get(int(h.replica[owner]), _NONE)  # the owner's replica's holders
    own = int(numel[owner])
    if len(h.holders) == 1:  # one copy (or one replica holding pieces): everyone's piece but the owner's
        sent = _spread(numel, np.array([owner]), np.array([-own]))
    else:
        others = home[home != owner]
        sent = _spread(None, others, numel[others])
    if copies is None:
        received = _spread(numel, np.array([owner]), np.array([-own]))
        relayed = relayed_in = _spread(None, _NONE, _NONE)
    else:
        parts, relay = by_layout("relay shares", m, lambda _: _relay_shares(numel, copies.count))
        extra = numel[home] - parts[home]  # the owner's replica gets whole pieces back
        extra[home == owner] -= own  # and the owner nothing
        received = _spread(parts, home, extra)
        relayed = _spread(relay, _NONE, _NONE)
        relayed_in = _spread(relay, home, -relay[home])
    taken = int(sent.add.sum()) + (int(sent.base.sum()) if sent.base is not None else 0)
    returned = int(received.add.sum()) + int(received.base.sum() if received.base is not None else 0)
    return Shares((m.numel, taken, returned), (sent, received, relayed, relayed_in))


def _relay_shares(numel: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(each holder's part, about 1/R of its piece; what it relays or receives by relay, the
    rest) of a layout with ``count`` replicas."""
    return -(-numel // count), numel - numel // count


def _spread(base: np.ndarray | None, ranks: np.ndarray, add: np.ndarray) -> Spread:
    if base is None:
        return Spread(None, ranks, add, int(add.max()) if len(add) else 0)
    whole = base.copy()
    whole[ranks] += add
    return Spread(base, ranks, add, int(whole.max()) if len(whole) else 0)


@dataclass(frozen=True)
class Cut:
    """Buckets cut from a sequence of matrices (each the matrices' indices), each with its
    ``pipeline.Load``."""

    buckets: tuple[tuple[int, ...], ...]
    loads: tuple[Load, ...]

    def __add__(self, other: Cut) -> Cut:
        return Cut(self.buckets + other.buckets, self.loads + other.loads)


class Cutter:
    """Cuts sequences of a plan's matrices into buckets (``cut``), given every matrix's ``Shares``,
    NS cost and owner, over ``world_size`` ranks, with at most ``limit`` elements in any rank's
    share of a bucket; ``relays_in_step`` False: a bucket's load leaves its relays out (they are
    the next forward's)."""

    def __init__(
        self,
        shares: Sequence[Shares],
        costs: Sequence[int],
        owners: Sequence[int],
        limit: int,
        world_size: int,
        relays_in_step: bool = True,
    ) -> None:
        self.shares, self.costs, self.owners, self.limit = shares, costs, owners, limit
        self.world_size, self.relays_in_step = world_size, relays_in_step

    def cut(self, order: Sequence[int], bounded: frozenset[int] = BUCKET_KINDS) -> Cut:
        """Cut ``order`` into consecutive buckets in which no rank holds whole matrices of more
        than ``limit`` elements (its stacks; what it takes is part of them), nor sends or receives
        more than ``limit`` in its exchanges to and from the owners (the kinds of share in
        ``bounded``; ``RELAY_KINDS``: cut into relays); a bucket holding a matrix larger than
        ``limit`` allows that matrix's size instead (so that such matrices still spread over the
        owners: one each). A matrix joins the current bucket unless it would take some rank's
        share, not empty yet, past the bucket's allowance; then the bucket closes and the matrix
        starts the next one."""
        buckets: list[tuple[int, ...]] = []
        loads: list[Load] = []
        current: list[int] = []
        bucket = _Bucket(self.world_size)
        allowance = self.limit
        for j in order:
            shares = self.shares[j]
            grown = max(allowance, shares.owner[0])  # (a matrix's own share is its size)
            if not current or bucket.over(shares, self.owners[j], grown, bounded):
                if current:
                    buckets.append(tuple(current))
                    loads.append(bucket.load(self.relays_in_step))
                current, bucket = [], _Bucket(self.world_size)
                grown = max(self.limit, shares.owner[0])
            current.append(j)
            allowance = grown
            bucket.add(shares, self.owners[j], self.costs[j])
        if current:
            buckets.append(tuple(current))
            loads.append(bucket.load(self.relays_in_step))
        return Cut(tuple(buckets), tuple(loads))


class _Bucket:
    """One bucket being cut: each kind's total per rank and its largest (``peaks``), and its
    owners' NS flops."""

    def __init__(self, world_size: int) -> None:
        self.owners: list[dict[int, int]] = [{} for _ in OWNER_KINDS]
        self.totals = [np.zeros(world_size, dtype=np.int64) for _ in SPREAD_KINDS]
        self.peaks = [0] * len(SHARES)
        self.ns: dict[int, int] = {}

    def over(self, shares: Shares, owner: int, bound: int, bounded: frozenset[int]) -> bool:
        """Whether a matrix with ``shares`` would take some rank's share of a kind in ``bounded``,
        not empty yet, past ``bound``."""
        for i, w in enumerate(OWNER_KINDS):
            owned = self.owners[i].get(owner, 0)
            if w in bounded and owned and owned + shares.owner[i] > bound:
                return True
        for total, w, spread in zip(self.totals, SPREAD_KINDS, shares.spread, strict=True):
            if w not in bounded or self.peaks[w] + spread.largest <= bound:
                continue
            if spread.base is None:
                now = total[spread.ranks]
                if ((now > 0) & (now + spread.add > bound)).any():
                    return True
                continue
            grown = total + spread.base
            grown[spread.ranks] += spread.add
            if ((total > 0) & (grown > bound)).any():
                return True
        return False

    def add(self, shares: Shares, owner: int, cost: int) -> None:
        self.ns[owner] = self.ns.get(owner, 0) + cost
        for i, w in enumerate(OWNER_KINDS):
            self.owners[i][owner] = owned = self.owners[i].get(owner, 0) + shares.owner[i]
            self.peaks[w] = max(self.peaks[w], owned)
        for per_rank, w, spread in zip(self.totals, SPREAD_KINDS, shares.spread, strict=True):
            if spread.base is not None:
                per_rank += spread.base
                per_rank[spread.ranks] += spread.add
                self.peaks[w] = max(self.peaks[w], int(per_rank.max()))
            elif len(spread.ranks):
                per_rank[spread.ranks] += spread.add
                self.peaks[w] = max(self.peaks[w], int(per_rank[spread.ranks].max()))

    def load(self, relays: bool) -> Load:
        """The bucket's ``pipeline.Load`` from the peaks of its shares and its owners' NS flops
        (and its relays', when they follow it in the step)."""
        peaks = self.peaks
        relay = max(peaks[RELAYED], peaks[RELAYED_IN]) if relays else 0
        return Load(max(peaks[SENT], peaks[TAKEN]), max(peaks[RETURNED], peaks[RECEIVED]), self.ns, relay)
