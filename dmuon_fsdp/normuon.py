"""NorMuon (Li et al., "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491):
Muon's orthogonalized update with each neuron (row) normalized by a running second moment.

For each Muon matrix (each row block, head or expert on its own) with O the Newton-Schulz output
in the parameter's orientation (rows are output neurons: dim 0, or dim 1 of a stack of matrices)
and C its columns:

    v <- beta2 v + (1 - beta2) mean over columns of O**2      (one number per row)
    O_hat = O / (sqrt(v) + eps) * ||O||_F / ||O / (sqrt(v) + eps)||_F

then Muon's step size, weight decay and update with O_hat in place of O. It is a row variant
([Note: row variants] in ``dmuon_fsdp.variants``): ``v`` is its row state, and it runs on the
owner, which holds the whole matrix, so the per-row numbers are exact; O_hat is applied as O times
a row factor (``NeuronNorm``: the rows' norms, one op per batch orientation, then foreach ops
over all owned matrices at once).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from dmuon_fsdp.variants import RowBatch

_TINY = torch.finfo(torch.float32).tiny  # a zero matrix keeps a zero update


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
    """NorMuon on one bucket's owned matrices (a ``RowStep``): per matrix j (``rows[j]``, its rows'
    norms; ``state[j]``, their second moments v; ``factors[j]``, filled with each row's factor, so
    that factor * O is O_hat), ``betas[j]`` = beta2, ``weights[j]`` = (1 - beta2) / columns,
    ``eps[j]``."""

    norms: tuple[RowNorms, ...]
    rows: list[Tensor]
    state: list[Tensor]
    factors: list[Tensor]
    betas: list[float]
    weights: list[float]
    eps: list[float]

    def run(self) -> None:
        for row_norms in self.norms:
            row_norms.run()
        v = self.state
        torch._foreach_mul_(v, self.betas)
        torch._foreach_addcmul_(v, self.rows, self.rows, self.weights)  # mean of O**2 per row
        f = self.factors
        torch._foreach_copy_(f, v)
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
class NorMuon:
    """NorMuon as a row variant (``dmuon_fsdp.variants.RowVariant``)."""

    name: str = "normuon"
    state_key: str = "neuron_second_moment"
    options: tuple[str, ...] = ("normuon_beta2", "normuon_eps")

    def check(self, group: dict[str, Any]) -> None:
        beta2, eps = group["normuon_beta2"], group["normuon_eps"]
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"normuon_beta2 must be in [0, 1), got {beta2!r}")
        if not (math.isfinite(eps) and eps > 0.0):
            raise ValueError(f"normuon_eps must be a finite number > 0, got {eps!r}")

    def settings(self, group: dict[str, Any]) -> tuple[float, ...]:
        return float(group["normuon_beta2"]), float(group["normuon_eps"])

    def bind(
        self, batches: Sequence[RowBatch], ns_dtype: torch.dtype, take: Callable[[int, torch.dtype], Tensor]
    ) -> NeuronNorm | None:
        """Buffers and views for NorMuon on ``batches``. The rows' norms are kept in float32
        (float64 for a float64 stack), the second moments and factors in float32."""
        total = sum(rows for batch in batches for rows, _ in batch.shapes.values())
        if not total:
            return None
        dtypes = (torch.promote_types(ns_dtype, torch.float32), torch.float32, torch.float32)
        flats = [take(total, dtype) for dtype in dtypes]
        norms: list[RowNorms] = []
        views: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])  # norms, v, factors
        betas: list[float] = []
        weights: list[float] = []
        epss: list[float] = []
        offset = 0
        for batch in batches:
            stack, shapes = batch.stack, batch.shapes
            beta2, eps = batch.settings
            wide = sum(rows <= cols for rows, cols in shapes.values())
            start = offset
            for part, dim in ((stack[:wide], -1), (stack[wide:], -2)):  # norms over the columns
                if part.shape[0]:
                    size = part.shape[0] * part.shape[-3 - dim]  # matrices x rows (the other dim)
                    norms.append(RowNorms(part, dim, flats[0][start : start + size].view(part.shape[0], -1)))
                    start += size
            for rows, cols in shapes.values():
                for out, flat in zip(views, flats, strict=True):
                    out.append(flat[offset : offset + rows])
                betas.append(beta2)
                weights.append((1.0 - beta2) / cols)
                epss.append(eps)
                offset += rows
        return NeuronNorm(tuple(norms), *views, betas, weights, epss)


NORMUON = NorMuon()
