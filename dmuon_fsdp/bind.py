"""Binding a plan to tensors: every view a step of it needs on this rank, into the shared pool.

Each bucket takes its buffers from its slot's arenas (``dmuon_fsdp.buffers``, [Note: slots]):
on the way to the owners, its exchange buffers in ``comm_dtype``, one (B, s, l) stack per batch
of owned matrices in ``ns_dtype`` (tall ones transposed), a ``comm_dtype`` staging copy of own
pieces when ``comm_dtype != ns_dtype`` (so that replicas round results alike) and scratch copies
of local shards; on the way back, its exchange buffers, NorMuon's rows and the own results a
later bucket of the slot would overwrite before they are applied. What a parameter's matrices
orthogonalize is written straight into its send-buffer segment or stack region when its shard
is one piece sent whole, else made whole in scratch and spread. docs/design.md ("Memory") lists
every buffer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from dmuon_fsdp import comm, elementwise
from dmuon_fsdp.buffers import BACK, SLOTS, TO, WORK, Pool, Region
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
from dmuon_fsdp.wires import as_wire, in_shape, piece_of, rows_of, staging, wired


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
    in_backward: bool  # steps start in backward (``dmuon_fsdp.backward``): its plan, groups, carrier


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
    pool: Pool,
) -> StepProgram:
    """Make every view a step of ``plan`` needs on this rank, into ``pool`` (grown first when it
    is too small; ``forms``: each matrix's NS form, as ``plan_program`` worked it out)."""
    entries = [Entry(i, g, p) for i, ((g, p), has) in enumerate(zip(indexed(groups), key.has_grad)) if has]
    binder = _Binder(plan, forms, schedule, entries, groups, state, settings, pool)
    if not pool.fits(binder.needed):  # measured only: bind again into arenas of the sizes asked
        pool.grow(binder.needed)
        binder = _Binder(plan, forms, schedule, entries, groups, state, settings, pool)
    buckets = binder.buckets
    wire = schedule.buckets[schedule.carrier].to_owners
    flags = Flags.bind(buckets[schedule.carrier].to_owners) if wire is not None and wire.flags else None
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
        muon=binder.muon_lists(state),
        adamw=binder.adamw(state),
        buckets=buckets,
        flags=flags,
        carrier=schedule.carrier,
        in_backward=settings.in_backward,
        counts=counts,
        generation=pool.generation,
    )


class _Binder:
    """Binds one program into a pool; holds what every part of the binding refers to.
    ``needed``: the bytes each arena had to hold (more than it has: the views are meta tensors,
    and the program is bound again into a grown pool)."""

    def __init__(
        self,
        plan: Plan,
        forms: Sequence[NSForm],
        schedule: RankSchedule,
        entries: list[Entry],
        groups: list[dict[str, Any]],
        state: Any,
        settings: Settings,
        pool: Pool,
    ):
        self.plan, self.forms, self.groups, self.settings = plan, forms, groups, settings
        self.schedule, self.state, self.pool = schedule, state, pool
        self.entries = tuple(entries)
        self.locals = [local_shard(e.param) for e in self.entries]
        self.muon = [i for i, e in enumerate(self.entries) if groups[e.group]["use_muon"]]
        self.staged = settings.comm_dtype != settings.ns_dtype
        # How many pieces of each parameter this rank orthogonalizes, over all buckets: a
        # parameter with one, its whole shard, has its NS input written straight in place.
        self.pieces: dict[int, int] = defaultdict(int)
        for bucket in schedule.buckets:
            sent = bucket.to_owners.send if bucket.to_owners else ()
            for t in [t for segment in sent for t in segment] + list(bucket.own_pieces):
                self.pieces[self.entry_of(t.matrix)] += 1
        self.needed: dict[tuple[str, int], int] = defaultdict(int)
        work = pool.regions()[WORK, 0]
        # One NS workspace for every batch of every bucket: they are orthogonalized one at a time.
        sizes = [
            Workspace.sizes((len(batch), s, l), form.segments)
            for bucket in schedule.buckets
            for (s, l, form), batch in self.members(bucket.owned).items()
        ]
        self.workspace = (
            tuple(work.take(max(size), settings.ns_dtype) for size in zip(*sizes)) if sizes else None
        )
        self.needed[WORK, 0] = work.used
        self.buckets = tuple(self.bucket(k, bucket) for k, bucket in enumerate(schedule.buckets))

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

    def batches(
        self, owned: Sequence[int], to: Region, back: Region
    ) -> tuple[tuple[Batch, ...], dict[int, Tensor], NeuronNorm | None, dict[int, tuple[Tensor, Tensor]]]:
        """Each batch of owned matrices as a (B, s, l) stack from ``to``, each matrix's (rows,
        cols) view into its stack (a transposed view for tall matrices), and NorMuon on those of
        NorMuon's groups with each one's rows' second moments and factors (from ``back``)."""
        batches, matrix_views, normed = [], {}, []
        for (s, l, form), members in self.members(owned).items():
            stack = to.take(len(members) * s * l, self.settings.ns_dtype).view(len(members), s, l)
            work = Workspace.for_stack(stack, form.segments, self.workspace)
            batches.append(Batch(stack, form.coefficients, form.eps, form.segments, work))
            for b, j in enumerate(members):
                matrix_views[j] = stack[b].mT if self.tall(j) else stack[b]
            if form.neurons is not None:
                shapes = [(self.plan.matrices[j].rows, self.plan.matrices[j].cols) for j in members]
                normed.append((stack, dict(zip(members, shapes)), form.neurons))
        bound = bind_neurons(normed, self.settings.ns_dtype, back.take)
        if bound is None:
            return tuple(batches), matrix_views, None, {}
        return tuple(batches), matrix_views, bound.norm, bound.rows

    def second_moments(self, t: Transfer) -> Tensor:
        """This rank's state of ``t``'s rows (NorMuon's second moments)."""
        param = self.entries[self.entry_of(t.matrix)].param
        return rows_of(local_shard(self.state[param][STATE_KEY]), t.piece)

    def bucket(self, k: int, bucket: BucketSchedule) -> BucketProgram:
        """Bucket ``k``'s views in its slot (see ``dmuon_fsdp.buffers``). NorMuon's row statistics
        are float32 everywhere but on the wire, which carries their bits (``wires.as_wire``)."""
        regions = self.pool.regions()
        to, back = regions[TO, k % SLOTS], regions[BACK, k % SLOTS]
        batches, matrix, neurons, rows = self.batches(bucket.owned, to, back)
        group = wire_group(self.settings).group
        comm_dtype, ns_dtype = self.settings.comm_dtype, self.settings.ns_dtype

        def region(t: Transfer) -> Tensor:
            p = t.piece
            return matrix[t.matrix][p.row : p.row + p.rows, p.col : p.col + p.cols]

        def owner_rows(t: Transfer) -> tuple[Tensor, Tensor]:
            """The owner's second moments and factors of ``t``'s rows."""
            v, f = rows[t.matrix]
            return v[t.piece.row : t.piece.row + t.piece.rows], f[t.piece.row : t.piece.row + t.piece.rows]

        def kept(transfers: Sequence[Transfer], dtype: torch.dtype, region: Region) -> list[Tensor]:
            """A copy of each own piece, without statistics, in ``dtype`` from ``region``."""
            return [s.piece for s in staging([replace(t, stats=0) for t in transfers], dtype, region)]

        # The way to the owners: NS inputs (``feeds``) into the send buffer and own stacks.
        to_owners = wired(bucket.to_owners, comm_dtype, to, group)
        feeds = [(slot.piece, slot.transfer) for slot in to_owners.sent]
        spread = Copies([], [])
        spread.dst.extend(s.stats for s in to_owners.sent if s.stats is not None)
        spread.src.extend(
            as_wire(self.second_moments(s.transfer), comm_dtype)
            for s in to_owners.sent
            if s.stats is not None
        )
        assemble = Copies([], [])
        for slot in to_owners.received:
            assemble.add(region(slot.transfer), slot.piece)
            if slot.stats is not None:
                assemble.add(as_wire(owner_rows(slot.transfer)[0], comm_dtype), slot.stats)
        own = list(bucket.own_pieces)
        if self.staged:
            for t, piece in zip(own, kept(own, comm_dtype, to)):
                feeds.append((piece, t))
                assemble.add(region(t), piece)
        else:
            feeds += [(region(t), t) for t in own]
        for t in own:
            if t.stats:
                assemble.add(owner_rows(t)[0], self.second_moments(t))
        stage = self.stage(feeds, spread, to)
        reads = tuple(sorted({self.entry_of(t.matrix) for _, t in feeds}))
        needs = tuple(sorted({self.entry_of(j) for j in self.plan_bucket(k)}))

        # The way back: results into the return buffer; own ones stay in the stack unless a
        # later bucket of this slot would overwrite it before they are applied.
        from_owners = wired(bucket.from_owners, comm_dtype, back, group)
        collect = Copies([], [])
        for slot in from_owners.sent:
            collect.add(slot.piece, region(slot.transfer))
            if slot.stats is not None:
                v, f = owner_rows(slot.transfer)
                collect.add(slot.second_moments, as_wire(v, comm_dtype))
                collect.add(slot.factors, as_wire(f, comm_dtype))
        writes = Copies([], [])  # the rows' new second moments into the state, their factors out
        count = sum(slot.transfer.piece.rows for slot in from_owners.received if slot.stats is not None)
        factors = back.take(count, torch.float32)
        returned, offset = [], 0  # (transfer, its result, its rows' new second moments, factors)
        for slot in from_owners.received:
            t, stats = slot.transfer, ()
            if slot.stats is not None:
                stats = self.second_moments(t), factors[offset : offset + t.piece.rows]
                writes.add(as_wire(stats[0], comm_dtype), slot.second_moments)
                writes.add(as_wire(stats[1], comm_dtype), slot.factors)
                offset += t.piece.rows
            returned.append((t, slot.piece, *stats))
        results = list(bucket.own_results)
        if self.staged or k + SLOTS < len(self.schedule.buckets):
            # through the wire's dtype (replicas round results alike), or kept from being overwritten
            copies = kept(results, comm_dtype if self.staged else ns_dtype, back)
            for t, piece in zip(results, copies):
                collect.add(piece, region(t))
        else:
            copies = [region(t) for t in results]
        for t, direction in zip(results, copies):
            stats = ()
            if t.stats:
                v, f = owner_rows(t)
                stats = self.second_moments(t), f
                writes.add(stats[0], v)
            returned.append((t, direction, *stats))
        updates: dict[tuple[int, float], Updates] = {}
        for t, direction, *stats in returned:
            cls = self.update_class(t.matrix)
            u = updates.setdefault(cls, Updates(*cls, [], [], [] if stats else None))
            u.params.append(piece_of(self.locals[self.entry_of(t.matrix)], t.piece))
            u.directions.append(direction)
            if stats:
                u.factors.append(stats[1].view(-1, 1))
        for name, r in ((TO, to), (BACK, back)):
            self.needed[name, k % SLOTS] = max(self.needed[name, k % SLOTS], r.used)
        return BucketProgram(
            reads,
            needs,
            stage,
            to_owners.exchange,
            assemble,
            batches,
            neurons,
            collect,
            from_owners.exchange,
            tuple(updates.values()),
            writes,
        )

    def stage(self, feeds: list[tuple[Tensor, Transfer]], spread: Copies, to: Region) -> Stage:
        """Where one bucket's NS inputs are written (``feeds``: destination and piece): per Muon
        group, straight into the destination when it is the parameter's one piece and its whole
        shard, else through a scratch copy of the local shard (from ``to``) that ``spread``
        copies into place (a parameter with pieces in several buckets is made whole in each)."""
        by_entry: dict[int, list[tuple[Tensor, Transfer]]] = defaultdict(list)
        for view, t in feeds:
            by_entry[self.entry_of(t.matrix)].append((view, t))
        inputs = []
        for group, members in self._by_group(muon=True).items():
            straight, through = [], []
            for i in members:
                if i not in by_entry:
                    continue  # nothing of it in this bucket (or another replica sends it)
                local = self.locals[i]
                view = by_entry[i][0][0]
                direct = in_shape(view, local) if self.pieces[i] == 1 else None
                if direct is not None:  # the one piece is the whole shard
                    straight.append((i, direct))
                    continue
                scratch = to.take(local.numel(), local.dtype).view(local.shape)
                through.append((i, scratch))
                spread.dst.extend(view for view, _ in by_entry[i])
                spread.src.extend(piece_of(scratch, t.piece) for _, t in by_entry[i])
            buffers = {i: local_shard(self.state[self.entries[i].param]["momentum_buffer"]) for i in members}
            inputs.extend(
                NSInputs(
                    group,
                    tuple(i for i, _ in chosen),
                    [buffers[i] for i, _ in chosen],
                    [d for _, d in chosen],
                    all(d.dtype == buffers[i].dtype for i, d in chosen),
                )
                for chosen in (straight, through)
                if chosen
            )
        return Stage(tuple(inputs), spread)

    def muon_lists(self, state: Any) -> tuple[MuonLists, ...]:
        lists = []
        for group, members in self._by_group(muon=True).items():
            params = [self.locals[i] for i in members]
            buffers = [local_shard(state[self.entries[i].param]["momentum_buffer"]) for i in members]
            lists.append(MuonLists(group, tuple(members), params, buffers))
        return tuple(lists)

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
