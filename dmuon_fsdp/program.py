"""The step program and its run: one plan's schedule bound to tensors, executed.

``dmuon_fsdp.build`` makes a program once per plan (every buffer and every view); ``run``
executes a step with it, top to bottom, in these phases (the names ``StepStats`` and a profiler
trace use):

- ``momentum``: what each matrix orthogonalizes, written straight into send buffers and own
  stacks (foreach ops), and this rank's check flags into the first exchange (the last, for
  steps begun in backward: ``dmuon_fsdp.backward``);
- ``wait``: blocked on an all-to-all; the one carrying the flags brings every rank's, read once
  into the verdict (``dmuon_fsdp.checks``), before anything is committed;
- ``commit``: momentum buffers and weight decay; ``adamw``: torch's functional AdamW;
- per bucket, ``assemble`` (received pieces into (B, s, l) stacks), ``newton_schulz`` (in place
  per stack) and ``return`` (results into the return buffer, the exchange back launched);
- ``apply``: p -= lr * scale * O, one foreach add per step size.

A bucket's work is two operations: ``launch`` starts its exchange to the owners, ``finish``
waits for it, orthogonalizes and starts the exchange back. With ``overlap``, bucket k+1 travels
while bucket k's Newton-Schulz runs. A steady-state step dispatches a fixed number of ops per
param group, bucket and NS batch, whatever the number of parameters or ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dmuon_fsdp import checks, comm, elementwise
from dmuon_fsdp.checks import Flags, StepKey, Verdict
from dmuon_fsdp.layouts import local_shard
from dmuon_fsdp.parts import AdamWLists, BucketProgram, Copies, Entry, MuonLists, Stage, Updates
from dmuon_fsdp.planner import Plan
from dmuon_fsdp.stats import StepStats

if TYPE_CHECKING:
    from dmuon_fsdp.validation import Options


@dataclass(frozen=True)
class StepProgram:
    """Everything a step of one plan needs on this rank. ``entries`` are the parameters with a
    gradient (in optimizer order); ``key`` is the step it was built for. ``flag_bucket``: the
    bucket whose exchange to owners carries the check flags, the first, or the last in a program
    whose steps start in backward (``in_backward``, see ``dmuon_fsdp.backward``)."""

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
    stages: tuple[Stage, ...]  # one, or one per bucket (in_backward)
    buckets: tuple[BucketProgram, ...]
    flags: Flags | None
    flag_bucket: int
    in_backward: bool
    all_updates: tuple[Updates, ...]  # every bucket's, merged by step size (applied once)
    all_writes: Copies  # every bucket's
    counts: dict[str, int]  # what every step of this program does: ``StepStats`` fields
    buffer_bytes: int  # of the buffers made for it

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

    def run(
        self,
        grads: Sequence[Tensor | None],
        groups: Sequence[dict[str, Any]],
        key: StepKey,
        options: Options,
        stats: StepStats,
        bound: bool = True,
        agreement: comm.Handle | None = None,
    ) -> Verdict:
        """One step: every phase in order; returns the verdict all ranks share. Nothing is
        committed unless it is ``GO``. ``bound`` False: the parameters or their state changed
        layout since the program was bound (the step reports it, on every rank). ``agreement``:
        on the step key, under way (``checks.key_agreement``), read before the first exchange.
        A program ``in_backward`` runs through ``dmuon_fsdp.backward`` instead."""
        if self.in_backward:
            raise RuntimeError("a program for steps begun in backward runs through dmuon_fsdp.backward")
        local = self.local_grads(grads) if bound and key == self.key else None
        hyper = checks.hyper_digest(groups) if self.flags is not None else 0  # every rank's alike?
        with stats.phase("momentum"):
            if local is not None:
                self.stages[0].run(local, groups)
            indicator = self.write_flags(key, hyper, local, options.nonfinite)
        if agreement is not None:
            with stats.phase("wait"):
                if not checks.agreed(agreement, key.digest):  # every rank's exchanges would differ
                    return abandon(Verdict.EXPLAIN, (), stats)
        in_flight = {0: self.launch(0)}
        if options.overlap and len(self.buckets) > 1:
            in_flight[1] = self.launch(1)
        verdict = self.verdict(in_flight[0], self.key.digest ^ hyper, local, indicator, options, stats)
        if verdict is not Verdict.GO:
            return abandon(verdict, in_flight.values(), stats)
        self.commit(local, groups, stats)
        returns = []
        for k, bucket in enumerate(self.buckets):
            ahead = k + 1 if options.overlap else k  # with overlap, bucket k+1 travels during NS of k
            if ahead < len(self.buckets) and ahead not in in_flight:
                in_flight[ahead] = self.launch(ahead)
            returns.append(self.finish(k, in_flight.pop(k), stats))
            if not options.overlap:
                apply_updates(bucket.updates, bucket.writes, [returns.pop()], groups, stats)
        if options.overlap:
            apply_updates(self.all_updates, self.all_writes, returns, groups, stats)
        stats.count(**self.counts)
        return verdict

    def launch(self, k: int) -> comm.Handle | None:
        """Start bucket ``k``'s exchange to its owners (None: nothing crosses)."""
        exchange = self.buckets[k].to_owners
        return comm.launch(exchange) if exchange is not None else None

    def finish(
        self, k: int, arriving: comm.Handle | None, stats: StepStats, discarded: bool = False
    ) -> comm.Handle | None:
        """Wait for bucket ``k``'s pieces, orthogonalize the matrices owned here and start the
        exchange back from the owners; returns its handle. ``discarded``: the results will not
        be used (only the exchanges run, so that every rank's stay in step)."""
        bucket = self.buckets[k]
        with stats.phase("wait"):
            wait(arriving)
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
            return comm.launch(bucket.from_owners) if bucket.from_owners is not None else None

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
            send = self.buckets[self.flag_bucket].to_owners.send
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

    def commit(self, grads: list[Tensor], groups: Sequence[dict[str, Any]], stats: StepStats) -> None:
        """The state changes of the step, after a ``GO``: momentum buffers and decoupled weight
        decay (``commit``), then torch's functional AdamW (``adamw``)."""
        with stats.phase("commit"):
            for lists in self.muon:
                group = groups[lists.group]
                torch._foreach_lerp_(lists.buffers, [grads[i] for i in lists.grads], 1.0 - group["momentum"])
                if group["weight_decay"]:
                    torch._foreach_mul_(lists.params, 1.0 - float(group["lr"]) * group["weight_decay"])
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


_NONE: dict = {}  # the state of a parameter whose state was removed (``moved`` reports it)


def wait(handle: comm.Handle | None) -> Tensor | None:
    return handle.wait() if handle is not None else None


def abandon(verdict: Verdict, in_flight: Iterable[comm.Handle | None], stats: StepStats) -> Verdict:
    """A step that does not go on: every exchange in flight waited for, nothing committed."""
    for handle in in_flight:
        wait(handle)
    stats.seconds.clear()
    stats.skipped = verdict is Verdict.SKIP
    return verdict


def apply_updates(
    updates: Sequence[Updates],
    writes: Copies,
    returns: Sequence[comm.Handle | None],
    groups: Sequence[dict[str, Any]],
    stats: StepStats,
) -> None:
    with stats.phase("wait"):
        for handle in returns:
            wait(handle)
    with stats.phase("apply"):
        writes.run()  # NorMuon's new second moments into the state, the rows' factors out
        for u in updates:
            u.apply(groups)
