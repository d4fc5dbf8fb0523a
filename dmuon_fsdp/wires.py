"""An exchange's buffers and every transfer's views in them, as ``dmuon_fsdp.schedule`` lays
them out: per peer segment, the check flags, then each transfer's piece (rows x cols) and its
rows' statistics (``Slot``). Used by ``dmuon_fsdp.bind``; no collectives."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dmuon_fsdp import comm
from dmuon_fsdp.buffers import Region
from dmuon_fsdp.layouts import Piece
from dmuon_fsdp.schedule import Transfer, Wire


@dataclass(frozen=True)
class Slot:
    """Where a transfer sits in a buffer: its piece (rows, cols) and its rows' statistics (None
    when none travel, see ``schedule.RowStats``): to the owner, the rows' second moments; back,
    the new ones (``second_moments``) and then the rows' factors (``factors``), as the wire
    holds float32 numbers (``as_wire``)."""

    transfer: Transfer
    piece: Tensor
    stats: Tensor | None

    @property
    def second_moments(self) -> Tensor:
        return self.stats[: self.stats.numel() // 2]

    @property
    def factors(self) -> Tensor:
        return self.stats[self.stats.numel() // 2 :]


def as_wire(numbers: Tensor, dtype: torch.dtype) -> Tensor:
    """Float32 ``numbers`` as a wire of ``dtype`` carries them exactly: their bits, two 16-bit
    elements each, on a 16-bit wire; else themselves (a copy converts them, exactly)."""
    return numbers.view(dtype) if dtype.itemsize == 2 else numbers


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
    """A rank's piece's rows in a tensor of one number per local row (NorMuon's state)."""
    return local.view(-1)[piece.local_row : piece.local_row + piece.rows]


def slots(buffer: Tensor, segments: Sequence[Sequence[Transfer]], flags: int) -> list[list[Slot]]:
    """Each transfer's slot in a flat buffer laid out segment after segment, flags first."""
    out, offset = [], 0
    for segment in segments:
        offset += flags
        out.append([])
        for t in segment:
            p = t.piece
            piece = buffer[offset : offset + p.numel].view(p.rows, p.cols)
            stats = buffer[offset + p.numel : offset + t.numel] if t.stats else None
            out[-1].append(Slot(t, piece, stats))
            offset += t.numel
    if offset != buffer.numel():
        raise RuntimeError(f"exchange buffer of {buffer.numel()} elements, its pieces and flags use {offset}")
    return out


def staging(transfers: Sequence[Transfer], dtype: torch.dtype, region: Region) -> list[Slot]:
    """A buffer of ``dtype`` from ``region`` holding ``transfers`` (own pieces passing through the
    wire's dtype)."""
    return slots(region.take(sum(t.numel for t in transfers), dtype), [transfers], 0)[0]


def wired(wire: Wire | None, dtype: torch.dtype, region: Region, group: object) -> Wired:
    """``wire``'s send and receive buffers (from ``region``) and exchange over ``group``."""
    if wire is None:
        return Wired(None, [], [])
    buffers = []
    for counts, segments in ((wire.send_counts, wire.send), (wire.receive_counts, wire.receive)):
        buffer = region.take(sum(counts), dtype)
        buffers.append(
            (buffer, [slot for segment in slots(buffer, segments, wire.flags) for slot in segment])
        )
    (send, sent), (receive, received) = buffers
    return Wired(comm.Exchange(send, receive, wire.send_counts, wire.receive_counts, group), sent, received)


def in_shape(view: Tensor, local: Tensor) -> Tensor | None:
    """``view`` seen in the local shard's shape, when it is the whole shard and can be."""
    if view.shape == local.shape:
        return view
    return view.view(local.shape) if view.numel() == local.numel() and view.is_contiguous() else None
