"""The step program and its run: one plan's schedule bound to tensors, executed bucket by bucket.

``dmuon_fsdp.build`` makes a program once per plan (every view, into the shared pool of
``dmuon_fsdp.buffers``); ``run`` executes a step with it, top to bottom, in these phases (the
names ``StepStats`` and a profiler trace use):

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
bucket launched at ``step`` (``carrier`` of ``dmuon_fsdp.schedule``): gradients' hooks launch
the buckets before it, which the loop then finds launched. Exchanges are issued in the same
order on every rank: to the owners 0, 1, back 0, to 2, back 1, ... A steady-state step
dispatches a fixed number of ops per param group, bucket and NS batch, whatever the number of
parameters or ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dmuon_fsdp import checks, comm, elementwise
from dmuon_fsdp.buffers import SLOTS
from dmuon_fsdp.checks import Flags, StepKey, Verdict
from dmuon_fsdp.layouts import local_shard
from dmuon_fsdp.parts import AdamWLists, BucketProgram, Entry, MuonLists
from dmuon_fsdp.planner import Plan
from dmuon_fsdp.stats import StepStats

if TYPE_CHECKING:
    from dmuon_fsdp.validation import Options


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
    found: Tensor  # (1,) float32: the non-finite check's result on the device
    one: Tensor  # 1.0, the check's scale
    muon: tuple[MuonLists, ...]
    adamw: tuple[AdamWLists, ...]
    buckets: tuple[BucketProgram, ...]
    flags: Flags | None
    carrier: int
    in_backward: bool
    counts: dict[str, int]  # what every step of this program does: ``StepStats`` fields
    generation: int

    def local_grads(self, grads: Sequence[Tensor | None]) -> list[Tensor] | None:
        """This rank's gradient shards in entry order, or None when one is sparse or shaped or
        typed unlike its parameter (``grads`` holds every optimizer parameter's ``.grad``)."""
        local = [local_shard(grads[e.position]) for e in self.entries]
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
        local: list[Tensor] | None,
        nonfinite: str,
        redo: bool = False,
        changed: Tensor | None = None,
    ) -> Tensor | None:
        """This rank's check flags into every segment of the exchange carrying them (device ops
        only): those of its key and per-step options (``hyper``), marked invalid when a gradient
        is, and to redo when this rank's gradients changed after their work began (``redo``,
        known on the host, or else ``changed``, a (1,) indicator on the device). Returns the
        non-finite indicator when that check is on."""
        indicator = None
        if nonfinite != "ignore" and local is not None:
            indicator = checks.nonfinite_indicator(local, self.found, self.one)
        if self.flags is not None:
            send = self.buckets[self.carrier].to_owners.send
            if local is None or key != self.key or redo:
                invalid = key == self.key and local is None
                found = checks.encode(key.digest ^ hyper, invalid=invalid, redo=redo)
                values = torch.tensor(found, dtype=send.dtype, device=send.device)
            else:
                values = self.flags.values_for(key.digest ^ hyper)
            send.index_put_((self.flags.send,), values)
            if indicator is not None:
                send.index_put_((self.flags.nonfinite,), indicator.to(send.dtype))
            if changed is not None:
                send.index_put_((self.flags.redo,), changed.to(send.dtype))
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
                summary = wait(carrier)[self.flags.receive].amax(0).tolist()
        else:
            summary = checks.encode(expected, invalid=local is None, redo=redo)
            if indicator is not None and changed is not None:  # one read for both
                both = torch.cat([indicator, changed]).tolist()
                summary[checks.NONFINITE_SLOT], summary[checks.REDO_SLOT] = both
            elif indicator is not None:
                summary[checks.NONFINITE_SLOT] = indicator.item()
            elif changed is not None:
                summary[checks.REDO_SLOT] = changed.item()
        return checks.decide(summary, expected, options.nonfinite, options.check_grads)

    def decay(self, groups: Sequence[dict[str, Any]], stats: StepStats) -> None:
        """Decoupled weight decay of the Muon parameters, after a ``GO`` and before any update."""
        with stats.phase("commit"):
            for lists in self.muon:
                group = groups[lists.group]
                if group["weight_decay"]:
                    torch._foreach_mul_(lists.params, 1.0 - float(group["lr"]) * group["weight_decay"])

    def adamw_step(self, grads: list[Tensor], groups: Sequence[dict[str, Any]], stats: StepStats) -> None:
        with stats.phase("adamw"):
            for lists in self.adamw:
                mine = [grads[i] for i in lists.grads]
                elementwise.adamw(
                    lists.params,
                    mine,
                    lists.exp_avgs,
                    lists.exp_avg_sqs,
                    lists.steps,
                    groups[lists.group],
                    lists.kernel,
                )

    def commit_momentum(
        self, grads: list[Tensor], groups: Sequence[dict[str, Any]], stats: StepStats
    ) -> None:
        """The momentum buffers, once every bucket's NS inputs were made from them."""
        with stats.phase("commit"):
            for lists in self.muon:
                group = groups[lists.group]
                torch._foreach_lerp_(lists.buffers, [grads[i] for i in lists.grads], 1.0 - group["momentum"])


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

    def start(self, k: int, grads: Sequence[Tensor | None] | None, groups: Sequence[dict[str, Any]]) -> None:
        """Make bucket ``k``'s NS inputs from ``grads`` (entry order; None: none, its results
        will not be used) and launch its exchange to the owners; buckets start in order."""
        if k != self.launched:
            raise RuntimeError(f"bucket {k} started after {self.launched} of {len(self.program.buckets)}")
        if grads is not None:
            self.program.buckets[k].stage.run(grads, groups)
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
        under way (``checks.key_agreement``), read before the first exchange; ``redo``, or
        ``changed`` on the device: this rank's gradients changed after a bucket started in
        backward (the flags ask every rank to run the step again)."""
        program, stats = self.program, self.stats
        n, carrier = len(program.buckets), program.carrier
        hyper = checks.hyper_digest(groups) if program.flags is not None else 0  # every rank's alike?
        made = None if redo else local  # a rank that will ask for a redo makes nothing
        indicator = None
        verdict = Verdict.GO
        applied = 0  # buckets whose results were applied
        for k in range(n):
            while self.launched <= min(n - 1, max(k + (1 if options.overlap else 0), carrier)):
                with stats.phase("momentum"):
                    if made is not None:
                        program.buckets[self.launched].stage.run(made, groups)
                    if self.launched == carrier:
                        indicator = program.write_flags(key, hyper, local, options.nonfinite, redo, changed)
                if agreement is not None:
                    with stats.phase("wait"):
                        if not checks.agreed(agreement, key.digest):  # every rank's exchanges would differ
                            return self.abandon(Verdict.EXPLAIN)
                    agreement = None
                self.start(self.launched, None, groups)
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
                program.decay(groups, stats)
                program.adamw_step(local, groups, stats)
            if k >= carrier:  # bucket k - 2's way back is bucket k's: applied first
                applied = self.apply_through(k - SLOTS, applied, groups)
            self.finish(k, discarded=made is None)
            if not options.overlap and k >= carrier:
                applied = self.apply_through(k, applied, groups)
        self.apply_through(n - 1, applied, groups)
        program.commit_momentum(local, groups, stats)
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
                if bucket.neurons is not None:
                    bucket.neurons.run()
        with stats.phase("return"):
            if not discarded:
                bucket.collect.run()
            exchange = bucket.from_owners
            self.from_owners[k] = comm.launch(exchange) if exchange is not None else None

    def apply_through(self, last: int, applied: int, groups: Sequence[dict[str, Any]]) -> int:
        """Wait for the way back of buckets ``applied`` .. ``last`` and apply them; returns how
        many buckets are applied now."""
        for k in range(applied, last + 1):
            bucket, stats = self.program.buckets[k], self.stats
            with stats.phase("wait"):
                wait(self.from_owners.pop(k))
            with stats.phase("apply"):
                bucket.writes.run()  # NorMuon's new second moments into the state, the rows' factors out
                for u in bucket.updates:
                    u.apply(groups)
        return max(applied, last + 1)

    def abandon(self, verdict: Verdict) -> Verdict:
        """A step that does not go on: every exchange in flight waited for, nothing committed."""
        self.settle()
        self.stats.seconds.clear()
        self.stats.skipped = verdict is Verdict.SKIP
        return verdict

    def settle(self) -> None:
        """Wait for every exchange in flight."""
        for handles in (self.to_owners, self.from_owners):
            for handle in handles.values():
                wait(handle)
            handles.clear()

    def discard(self, groups: Sequence[dict[str, Any]]) -> None:
        """Bring a step that will not be completed to where every rank's is, whatever was started:
        every exchange launched in the loop's order and waited for; nothing made or committed."""
        n = len(self.program.buckets)
        for k in range(n):
            while self.launched <= min(n - 1, max(k + 1, self.program.carrier)):
                self.start(self.launched, None, groups)
            self.finish(k, discarded=True)
            if k >= SLOTS:
                wait(self.from_owners.pop(k - SLOTS))
        self.settle()
