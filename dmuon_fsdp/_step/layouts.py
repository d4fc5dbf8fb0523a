"""Where each Muon matrix lives: the piece of it every rank holds, read from DTensor placements.

Pure: no collectives. Matrices move between one set of ranks (``exchange_ranks``): those linked
by the meshes the Muon parameters live on, which may be several views of one job's ranks (a dp x
tp mesh and its dp sub-mesh; torchtitan's dense and expert meshes, unflattened or flattened from
the world). Plan rank i is the i-th of them by global rank. A parameter's block on each rank
follows from its own mesh and placements (Shard, Replicate, and the _StridedShard that FSDP2
puts over tensor or expert parallelism), each cut with torch.chunk semantics, on every copy of
its mesh (``mesh_copies``: a sub-mesh has one per coordinate of the dims it leaves out, each a
replica); this rank's block is checked against DTensor's own rule and its local tensor. A plain
tensor in a job of W ranks is replicated on all of them (DDP). A parameter viewed as matrices
(``row_blocks``) then gives each matrix one ``Piece`` per rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import product
from typing import TypeVar, cast

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard


@dataclass(frozen=True)
class Piece:
    """A rank's rectangle of a matrix: rows [row, row + rows) x columns [col, col + cols), whose
    first row is row ``local_row`` of the rank's local shard viewed as (-1, cols)."""

    row: int = 0
    rows: int = 0
    col: int = 0
    cols: int = 0
    local_row: int = 0

    @property
    def numel(self) -> int:
        return self.rows * self.cols


EMPTY = Piece()


@dataclass(frozen=True)
class MatrixLayout:
    """One Muon matrix: its global (rows, cols) and the piece of it each exchange rank holds.

    ``replicas[r]`` tells copies apart: ranks with the same replica index hold disjoint pieces
    that tile the matrix once (None: a single copy, all ranks index 0). HSDP replica groups, a
    tensor-parallel dimension a weight is replicated on, and DDP ranks (each its own replica)
    are all described this way.
    """

    name: str
    rows: int
    cols: int
    pieces: tuple[Piece, ...]
    replicas: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def replica(self, rank: int) -> int:
        return self.replicas[rank] if self.replicas else 0

    def senders(self, owner: int) -> frozenset[int]:
        """Ranks that send their pieces to ``owner``: one copy of each, from owner's replica."""
        return holding(self).senders(self.replica(owner))

    @property
    def full_holders(self) -> tuple[int, ...]:
        """Ranks holding the whole matrix: an owner among them needs nothing sent to it."""
        return holding(self).full


@dataclass(frozen=True)
class Holding:
    """Who holds what of a matrix, as arrays over the ranks, made once for every matrix with the
    same pieces and replicas (one per shape and layout of a parameter, whatever the number of
    layers: ``holding``), so that planning takes time and memory that grow with matrices plus
    ranks, not their product."""

    numel: np.ndarray  # each rank's piece's elements
    replica: np.ndarray  # each rank's replica index (all 0: one copy)
    holders: dict[int, np.ndarray]  # each replica's ranks with a piece, ascending
    full: tuple[int, ...]  # ranks holding the whole matrix
    _senders: dict[int, frozenset[int]] = field(default_factory=dict, compare=False, repr=False)

    def senders(self, replica: int) -> frozenset[int]:
        """The ranks of ``replica`` holding a piece (one copy of every piece)."""
        if replica not in self._senders:
            self._senders[replica] = frozenset(self.holders.get(replica, np.empty(0, np.int64)).tolist())
        return self._senders[replica]


_BY_LAYOUT: dict[tuple[str, int, int], tuple[MatrixLayout, object]] = {}


def by_layout(kind: str, m: MatrixLayout, make: Callable[[MatrixLayout], T]) -> T:
    """``make(m)``, made once for every matrix whose pieces and replicas are the same tuples as
    ``m``'s (``kind`` names what is made)."""
    key = (kind, id(m.pieces), id(m.replicas))
    found = _BY_LAYOUT.get(key)
    if found is not None and found[0].pieces is m.pieces and found[0].replicas is m.replicas:
        return cast(T, found[1])
    made = make(m)
    if len(_BY_LAYOUT) > 4096:
        _BY_LAYOUT.clear()
    _BY_LAYOUT[key] = (m, made)  # (the layout keeps the keyed tuples alive)
    return made


def holding(m: MatrixLayout) -> Holding:
    """``m``'s ``Holding`` (shared by the matrices with its pieces and replicas)."""
    return by_layout("holding", m, _holding)


def _holding(m: MatrixLayout) -> Holding:
    numel = np.array([p.rows * p.cols for p in m.pieces], dtype=np.int64)
    replica = np.array(m.replicas, dtype=np.int64) if m.replicas else np.zeros(len(m.pieces), np.int64)
    held = np.nonzero(numel)[0]
    holders = {int(q): held[replica[held] == q] for q in np.unique(replica)}
    full = tuple(np.nonzero(numel == m.numel)[0].tolist()) if m.numel else ()
    return Holding(numel, replica, holders, full)


T = TypeVar("T")

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offset, local shape) of one rank's block


@lru_cache(maxsize=64)
def mesh_copies(mesh: DeviceMesh) -> tuple[tuple[int, ...], ...]:
    """The global ranks of every copy of ``mesh``, each in row-major coordinate order; the copy
    holding this rank is ``mesh.mesh``. A mesh sliced, flattened or unflattened from another
    (``root["dp"]``, ``root._flatten()``, torchtitan's dense and sparse meshes) has one copy per
    coordinate of the dims it leaves out; a mesh made on its own, one. Cached: parameters share
    a few meshes."""
    layout, rank_map = getattr(mesh, "_layout", None), getattr(mesh, "_rank_map", None)
    if layout is not None and rank_map is not None:  # where the mesh sits among the job's ranks
        full = layout.remap_to_tensor(rank_map)
    else:  # torch before mesh layouts: a mesh sliced by dim names from its root, or itself alone
        full = _copies_by_name(mesh)
    return tuple(tuple(copy) for copy in full.reshape(-1, mesh.size()).tolist())


def _copies_by_name(mesh: DeviceMesh) -> torch.Tensor:
    from torch.distributed.device_mesh import _mesh_resources

    root = _mesh_resources.get_root_mesh(mesh)
    names, root_names = mesh.mesh_dim_names or (), root.mesh_dim_names or ()
    if root is mesh or not names or not set(names) <= set(root_names):
        return mesh.mesh
    dims = [root_names.index(n) for n in names]
    return root.mesh.permute(*(d for d in range(root.ndim) if d not in dims), *dims)


def exchange_ranks(meshes: Iterable[DeviceMesh], me: int) -> tuple[int, ...]:
    """The global ranks Muon matrices move between, in plan order: rank ``me`` and every rank
    linked to it through copies of ``meshes`` (torchtitan's dense and sparse meshes, a dp x tp
    mesh and its dp sub-mesh: the whole job; one pipeline stage's meshes: the stage)."""
    copies = [frozenset(copy) for mesh in meshes for copy in mesh_copies(mesh)]
    ranks = {me}
    while True:
        linked = ranks.union(*(copy for copy in copies if copy & ranks))
        if linked == ranks:
            return tuple(sorted(ranks))
        ranks = linked


@lru_cache(maxsize=64)
def _copies_among(
    mesh: DeviceMesh, ranks: tuple[int, ...]
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    wanted = set(ranks)
    copies = tuple(copy for copy in mesh_copies(mesh) if any(r in wanted for r in copy))
    return copies, tuple(sorted(r for copy in copies for r in copy))


def copies_over(mesh: DeviceMesh, ranks: Sequence[int], name: str) -> tuple[tuple[int, ...], ...]:
    """The copies of ``mesh`` among ``ranks``, which they must hold exactly: every rank holds the
    parameter ``name`` once (a copy per replica)."""
    copies, held = _copies_among(mesh, tuple(ranks))
    if held != tuple(sorted(ranks)):
        raise ValueError(
            f"parameter {name!r} lives on {mesh} over ranks {mesh.mesh.flatten().tolist()}, whose copies "
            f"hold it on ranks {list(held)}, but Muon matrices move between ranks {list(ranks)}: every mesh "
            "of a Muon parameter must be a view of the same ranks (one mesh, or meshes sliced, "
            "flattened or unflattened from one)"
        )
    return copies


def _chunk(start: int, length: int, parts: int, index: int) -> tuple[int, int]:
    """Piece ``index`` of [start, start + length) cut by ``torch.chunk`` into ``parts``."""
    size = -(-length // parts) if length else 0
    lo = min(length, index * size)
    return start + lo, min(length, lo + size) - lo


def _shard_order(placements: Sequence[Placement], mesh_shape: Sequence[int], name: str) -> list[int]:
    """Mesh dims in the order their shards cut the tensor: mesh order, except that FSDP2's
    _StridedShard on top of tensor parallelism cuts after the later Shards of its dim."""
    order: list[int] = []
    deferred: list[int] = []
    for i, placement in enumerate(placements):
        if isinstance(placement, _StridedShard):
            later = [
                mesh_shape[k]
                for k, p in enumerate(placements[i + 1 :], i + 1)
                if type(p) is Shard and p.dim == placement.dim
            ]
            if math.prod(later) != placement.split_factor or any(
                isinstance(p, _StridedShard) and p.dim == placement.dim for p in placements[i + 1 :]
            ):
                raise NotImplementedError(
                    f"parameter {name!r}: placements {tuple(placements)} hold strided (non-contiguous) "
                    "blocks; only FSDP2's _StridedShard over tensor parallelism is supported"
                )
            deferred.insert(0, i)
        elif type(placement) is Shard:
            order.append(i)
        elif type(placement) is not Replicate:
            raise NotImplementedError(f"parameter {name!r} has unsupported placements {tuple(placements)}")
    return order + deferred


def _row_major(coordinate: Sequence[int], shape: Sequence[int]) -> int:
    index = 0
    for k, n in zip(coordinate, shape, strict=True):
        index = index * n + k
    return index


@lru_cache(maxsize=1024)
def rank_boxes(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]
) -> tuple[Box, ...]:
    """Every rank's block of a tensor (torch.chunk at each cut), in row-major coordinate order.
    Cached: parameters of one shape and layout share it."""
    order = _shard_order(placements, mesh_shape, "?")
    boxes = []
    for coordinate in product(*(range(n) for n in mesh_shape)):
        offset, size = [0] * len(shape), list(shape)
        for i in order:
            placement = placements[i]
            assert isinstance(placement, (Shard, _StridedShard))  # order lists the sharded mesh dims
            d = placement.dim % len(shape)
            offset[d], size[d] = _chunk(offset[d], size[d], mesh_shape[i], coordinate[i])
        boxes.append((tuple(offset), tuple(size)))
    return tuple(boxes)


def replica_indices(mesh_shape: Sequence[int], placements: Sequence[Placement]) -> tuple[int, ...] | None:
    """Each rank's row-major index over the mesh dims the tensor is replicated on."""
    replicated = [k for k, p in enumerate(placements) if isinstance(p, Replicate)]
    if not replicated:
        return None
    sizes = [mesh_shape[k] for k in replicated]
    coordinates = product(*(range(n) for n in mesh_shape))
    return tuple(_row_major([c[k] for k in replicated], sizes) for c in coordinates)


def param_boxes(
    param: torch.Tensor, name: str, ranks: Sequence[int] | None = None
) -> tuple[tuple[Box, ...], tuple[int, ...] | None]:
    """(box of each of ``ranks``, replica indices) of a parameter: a DTensor's from its own mesh
    and placements, on every copy of its mesh among ``ranks`` (default: its mesh's ranks); a
    plain tensor is whole on each of ``ranks`` (default: this process alone), as under DDP.
    Ranks with the same replica index hold disjoint blocks that tile the tensor once."""
    shape = tuple(param.shape)
    if not isinstance(param, DTensor):
        count = len(ranks) if ranks is not None else 1
        return _whole(shape, count)
    mesh, placements = param.device_mesh, tuple(param.placements)
    ranks = tuple(ranks) if ranks is not None else tuple(sorted(mesh.mesh.flatten().tolist()))
    mesh_shape = tuple(mesh.shape)
    _shard_order(placements, mesh_shape, name)  # names the parameter if the layout is unsupported
    boxes = rank_boxes(shape, mesh_shape, placements)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # this rank holds a shard of param, so it is on param's mesh
    me = _row_major(coordinate, mesh_shape)
    # DTensor's own rule for this rank's block must agree (an empty block's offset aside), as
    # must the local tensor.
    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    agrees = boxes[me][1] == tuple(local) and (boxes[me][0] == tuple(offset) or not all(local))
    if not agrees or tuple(local) != tuple(param.to_local().shape):
        raise NotImplementedError(
            f"parameter {name!r}: placements {placements} on mesh {mesh_shape} give the block at offset "
            f"{boxes[me][0]} of shape {boxes[me][1]} at coordinate {tuple(coordinate)}, but DTensor "
            f"places offset {tuple(offset)} shape {tuple(local)}, local shard {tuple(param.to_local().shape)}"
        )
    key = (shape, mesh, placements, ranks)
    if key not in _PLACED:  # (made once per shape and layout, for every rank of the exchange)
        if len(_PLACED) > 256:
            _PLACED.clear()
        _PLACED[key] = _placed(boxes, mesh, placements, ranks, name)
    return _PLACED[key]


_PLACED: dict[tuple, tuple[tuple[Box, ...], tuple[int, ...] | None]] = {}


@lru_cache(maxsize=64)
def _whole(shape: tuple[int, ...], count: int) -> tuple[tuple[Box, ...], tuple[int, ...] | None]:
    """A tensor whole on each of ``count`` ranks, each its own replica (DDP)."""
    return (((0,) * len(shape), shape),) * count, (tuple(range(count)) if count > 1 else None)


def _placed(
    boxes: tuple[Box, ...],
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    ranks: tuple[int, ...],
    name: str,
) -> tuple[tuple[Box, ...], tuple[int, ...] | None]:
    """The blocks ``boxes`` of every copy of ``mesh`` among ``ranks``, and each rank's replica."""
    inner = replica_indices(tuple(mesh.shape), placements)  # within one copy of the mesh
    per_copy = max(inner) + 1 if inner else 1
    copies = copies_over(mesh, ranks, name)
    placed: dict[int, tuple[Box, int]] = {}  # global rank -> (its box, its replica index)
    for c, copy in enumerate(copies):
        for x, r in enumerate(copy):
            placed[r] = boxes[x], c * per_copy + (inner[x] if inner else 0)
    replicas = tuple(placed[r][1] for r in ranks)
    return tuple(placed[r][0] for r in ranks), (replicas if len(copies) > 1 or inner else None)


def row_blocks(
    name: str, rows: int, split_sizes: list[int] | None, num_heads: int | None
) -> list[tuple[int, int]]:
    """(first row, rows) of each block a matrix of ``rows`` rows is cut into: ``split_sizes``
    (fused weights such as QKV), ``num_heads`` equal blocks, or the whole matrix."""
    sizes = [rows]
    if split_sizes is not None:
        if sum(split_sizes) != rows:
            raise ValueError(f"parameter {name!r}: split_sizes {split_sizes} do not add up to {rows} rows")
        sizes = list(split_sizes)
    elif num_heads is not None:
        if rows % num_heads:
            raise ValueError(f"parameter {name!r}: {rows} rows do not split into {num_heads} heads")
        sizes = [rows // num_heads] * num_heads
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return list(zip(starts, sizes, strict=True))


def _columns(shape: tuple[int, ...], box: Box, first: int, name: str, placements: str) -> tuple[int, int]:
    """Columns [start, stop) of a box in the row-major flattening of dims ``first``..: contiguous
    only when at most one of those dims is cut and every dim before it has size 1."""
    offset, size = box
    cut = [d for d in range(first, len(shape)) if size[d] != shape[d]]
    if not cut:
        return 0, math.prod(shape[first:])
    d = cut[0]
    if len(cut) > 1 or any(shape[k] != 1 for k in range(first, d)):
        raise NotImplementedError(
            f"parameter {name!r} of shape {shape}: placements {placements} cut dims {cut} of its "
            f"matrix columns (dims {first}..{len(shape) - 1}); such shards cannot be reassembled "
            "into a matrix block"
        )
    inner = math.prod(shape[d + 1 :])
    return offset[d] * inner, (offset[d] + size[d]) * inner


def describe_param(
    param: torch.Tensor,
    name: str,
    flatten: bool = True,
    split_sizes: list[int] | None = None,
    num_heads: int | None = None,
    ranks: Sequence[int] | None = None,
) -> list[MatrixLayout]:
    """The Muon matrices of a parameter and every rank's piece of each.

    ``flatten`` views the weight as one (dim0, -1) matrix; otherwise a >2-D weight is a stack of
    dim0 matrices (dim1, -1) (expert stacks). Each matrix is then cut by ``row_blocks``. ``ranks``:
    as in ``param_boxes``.
    Raises NotImplementedError for placements whose blocks are not matrix rectangles.
    """
    if param.ndim < 2:
        raise ValueError(f"parameter {name!r} has shape {tuple(param.shape)}: Muon needs >= 2 dims")
    shape = tuple(param.shape)
    boxes, replicas = param_boxes(param, name, ranks)
    placements = str(getattr(param, "placements", "(plain tensor)"))
    split = tuple(split_sizes) if split_sizes is not None else None
    key = (id(boxes), id(replicas), shape, flatten, split, num_heads)
    found = _MATRICES.get(key)
    if found is None or found[0] is not boxes or found[1] is not replicas:
        if len(_MATRICES) > 256:
            _MATRICES.clear()
        matrices = _matrices(shape, boxes, flatten, split_sizes, num_heads, name, placements)
        found = _MATRICES[key] = (boxes, replicas, matrices)  # (keeps the keyed tuples alive)
    return [
        MatrixLayout(name + label, rows, cols, pieces, replicas) for label, rows, cols, pieces in found[2]
    ]


_MATRICES: dict[
    tuple, tuple[tuple[Box, ...], tuple[int, ...] | None, list[tuple[str, int, int, tuple[Piece, ...]]]]
] = {}


def _matrices(
    shape: tuple[int, ...],
    boxes: tuple[Box, ...],
    flatten: bool,
    split_sizes: list[int] | None,
    num_heads: int | None,
    name: str,
    placements: str,
) -> list[tuple[str, int, int, tuple[Piece, ...]]]:
    """(label, rows, cols, pieces) of each matrix of a parameter of ``shape`` whose ranks hold
    ``boxes`` (see ``describe_param``), made once per shape and layout: parameters of one shape
    and layout share their pieces."""
    stacked = not flatten and len(shape) > 2
    row_dim = 1 if stacked else 0
    columns = [
        _columns(shape, box, row_dim + 1, name, placements) if all(box[1]) else (0, 0) for box in boxes
    ]
    cols = math.prod(shape[row_dim + 1 :])
    blocks = row_blocks(name, shape[row_dim], split_sizes, num_heads)
    out = []
    for expert in range(shape[0] if stacked else 1):
        for first, size in blocks:
            pieces = []
            for (offset, local), (c0, c1) in zip(boxes, columns, strict=True):
                lo, hi = max(first, offset[row_dim]), min(first + size, offset[row_dim] + local[row_dim])
                in_stack = not stacked or offset[0] <= expert < offset[0] + local[0]
                if hi <= lo or c1 <= c0 or not in_stack:
                    pieces.append(EMPTY)
                    continue
                local_row = lo - offset[row_dim] + ((expert - offset[0]) * local[1] if stacked else 0)
                pieces.append(Piece(lo - first, hi - lo, c0, c1 - c0, local_row))
            label = f"[{expert}]" if stacked else ""
            label += f"[rows {first}:{first + size}]" if len(blocks) > 1 else ""
            out.append((label, size, cols, tuple(pieces)))
    return out


def describe_params(
    params: Sequence[tuple[torch.Tensor, str, dict]], ranks: Sequence[int] | None = None
) -> tuple[list[MatrixLayout], list[int]]:
    """The matrices of (parameter, name, group options) items, and the item each belongs to.

    ``ranks``: the global ranks the matrices move between (``exchange_ranks``), plan rank i
    being ``ranks[i]``; plain tensors are replicated on all of them (DDP)."""
    layouts, param_of = [], []
    for index, (param, name, group) in enumerate(params):
        for layout in describe_param(
            param, name, group["flatten"], group["split_sizes"], group["num_heads"], ranks
        ):
            layouts.append(layout)
            param_of.append(index)
    return layouts, param_of
