"""Binding a plan to tensors: every buffer and view a step of it needs on this rank.

Buffers (every bucket's exchange buffers in ``comm_dtype``, one (B, s, l) stack per batch of owned
matrices in ``ns_dtype``, tall ones transposed, and one NS workspace for all) live as long as the
program and are reused every step; what a parameter's matrices orthogonalize is written straight
into its send-buffer segment or stack region when its shard is one piece sent whole, else through
a scratch copy. Own pieces never enter an exchange buffer; with ``comm_dtype != ns_dtype`` they
pass through a ``comm_dtype`` staging copy, so that replicas round results alike. docs/design.md
("Memory") lists every buffer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from dmuon_fsdp import checks, comm, elementwise
from dmuon_fsdp.checks import Flags, StepKey
from dmuon_fsdp.layouts import local_shard
from dmuon_fsdp.neurons import STATE_KEY, NeuronNorm, bind_neurons
from dmuon_fsdp.newton_schulz import Workspace
from dmuon_fsdp.parts import (
    AdamWLists,
    Batch,
    BucketProgram,
    Copies,
    Entry,
    MuonLists,
    NSForm,
    NSInputs,
    Stage,
    Updates,
)
from dmuon_fsdp.planner import Plan
from dmuon_fsdp.program import StepProgram
from dmuon_fsdp.schedule import BucketSchedule, RankSchedule, Transfer
from dmuon_fsdp.wires import Slot, as_wire, in_shape, nbytes, piece_of, rows_of, staging, wired


@dataclass(frozen=True)
class Settings:
    """What a program is built with besides the parameters, resolved by the optimizer."""

    site: comm.ExchangeSite
    device: torch.device
    ns_dtype: torch.dtype
    comm_dtype: torch.dtype
    bucket_bytes: int
    check_grads: bool
    nonfinite: str
    in_backward: bool  # steps start in backward (``dmuon_fsdp.backward``): its plan, groups, stages


def indexed(groups: Sequence[dict[str, Any]]) -> list[tuple[int, Tensor]]:
    return [(g, p) for g, group in enumerate(groups) for p in group["params"]]


def wire_group(settings: Settings) -> comm.ExchangeGroup:
    """The group the exchanges run on."""
    return settings.site.backward if settings.in_backward else settings.site.group


def bind(
    plan: Plan,
    forms: Sequence[NSForm],
    schedule: RankSchedule,
    key: StepKey,
    groups: list[dict[str, Any]],
    state: Any,
    settings: Settings,
) -> StepProgram:
    """Allocate every buffer and make every view a step of ``plan`` needs on this rank
    (``forms``: each matrix's NS form, as ``plan_program`` worked it out)."""
    entries = [Entry(i, g, p) for i, ((g, p), has) in enumerate(zip(indexed(groups), key.has_grad)) if has]
    binder = _Binder(plan, forms, schedule, entries, groups, state, settings)
    buckets = tuple(binder.bucket(k, bucket) for k, bucket in enumerate(schedule.buckets))
    muon, stages = binder.momentum(state)
    carried = [k for k, b in enumerate(schedule.buckets) if b.to_owners is not None and b.to_owners.flags]
    flag_bucket, flags = (carried or [0])[0], None
    if carried:
        flags = Flags.bind(buckets[flag_bucket].to_owners, key.digest ^ checks.hyper_digest(groups))
    size = settings.comm_dtype.itemsize
    counts = {
        "ns_flops": sum(plan.costs[j] for bucket in schedule.buckets for j in bucket.owned),
        "bytes_sent": schedule.elements(sent=True) * size,
        "bytes_received": schedule.elements(sent=False) * size,
        "flag_bytes": flags.send.numel() * size if flags is not None else 0,
        "collectives": sum(e is not None for b in buckets for e in (b.to_owners, b.from_owners)),
    }
    return StepProgram(
        key=key,
        plan=plan,
        entries=binder.entries,
        storage=tuple(t.data_ptr() for t in binder.locals),
        state_slots=tuple((e.param, k, value) for e in binder.entries for k, value in state[e.param].items()),
        grad_shapes=[t.shape for t in binder.locals],
        grad_dtypes=[t.dtype for t in binder.locals],
        found=torch.zeros(1, device=settings.device),
        one=torch.ones((), device=settings.device),
        muon=muon,
        adamw=binder.adamw(state),
        stages=stages,
        buckets=buckets,
        flags=flags,
        flag_bucket=flag_bucket,
        in_backward=settings.in_backward,
        all_updates=tuple(binder.merged.values()),
        all_writes=binder.writes,
        counts=counts,
        buffer_bytes=binder.allocated,
    )


class _Binder:
    """Binds one program; holds what every part of the binding refers to."""

    def __init__(
        self,
        plan: Plan,
        forms: Sequence[NSForm],
        schedule: RankSchedule,
        entries: list[Entry],
        groups: list[dict[str, Any]],
        state: Any,
        settings: Settings,
    ):
        self.plan, self.forms, self.groups, self.settings = plan, forms, groups, settings
        self.schedule, self.state = schedule, state
        self.entries = tuple(entries)
        self.locals = [local_shard(e.param) for e in self.entries]
        self.muon = [i for i, e in enumerate(self.entries) if groups[e.group]["use_muon"]]
        self.staged = settings.comm_dtype != settings.ns_dtype
        # (destination, this rank's piece, its bucket) to fill with NS inputs, and with its rows'
        # second moments (NorMuon)
        self.feeds: list[tuple[Tensor, Transfer, int]] = []
        self.stat_feeds: list[tuple[Tensor, Transfer, int]] = []
        self.merged: dict[tuple[int, float], Updates] = {}
        self.writes = Copies([], [])  # every bucket's new second moments into the state
        self.rows: dict[int, tuple[Tensor, Tensor]] = {}  # the bucket's owned second moments, factors
        self.allocated = 0  # bytes of the buffers made (the program keeps them)
        # One NS workspace for every batch of every bucket: they are orthogonalized one at a time.
        sizes = [
            Workspace.sizes((len(batch), s, l), form.segments)
            for bucket in schedule.buckets
            for (s, l, form), batch in self.members(bucket.owned).items()
        ]
        self.workspace = (
            tuple(
                torch.empty(max(size), dtype=settings.ns_dtype, device=settings.device)
                for size in zip(*sizes)
            )
            if sizes
            else None
        )
        self.allocated += nbytes(*(self.workspace or ()))

    def plan_bucket(self, k: int) -> tuple[int, ...]:
        """The matrices of schedule bucket ``k`` (none in the one bucket of a plan without any)."""
        return self.plan.buckets[k].matrices if k < len(self.plan.buckets) else ()

    def entry_of(self, j: int) -> int:
        return self.muon[self.plan.param_of[j]]

    def update_class(self, j: int) -> tuple[int, float]:
        group = self.entries[self.entry_of(j)].group
        m = self.plan.matrices[j]
        return group, elementwise.adjusted_lr(1.0, self.groups[group]["adjust_lr_fn"], m.rows, m.cols)

    def members(self, owned: Sequence[int]) -> dict[tuple[int, int, NSForm], list[int]]:
        """Owned matrices by (short side, long side, NS form): the batches of one bucket, wide
        matrices first."""
        members: dict[tuple[int, int, NSForm], list[int]] = defaultdict(list)
        for j in sorted(owned, key=lambda j: self.tall(j)):
            m = self.plan.matrices[j]
            members[(min(m.rows, m.cols), max(m.rows, m.cols), self.forms[j])].append(j)
        return members

    def tall(self, j: int) -> bool:
        return self.plan.matrices[j].rows > self.plan.matrices[j].cols

    def batches(self, owned: Sequence[int]) -> tuple[tuple[Batch, ...], dict[int, Tensor], NeuronNorm | None]:
        """Each batch of owned matrices as a new (B, s, l) stack, each matrix's (rows, cols)
        view into its stack (a transposed view for tall matrices), and NorMuon on those of
        NorMuon's groups (``neurons``)."""
        batches, matrix_views, normed = [], {}, []
        for (s, l, form), members in self.members(owned).items():
            stack = torch.zeros(len(members), s, l, dtype=self.settings.ns_dtype, device=self.settings.device)
            self.allocated += nbytes(stack)
            work = Workspace.for_stack(stack, form.segments, self.workspace)
            batches.append(Batch(stack, form.coefficients, form.eps, form.segments, work))
            for b, j in enumerate(members):
                matrix_views[j] = stack[b].mT if self.tall(j) else stack[b]
            if form.neurons is not None:
                shapes = [(self.plan.matrices[j].rows, self.plan.matrices[j].cols) for j in members]
                normed.append((stack, dict(zip(members, shapes)), form.neurons))
        bound = bind_neurons(normed, self.settings.ns_dtype, self.settings.device)
        if bound is None:
            self.rows = {}
            return tuple(batches), matrix_views, None
        self.rows, self.allocated = bound.rows, self.allocated + bound.nbytes
        return tuple(batches), matrix_views, bound.norm

    def second_moments(self, t: Transfer) -> Tensor:
        """This rank's state of ``t``'s rows (NorMuon's second moments)."""
        param = self.entries[self.entry_of(t.matrix)].param
        return rows_of(local_shard(self.state[param][STATE_KEY]), t.piece)

    def bucket(self, k: int, bucket: BucketSchedule) -> BucketProgram:
        """Bucket ``k``'s exchanges, stacks, copies and updates. NorMuon's row statistics are
        float32 everywhere but on the wire, which carries their bits (``wires.as_wire``)."""
        batches, matrix, neurons = self.batches(bucket.owned)
        fed = len(self.feeds)
        group = wire_group(self.settings).group
        comm_dtype, device = self.settings.comm_dtype, self.settings.device

        def region(t: Transfer) -> Tensor:
            p = t.piece
            return matrix[t.matrix][p.row : p.row + p.rows, p.col : p.col + p.cols]

        def owner_rows(t: Transfer) -> tuple[Tensor, Tensor]:
            """The owner's second moments and factors of ``t``'s rows."""
            v, f = self.rows[t.matrix]
            return v[t.piece.row : t.piece.row + t.piece.rows], f[t.piece.row : t.piece.row + t.piece.rows]

        def staged(transfers: Sequence[Transfer]) -> list[Slot]:
            """Own pieces through the wire's dtype (their statistics need no staging)."""
            transfers = [replace(t, stats=0) for t in transfers]
            self.allocated += sum(t.numel for t in transfers) * comm_dtype.itemsize
            return staging(transfers, comm_dtype, device)

        to_owners = wired(bucket.to_owners, comm_dtype, device, group)
        from_owners = wired(bucket.from_owners, comm_dtype, device, group)
        for wire in (to_owners, from_owners):
            if wire.exchange is not None:
                self.allocated += nbytes(wire.exchange.send, wire.exchange.receive)
        self.feeds += [(slot.piece, slot.transfer, k) for slot in to_owners.sent]
        self.stat_feeds += [(s.stats, s.transfer, k) for s in to_owners.sent if s.stats is not None]
        assemble = Copies([], [])
        for slot in to_owners.received:
            assemble.add(region(slot.transfer), slot.piece)
            if slot.stats is not None:
                assemble.add(as_wire(owner_rows(slot.transfer)[0], comm_dtype), slot.stats)
        own = list(bucket.own_pieces)
        if self.staged:
            for t, slot in zip(own, staged(own)):
                self.feeds.append((slot.piece, t, k))
                assemble.add(region(t), slot.piece)
        else:
            self.feeds += [(region(t), t, k) for t in own]
        for t in own:
            if t.stats:
                assemble.add(owner_rows(t)[0], self.second_moments(t))
        reads = tuple(sorted({self.entry_of(t.matrix) for _, t, _ in self.feeds[fed:]}))
        needs = tuple(sorted({self.entry_of(j) for j in self.plan_bucket(k)}))

        collect = Copies([], [])
        for slot in from_owners.sent:
            collect.add(slot.piece, region(slot.transfer))
            if slot.stats is not None:
                v, f = owner_rows(slot.transfer)
                collect.add(slot.second_moments, as_wire(v, comm_dtype))
                collect.add(slot.factors, as_wire(f, comm_dtype))
        writes = Copies([], [])  # the rows' new second moments into the state, their factors out
        rows = sum(slot.transfer.piece.rows for slot in from_owners.received if slot.stats is not None)
        factors = torch.empty(rows, dtype=torch.float32, device=device)
        self.allocated += nbytes(factors)
        returned, offset = [], 0  # (transfer, its result, its rows' new second moments, factors)
        for slot in from_owners.received:
            t, stats = slot.transfer, ()
            if slot.stats is not None:
                stats = self.second_moments(t), factors[offset : offset + t.piece.rows]
                writes.add(as_wire(stats[0], comm_dtype), slot.second_moments)
                writes.add(as_wire(stats[1], comm_dtype), slot.factors)
                offset += t.piece.rows
            returned.append((t, slot.piece, *stats))
        if self.staged:  # through the wire's dtype, so that replicas round results alike
            own = list(zip(bucket.own_results, (slot.piece for slot in staged(bucket.own_results))))
            for t, piece in own:
                collect.add(piece, region(t))
        else:
            own = [(t, region(t)) for t in bucket.own_results]
        for t, direction in own:
            stats = ()
            if t.stats:
                v, f = owner_rows(t)
                stats = self.second_moments(t), f
                writes.add(stats[0], v)
            returned.append((t, direction, *stats))
        mine: dict[tuple[int, float], Updates] = {}
        for t, direction, *stats in returned:
            cls = self.update_class(t.matrix)
            for table in (mine, self.merged):
                u = table.setdefault(cls, Updates(*cls, [], [], [] if stats else None))
                u.params.append(piece_of(self.locals[self.entry_of(t.matrix)], t.piece))
                u.directions.append(direction)
                if stats:
                    u.factors.append(stats[1].view(-1, 1))
        self.writes.dst.extend(writes.dst)
        self.writes.src.extend(writes.src)
        return BucketProgram(
            reads,
            needs,
            to_owners.exchange,
            assemble,
            batches,
            neurons,
            collect,
            from_owners.exchange,
            tuple(mine.values()),
            writes,
        )

    def momentum(self, state: Any) -> tuple[tuple[MuonLists, ...], tuple[Stage, ...]]:
        """Per Muon group its tensors, and per stage where its NS inputs are written, straight
        or through scratch + spread: one stage, or (``in_backward``) one per bucket, each
        parameter's inputs made in the stage of its first bucket."""
        feeds: dict[int, list[tuple[Tensor, Transfer]]] = defaultdict(list)
        first: dict[int, int] = {}
        for view, t, k in self.feeds:
            i = self.entry_of(t.matrix)
            feeds[i].append((view, t))
            first[i] = min(first.get(i, k), k) if self.settings.in_backward else 0
        count = len(self.schedule.buckets) if self.settings.in_backward else 1
        stages = [([], Copies([], [])) for _ in range(count)]
        for view, t, _ in self.stat_feeds:  # the rows' second moments go with the first inputs
            stages[first[self.entry_of(t.matrix)]][1].add(view, as_wire(self.second_moments(t), view.dtype))
        lists = []
        for group, members in self._by_group(muon=True).items():
            buffer = {i: local_shard(state[self.entries[i].param]["momentum_buffer"]) for i in members}
            for s, (inputs, spread) in enumerate(stages):
                straight, through = [], []
                for i in members:
                    if i not in first or first[i] != s:
                        continue  # nothing of it is orthogonalized here (another replica sends it)
                    local = self.locals[i]
                    direct = in_shape(feeds[i][0][0], local) if len(feeds[i]) == 1 else None
                    if direct is not None:  # the one piece is the whole shard
                        straight.append((i, direct))
                        continue
                    scratch = torch.empty_like(local)
                    self.allocated += nbytes(scratch)
                    through.append((i, scratch))
                    spread.dst.extend(view for view, _ in feeds[i])
                    spread.src.extend(piece_of(scratch, t.piece) for _, t in feeds[i])
                inputs.extend(
                    NSInputs(
                        group,
                        tuple(i for i, _ in chosen),
                        [buffer[i] for i, _ in chosen],
                        [d for _, d in chosen],
                        all(d.dtype == buffer[i].dtype for i, d in chosen),
                    )
                    for chosen in (straight, through)
                    if chosen
                )
            params = [self.locals[i] for i in members]
            lists.append(MuonLists(group, tuple(members), params, [buffer[i] for i in members]))
        return tuple(lists), tuple(Stage(tuple(inputs), spread) for inputs, spread in stages)

    def adamw(self, state: Any) -> tuple[AdamWLists, ...]:
        lists = []
        for group, members in self._by_group(muon=False).items():
            params = [self.locals[i] for i in members]
            states = [state[self.entries[i].param] for i in members]
            exp_avgs, exp_avg_sqs = ([local_shard(st[k]) for st in states] for k in ("exp_avg", "exp_avg_sq"))
            steps = [st["step"] for st in states]
            kernel = elementwise.adamw_kernel(params)
            lists.append(AdamWLists(group, tuple(members), params, exp_avgs, exp_avg_sqs, steps, kernel))
        return tuple(lists)

    def _by_group(self, muon: bool) -> dict[int, list[int]]:
        """Entry indices (= positions in the step's gradient list) by param group."""
        out: dict[int, list[int]] = defaultdict(list)
        for i, e in enumerate(self.entries):
            if self.groups[e.group]["use_muon"] == muon:
                out[e.group].append(i)
        return out
