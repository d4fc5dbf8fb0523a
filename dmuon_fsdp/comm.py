"""Moving shards to their owners and orthogonalized rows back: the only torch.distributed calls.

Wire layout of one bucket (forward, shards -> owners): a rank's send buffer holds, per owner in
rank order, its rows of each matrix that owner owns, in bucket order. The reverse exchange sends
each rank its rows of every orthogonalized matrix in the same order, so both directions use one
``all_to_all_single`` whose split sizes come straight from the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from dmuon_fsdp.planner import Bucket, Plan
from dmuon_fsdp.stats import StepStats


@dataclass
class Pending:
    """An exchange in flight. Holds the buffers so they outlive the asynchronous collective."""

    bucket: Bucket
    send: Tensor
    receive: Tensor
    work: dist.Work | None

    def wait(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.receive


class ShardExchange:
    """Exchanges for one plan, seen from one rank of ``group`` (None: a single process)."""

    def __init__(
        self, plan: Plan, rank: int, group: dist.ProcessGroup | None, dtype: torch.dtype, stats: StepStats
    ):
        if group is None and plan.world_size != 1:
            raise ValueError(f"a plan over {plan.world_size} ranks needs a process group")
        self.plan, self.rank, self.group, self.dtype, self.stats = plan, rank, group, dtype, stats

    def _launch(self, bucket: Bucket, send: Tensor, out_counts: list[int], in_counts: list[int]) -> Pending:
        receive = torch.empty(sum(out_counts), dtype=self.dtype, device=send.device)
        size = send.element_size()
        self.stats.bytes_sent += (sum(in_counts) - in_counts[self.rank]) * size
        self.stats.bytes_received += (sum(out_counts) - out_counts[self.rank]) * size
        if self.group is None:
            receive.copy_(send)
            return Pending(bucket, send, receive, None)
        work = dist.all_to_all_single(
            receive, send, out_counts, in_counts, group=self.group, async_op=True
        )
        self.stats.collectives += 1
        return Pending(bucket, send, receive, work)

    def _wait(self, pending: Pending) -> Tensor:
        with self.stats.phase("wait"):
            return pending.wait()

    def run(
        self,
        local_rows: dict[int, Tensor],
        device: torch.device,
        orthogonalize: Callable[[dict[int, Tensor]], dict[int, Tensor]],
        apply: Callable[[dict[int, Tensor]], None],
        overlap: bool,
    ) -> None:
        """Every bucket: rows to owners, ``orthogonalize`` on the owners, rows back to ``apply``.

        With ``overlap``, bucket k+1's exchange is launched before bucket k's orthogonalization
        and all returns are applied at the end; without it, each bucket completes in turn.
        """
        buckets = self.plan.buckets
        gathers: dict[int, Pending] = {}
        scatters = []
        for k, bucket in enumerate(buckets):
            if k not in gathers:
                gathers[k] = self.start_gather(bucket, local_rows, device)
            if overlap and k + 1 < len(buckets):
                gathers[k + 1] = self.start_gather(buckets[k + 1], local_rows, device)
            scatter = self.start_scatter(bucket, orthogonalize(self.finish_gather(gathers.pop(k))), device)
            if overlap:
                scatters.append(scatter)
            else:
                apply(self.finish_scatter(scatter))
        for scatter in scatters:
            apply(self.finish_scatter(scatter))

    def start_gather(self, bucket: Bucket, local_rows: dict[int, Tensor], device: torch.device) -> Pending:
        """Send this rank's rows of each matrix in ``bucket`` to its owner.

        ``local_rows[j]`` is this rank's (row_counts[rank], cols) block of matrix j.
        """
        plan = self.plan
        counts = plan.send_counts(bucket, self.rank)
        with self.stats.phase("pack"):
            send = torch.empty(sum(counts), dtype=self.dtype, device=device)
            offset = 0
            for owner in range(plan.world_size):
                for j in bucket.matrices:
                    if plan.owners[j] == owner:
                        block = local_rows[j]
                        send[offset : offset + block.numel()].view_as(block).copy_(block)
                        offset += block.numel()
        return self._launch(bucket, send, plan.receive_counts(bucket, self.rank), counts)

    def finish_gather(self, pending: Pending) -> dict[int, Tensor]:
        """Wait, then reassemble the full (rows, cols) matrices this rank owns in the bucket."""
        plan = self.plan
        receive = self._wait(pending)
        owned = plan.owned_by(pending.bucket, self.rank)
        pieces: dict[int, list[Tensor]] = {j: [] for j in owned}
        offset = 0
        for src in range(plan.world_size):
            for j in owned:
                m = plan.matrices[j]
                size = m.row_counts[src] * m.cols
                pieces[j].append(receive[offset : offset + size].view(m.row_counts[src], m.cols))
                offset += size
        with self.stats.phase("pack"):
            return {j: torch.cat(pieces[j]) for j in owned}

    def start_scatter(self, bucket: Bucket, results: dict[int, Tensor], device: torch.device) -> Pending:
        """Send every rank its rows of each orthogonalized matrix this rank owns in the bucket."""
        plan = self.plan
        owned = plan.owned_by(bucket, self.rank)
        out_counts = plan.receive_counts(bucket, self.rank)
        with self.stats.phase("pack"):
            send = torch.empty(sum(out_counts), dtype=self.dtype, device=device)
            offset = 0
            for dst in range(plan.world_size):
                for j in owned:
                    m = plan.matrices[j]
                    start, rows = m.row_offsets[dst], m.row_counts[dst]
                    block = send[offset : offset + rows * m.cols].view(rows, m.cols)
                    block.copy_(results[j][start : start + rows])
                    offset += rows * m.cols
        return self._launch(bucket, send, plan.send_counts(bucket, self.rank), out_counts)

    def finish_scatter(self, pending: Pending) -> dict[int, Tensor]:
        """Wait, then return this rank's (row_counts[rank], cols) block of each bucket matrix."""
        plan = self.plan
        receive = self._wait(pending)
        blocks: dict[int, Tensor] = {}
        offset = 0
        for owner in range(plan.world_size):
            for j in pending.bucket.matrices:
                if plan.owners[j] == owner:
                    m = plan.matrices[j]
                    size = m.row_counts[self.rank] * m.cols
                    blocks[j] = receive[offset : offset + size].view(m.row_counts[self.rank], m.cols)
                    offset += size
        return blocks


def local_shard(t: Tensor) -> Tensor:
    """This rank's part of a DTensor (a view that in-place ops update), or a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def process_group_of(param: Tensor) -> tuple[dist.ProcessGroup | None, int]:
    """(process group, rank in it) that a parameter's shards live on; (None, 0) for plain tensors."""
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        return mesh.get_group(0), mesh.get_local_rank(0)
    return None, 0


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
