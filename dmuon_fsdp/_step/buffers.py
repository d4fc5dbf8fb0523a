"""The buffers a step's exchanges and Newton-Schulz run in, and each transfer's views in them:
``wired`` lays a wire of the schedule (``dmuon_fsdp._step.schedule``) into buffers, per transfer
its piece (rows x cols) and the numbers that follow it (``Slot``); ``Pool`` holds the arenas every view
is taken from. No collectives (``dmuon_fsdp._step.comm`` runs them).

[Note: slots] The buffers are a few arenas that every bucket of every kept program takes its
views from. A step runs its buckets one after another, and at most ``SLOTS`` of them hold
buffers at once: bucket k takes its views from slot ``k % SLOTS``. A slot has three arenas: one
for the bucket's way to its owners (send and receive buffers, the stacks of owned matrices,
staging and scratch: alive from making its NS inputs to collecting its results), one for its way
back (send and receive buffers, numbers bound with the results, own results kept for the update:
alive from its Newton-Schulz to its update) and one for its relays across replicas (the parts
this rank relays, send and receive buffers and the factors relayed: alive from its update to the
relay's). With two slots,
bucket k+1 travels while bucket k's NS runs, and bucket k+2 takes bucket k's arenas once k is
through with them; the bucket loop (``dmuon_fsdp._step.run``) orders its work so. One more arena
holds the NS workspace, used by one batch at a time. So the buffers are a small multiple of the
largest bucket (``bucket_bytes``), whatever the depth of the model, and the programs kept for
other gradient sets share them (one program runs at a time). The one exception: relays left to
the next forward (``overlap_forward``) are all launched at the end of the step and land where
each rank needs them, so each has buffers of its own, laid one after another in the arena
``FORWARD`` (send buffers filled straight from the results as each bucket's way back is
applied, receive buffers, factors relayed): about 2 (R - 1) / R of this rank's Muon shards in
``comm_dtype`` with R replicas, alive from the step to the forward. A program is bound into the pool as
it is (``Region.take`` hands out views in order); if some arena was too small, binding asked for
meta tensors past its end, and the pool grows to what was asked, with headroom (``Pool.grow``),
before binding again. Growing replaces arenas: the kept programs let go of them first, so that
each is freed before its successor is made, and bind anew when next used (``Pool.generation``
tells them apart).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon_fsdp._step import comm
from dmuon_fsdp._step.layouts import Piece
from dmuon_fsdp._step.schedule import Transfer, Wire


@dataclass(frozen=True)
class Slot:
    """Where a transfer sits in a buffer: its piece (rows x cols) and the elements that follow it
    there (``numbers``; None when the transfer has none: ``Transfer.per_row``)."""

    transfer: Transfer
    piece: Tensor
    numbers: Tensor | None


@dataclass(frozen=True)
class Wired:
    """One wire bound to buffers: the exchange and each transfer's send and receive slots."""

    exchange: comm.Exchange | None
    sent: list[Slot]
    received: list[Slot]


def piece_of(local: Tensor, piece: Piece) -> Tensor:
    """A rank's piece inside a tensor shaped like its local shard (a view)."""
    return local.view(-1, piece.cols)[piece.local_row : piece.local_row + piece.rows]


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
            numbers = buffer[offset + p.numel : offset + t.numel] if t.per_row else None
            out[-1].append(Slot(t, piece, numbers))
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


TO, BACK, RELAY, WORK, FORWARD = "to owners", "back", "relay", "workspace", "forward relays"


def arena_names() -> list[tuple[str, int]]:
    return [(way, s) for s in range(SLOTS) for way in (TO, BACK, RELAY)] + [(WORK, 0), (FORWARD, 0)]


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
