"""The one interface a variant of Muon plugs into the step program through: ``RowVariant``.

[Note: row variants] A row variant keeps one float32 number of state per row of each Muon matrix
(its *row state*, held like the parameter's rows: ``row_state_like``) and, on the matrix's
owner, which holds the whole orthogonalized matrix, turns that matrix and its rows' state into
new state and one *row factor* per row that scales the row's update. That is all the step
program knows of a variant: the holders send their rows' state with their pieces and get the
new state and the factors back with the results (``exchange.PerRow``), the owner runs the
variant's ``RowStep`` after the bucket's Newton-Schulz, and the factors scale the update
(``program.Updates``). A variant's options must be in every Muon group (``DMuonFSDP``'s
arguments and defaults): each is checked in every Muon group, whatever its variant, and is part
of the step key (``config.structural_options``); its settings become part of each matrix's NS
form, so matrices are batched apart from those with other settings. Its state entry
(``state_key``) must not be one of Muon's or AdamW's.
Non-goals: element-wise or column state, variants that change the Newton-Schulz iteration.
NorMuon (``dmuon_fsdp.normuon``) is one; plain Muon is none. The registry by name is
``dmuon_fsdp.config.VARIANTS``.
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


@dataclass(frozen=True)
class RowBatch:
    """Owned matrices of one Newton-Schulz batch whose group has a row variant: the batch's
    (B, s, l) stack, holding after NS the orthogonalized matrices (wide ones, rows <= cols, first
    as they are, then tall ones transposed), each matrix's (rows, cols) in the parameter's
    orientation, in stack order, and the variant's settings for their group."""

    stack: Tensor
    shapes: dict[int, tuple[int, int]]
    settings: tuple[Any, ...]

    def matrices(self) -> list[Tensor]:
        """Each matrix as a (rows, cols) view of the stack, in stack order."""
        return [
            self.stack[b].mT if rows > cols else self.stack[b]
            for b, (rows, cols) in enumerate(self.shapes.values())
        ]


class RowStep(Protocol):
    """A row variant bound to one bucket's owned matrices. ``state`` and ``factors``: per matrix,
    a contiguous 1-D float32 view with one number per row, in the order of the batches it was
    bound to and their ``shapes``; the program fills ``state`` with the rows' state before
    ``run`` and reads the new state from it, and the factors from ``factors``, after. ``run``
    writes every factor (buffers are reused step after step) and only into its own views (the
    program writes the new state into the optimizer's after the step's verdict)."""

    @property
    def state(self) -> list[Tensor]: ...

    @property
    def factors(self) -> list[Tensor]: ...

    def run(self) -> None: ...


class RowVariant(Protocol):
    """What the program asks of a row variant (see [Note: row variants]); a hashable record (it
    is part of each matrix's NS form)."""

    @property
    def name(self) -> str: ...  # the ``variant`` option's value

    @property
    def state_key(self) -> str: ...  # its row state's entry in a parameter's optimizer state

    @property
    def options(self) -> tuple[str, ...]: ...  # its options in every Muon group

    def check(self, group: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the option when one of ``options`` is out of range."""
        ...

    def settings(self, group: dict[str, Any]) -> tuple[Any, ...]:
        """What its math reads from a group's options (hashable values)."""
        ...

    def bind(
        self, batches: Sequence[RowBatch], ns_dtype: torch.dtype, take: Callable[[int, torch.dtype], Tensor]
    ) -> RowStep | None:
        """Its step on ``batches``, with buffers from ``take(numel, dtype)``, or None when they
        hold no rows. It only makes views: it writes nothing (an exchange of the buffers' last use
        may be in flight) and reads nothing (when the program is only measured, ``take`` and
        the stacks give meta tensors)."""
        ...


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
