"""Moving pieces to their owners and orthogonalized pieces back: the only torch.distributed calls.

Wire layout of one bucket (see ``Plan``): a buffer holds, per peer rank in rank order, the pieces
of the bucket's matrices in bucket order. Each direction is one ``all_to_all_single`` whose split
sizes come straight from the plan; the two differ when matrices are replicated (HSDP, DDP, a TP
dim a weight is replicated on): one copy travels to the owner, every copy gets the result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dmuon_fsdp.planner import Bucket, Piece, Plan
from dmuon_fsdp.stats import StepStats


@dataclass
class Pending:
    """An exchange in flight. Holds the buffers so they outlive the asynchronous collective."""

    bucket: int
    send: Tensor
    receive: Tensor
    work: dist.Work | None

    def wait(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.receive


@dataclass(frozen=True)
class ExchangeGroup:
    """The process group matrices move over. Plans number ranks by mesh index (row-major mesh
    coordinate); ``peers[g]`` is the mesh index of group rank g, ``rank`` this rank's mesh index."""

    group: dist.ProcessGroup | None
    rank: int
    peers: tuple[int, ...]


@dataclass(frozen=True)
class _Wire:
    """One bucket's buffers seen from this rank, peers in group rank order: (matrix, piece)
    pairs in the order they sit in each buffer, and the split sizes (send, receive) by mesh index."""

    gather_send: tuple[int, ...]
    gather_receive: tuple[tuple[int, Piece], ...]
    owned: tuple[int, ...]
    scatter_send: tuple[tuple[int, Piece], ...]
    scatter_receive: tuple[tuple[int, Piece], ...]
    gather_counts: tuple[list[int], list[int]]
    scatter_counts: tuple[list[int], list[int]]


class ShardExchange:
    """Exchanges for one plan, seen from one rank (``exchange.group`` None: a single process).

    Buffer layouts and split sizes are worked out once here; build one per plan and reuse it
    every step. Buffers hold peers in group rank order, which need not be mesh order.
    """

    def __init__(self, plan: Plan, exchange: ExchangeGroup, dtype: torch.dtype):
        if exchange.group is None and plan.world_size != 1:
            raise ValueError(f"a plan over {plan.world_size} ranks needs a process group")
        if len(exchange.peers) != plan.world_size:
            raise ValueError(f"a plan over {plan.world_size} ranks cannot run on a group of {len(exchange.peers)}")
        self.plan, self.rank, self.group, self.dtype = plan, exchange.rank, exchange.group, dtype
        self.peers = exchange.peers
        self.wires = [self._wire(bucket) for bucket in plan.buckets]
        self.stats = StepStats(torch.device("cpu"))

    def _wire(self, bucket: Bucket) -> _Wire:
        plan, me = self.plan, self.rank
        by_owner = [j for o in self.peers for j in bucket.matrices if plan.owners[j] == o]
        owned = plan.owned_by(bucket, me)
        return _Wire(
            gather_send=tuple(j for j in by_owner if me in plan.senders[j]),
            gather_receive=tuple((j, plan.matrices[j].pieces[src]) for src in self.peers for j in owned
                                 if src in plan.senders[j]),
            owned=tuple(owned),
            scatter_send=tuple((j, plan.matrices[j].pieces[dst]) for dst in self.peers for j in owned
                               if plan.matrices[j].pieces[dst].numel),
            scatter_receive=tuple((j, plan.matrices[j].pieces[me]) for j in by_owner if plan.matrices[j].pieces[me].numel),
            gather_counts=plan.gather_counts(bucket, me),
            scatter_counts=plan.scatter_counts(bucket, me),
        )  # fmt: skip

    def _launch(self, bucket: int, send: Tensor, counts: tuple[list[int], list[int]]) -> Pending:
        send_counts, receive_counts = counts
        receive = torch.empty(sum(receive_counts), dtype=self.dtype, device=send.device)
        size = send.element_size()
        self.stats.bytes_sent += (sum(send_counts) - send_counts[self.rank]) * size
        self.stats.bytes_received += (sum(receive_counts) - receive_counts[self.rank]) * size
        if self.group is None:
            receive.copy_(send)
            return Pending(bucket, send, receive, None)
        in_group_order = [receive_counts[c] for c in self.peers], [send_counts[c] for c in self.peers]
        work = dist.all_to_all_single(receive, send, *in_group_order, group=self.group, async_op=True)
        self.stats.collectives += 1
        return Pending(bucket, send, receive, work)

    def _wait(self, pending: Pending) -> Tensor:
        with self.stats.phase("wait"):
            return pending.wait()

    def run(
        self,
        local_pieces: dict[int, Tensor],
        device: torch.device,
        orthogonalize: Callable[[dict[int, Tensor]], dict[int, Tensor]],
        apply: Callable[[dict[int, Tensor]], None],
        overlap: bool,
        stats: StepStats,
    ) -> None:
        """Every bucket: pieces to owners, ``orthogonalize`` on the owners, pieces back to ``apply``.

        With ``overlap``, bucket k+1's exchange is launched before bucket k's orthogonalization
        and all returns are applied at the end; without it, each bucket completes in turn.
        """
        self.stats = stats
        count = len(self.plan.buckets)
        gathers: dict[int, Pending] = {}
        scatters = []
        for k in range(count):
            if k not in gathers:
                gathers[k] = self.start_gather(k, local_pieces, device)
            if overlap and k + 1 < count:
                gathers[k + 1] = self.start_gather(k + 1, local_pieces, device)
            scatter = self.start_scatter(k, orthogonalize(self.finish_gather(gathers.pop(k))), device)
            if overlap:
                scatters.append(scatter)
            else:
                apply(self.finish_scatter(scatter))
        for scatter in scatters:
            apply(self.finish_scatter(scatter))

    def start_gather(self, k: int, local_pieces: dict[int, Tensor], device: torch.device) -> Pending:
        """Send this rank's piece of each matrix in bucket k to its owner, if it is a sender.

        ``local_pieces[j]`` is this rank's (piece.rows, piece.cols) block of matrix j.
        """
        wire = self.wires[k]
        with self.stats.phase("pack"):
            pieces = [local_pieces[j] for j in wire.gather_send]
            send = _packed(pieces, sum(wire.gather_counts[0]), self.dtype, device)
        return self._launch(k, send, wire.gather_counts)

    def finish_gather(self, pending: Pending) -> dict[int, Tensor]:
        """Wait, then assemble the full (rows, cols) matrices this rank owns in the bucket."""
        wire, matrices = self.wires[pending.bucket], self.plan.matrices
        receive = self._wait(pending)
        with self.stats.phase("pack"):
            received: dict[int, list[tuple[Piece, Tensor]]] = {j: [] for j in wire.owned}
            offset = 0
            for j, p in wire.gather_receive:
                received[j].append((p, receive[offset : offset + p.numel].view(p.rows, p.cols)))
                offset += p.numel
            return {j: _assembled(matrices[j].rows, matrices[j].cols, received[j], receive) for j in wire.owned}

    def start_scatter(self, k: int, results: dict[int, Tensor], device: torch.device) -> Pending:
        """Send every rank its piece of each orthogonalized matrix this rank owns in bucket k."""
        wire = self.wires[k]
        with self.stats.phase("pack"):
            pieces = [_region(results[j], p) for j, p in wire.scatter_send]
            send = _packed(pieces, sum(wire.scatter_counts[0]), self.dtype, device)
        return self._launch(k, send, wire.scatter_counts)

    def finish_scatter(self, pending: Pending) -> dict[int, Tensor]:
        """Wait, then return this rank's (piece.rows, piece.cols) block of each bucket matrix it holds."""
        receive = self._wait(pending)
        blocks: dict[int, Tensor] = {}
        offset = 0
        for j, p in self.wires[pending.bucket].scatter_receive:
            blocks[j] = receive[offset : offset + p.numel].view(p.rows, p.cols)
            offset += p.numel
        return blocks


def _region(matrix: Tensor, piece: Piece) -> Tensor:
    return matrix[piece.row : piece.row + piece.rows, piece.col : piece.col + piece.cols]


def _packed(pieces: list[Tensor], numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """One flat ``dtype`` buffer holding ``pieces`` in order, written by a single ``cat``."""
    send = torch.empty(numel, dtype=dtype, device=device)
    flat = [p.reshape(-1) for p in pieces if p.numel()]
    if flat:
        torch.cat(flat, out=send)
    return send


def _assembled(rows: int, cols: int, received: list[tuple[Piece, Tensor]], buffer: Tensor) -> Tensor:
    """A full matrix from its received pieces: the buffer itself when one piece is the whole
    matrix, one ``cat`` when the pieces are full-width row blocks, else a copy per piece."""
    received = [(p, view) for p, view in received if p.numel]
    if not received:
        return buffer.new_zeros(rows, cols)
    if len(received) == 1 and received[0][0].rows == rows and received[0][0].cols == cols:
        return received[0][1]
    if all(p.col == 0 and p.cols == cols for p, _ in received):
        return torch.cat([view for _, view in sorted(received, key=lambda item: item[0].row)])
    full = buffer.new_empty(rows, cols)
    for p, view in received:
        _region(full, p).copy_(view)
    return full


def local_shard(t: Tensor) -> Tensor:
    """This rank's part of a DTensor (a view that in-place ops update), or a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


_SUBSET_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def exchange_group(mesh: DeviceMesh | None) -> ExchangeGroup:
    """The group over all ranks of ``mesh`` (for plain tensors, None: the default group, or no
    group in a single process). A mesh covering part of the job gets a group created by its
    ranks alone (hashed name, no job-wide counter), so ranks on other meshes need not join."""
    if mesh is None:
        if default_world_size() > 1:
            return ExchangeGroup(dist.group.WORLD, dist.get_rank(), tuple(range(dist.get_world_size())))
        return ExchangeGroup(None, 0, (0,))
    ranks = mesh.mesh.flatten().tolist()
    if mesh.ndim == 1:
        group = mesh.get_group(0)
    elif sorted(ranks) == list(range(dist.get_world_size())):
        group = dist.group.WORLD
    else:
        key = (id(dist.group.WORLD), *sorted(ranks))  # a re-initialized job gets new groups
        if key not in _SUBSET_GROUPS:
            _SUBSET_GROUPS[key] = dist.new_group(sorted(ranks), use_local_synchronization=True)
        group = _SUBSET_GROUPS[key]
    index = {r: i for i, r in enumerate(ranks)}
    peers = tuple(index[r] for r in dist.get_process_group_ranks(group))
    return ExchangeGroup(group, index[dist.get_rank()], peers)


def all_agree(value: int, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether every rank of ``group`` passed the same integer (one ``all_reduce``)."""
    if group is None:
        return True
    both = all_max(torch.tensor([value, -value], dtype=torch.int64, device=device), group).tolist()
    return both[0] == -both[1]


def default_world_size() -> int:
    """World size of the default process group, 1 when there is none."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_max(values: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Element-wise maximum of ``values`` over the group (in place, and returned)."""
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values


def all_rows(row: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's ``row`` (1-D), stacked in group rank order: one ``all_reduce`` of a table that
    each rank fills in its own row. For rare paths such as error messages."""
    table = torch.zeros(dist.get_world_size(group), row.numel(), dtype=row.dtype, device=row.device)
    table[dist.get_rank(group)] = row
    dist.all_reduce(table, group=group)
    return table
