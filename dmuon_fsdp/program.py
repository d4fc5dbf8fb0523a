"""The step program: one plan's schedule bound to tensors, with every buffer and view made once.

A program is built (``dmuon_fsdp.binding``) when the plan changes or the tensors it points into
are replaced, never per step. A steady-state step then dispatches a fixed number of ops per
param group, bucket and NS batch, whatever the number of parameters or ranks: momentum as
foreach ops writing what each matrix orthogonalizes straight into the send buffers and local
stacks; per bucket one foreach copy assembling received pieces into (B, s, l) stacks (tall
matrices transposed), in-place Newton-Schulz on each stack, one foreach copy into the return
buffer; one foreach add per step size. Runtime only: what moves where is ``schedule``'s, when
each phase runs is the optimizer's ``step``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dmuon_fsdp import elementwise
from dmuon_fsdp.layouts import local_shard
from dmuon_fsdp.newton_schulz import Coefficients, Workspace, orthogonalize_
from dmuon_fsdp.planner import Plan
from dmuon_fsdp.schedule import RankSchedule


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

    def run(self) -> None:
        if self.dst:
            torch._foreach_copy_(self.dst, self.src)


@dataclass(frozen=True)
class Exchange:
    """The buffers and split sizes (process-group order) of one all-to-all."""

    send: Tensor
    receive: Tensor
    send_counts: list[int]
    receive_counts: list[int]


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
    """p -= lr * scale * O on these pieces, lr read from param group ``group`` at each step."""

    group: int
    scale: float
    targets: list[Tensor]
    updates: list[Tensor]


@dataclass(frozen=True)
class BucketProgram:
    gather: Exchange | None
    assemble: Copies
    batches: tuple[Batch, ...]
    results: Copies  # stacks into the return buffer (and the local staging)
    scatter: Exchange | None
    updates: tuple[Updates, ...]


@dataclass(frozen=True)
class MomentumInput:
    """Where what some matrices orthogonalize is written: their send-buffer or stack views
    themselves (shaped like the local shards), or scratch copies that ``pack`` spreads."""

    grads: tuple[int, ...]
    buffers: list[Tensor]
    dst: list[Tensor]
    in_place: bool  # dst has the buffers' dtype: compute in it


@dataclass(frozen=True)
class MuonLists:
    """One Muon param group's tensors; ``grads`` index the step's local gradients."""

    group: int
    grads: tuple[int, ...]
    params: list[Tensor]
    buffers: list[Tensor]
    inputs: tuple[MomentumInput, ...]


@dataclass(frozen=True)
class AdamWLists:
    group: int
    grads: tuple[int, ...]
    params: list[Tensor]
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    steps: list[Tensor]
    kernel: dict[str, bool]


@dataclass(frozen=True)
class Flags:
    """Where the check flags sit in the first exchange's buffers: (peers, FLAG_ELEMENTS)."""

    send: Tensor
    receive: Tensor
    nonfinite: Tensor  # the non-finite slot of each send segment: (peers,)
    values: Tensor  # this rank's flags when nothing is wrong here, comm dtype, on the device


@dataclass(frozen=True)
class StepProgram:
    """Everything a step of one plan needs on this rank. ``entries`` are the parameters with a
    gradient (in optimizer order); ``key`` and ``digest`` identify the step shape it was built
    for (which parameters have gradients, the Muon groups' structural options)."""

    key: tuple
    digest: int
    plan: Plan
    schedule: RankSchedule
    entries: tuple[Entry, ...]
    storage: tuple[int, ...]  # data_ptr of each entry's local shard when bound
    state_slots: tuple[tuple[Tensor, str, Tensor], ...]  # (parameter, state key, the tensor bound)
    grad_shapes: list[torch.Size]
    found: Tensor  # (1,) float32: the non-finite check's result on the device
    one: Tensor  # 1.0, the check's scale
    muon: tuple[MuonLists, ...]
    adamw: tuple[AdamWLists, ...]
    pack: Copies
    buckets: tuple[BucketProgram, ...]
    flags: Flags | None
    all_updates: tuple[Updates, ...]  # every bucket's, merged by step size (applied once)
    counts: dict[str, int]  # what every step of this program does: ``StepStats`` fields


    def local_grads(self, grads: list[Tensor | None]) -> list[Tensor] | None:
        """This rank's gradient shards in entry order, or None when one is sparse or shaped
        unlike its parameter (``grads`` holds every optimizer parameter's ``.grad``)."""
        local = [local_shard(grads[e.position]) for e in self.entries]
        if [g.shape for g in local] != self.grad_shapes or any(g.layout != torch.strided for g in local):
            return None
        return local

    def moved(self, params: Sequence[Tensor], state: Any) -> bool:
        """Whether a parameter's local storage (``p.data = ...``) or one of its state tensors
        (``opt.state[p][key] = ...``) was replaced since binding."""
        if [local_shard(params[e.position]).data_ptr() for e in self.entries] != list(self.storage):
            return True
        return any(state[p][key] is not bound for p, key, bound in self.state_slots)

    def write_flags(self, values: Tensor | None, nonfinite: Tensor | None) -> None:
        """Check flags into every segment of the first exchange: all of them (``values``, one per
        flag) and/or the non-finite slot (a 0-d ``nonfinite_indicator``). Device ops only."""
        send = self.buckets[0].gather.send
        if values is not None:
            send.index_put_((self.flags.send,), values)
        if nonfinite is not None:
            send.index_put_((self.flags.nonfinite,), nonfinite.to(send.dtype))

    def flag_summary(self, receive: Tensor) -> list[float]:
        """The element-wise maximum of every rank's flags: the step's one device-to-host read."""
        return receive[self.flags.receive].amax(0).tolist()

    def momentum(self, grads: list[Tensor], groups: list[dict[str, Any]]) -> None:
        """What each matrix orthogonalizes, into send buffers and local stacks; state untouched."""
        for lists in self.muon:
            weight = elementwise.input_weight(groups[lists.group]["momentum"], groups[lists.group]["nesterov"])
            for source in lists.inputs:
                mine = [grads[i] for i in source.grads]
                elementwise.muon_input(source.dst, source.buffers, mine, weight, source.in_place)
        self.pack.run()

    def commit(self, grads: list[Tensor], groups: list[dict[str, Any]]) -> None:
        """Momentum buffers and decoupled weight decay: the state changes of the Muon step."""
        for lists in self.muon:
            group = groups[lists.group]
            torch._foreach_lerp_(lists.buffers, [grads[i] for i in lists.grads], 1.0 - group["momentum"])
            if group["weight_decay"]:
                torch._foreach_mul_(lists.params, 1.0 - float(group["lr"]) * group["weight_decay"])

    def adamw_step(self, grads: list[Tensor], groups: list[dict[str, Any]]) -> None:
        for lists in self.adamw:
            mine = [grads[i] for i in lists.grads]
            elementwise.adamw(lists.params, mine, lists.exp_avgs, lists.exp_avg_sqs, lists.steps,
                              groups[lists.group], lists.kernel)  # fmt: skip


def apply(updates: Sequence[Updates], groups: list[dict[str, Any]]) -> None:
    for u in updates:
        torch._foreach_add_(u.targets, u.updates, alpha=-float(groups[u.group]["lr"]) * u.scale)
