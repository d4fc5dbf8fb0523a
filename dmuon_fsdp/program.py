"""The step program and its run: one plan's schedule bound to tensors, executed bucket by bucket.

A ``StepProgram`` holds everything a step of one plan needs on this rank, as parts that each
know their own few foreach ops (``Copies``, ``Batch``, ``Updates``, ``Stage``, one
``BucketProgram`` per bucket); ``dmuon_fsdp.binding`` binds it once per plan into the shared
buffers (``dmuon_fsdp.exchange``). ``StepRun`` executes a step with it, top to bottom, in these
phases (the names ``StepStats`` and a profiler trace use):

- ``momentum``: a bucket's NS inputs, written straight into its send buffer and own stacks
  (foreach ops; the momentum buffers are only read), and this rank's check flags into the
  exchange that carries them;
- ``wait``: blocked on an all-to-all; the one carrying the flags brings every rank's, read once
  into the verdict (``dmuon_fsdp.checks``), before anything is committed;
- ``commit``: weight decay after the verdict, the momentum buffers at the end; ``adamw``:
  torch's functional AdamW;
- per bucket, ``assemble`` (received pieces into (B, s, l) stacks), ``newton_schulz`` (in place
  per stack) and ``return`` (results into the return buffer, the exchange back launched);
- ``apply``: p -= lr * scale * O, one foreach add per bucket and step size.

[Note: the bucket loop] Every step, plain or begun in backward, runs ``StepRun.run``: for each
bucket k in order, launch the exchanges to the owners through bucket k + 1 (with ``overlap``;
else k), and at least through the carrier of the flags; wait for bucket k's pieces; at the
carrier, read the verdict and commit weight decay and AdamW; apply bucket k - 2 (its way back
shares bucket k's slot, see [Note: slots]); assemble, orthogonalize and launch the way back.
Bucket k + 2 takes bucket k's way to the owners only after bucket k's results were collected,
and bucket k's way back is applied before bucket k + 2 is orthogonalized; so ``SLOTS`` sets of
buffers serve every bucket. The carrier is bucket 0, or for steps begun in backward the first
bucket launched at ``step`` (``RankSchedule.carrier``): gradients' hooks launch the buckets
before it, which the loop then finds launched. Exchanges are issued in the same order on every
rank: to the owners 0, 1, back 0, to 2, back 1, ... A steady-state step dispatches a fixed
number of ops per param group, bucket and NS batch, whatever the number of parameters or ranks.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.autograd.profiler as autograd_profiler
from torch import Tensor

from dmuon_fsdp import comm
from dmuon_fsdp.checks import (
    NONFINITE_SLOT,
    REDO_SLOT,
    Flags,
    StepKey,
    Verdict,
    agreed,
    decide,
    encode,
    hyper_digest,
    nonfinite_indicator,
    tensor_flags,
    tensor_options,
)
from dmuon_fsdp.exchange import SLOTS
from dmuon_fsdp.newton_schulz import Coefficients, Workspace, orthogonalize_
from dmuon_fsdp.planner import Plan
from dmuon_fsdp.state import AdamWKernel, MuonStep, adamw, local_shard, muon_input, muon_steps

if TYPE_CHECKING:
    from dmuon_fsdp.config import Options
    from dmuon_fsdp.variants import RowStep, RowVariant


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
    ``variant``: its group's row variant and the ``settings`` it reads (see [Note: row
    variants] in ``dmuon_fsdp.variants``)."""

    coefficients: tuple[Coefficients, ...]
    eps: float
    segments: tuple[int, ...]
    variant: RowVariant | None = None
    settings: tuple[float, ...] = ()


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
    ``group``'s lr of the step (``MuonStep``); ``directions`` are views of orthogonalized results, scaled row
    by row by ``factors`` (views shaped (rows, 1)) in groups with a row variant."""

    group: int
    scale: float
    params: list[Tensor]
    directions: list[Tensor]
    factors: list[Tensor] | None = None

    def apply(self, steps: Sequence[MuonStep | None]) -> None:
        step = steps[self.group]
        assert step is not None  # updates are of Muon groups
        alpha = step.alpha(self.scale)
        if isinstance(alpha, Tensor):  # a tensor lr, on the device: scaled there, never read
            scales = (
                [alpha] * len(self.params)
                if self.factors is None
                else torch._foreach_mul(self.factors, alpha)
            )
            torch._foreach_addcmul_(self.params, self.directions, scales)
        elif self.factors is None:
            torch._foreach_add_(self.params, self.directions, alpha=alpha)
        else:
            torch._foreach_addcmul_(self.params, self.directions, self.factors, value=alpha)


@dataclass(frozen=True)
class BucketProgram:
    """One bucket bound to its slot's buffers (see ``dmuon_fsdp.exchange``), in the order a step
    runs it: ``stage`` makes its NS inputs, ``to_owners`` carries them, ``assemble`` stacks what
    arrived, ``batches`` orthogonalize (and ``row_steps`` run the row variants), ``collect``
    fills the way back, ``from_owners`` returns the results, ``updates`` and ``writes`` apply
    them."""

    reads: tuple[int, ...]  # the step's gradients (indices) its NS inputs are made from, here
    needs: tuple[int, ...]  # those of every parameter with a matrix in it, on any rank
    stage: Stage
    to_owners: comm.Exchange | None
    assemble: Copies  # received pieces (and own ones, when staged) into the stacks
    batches: tuple[Batch, ...]
    row_steps: tuple[RowStep, ...]  # row variants on the owned matrices of their groups, after NS
    collect: Copies  # results into the return buffer (and own ones into the way back's arena)
    from_owners: comm.Exchange | None
    updates: tuple[Updates, ...]
    writes: Copies  # a row variant's new row state into the holders' state, row factors out


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
    a row variant's state of the rows that travel)."""

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
    kernel: AdamWKernel


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
    flags: Flags | None
    carrier: int
    counts: dict[str, int]  # what every step of this program does: ``StepStats`` fields
    generation: int

    def local_grads(self, grads: Sequence[Tensor | None]) -> list[Tensor] | None:
        """This rank's gradient shards in entry order, or None when one is sparse or shaped or
        typed unlike its parameter (``grads`` holds every optimizer parameter's ``.grad``)."""
        local = []
        for e in self.entries:
            grad = grads[e.position]
            assert grad is not None  # callers check the step's key: its entries are those with a gradient
            local.append(local_shard(grad))
        if [g.shape for g in local] != self.grad_shapes or [g.dtype for g in local] != self.grad_dtypes:
            return None
        return None if any(g.layout != torch.strided for g in local) else local

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
        stats: StepStats,
        redo: bool = False,
        changed: Tensor | None = None,
    ) -> Verdict:
        """The verdict, the same on every rank, from at most one device-to-host read: the
        maximum of every rank's flags (from the exchange carrying them, ``carrier``) or,
        without flags, this rank's own findings; ``expected``: the digest every rank sends when
        all step this program with the same per-step options."""
        if self.flags is not None:
            with stats.phase("wait"):
                received = wait(carrier)
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

    def decay(self, steps: Sequence[MuonStep | None], stats: StepStats) -> None:
        """Decoupled weight decay of the Muon parameters, after a ``GO`` and before any update."""
        with stats.phase("commit"):
            for lists in self.muon:
                step = steps[lists.group]
                assert step is not None  # these are Muon groups
                if step.weight_decay:
                    torch._foreach_mul_(lists.params, step.decay_factor())

    def adamw_step(self, grads: list[Tensor], groups: Sequence[dict[str, Any]], stats: StepStats) -> None:
        with stats.phase("adamw"):
            for lists in self.adamw:
                mine = [grads[i] for i in lists.grads]
                adamw(
                    lists.params,
                    mine,
                    lists.exp_avgs,
                    lists.exp_avg_sqs,
                    lists.steps,
                    groups[lists.group],
                    lists.kernel,
                )

    def commit_momentum(
        self, grads: list[Tensor], steps: Sequence[MuonStep | None], stats: StepStats
    ) -> None:
        """The momentum buffers, once every bucket's NS inputs were made from them."""
        with stats.phase("commit"):
            for lists in self.muon:
                step = steps[lists.group]
                assert step is not None  # these are Muon groups
                torch._foreach_lerp_(lists.buffers, [grads[i] for i in lists.grads], 1.0 - step.momentum)


_NONE: dict = {}  # the state of a parameter whose state was removed (``moved`` reports it)


def wait(handle: comm.Handle | None) -> Tensor | None:
    return handle.wait() if handle is not None else None


@dataclass
class StepRun:
    """One step of ``program`` under way: which buckets' exchanges to the owners are launched,
    and the exchanges in flight (see [Note: the bucket loop])."""

    program: StepProgram
    stats: StepStats
    launched: int = 0
    to_owners: dict[int, comm.Handle | None] = field(default_factory=dict)
    from_owners: dict[int, comm.Handle | None] = field(default_factory=dict)

    def start(self, k: int, grads: list[Tensor] | None, steps: Sequence[MuonStep | None] = ()) -> None:
        """Make bucket ``k``'s NS inputs from ``grads`` (entry order) with the groups' ``steps``
        (None: none, its results will not be used) and launch its exchange to the owners;
        buckets start in order."""
        if k != self.launched:
            raise RuntimeError(f"bucket {k} started after {self.launched} of {len(self.program.buckets)}")
        if grads is not None:
            self.program.buckets[k].stage.run(grads, steps)
        exchange = self.program.buckets[k].to_owners
        self.to_owners[k] = comm.launch(exchange) if exchange is not None else None
        self.launched += 1

    def run(
        self,
        local: list[Tensor] | None,
        groups: Sequence[dict[str, Any]],
        key: StepKey,
        options: Options,
        agreement: comm.Handle | None = None,
        redo: bool = False,
        changed: Tensor | None = None,
    ) -> Verdict:
        """The step from where it is (see [Note: the bucket loop]); returns the verdict all ranks
        share. Nothing is committed unless it is ``GO``. ``local``: this rank's gradients (None
        when they do not fit the program: the flags say so); ``agreement``: on the step key,
        under way (``key_agreement``), read before the first exchange; ``redo``, or
        ``changed`` on the device: this rank's gradients changed after a bucket started in
        backward (the flags ask every rank to run the step again)."""
        program, stats = self.program, self.stats
        n, carrier = len(program.buckets), program.carrier
        steps = muon_steps(groups, program.device)  # the per-step options, read once
        hyper = hyper_digest(groups) if program.flags is not None else 0  # every rank's alike?
        made = None if redo else local  # a rank that will ask for a redo makes nothing
        indicator = None
        verdict = Verdict.GO
        applied = 0  # buckets whose results were applied
        for k in range(n):
            while self.launched <= min(n - 1, max(k + (1 if options.overlap else 0), carrier)):
                with stats.phase("momentum"):
                    if made is not None:
                        program.buckets[self.launched].stage.run(made, steps)
                    if self.launched == carrier:
                        indicator = program.write_flags(
                            key, hyper, tensor_options(groups), local, options.nonfinite, redo, changed
                        )
                if agreement is not None:
                    with stats.phase("wait"):
                        if not agreed(agreement, key.digest):  # every rank's exchanges would differ
                            return self.abandon(Verdict.RAISE)
                    agreement = None
                self.start(self.launched, None)
            if k == carrier:
                verdict = program.verdict(
                    self.to_owners[k],
                    program.key.digest ^ hyper,
                    local,
                    indicator,
                    options,
                    stats,
                    redo,
                    changed,
                )
                if verdict is not Verdict.GO:
                    return self.abandon(verdict)
                assert local is not None  # else the flags (or this rank's findings) say INVALID
                program.decay(steps, stats)
                program.adamw_step(local, groups, stats)
            if k >= carrier:  # bucket k - 2's way back is bucket k's: applied first
                applied = self.apply_through(k - SLOTS, applied, steps)
            self.finish(k, discarded=made is None)
            if not options.overlap and k >= carrier:
                applied = self.apply_through(k, applied, steps)
        self.apply_through(n - 1, applied, steps)
        assert local is not None  # the carrier (one of the buckets) had a GO verdict
        program.commit_momentum(local, steps, stats)
        stats.count(**program.counts)
        return verdict

    def finish(self, k: int, discarded: bool = False) -> None:
        """Wait for bucket ``k``'s pieces, orthogonalize the matrices owned here and start the
        exchange back from the owners. ``discarded``: the results will not be used (only the
        exchanges run, so that every rank's stay in step)."""
        bucket, stats = self.program.buckets[k], self.stats
        with stats.phase("wait"):
            wait(self.to_owners.pop(k))
        if not discarded:
            with stats.phase("assemble"):
                bucket.assemble.run()
            with stats.phase("newton_schulz"):
                for batch in bucket.batches:
                    batch.orthogonalize()
                    stats.ns_matrices += batch.stack.shape[0]
                for row_step in bucket.row_steps:
                    row_step.run()
        with stats.phase("return"):
            if not discarded:
                bucket.collect.run()
            exchange = bucket.from_owners
            self.from_owners[k] = comm.launch(exchange) if exchange is not None else None

    def apply_through(self, last: int, applied: int, steps: Sequence[MuonStep | None]) -> int:
        """Wait for the way back of buckets ``applied`` .. ``last`` and apply them; returns how
        many buckets are applied now."""
        for k in range(applied, last + 1):
            bucket, stats = self.program.buckets[k], self.stats
            with stats.phase("wait"):
                wait(self.from_owners.pop(k))
            with stats.phase("apply"):
                bucket.writes.run()  # new row state into the state, the row factors out
                for u in bucket.updates:
                    u.apply(steps)
        return max(applied, last + 1)

    def abandon(self, verdict: Verdict) -> Verdict:
        """A step that does not go on: every exchange in flight waited for, nothing committed."""
        self.settle()
        self.stats.seconds.clear()
        self.stats._events.clear()
        self.stats.skipped = verdict is Verdict.SKIP
        return verdict

    def settle(self) -> None:
        """Wait for every exchange in flight."""
        for handles in (self.to_owners, self.from_owners):
            for handle in handles.values():
                wait(handle)
            handles.clear()

    def discard(self) -> None:
        """Bring a step that will not be completed to where every rank's is, whatever was started:
        every exchange launched in the loop's order and waited for; nothing made or committed."""
        n = len(self.program.buckets)
        for k in range(n):
            while self.launched <= min(n - 1, max(k + 1, self.program.carrier)):
                self.start(self.launched, None)
            self.finish(k, discarded=True)
            if k >= SLOTS:
                wait(self.from_owners.pop(k - SLOTS))
        self.settle()


# The phases of a step, in order (``dmuon_fsdp.program`` says what each does); ``wait`` recurs.
PHASES = ("momentum", "wait", "commit", "adamw", "assemble", "newton_schulz", "return", "apply")


@dataclass
class StepStats:
    """What one rank did in one step.

    ``skipped`` is True when ``nonfinite="skip"`` skipped the step (nothing else is counted
    then). Counted for every step that ran: ``ns_matrices`` (matrices this rank orthogonalized,
    counted as each batch runs), ``ns_flops`` (their Newton-Schulz flops), ``bytes_sent`` and
    ``bytes_received`` (matrix pieces to and from other ranks, both exchanges; the check flags
    riding in one exchange, ``flag_bytes`` each way, and a row variant's numbers, one or two per
    row, are not included),
    ``collectives`` (all-to-alls launched) and ``buffer_bytes`` (the buffers the optimizer keeps
    between steps: the two slots' exchange buffers, stacks of owned matrices, staging and scratch
    copies, and the NS workspace, which every bucket and every kept program share:
    ``dmuon_fsdp.exchange``).
    With ``timed=True``, ``seconds[phase]`` holds the time of each of ``PHASES``, summed over the
    step: on CPU the host's (``wait``: blocked on an all-to-all); on accelerators the device's,
    between events recorded on the current stream at the phase's start and end (``wait``: the
    stream waiting for an exchange), read with one synchronization when the step ends
    (``settle_times``), so that timing leaves the overlap of exchange and NS as it is.

    With ``overlap_backward``: ``started_in_backward`` counts the buckets whose NS inputs and
    exchange to owners began in backward, and ``redone`` is True when the step was redone from
    gradients that changed after backward began it (the count is then the redone step's, 0).
    Phase times leave out the work done in hooks (it is labelled in a profiler trace).
    """

    device: torch.device
    timed: bool = False
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    ns_matrices: int = 0
    ns_flops: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    flag_bytes: int = 0
    collectives: int = 0
    buffer_bytes: int = 0
    skipped: bool = False
    started_in_backward: int = 0
    redone: bool = False
    _events: list[tuple[str, Any, Any]] = field(default_factory=list, repr=False)  # to read at the end

    def count(
        self, ns_flops: int, bytes_sent: int, bytes_received: int, flag_bytes: int, collectives: int
    ) -> None:
        """What the step program does every step (``StepProgram.counts``)."""
        self.ns_flops, self.bytes_sent, self.bytes_received = ns_flops, bytes_sent, bytes_received
        self.flag_bytes, self.collectives = flag_bytes, collectives

    def settle_times(self) -> None:
        """Add the device times of the phases timed by events to ``seconds`` (one wait, for the
        last event)."""
        if self._events:
            self._events[-1][2].synchronize()
            for name, begin, end in self._events:
                self.seconds[name] += begin.elapsed_time(end) / 1000.0
            self._events.clear()

    @contextmanager
    def label(self, name: str) -> Iterator[None]:
        """Label ``dmuon_fsdp.<name>`` in a profiler trace (only while a profiler runs: a label
        costs two dispatched ops), untimed: as for work in backward's hooks (on a side stream,
        amid backward)."""
        profiling = autograd_profiler._is_profiler_enabled  # torch's fast check for this purpose
        with autograd_profiler.record_function(f"dmuon_fsdp.{name}") if profiling else nullcontext():
            yield

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label the phase ``dmuon_fsdp.<name>`` and time it when ``timed``."""
        with self.label(name):
            if not self.timed:
                yield
                return
            if self.device.type != "cpu":
                module = torch.get_device_module(self.device)
                begin, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
                begin.record()
                try:
                    yield
                finally:
                    end.record()
                    self._events.append((name, begin, end))
                return
            start = time.perf_counter()
            try:
                yield
            finally:
                self.seconds[name] += time.perf_counter() - start
