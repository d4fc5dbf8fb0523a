"""The step program: one plan's schedule bound to tensors on this rank.

A ``StepProgram`` holds everything a step of one plan needs on this rank, as parts that each
know their own few foreach ops (``Copies``, ``Batch``, ``Updates``, ``Stage``, one
``BucketProgram`` per bucket), and the verdict and commits around the carrier of the flags;
``dmuon_fsdp._step.binding`` binds it once per plan into the shared buffers
(``dmuon_fsdp._step.buffers``), and ``dmuon_fsdp._step.run`` runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from dmuon_fsdp._step import comm
from dmuon_fsdp._step.flags import (
    NONFINITE_SLOT,
    REDO_SLOT,
    Flags,
    StepKey,
    Verdict,
    decide,
    encode,
    nonfinite_indicator,
    tensor_flags,
)
from dmuon_fsdp._step.planner import Plan
from dmuon_fsdp._step.state import AdamWKernel, MuonStep, adamw, commit_momentum, local_shard, muon_input
from dmuon_fsdp.newton_schulz import Coefficients, Workspace, orthogonalize_

if TYPE_CHECKING:
    from dmuon_fsdp.config import Options


class Runnable(Protocol):
    """Work bound to a program's buffers, run as it is (a row variant's step after NS)."""

    def run(self) -> None: ...


class Phases(Protocol):
    """What times a program's phases (``run.StepStats``)."""

    def phase(self, name: str) -> AbstractContextManager[Any]: ...


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
    """``params -= lr * scale * directions`` on views of local shards, with param group
    ``group``'s lr of the step (``MuonStep``); ``directions`` are views of orthogonalized
    results, each row scaled by its number in ``row_scales`` (views shaped (rows, 1)) when given;
    ``entries``: the program entry each view is of. A view of a main weight ([Note: main weights]
    in ``dmuon_fsdp._step.state``) is rounded into its parameter's view after (``rounded``, of
    entries ``rounded_entries``). Rows of a parameter whose main weight its owner holds arrive
    as their new values (``NewMains``): ``values`` copies them into the parameter's view (and,
    on the owner, its new main weight into place), of entries ``value_entries``."""

    group: int
    scale: float
    params: list[Tensor]
    directions: list[Tensor]
    row_scales: list[Tensor] | None = None
    entries: list[int] = field(default_factory=list)
    rounded: Copies = field(default_factory=lambda: Copies([], []))
    rounded_entries: list[int] = field(default_factory=list)
    values: Copies = field(default_factory=lambda: Copies([], []))
    value_entries: list[int] = field(default_factory=list)

    @property
    def touched(self) -> set[int]:
        """The entries whose rows these updates write."""
        return {*self.entries, *self.value_entries}

    def without(self, entries: frozenset[int]) -> Updates:
        """These updates but those of ``entries`` (a relay's rows for parameters written since
        the step: ``dmuon_fsdp.forward``)."""
        keep = [i for i, e in enumerate(self.entries) if e not in entries]
        kept = [i for i, e in enumerate(self.rounded_entries) if e not in entries]
        copied = [i for i, e in enumerate(self.value_entries) if e not in entries]
        scales = self.row_scales
        return Updates(
            self.group,
            self.scale,
            [self.params[i] for i in keep],
            [self.directions[i] for i in keep],
            [scales[i] for i in keep] if scales is not None else None,
            [self.entries[i] for i in keep],
            Copies([self.rounded.dst[i] for i in kept], [self.rounded.src[i] for i in kept]),
            [self.rounded_entries[i] for i in kept],
            Copies([self.values.dst[i] for i in copied], [self.values.src[i] for i in copied]),
            [self.value_entries[i] for i in copied],
        )

    def apply(self, steps: Sequence[MuonStep | None]) -> None:
        self.values.run()
        if not self.params:  # (all of a relay's rows dropped, or all arrive as values)
            return
        step = steps[self.group]
        assert step is not None  # updates are of Muon groups
        alpha = step.alpha(self.scale)
        if isinstance(alpha, Tensor):  # a tensor lr, on the device: scaled there, never read
            scales = (
                [alpha] * len(self.params)
                if self.row_scales is None
                else torch._foreach_mul(self.row_scales, alpha)
            )
            torch._foreach_addcmul_(self.params, self.directions, scales)
        elif self.row_scales is None:
            torch._foreach_add_(self.params, self.directions, alpha=alpha)
        else:
            torch._foreach_addcmul_(self.params, self.directions, self.row_scales, value=alpha)
        self.rounded.run()


@dataclass(frozen=True)
class NewMains:
    """The new main weights of matrices owned here whose main weights are held here ([Note: main
    weights] in ``dmuon_fsdp._step.state``), made before the results are collected: float32
    scratch (``update.params``) takes the main weights (``take``), decayed and updated by the
    results (``update``), and the results take the scratch (``spread``), so that every holder
    receives the rows' new values instead of their directions. Nothing is committed: the main
    weights take the scratch with their bucket's ``Updates.values``, after the verdict."""

    take: Copies
    update: Updates
    spread: Copies

    def run(self, steps: Sequence[MuonStep | None]) -> None:
        step = steps[self.update.group]
        assert step is not None  # of Muon groups
        self.take.run()
        if step.weight_decay:
            torch._foreach_mul_(self.update.params, step.decay_factor())
        self.update.apply(steps)
        self.spread.run()


@dataclass(frozen=True)
class RelayProgram:
    """Relay ``index`` of a plan bound to its slot's buffers (relay g takes slot g % ``SLOTS``),
    in the order a step runs it once its bucket's way back arrived: ``keep`` copies the parts
    this rank relays (and their rows' numbers) out of the results, ``pack`` fills the send
    buffer with them, once per twin, ``exchange`` carries them to the twins in other replicas,
    ``writes`` and ``updates`` apply what it brought ([Note: the relay] in
    ``dmuon_fsdp._step.relay``). A relay left to the next forward has buffers of its own, whose
    send buffer its buckets' ``BucketProgram.keep`` fill (its ``keep`` and ``pack`` are empty).
    ``entries``: the program entries whose rows it brings to this rank."""

    index: int
    keep: Copies  # this rank's parts, from its bucket's results (a relay in the step)
    pack: Copies
    exchange: comm.Exchange | None
    updates: tuple[Updates, ...]
    writes: Copies
    entries: tuple[int, ...] = ()


@dataclass(frozen=True)
class BucketProgram:
    """One bucket bound to its slot's buffers (see ``dmuon_fsdp._step.buffers``), in the order a step
    runs it: ``stage`` makes its NS inputs, ``to_owners`` carries them, ``assemble`` stacks what
    arrived, ``batches`` orthogonalize (then ``after_ns`` and ``new_mains`` run), ``collect``
    fills the way back, ``from_owners`` returns the results, ``writes`` and ``updates`` apply
    them, and the bucket's ``relays`` carry the rest to the replicas outside each owner's."""

    reads: tuple[int, ...]  # the step's gradients (indices) its NS inputs are made from, here
    needs: tuple[int, ...]  # those of every parameter with a matrix in it, on any rank
    stage: Stage
    to_owners: comm.Exchange | None
    assemble: Copies  # received pieces (and own ones, when staged) into the stacks
    batches: tuple[Batch, ...]
    after_ns: tuple[Runnable, ...]  # work on the owned matrices after their NS (a row variant's)
    new_mains: tuple[NewMains, ...]  # then the owned matrices' main weights held here, into the results
    collect: Copies  # results into the return buffer (and own ones into the way back's arena)
    from_owners: comm.Exchange | None
    updates: tuple[Updates, ...]
    writes: Copies  # numbers returned with the results into place (after the verdict)
    keep: Copies  # its parts of the relays left to the forward (and rows' numbers), into their send buffers
    relays: tuple[RelayProgram, ...]


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
    math_dtype: torch.dtype | None  # lerp's for the buffers (``state.lerp_math_dtype``), planned once


@dataclass(frozen=True)
class Stage:
    """A bucket's NS inputs: written straight where they travel (a parameter whose shard is one
    piece sent whole), or made whole in scratch copies that ``spread`` copies into place (with
    the numbers that travel with the pieces)."""

    inputs: tuple[NSInputs, ...]
    spread: Copies

    def run(self, grads: list[Tensor], steps: Sequence[MuonStep | None]) -> None:
        """Write the inputs; the momentum buffers are only read (``commit`` updates them after
        the verdict)."""
        for inputs in self.inputs:
            step = steps[inputs.group]
            assert step is not None  # NS inputs are of Muon groups
            mine = [grads[i] for i in inputs.grads]
            muon_input(
                inputs.destinations,
                inputs.buffers,
                mine,
                step.momentum,
                step.nesterov,
                inputs.in_place,
                inputs.math_dtype,
            )
        self.spread.run()


@dataclass(frozen=True)
class MuonLists:
    """One Muon param group's tensors, those with main weights apart (two lists of the group:
    ``params`` are then the main weights, whose gradients are of another dtype than their
    momentum); ``grads`` index the step's local gradients."""

    group: int
    grads: tuple[int, ...]
    params: list[Tensor]
    buffers: list[Tensor]


@dataclass(frozen=True)
class AdamWLists:
    """One AdamW param group's tensors (those with main weights apart: ``params`` are then the
    main weights, the last ones, which take their gradients through float32 scratch,
    ``grads32``, and are rounded into the parameters after, ``rounded``)."""

    group: int
    grads: tuple[int, ...]
    params: list[Tensor]
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    steps: list[Tensor]
    kernel: AdamWKernel
    grads32: list[Tensor] = field(default_factory=list)
    rounded: Copies = field(default_factory=lambda: Copies([], []))


@dataclass(frozen=True)
class StepProgram:
    """Everything a step of one plan needs on this rank. ``entries`` are the parameters with a
    gradient (in optimizer order); ``key`` is the step it was built for. ``carrier``: the bucket
    whose exchange to owners carries the check flags (see [Note: the bucket loop]);
    ``generation``: the pool's when bound (a grown pool makes the program stale)."""

    key: StepKey
    plan: Plan
    entries: tuple[Entry, ...]
    storage: tuple[int, ...]  # data_ptr of each entry's local shard when bound
    state_slots: tuple[tuple[Tensor, str, Tensor], ...]  # (parameter, state key, the tensor bound)
    grad_shapes: list[torch.Size]
    grad_dtypes: list[torch.dtype]  # a gradient must have its parameter's dtype
    device: torch.device
    checked: tuple[tuple[int, ...], ...]  # the gradients the non-finite check reads (``nonfinite_groups``)
    muon: tuple[MuonLists, ...]
    adamw: tuple[AdamWLists, ...]
    buckets: tuple[BucketProgram, ...]
    relays: tuple[RelayProgram, ...]  # every bucket's, in order (``BucketProgram.relays``)
    relays_before: tuple[int, ...]  # per bucket, the relays of the buckets before it (and in all)
    relays_of: dict[Tensor, tuple[int, ...]]  # the relays bringing this rank rows of each parameter
    flags: Flags | None
    carrier: int
    counts: dict[str, int]  # what every step of this program does: ``StepStats`` fields
    generation: int

    def fits(self, i: int, grad: Tensor) -> bool:
        """Whether a gradient shard can be entry ``i``'s: dense, and shaped and typed as when bound."""
        return (
            grad.layout == torch.strided
            and grad.shape == self.grad_shapes[i]
            and grad.dtype == self.grad_dtypes[i]
        )

    def local_grads(self, grads: Sequence[Tensor | None]) -> list[Tensor] | None:
        """This rank's gradient shards in entry order, or None when one does not ``fit``
        (``grads`` holds every optimizer parameter's ``.grad``)."""
        local = []
        for e in self.entries:
            grad = grads[e.position]
            assert grad is not None  # callers check the step's key: its entries are those with a gradient
            local.append(local_shard(grad))
        return local if all(self.fits(i, g) for i, g in enumerate(local)) else None

    def moved(self, params: Sequence[Tensor], state: Any) -> bool:
        """Whether a parameter's local storage (``p.data = ...``) or one of its state tensors
        (``opt.state[p][key] = ...``) was replaced since binding."""
        if [local_shard(params[e.position]).data_ptr() for e in self.entries] != list(self.storage):
            return True
        return any(state.get(p, _NONE).get(key) is not bound for p, key, bound in self.state_slots)

    def write_flags(
        self,
        key: StepKey,
        hyper: int,
        tensors: list[Tensor],
        local: list[Tensor] | None,
        nonfinite: str,
        redo: bool = False,
        changed: Tensor | None = None,
    ) -> Tensor | None:
        """This rank's check flags into every segment of the exchange carrying them (device ops
        only): those of its key and per-step options (``hyper``; those given as ``tensors``, on
        the device), marked invalid when a gradient is, and to redo when this rank's gradients
        changed after their work began (``redo``, known on the host, or else ``changed``, a (1,)
        indicator on the device). Returns the non-finite indicator when that check is on."""
        indicator = None
        if nonfinite != "ignore" and local is not None:
            indicator = nonfinite_indicator([[local[i] for i in g] for g in self.checked], self.device)
        if self.flags is not None:
            exchange = self.buckets[self.carrier].to_owners
            assert exchange is not None  # the flags are bound into the carrier's exchange to owners
            send = exchange.send
            if local is None or key != self.key or redo:
                invalid = key == self.key and local is None
                found = encode(key.digest ^ hyper, invalid=invalid, redo=redo)
                values = torch.tensor(found, dtype=send.dtype, device=send.device)
            else:
                values = self.flags.values_for(key.digest ^ hyper)
            send.index_put_((self.flags.send,), values)
            if indicator is not None:
                send.index_put_((self.flags.nonfinite,), indicator.to(send.dtype))
            if changed is not None:
                send.index_put_((self.flags.redo,), changed.to(send.dtype))
            if tensors:
                send.index_put_((self.flags.tensors,), tensor_flags(tensors, send.dtype, send.device))
        return indicator

    def verdict(
        self,
        carrier: comm.Handle | None,
        expected: int,
        local: list[Tensor] | None,
        indicator: Tensor | None,
        options: Options,
        stats: Phases,
        redo: bool = False,
        changed: Tensor | None = None,
    ) -> Verdict:
        """The verdict, the same on every rank, from at most one device-to-host read: the
        maximum of every rank's flags (from the exchange carrying them, ``carrier``) or,
        without flags, this rank's own findings; ``expected``: the digest every rank sends when
        all step this program with the same per-step options."""
        if self.flags is not None:
            with stats.phase("wait"):
                received = comm.wait(carrier)
                assert received is not None  # the carrier's exchange holds the flags: it was launched
                summary = received[self.flags.receive].amax(0).tolist()
        else:
            summary = encode(expected, invalid=local is None, redo=redo)
            if indicator is not None and changed is not None:  # one read for both
                both = torch.cat([indicator, changed]).tolist()
                summary[NONFINITE_SLOT], summary[REDO_SLOT] = both
            elif indicator is not None:
                summary[NONFINITE_SLOT] = indicator.item()
            elif changed is not None:
                summary[REDO_SLOT] = changed.item()
        return decide(summary, expected, options.nonfinite, options.check_grads)

    def decay(self, steps: Sequence[MuonStep | None], stats: Phases) -> None:
        """Decoupled weight decay of the Muon parameters, after a ``GO`` and before any update."""
        with stats.phase("commit"):
            for lists in self.muon:
                step = steps[lists.group]
                assert step is not None  # these are Muon groups
                if step.weight_decay and lists.params:
                    torch._foreach_mul_(lists.params, step.decay_factor())

    def adamw_step(self, grads: list[Tensor], groups: Sequence[dict[str, Any]], stats: Phases) -> None:
        with stats.phase("adamw"):
            for lists in self.adamw:
                mine = [grads[i] for i in lists.grads]
                if lists.grads32:  # (the last ones: those of main weights, in float32)
                    first = len(mine) - len(lists.grads32)
                    torch._foreach_copy_(lists.grads32, mine[first:])
                    mine = mine[:first] + lists.grads32
                adamw(
                    lists.params,
                    mine,
                    lists.exp_avgs,
                    lists.exp_avg_sqs,
                    lists.steps,
                    groups[lists.group],
                    lists.kernel,
                )
                lists.rounded.run()

    def commit_momentum(self, grads: list[Tensor], steps: Sequence[MuonStep | None], stats: Phases) -> None:
        """The momentum buffers, once every bucket's NS inputs were made from them."""
        with stats.phase("commit"):
            for lists in self.muon:
                step = steps[lists.group]
                assert step is not None  # these are Muon groups
                commit_momentum(lists.buffers, [grads[i] for i in lists.grads], step.momentum)


_NONE: dict = {}  # the state of a parameter whose state was removed (``moved`` reports it)
