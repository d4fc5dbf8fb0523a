"""The exchange plan: who orthogonalizes which matrix, and in which bucket.

Pure Python: no collectives and no tensors beyond reading a parameter's shape, placements and
mesh. Every rank derives the identical plan from the same inputs, so no rank has to ask another.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch.distributed.tensor import DTensor, Shard

from dmuon_fsdp.newton_schulz import newton_schulz_flops


@dataclass(frozen=True)
class MatrixLayout:
    """One Muon matrix: its global (rows, cols) and how many of its rows each mesh rank holds.

    ``row_counts[r]`` rows starting at ``sum(row_counts[:r])`` live on rank r (dim-0 sharding),
    from row ``local_starts[r]`` of that rank's local shard (all 0, the default, when the matrix
    is a whole parameter; a row block of a fused or stacked parameter starts further in).
    """

    name: str
    rows: int
    cols: int
    row_counts: tuple[int, ...]
    ns_steps: int
    local_starts: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def cost(self) -> int:
        return newton_schulz_flops(self.rows, self.cols, self.ns_steps)

    @cached_property
    def row_offsets(self) -> tuple[int, ...]:
        offsets = [0]
        for count in self.row_counts[:-1]:
            offsets.append(offsets[-1] + count)
        return tuple(offsets)

    def local_start(self, rank: int) -> int:
        return self.local_starts[rank] if self.local_starts else 0

    @property
    def sole_holder(self) -> int | None:
        """The one rank holding every row, if there is one (it owns the matrix: no exchange)."""
        holders = [r for r, count in enumerate(self.row_counts) if count]
        return holders[0] if len(holders) == 1 else None


def chunk_row_counts(rows: int, world_size: int) -> tuple[int, ...]:
    """Rows per rank under ``torch.chunk`` semantics, as FSDP2 shards dim 0.

    Chunks of ceil(rows / W) rows; the remainder goes to the earlier ranks, and the last ranks
    may hold none: 5 rows over 4 ranks -> (2, 2, 1, 0).
    """
    size = -(-rows // world_size) if rows else 0
    return tuple(max(0, min(size, rows - r * size)) for r in range(world_size))


def _shard_rows(param: torch.Tensor, name: str) -> tuple[int, ...]:
    """How many dim-0 slices of ``param`` each mesh rank holds (one entry for a plain tensor)."""
    if not isinstance(param, DTensor):
        return (param.shape[0],)
    mesh, placements = param.device_mesh, tuple(param.placements)
    if mesh.ndim != 1 or placements != (Shard(0),) or type(placements[0]) is not Shard:
        raise NotImplementedError(
            f"parameter {name!r} is a DTensor with placements {placements} on a {mesh.ndim}-D mesh "
            f"{tuple(mesh.shape)}; DMuonFSDP supports only plain FSDP2 sharding (Shard(0) on a 1-D "
            "mesh) so far: HSDP, tensor parallel and replicated layouts are not implemented yet"
        )
    counts = chunk_row_counts(param.shape[0], mesh.size())
    local_rows = param.to_local().shape[0]
    if local_rows != counts[mesh.get_local_rank()]:
        raise NotImplementedError(
            f"parameter {name!r}: local shard has {local_rows} rows on mesh rank "
            f"{mesh.get_local_rank()}, expected {counts[mesh.get_local_rank()]} from torch.chunk "
            f"sharding of {param.shape[0]} rows over {mesh.size()} ranks"
        )
    return counts


def row_blocks(
    name: str, shape: tuple[int, ...], flatten: bool, split_sizes: list[int] | None, num_heads: int | None
) -> tuple[int, list[tuple[int, int]]]:
    """(cols, [(first row, rows) of each matrix]) of a parameter seen as a 2-D row-major view.

    ``flatten`` views (dim0, -1); otherwise a >2-D weight is a stack of dim0 matrices of shape
    (dim1, -1) (expert stacks). Each matrix is then cut into row blocks by ``split_sizes`` (fused
    weights such as QKV) or into ``num_heads`` equal blocks.
    """
    stacked = not flatten and len(shape) > 2
    per_matrix = shape[1] if stacked else shape[0]
    cols = math.prod(shape[2:] if stacked else shape[1:])
    sizes = [per_matrix]
    if split_sizes is not None:
        if sum(split_sizes) != per_matrix:
            raise ValueError(f"parameter {name!r}: split_sizes {split_sizes} do not add up to {per_matrix} rows")
        sizes = list(split_sizes)
    elif num_heads is not None:
        if per_matrix % num_heads:
            raise ValueError(f"parameter {name!r}: {per_matrix} rows do not split into {num_heads} heads")
        sizes = [per_matrix // num_heads] * num_heads
    blocks, start = [], 0
    for _ in range(shape[0] if stacked else 1):
        for size in sizes:
            blocks.append((start, size))
            start += size
    return cols, blocks


def describe_param(
    param: torch.Tensor,
    name: str,
    ns_steps: int,
    flatten: bool = True,
    split_sizes: list[int] | None = None,
    num_heads: int | None = None,
) -> list[MatrixLayout]:
    """The Muon matrices of a parameter: a plain tensor (one process) or a 1-D-mesh Shard(0)
    DTensor, cut into row blocks as ``row_blocks`` describes.

    Raises NotImplementedError for layouts this release does not exchange (HSDP, TP, replicated).
    """
    if param.ndim < 2:
        raise ValueError(f"parameter {name!r} has shape {tuple(param.shape)}: Muon needs >= 2 dims")
    shape = tuple(param.shape)
    cols, blocks = row_blocks(name, shape, flatten, split_sizes, num_heads)
    rows_per_slice = sum(size for _, size in blocks) // shape[0] if shape[0] else 0
    rank_rows, held = [], 0
    for count in _shard_rows(param, name):
        rank_rows.append((held, count * rows_per_slice))
        held += count * rows_per_slice
    layouts = []
    for first, size in blocks:
        counts, local = [], []
        for start, count in rank_rows:
            lo, hi = max(first, start), min(first + size, start + count)
            counts.append(max(0, hi - lo))
            local.append(lo - start if hi > lo else 0)
        label = name if len(blocks) == 1 else f"{name}[rows {first}:{first + size}]"
        layouts.append(MatrixLayout(label, size, cols, tuple(counts), ns_steps, tuple(local) if any(local) else None))
    return layouts


def describe_params(params: Sequence[tuple[torch.Tensor, str, dict]]) -> tuple[list[MatrixLayout], list[int]]:
    """The matrices of (parameter, name, group options) items, and the item each belongs to."""
    layouts, sources = [], []
    for index, (param, name, group) in enumerate(params):
        for layout in describe_param(
            param, name, group["ns_steps"], group["flatten"], group["split_sizes"], group["num_heads"]
        ):
            layouts.append(layout)
            sources.append(index)
    return layouts, sources


@dataclass(frozen=True)
class Bucket:
    """Matrices (indices into ``Plan.matrices``) exchanged by one pair of all-to-alls."""

    matrices: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """Owners and buckets for a list of matrices over ``world_size`` ranks; ``sources[j]`` is the
    index of the parameter matrix j belongs to (a parameter may hold several row blocks)."""

    matrices: tuple[MatrixLayout, ...]
    owners: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    world_size: int
    sources: tuple[int, ...]

    def owned_by(self, bucket: Bucket, rank: int) -> list[int]:
        return [j for j in bucket.matrices if self.owners[j] == rank]

    def send_counts(self, bucket: Bucket, rank: int) -> list[int]:
        """Elements ``rank`` sends to each owner in the forward (shards -> owner) exchange."""
        counts = [0] * self.world_size
        for j in bucket.matrices:
            m = self.matrices[j]
            counts[self.owners[j]] += m.row_counts[rank] * m.cols
        return counts

    def receive_counts(self, bucket: Bucket, rank: int) -> list[int]:
        """Elements ``rank`` receives from each rank in the forward exchange (as owner)."""
        counts = [0] * self.world_size
        for j in self.owned_by(bucket, rank):
            m = self.matrices[j]
            for src, rows in enumerate(m.row_counts):
                counts[src] += rows * m.cols
        return counts

    def loads(self) -> list[int]:
        """NS flops assigned to each rank."""
        loads = [0] * self.world_size
        for j, owner in enumerate(self.owners):
            loads[owner] += self.matrices[j].cost
        return loads

    def elements_moved(self, rank: int) -> int:
        """Elements ``rank`` sends to other ranks in one step, both exchanges together.

        The reverse exchange mirrors the forward one, so what a rank sends back equals what it
        received: this is also the least any owner-based schedule can move for this plan.
        """
        total = 0
        for bucket in self.buckets:
            sent = self.send_counts(bucket, rank)
            received = self.receive_counts(bucket, rank)
            total += sum(sent) - sent[rank] + sum(received) - received[rank]
        return total


def assignment_lower_bound(costs: Sequence[int], world_size: int) -> float:
    """Least possible busiest-rank cost when whole matrices are assigned to ranks.

    max(mean load, largest matrix, W-th + (W+1)-th largest): with more than W matrices, two of
    the W+1 largest share a rank.
    """
    ordered = sorted(costs, reverse=True)
    bound = max(sum(ordered) / world_size, ordered[0] if ordered else 0)
    if len(ordered) > world_size:
        bound = max(bound, ordered[world_size - 1] + ordered[world_size])
    return bound


def _bins_needed(costs_desc: Sequence[int], capacity: float) -> int:
    """Martello-Toth L2 lower bound on the bins of ``capacity`` that hold all items (sorted desc)."""
    best = 0
    for alpha in sorted({c for c in costs_desc if c <= capacity / 2} | {0}):
        big = [c for c in costs_desc if c > capacity - alpha]
        medium = [c for c in costs_desc if capacity / 2 < c <= capacity - alpha]
        small = sum(c for c in costs_desc if alpha <= c <= capacity / 2)
        spare = len(medium) * capacity - sum(medium)
        best = max(best, len(big) + len(medium) + max(0, math.ceil((small - spare) / capacity)))
    return best


def makespan_lower_bound(costs: Sequence[int], world_size: int) -> float:
    """A tighter bound than ``assignment_lower_bound``: the least capacity for which the L2 bin
    packing bound does not exceed ``world_size`` bins (bisection to 0.1%)."""
    ordered = sorted(costs, reverse=True)
    low = assignment_lower_bound(ordered, world_size)
    high = max(low, sum(ordered))
    if not ordered or _bins_needed(ordered, low) <= world_size:
        return low
    while high - low > 1e-3 * low:
        mid = (low + high) / 2
        if _bins_needed(ordered, mid) > world_size:
            low = mid
        else:
            high = mid
    return low


def assign_owners(
    costs: Sequence[int], world_size: int, pinned: Sequence[int | None] | None = None
) -> tuple[list[int], list[int]]:
    """Longest-processing-time-first: biggest matrix first, each to the least-loaded rank.

    ``pinned[j]``, when given, fixes matrix j's owner (its load still counts). Ties break on
    matrix index and rank number, so the result depends only on the inputs.
    Returns (owner of each matrix, matrix indices in assignment order).
    """
    pinned = pinned or [None] * len(costs)
    order = sorted(range(len(costs)), key=lambda j: (-costs[j], j))
    loads = [0] * world_size
    owners = [0] * len(costs)
    for j in order:
        if pinned[j] is not None:
            owners[j] = pinned[j]
            loads[pinned[j]] += costs[j]
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    for j in order:
        if pinned[j] is None:
            load, rank = heapq.heappop(heap)
            owners[j] = rank
            heapq.heappush(heap, (load + costs[j], rank))
    return owners, order


def build_plan(
    matrices: Sequence[MatrixLayout],
    world_size: int,
    bucket_bytes: int,
    element_size: int,
    sources: Sequence[int] | None = None,
) -> Plan:
    """Assign owners by NS cost over all matrices and cut them into buckets of bounded bytes.

    A matrix held entirely by one rank (a 1-row matrix, an expert of an expert-sharded stack) is
    owned by that rank and never moves. Buckets follow the assignment order (largest first), so
    consecutive matrices go to different owners and every bucket spreads NS work over the ranks; while one bucket's NS runs, the next
    bucket's exchange is in flight. A matrix larger than ``bucket_bytes`` gets a bucket of its own.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for m in matrices:
        if len(m.row_counts) != world_size or sum(m.row_counts) != m.rows:
            raise ValueError(
                f"matrix {m.name!r}: row counts {m.row_counts} do not split {m.rows} rows over "
                f"{world_size} ranks"
            )
    pinned = [m.sole_holder if world_size > 1 else None for m in matrices]
    owners, order = assign_owners([m.cost for m in matrices], world_size, pinned)
    buckets: list[Bucket] = []
    current: list[int] = []
    current_bytes = 0
    for j in order:
        size = matrices[j].numel * element_size
        if current and current_bytes + size > bucket_bytes:
            buckets.append(Bucket(tuple(current)))
            current, current_bytes = [], 0
        current.append(j)
        current_bytes += size
    if current:
        buckets.append(Bucket(tuple(current)))
    sources = tuple(sources) if sources is not None else tuple(range(len(matrices)))
    return Plan(tuple(matrices), tuple(owners), tuple(buckets), world_size, sources)
