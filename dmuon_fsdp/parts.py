"""The parts a step program is bound from (``dmuon_fsdp.bind``) and runs
(``dmuon_fsdp.program``): pairs of views copied at once, NS batches, the updates, a bucket's
exchanges and stacks, where NS inputs are written, each param group's tensors. Each part knows
its own few foreach ops."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dmuon_fsdp import comm, elementwise
from dmuon_fsdp.neurons import NeuronNorm
from dmuon_fsdp.newton_schulz import Coefficients, Workspace, orthogonalize_


@dataclass(frozen=True)
class Entry:
    """A parameter with a gradient this step: its index in the optimizer's flat parameter list
    (where its gradient is read) and its param group."""

    position: int
    group: int
    param: Tensor


@dataclass(frozen=True)
class Copies:
    """Pairs of views copied by one ``_foreach_copy_`` (dtype conversion included)."""

    dst: list[Tensor]
    src: list[Tensor]

    def add(self, dst: Tensor, src: Tensor) -> None:
        self.dst.append(dst)
        self.src.append(src)

    def run(self) -> None:
        if self.dst:
            torch._foreach_copy_(self.dst, self.src)


@dataclass(frozen=True)
class NSForm:
    """How one matrix is orthogonalized: its group's NS settings and the form for its shape;
    ``neurons``: NorMuon's (beta2, eps) when its group's variant is NorMuon."""

    coefficients: tuple[Coefficients, ...]
    eps: float
    segments: tuple[int, ...]
    neurons: tuple[float, float] | None = None


@dataclass(frozen=True)
class Batch:
    """Matrices of one shape and NS settings (coefficients, eps, form), stacked (B, s, l) and
    orthogonalized in place."""

    stack: Tensor
    coefficients: tuple[Coefficients, ...]
    eps: float
    segments: tuple[int, ...]
    work: Workspace

    def orthogonalize(self) -> None:
        orthogonalize_(self.stack, self.coefficients, self.eps, self.work, self.segments)


@dataclass(frozen=True)
class Updates:
    """``params -= lr * scale * directions`` on views of local shards, ``lr`` read from param
    group ``group`` at each step; ``directions`` are views of orthogonalized results, scaled row
    by row by ``factors`` (views shaped (rows, 1)) for NorMuon's groups."""

    group: int
    scale: float
    params: list[Tensor]
    directions: list[Tensor]
    factors: list[Tensor] | None = None

    def apply(self, groups: Sequence[dict[str, Any]]) -> None:
        alpha = -float(groups[self.group]["lr"]) * self.scale
        if self.factors is None:
            torch._foreach_add_(self.params, self.directions, alpha=alpha)
        else:
            torch._foreach_addcmul_(self.params, self.directions, self.factors, value=alpha)


@dataclass(frozen=True)
class BucketProgram:
    """One bucket bound to its slot's buffers (see ``dmuon_fsdp.buffers``), in the order a step
    runs it: ``stage`` makes its NS inputs, ``to_owners`` carries them, ``assemble`` stacks what
    arrived, ``batches`` (and ``neurons``) orthogonalize, ``collect`` fills the way back,
    ``from_owners`` returns the results, ``updates`` and ``writes`` apply them."""

    reads: tuple[int, ...]  # the step's gradients (indices) its NS inputs are made from, here
    needs: tuple[int, ...]  # those of every parameter with a matrix in it, on any rank
    stage: Stage
    to_owners: comm.Exchange | None
    assemble: Copies  # received pieces (and own ones, when staged) into the stacks
    batches: tuple[Batch, ...]
    neurons: NeuronNorm | None  # NorMuon on the owned matrices of NorMuon's groups
    collect: Copies  # results into the return buffer (and own ones into the way back's arena)
    from_owners: comm.Exchange | None
    updates: tuple[Updates, ...]
    writes: Copies  # NorMuon's new second moments into the holders' state


@dataclass(frozen=True)
class NSInputs:
    """Where some matrices' Newton-Schulz inputs are written: their send-buffer or stack views
    themselves (shaped like the local shards), or scratch copies of the shards that
    their ``Stage`` spreads into place. ``grads`` index the step's local gradients; ``group``
    is the param group whose momentum and nesterov apply."""

    group: int
    grads: tuple[int, ...]
    buffers: list[Tensor]  # momentum buffers, read
    destinations: list[Tensor]
    in_place: bool  # destinations have the buffers' dtype: compute in them


@dataclass(frozen=True)
class Stage:
    """A bucket's NS inputs: written straight where they travel (a parameter whose shard is one
    piece sent whole), or made whole in scratch copies that ``spread`` copies into place (with
    NorMuon's second moments of the rows that travel)."""

    inputs: tuple[NSInputs, ...]
    spread: Copies

    def run(self, grads: list[Tensor], groups: Sequence[dict[str, Any]]) -> None:
        """Write the inputs; the momentum buffers are only read (``commit`` updates them after
        the verdict)."""
        for inputs in self.inputs:
            group = groups[inputs.group]
            weight = elementwise.input_weight(group["momentum"], group["nesterov"])
            mine = [grads[i] for i in inputs.grads]
            elementwise.muon_input(inputs.destinations, inputs.buffers, mine, weight, inputs.in_place)
        self.spread.run()


@dataclass(frozen=True)
class MuonLists:
    """One Muon param group's tensors; ``grads`` index the step's local gradients."""

    group: int
    grads: tuple[int, ...]
    params: list[Tensor]
    buffers: list[Tensor]


@dataclass(frozen=True)
class AdamWLists:
    group: int
    grads: tuple[int, ...]
    params: list[Tensor]
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    steps: list[Tensor]
    kernel: dict[str, bool]
