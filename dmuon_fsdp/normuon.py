"""NorMuon (Li et al., "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491):
Muon's orthogonalized update with each neuron (row) normalized by a running second moment.

For each Muon matrix (each row block, head or expert on its own) with O the Newton-Schulz output
in the parameter's orientation (rows are output neurons: dim 0, or dim 1 of a stack of matrices)
and C its columns:

    v <- beta2 v + (1 - beta2) mean over columns of O**2      (one number per row)
    O_hat = O / (sqrt(v) + eps) * ||O||_F / ||O / (sqrt(v) + eps)||_F

then Muon's step size, weight decay and update with O_hat in place of O. Here it runs on the
owner, which holds the whole matrix, so the per-row numbers are exact: ``v`` is optimizer state placed
like the parameter's rows (``second_moment_like``), the holders send the owner their rows' ``v``
with their pieces and get the new ``v`` back with the result, and O_hat is applied as O times
a per-row factor (``NeuronNorm``: the rows' norms, one op per batch orientation, then foreach ops
over all owned matrices at once).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

VARIANTS = ("muon", "normuon")
STATE_KEY = "neuron_second_moment"
_TINY = torch.finfo(torch.float32).tiny  # a zero matrix keeps a zero update


def row_dims(param: Tensor, flatten: bool) -> int:
    """How many leading dims of ``param`` index its matrices' rows: 1, or 2 for a stack of
    matrices (``flatten=False``, ndim > 2)."""
    return 2 if not flatten and param.ndim > 2 else 1


def second_moment_like(param: Tensor, flatten: bool) -> Tensor:
    """Float32 zeros with one number per matrix row of ``param``, placed like those rows: a
    DTensor sharded as the parameter's leading dims and replicated on mesh dims that cut only
    its columns (or replicate it), a plain tensor for a plain parameter."""
    dims = row_dims(param, flatten)
    shape = tuple(param.shape[:dims])
    if not isinstance(param, DTensor):
        return torch.zeros(shape, dtype=torch.float32, device=param.device)

    def on_rows(pl: Placement) -> Placement:
        if isinstance(pl, _StridedShard) and pl.dim < dims:
            return pl
        return Shard(pl.dim % param.ndim) if type(pl) is Shard and pl.dim % param.ndim < dims else Replicate()

    placements = tuple(on_rows(pl) for pl in param.placements)
    local, _ = compute_local_shape_and_global_offset(shape, param.device_mesh, placements)
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    zeros = torch.zeros(tuple(local), dtype=torch.float32, device=param.device)
    return DTensor.from_local(
        zeros, param.device_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


@dataclass(frozen=True)
class RowNorms:
    """The rows' norms of some matrices of one stack, in ``out``'s dtype (float32, or float64
    for a float64 stack): ``stack`` (a slice of a batch's stack) along ``dim`` (-1 where the stack
    holds the matrices as they are, -2 where it holds them transposed) into ``out``."""

    stack: Tensor
    dim: int
    out: Tensor

    def run(self) -> None:
        torch.linalg.vector_norm(self.stack, 2, dim=self.dim, dtype=self.out.dtype, out=self.out)


@dataclass(frozen=True)
class NeuronNorm:
    """NorMuon on one bucket's owned matrices: per matrix j (``rows[j]``, its rows' norms; ``v[j]``
    their second moments; ``factors[j]``, filled with each row's factor, so that factor * O is
    O_hat), ``betas[j]`` = beta2, ``weights[j]`` = (1 - beta2) / columns, ``eps[j]``."""

    norms: tuple[RowNorms, ...]
    rows: list[Tensor]
    v: list[Tensor]
    factors: list[Tensor]
    betas: list[float]
    weights: list[float]
    eps: list[float]

    def run(self) -> None:
        for row_norms in self.norms:
            row_norms.run()
        torch._foreach_mul_(self.v, self.betas)
        torch._foreach_addcmul_(self.v, self.rows, self.rows, self.weights)  # mean of O**2 per row
        f = self.factors
        torch._foreach_copy_(f, self.v)
        torch._foreach_sqrt_(f)
        torch._foreach_add_(f, self.eps)
        torch._foreach_reciprocal_(f)  # 1 / (sqrt(v) + eps)
        # ||O||_F is the norm of the rows' norms, ||O_hat||_F that of the scaled ones (one op)
        norms = torch._foreach_norm([*self.rows, *torch._foreach_mul(self.rows, f)])
        kept, normalized = norms[: len(f)], norms[len(f) :]
        torch._foreach_clamp_min_(normalized, _TINY)
        torch._foreach_div_(kept, normalized)
        torch._foreach_mul_(f, kept)


@dataclass(frozen=True)
class BoundNeurons:
    """NorMuon bound to one bucket's owned matrices: its ``norm`` and each matrix's second
    moments and factors (``rows[j]``, float32 views)."""

    norm: NeuronNorm
    rows: dict[int, tuple[Tensor, Tensor]]


Normed = tuple[Tensor, dict[int, tuple[int, int]], tuple[float, float]]


def bind_neurons(
    normed: list[Normed], ns_dtype: torch.dtype, take: Callable[..., Tensor]
) -> BoundNeurons | None:
    """Buffers (``take(numel, dtype)``) and views for NorMuon on the batches ``normed``: (stack,
    {matrix: (rows, cols)} in stack order, wide ones first, (beta2, eps)); None when there are
    none. The rows' norms are kept in float32 (float64 for a float64 stack), the second moments
    and factors in float32."""
    total = sum(rows for _, shapes, _ in normed for rows, _ in shapes.values())
    if not total:
        return None
    dtypes = (torch.promote_types(ns_dtype, torch.float32), torch.float32, torch.float32)
    flats = [take(total, dtype) for dtype in dtypes]
    norms: list[RowNorms] = []
    row_views: list[Tensor] = []  # per matrix, its rows' norms, second moments and factors
    v_views: list[Tensor] = []
    factor_views: list[Tensor] = []
    betas: list[float] = []
    weights: list[float] = []
    epss: list[float] = []
    owned: dict[int, tuple[Tensor, Tensor]] = {}
    offset = 0
    for stack, shapes, (beta2, eps) in normed:
        wide = sum(rows <= cols for rows, cols in shapes.values())
        start = offset
        for part, dim in ((stack[:wide], -1), (stack[wide:], -2)):  # norms over the columns
            if part.shape[0]:
                size = part.shape[0] * part.shape[-3 - dim]  # matrices x rows (the other dim)
                norms.append(RowNorms(part, dim, flats[0][start : start + size].view(part.shape[0], -1)))
                start += size
        for j, (rows, cols) in shapes.items():
            for views, flat in zip((row_views, v_views, factor_views), flats, strict=True):
                views.append(flat[offset : offset + rows])
            betas.append(beta2)
            weights.append((1.0 - beta2) / cols)
            epss.append(eps)
            owned[j] = v_views[-1], factor_views[-1]
            offset += rows
    norm = NeuronNorm(tuple(norms), row_views, v_views, factor_views, betas, weights, epss)
    return BoundNeurons(norm, owned)
