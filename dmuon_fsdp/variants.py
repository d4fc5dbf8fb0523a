"""Muon's variants by the name the ``variant`` option takes, and the one interface a variant
plugs into the step program through: ``RowVariant``.

[Note: row variants] A row variant keeps one float32 number of state per row of each Muon matrix
(its *row state*, held like the parameter's rows: ``row_state_like``) and, on the matrix's
owner, which holds the whole orthogonalized matrix, turns that matrix and its rows' state into
new state and one *row factor* per row that scales the row's update. That is all the step
program knows of a variant: the holders send their rows' state with their pieces and get the
new state and the factors back with the results (``exchange.PerRow``), the owner runs the
variant's ``RowStep`` after the bucket's Newton-Schulz, and the factors scale the update
(``program.Updates``). A variant adds its options to every Muon group (``options``, part of the
program's key) and names its state entry (``state_key``); a variant's settings become part of
each matrix's NS form, so matrices are batched apart from those with other settings.
Non-goals: element-wise or column state, variants that change the Newton-Schulz iteration.
NorMuon (``dmuon_fsdp.normuon``) is one; plain Muon is none (``VARIANTS["muon"]`` is None).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from dmuon_fsdp.normuon import NORMUON


@dataclass(frozen=True)
class RowBatch:
    """Owned matrices of one Newton-Schulz batch whose group has a row variant: the batch's
    (B, s, l) stack after NS (wide matrices first as they are, then tall ones transposed), each
    matrix's (rows, cols) in stack order, and the variant's settings for their group."""

    stack: Tensor
    shapes: dict[int, tuple[int, int]]
    settings: tuple[float, ...]


class RowStep(Protocol):
    """A row variant bound to one bucket's owned matrices. ``state`` and ``factors``: one float32
    view of ``rows`` numbers per matrix, in the order of the batches it was bound to and their
    ``shapes``; the program fills ``state`` with the rows' state before ``run`` and reads the
    new state from it, and the factors from ``factors``, after. ``run`` writes only into its own
    views (the program writes the new state into the optimizer's after the step's verdict)."""

    @property
    def state(self) -> list[Tensor]: ...

    @property
    def factors(self) -> list[Tensor]: ...

    def run(self) -> None: ...


class RowVariant(Protocol):
    """What the program asks of a row variant (see [Note: row variants])."""

    @property
    def name(self) -> str: ...  # the ``variant`` option's value

    @property
    def state_key(self) -> str: ...  # its row state's entry in a parameter's optimizer state

    @property
    def options(self) -> tuple[str, ...]: ...  # its options in every Muon group

    def check(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the option when one of ``options`` is out of range."""
        ...

    def settings(self, group: dict[str, Any]) -> tuple[float, ...]:
        """What its math reads from a group's options."""
        ...

    def bind(
        self, batches: Sequence[RowBatch], ns_dtype: torch.dtype, take: Callable[[int, torch.dtype], Tensor]
    ) -> RowStep | None:
        """Its step on ``batches``, with buffers from ``take(numel, dtype)``; None when there are
        none."""
        ...


VARIANTS: dict[str, RowVariant | None] = {"muon": None, NORMUON.name: NORMUON}


def row_state_keys() -> frozenset[str]:
    """The state keys of every row variant's row state."""
    return frozenset(v.state_key for v in VARIANTS.values() if v is not None)


def row_variant(group: dict[str, Any]) -> RowVariant | None:
    """The row variant of a Muon group, or None for plain Muon."""
    return VARIANTS[group["variant"]]


def row_dims(param: Tensor, flatten: bool) -> int:
    """How many leading dims of ``param`` index its matrices' rows: 1, or 2 for a stack of
    matrices (``flatten=False``, ndim > 2)."""
    return 2 if not flatten and param.ndim > 2 else 1


def row_shape(param: Tensor, flatten: bool) -> tuple[int, ...]:
    """The shape of ``param``'s row state: its leading (row) dims."""
    return tuple(param.shape[: row_dims(param, flatten)])


def row_state_like(param: Tensor, flatten: bool) -> Tensor:
    """Float32 zeros with one number per matrix row of ``param``, placed like those rows: a
    DTensor sharded as the parameter's leading dims and replicated on mesh dims that cut only
    its columns (or replicate it), a plain tensor for a plain parameter."""
    dims = row_dims(param, flatten)
    shape = row_shape(param, flatten)
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
