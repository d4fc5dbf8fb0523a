"""A step under way: a bound program (``dmuon_fsdp._step.program``) run bucket by bucket, and
what one rank did in it (``StepStats``, timed in ``PHASES``).

``StepRun`` executes a step of a program, top to bottom, in these
phases (the names ``StepStats`` and a profiler trace use):

- ``momentum``: a bucket's NS inputs, written straight into its send buffer and own stacks
  (foreach ops; the momentum buffers are only read), and this rank's check flags into the
  exchange that carries them;
- ``wait``: blocked on an all-to-all; the one carrying the flags brings every rank's, read once
  into the verdict (``dmuon_fsdp._step.flags``), before anything is committed;
- ``commit``: weight decay after the verdict, the momentum buffers at the end; ``adamw``:
  torch's functional AdamW;
- per bucket, ``assemble`` (received pieces into (B, s, l) stacks), ``newton_schulz`` (in place
  per stack) and ``return`` (results into the return buffer, the exchange back launched);
- ``apply``: p -= lr * scale * O, one foreach add per bucket and step size, for what came back
  from the owners and what came by relay (the parts relayed are packed and launched there).

[Note: the bucket loop] Every step, plain or begun in backward, runs ``StepRun.run``: for each
bucket k in order, launch the exchanges to the owners through bucket k + 1 (with ``overlap``;
else k), and at least through the carrier of the flags; wait for bucket k's pieces; at the
carrier, read the verdict and commit weight decay and AdamW; apply bucket k - 3's relay (its
buffers are bucket k - 1's) and bucket k - 2's way back (it shares bucket k's slot, see
[Note: slots]), launching bucket k - 2's relay there; assemble, orthogonalize and launch the way
back. Bucket k + 2 takes bucket k's way to the owners only after bucket k's results were
collected, and bucket k's way back is applied before bucket k + 2 is orthogonalized; so
``SLOTS`` sets of buffers serve every bucket. The carrier is bucket 0, or for steps begun in
backward the first bucket launched at ``step`` (``RankSchedule.carrier``): gradients' hooks
launch the buckets before it, which the loop then finds launched. Exchanges are issued in the
same order on every rank: to the owners 0, 1, back 0, to 2, back 1, to 3, relay 0, back 2, ...
(a relay only where some bucket's matrices have twins in other replicas: [Note: the relay] in
``dmuon_fsdp._step.relay``). A steady-state step dispatches a fixed number of ops per param
group, bucket and NS batch, whatever the number of parameters or ranks.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.autograd.profiler as autograd_profiler
from torch import Tensor

from dmuon_fsdp._step import comm
from dmuon_fsdp._step.buffers import SLOTS
from dmuon_fsdp._step.flags import StepKey, Verdict, agreed, hyper_digest, tensor_options
from dmuon_fsdp._step.program import StepProgram
from dmuon_fsdp._step.state import MuonStep, muon_steps

if TYPE_CHECKING:
    from dmuon_fsdp.config import Options


@dataclass
class StepRun:
    """One step of ``program`` under way: which buckets' exchanges to the owners are launched,
    and the exchanges in flight (see [Note: the bucket loop])."""

    program: StepProgram
    stats: StepStats
    overlap: bool = True  # launch bucket k + 1's exchange before bucket k's NS (the option)
    deferred: bool = False  # the relays are left to the next forward (``overlap_forward``)
    launched: int = 0  # buckets whose exchange to the owners is launched
    applied: int = 0  # buckets whose way back is applied
    relays_launched: int = 0
    relays_applied: int = 0
    steps: Sequence[MuonStep | None] = ()  # the groups' per-step options (the relays' too)
    to_owners: dict[int, comm.Handle | None] = field(default_factory=dict)
    from_owners: dict[int, comm.Handle | None] = field(default_factory=dict)
    relays: dict[int, comm.Handle | None] = field(default_factory=dict)

    @classmethod
    def of(cls, program: StepProgram, options: Options) -> StepRun:
        stats = StepStats(program.device, timed=options.time_phases)
        return cls(program, stats, options.overlap, options.overlap_forward)

    def ahead(self, k: int) -> int:
        """The last bucket whose exchange to the owners is launched before bucket ``k``'s pieces are
        waited for: ``k + 1`` with ``overlap`` (else ``k``), and at least the carrier."""
        return min(len(self.program.buckets) - 1, max(k + (1 if self.overlap else 0), self.program.carrier))

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
        steps = self.steps = muon_steps(groups, program.device)  # the per-step options, read once
        hyper = hyper_digest(groups) if program.flags is not None else 0  # every rank's alike?
        made = None if redo else local  # a rank that will ask for a redo makes nothing
        flags = partial(program.write_flags, key, hyper, tensor_options(groups), local, options.nonfinite)
        indicator, verdict = None, Verdict.GO
        for k in range(n):
            while self.launched <= self.ahead(k):
                with stats.phase("momentum"):
                    if made is not None:
                        program.buckets[self.launched].stage.run(made, steps)
                    if self.launched == carrier:
                        indicator = flags(redo, changed)
                if agreement is not None:
                    with stats.phase("wait"):
                        if not agreed(agreement, key.digest):  # every rank's exchanges would differ
                            return self.abandon(Verdict.RAISE)
                    agreement = None
                self.start(self.launched, None)
            if k == carrier:
                received = self.to_owners[k]
                verdict = program.verdict(
                    received, program.key.digest ^ hyper, local, indicator, options, stats, redo, changed
                )
                if verdict is not Verdict.GO:
                    return self.abandon(verdict)
                assert local is not None  # else the flags (or this rank's findings) say INVALID
                program.decay(steps, stats)
                program.adamw_step(local, groups, stats)
            if k >= carrier:  # bucket k - 2's way back is bucket k's (its relays: applied in turn)
                self.relay_through(program.relays_before[max(0, k - SLOTS)], steps)
                self.back_through(k - SLOTS, steps)
            self.finish(k, discarded=made is None)
            if not self.overlap and k >= carrier:
                self.back_through(k, steps)
                self.relay_through(program.relays_before[k + 1], steps)
        self.back_through(n - 1, steps)
        self.end_relays(steps)
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
            comm.wait(self.to_owners.pop(k))
        if not discarded:
            with stats.phase("assemble"):
                bucket.assemble.run()
            with stats.phase("newton_schulz"):
                for batch in bucket.batches:
                    batch.orthogonalize()
                    stats.ns_matrices += batch.stack.shape[0]
                for work in bucket.after_ns:
                    work.run()
                for new in bucket.new_mains:  # (not committed: see ``NewMains``)
                    new.run(self.steps)
        with stats.phase("return"):
            if not discarded:
                bucket.collect.run()
            exchange = bucket.from_owners
            self.from_owners[k] = comm.launch(exchange) if exchange is not None else None

    def back_through(self, last: int, steps: Sequence[MuonStep | None] | None) -> None:
        """Wait for the way back of the buckets not yet applied through ``last``, start each one's
        relays across replicas (from the parts it holds now) and apply what came back. ``steps``
        None: the step is discarded (only the exchanges run)."""
        for k in range(self.applied, last + 1):
            bucket, stats = self.program.buckets[k], self.stats
            with stats.phase("wait"):
                comm.wait(self.from_owners.pop(k))
            with stats.phase("apply"):
                if steps is not None:
                    bucket.writes.run()
                    bucket.keep.run()
                for relay in () if self.deferred else bucket.relays:
                    self.launch_relay(relay.index, steps)
                if steps is not None:
                    for u in bucket.updates:
                        u.apply(steps)
            self.applied = k + 1

    def launch_relay(self, g: int, steps: Sequence[MuonStep | None] | None) -> None:
        """Pack relay ``g`` (its parts kept) and launch it; relays launch in order, each once the
        one two before it, whose buffers it takes, is applied."""
        if g != self.relays_launched:
            raise RuntimeError(f"relay {g} launched after {self.relays_launched}")
        self.relay_through(g - SLOTS + 1, steps)
        relay = self.program.relays[g]
        if steps is not None:
            relay.keep.run()
            relay.pack.run()
        self.relays[g] = comm.launch(relay.exchange) if relay.exchange is not None else None
        self.relays_launched += 1

    def relay_through(self, stop: int, steps: Sequence[MuonStep | None] | None) -> None:
        """Wait for the relays launched before relay ``stop`` and apply them (``steps`` None:
        discarded)."""
        relays = self.program.relays
        for g in range(self.relays_applied, min(stop, self.relays_launched)):
            with self.stats.phase("wait"):
                comm.wait(self.relays.pop(g))
            if steps is not None:
                with self.stats.phase("apply"):
                    relays[g].writes.run()
                    for u in relays[g].updates:
                        u.apply(steps)
            self.relays_applied = g + 1

    def end_relays(self, steps: Sequence[MuonStep | None]) -> None:
        """After the last way back: apply the relays not yet applied or, left to the next forward
        (``deferred``), launch every one, in order (their send buffers were filled as each
        bucket's way back was applied): each rank lands them where it needs them, alone."""
        if not self.deferred:
            self.relay_through(len(self.program.relays), steps)
            return
        for relay in self.program.relays:
            self.relays[relay.index] = comm.launch(relay.exchange) if relay.exchange is not None else None
        self.relays_launched = len(self.program.relays)

    def land(self, g: int, dropped: frozenset[int] = frozenset()) -> None:
        """Wait for relay ``g`` left to the next forward and apply what it brought, but the rows
        of the entries ``dropped`` (parameters written since the step)."""
        with self.stats.phase("wait"):
            comm.wait(self.relays.pop(g))
        relay = self.program.relays[g]
        with self.stats.phase("apply"):
            relay.writes.run()
            for u in relay.updates:
                (u.without(dropped) if dropped else u).apply(self.steps)

    def abandon(self, verdict: Verdict) -> Verdict:
        """A step that does not go on: every exchange in flight waited for, nothing committed."""
        self.settle()
        self.stats.seconds.clear()
        self.stats._events.clear()
        return verdict

    def settle(self) -> None:
        """Wait for every exchange in flight."""
        for handles in (self.to_owners, self.from_owners, self.relays):
            for handle in handles.values():
                comm.wait(handle)
            handles.clear()

    def discard(self) -> None:
        """Bring a step that will not be completed to where every rank's is, whatever was started:
        every exchange launched in the loop's order (``run``'s, the carrier's verdict aside) and
        waited for; nothing made or committed."""
        n, carrier = len(self.program.buckets), self.program.carrier
        for k in range(n):
            while self.launched <= self.ahead(k):  # as ``run`` launches them
                self.start(self.launched, None)
            if k >= carrier:
                self.relay_through(self.program.relays_before[max(0, k - SLOTS)], None)
                self.back_through(k - SLOTS, None)
            self.finish(k, discarded=True)
            if not self.overlap and k >= carrier:
                self.back_through(k, None)
                self.relay_through(self.program.relays_before[k + 1], None)
        self.back_through(n - 1, None)
        self.settle()


# The phases of a step, in order (the module docstring says what each does); ``wait`` recurs.
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
    ``dmuon_fsdp._step.buffers``).
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
