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
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dmuon_fsdp import checks, comm, elementwise
from dmuon_fsdp.checks import Flags, StepKey
from dmuon_fsdp.layouts import Piece, local_shard
from dmuon_fsdp.newton_schulz import Workspace
from dmuon_fsdp.planner import Plan
from dmuon_fsdp.program import (
    AdamWLists,
    Batch,
    BucketProgram,
    Copies,
    Entry,
    MuonLists,
    NSForm,
    NSInputs,
    Stage,
    StepProgram,
    Updates,
)
from dmuon_fsdp.schedule import BucketSchedule, RankSchedule, Transfer, Wire


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
    binder = _Binder(plan, forms, schedule, entries, groups, settings)
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
        counts=counts,
        buffer_bytes=binder.allocated,
    )


def _nbytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _piece(local: Tensor, piece: Piece) -> Tensor:
    """A rank's piece inside a tensor shaped like its local shard (a view)."""
    return local.view(-1, piece.cols)[piece.local_row : piece.local_row + piece.rows]


def _views(buffer: Tensor, segments: Sequence[Sequence[Transfer]], flags: int) -> list[list[Tensor]]:
    """Views of each piece in a flat buffer laid out segment after segment, flags first."""
    views, offset = [], 0
    for segment in segments:
        offset += flags
        views.append([])
        for t in segment:
            views[-1].append(buffer[offset : offset + t.piece.numel].view(t.piece.rows, t.piece.cols))
            offset += t.piece.numel
    if offset != buffer.numel():
        raise RuntimeError(f"exchange buffer of {buffer.numel()} elements, its pieces and flags use {offset}")
    return views


def _staging(transfers: Sequence[Transfer], dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    return _views(
        torch.empty(sum(t.piece.numel for t in transfers), dtype=dtype, device=device), [transfers], 0
    )[0]


@dataclass(frozen=True)
class _Wired:
    """One wire bound to buffers: the exchange and each transfer's send and receive view."""

    exchange: comm.Exchange | None
    sent: list[tuple[Transfer, Tensor]]
    received: list[tuple[Transfer, Tensor]]


def _wired(wire: Wire | None, settings: Settings, group: Any) -> _Wired:
    if wire is None:
        return _Wired(None, [], [])
    buffers = []
    for counts, segments in ((wire.send_counts, wire.send), (wire.receive_counts, wire.receive)):
        buffer = torch.zeros(sum(counts), dtype=settings.comm_dtype, device=settings.device)
        views = _views(buffer, segments, wire.flags)
        buffers.append(
            (buffer, [(t, v) for segment, vs in zip(segments, views) for t, v in zip(segment, vs)])
        )
    (send, sent), (receive, received) = buffers
    return _Wired(comm.Exchange(send, receive, wire.send_counts, wire.receive_counts, group), sent, received)


def _in_shape(view: Tensor, local: Tensor) -> Tensor | None:
    """``view`` seen in the local shard's shape, when it is the whole shard and can be."""
    if view.shape == local.shape:
        return view
    return view.view(local.shape) if view.numel() == local.numel() and view.is_contiguous() else None


class _Binder:
    """Binds one program; holds what every part of the binding refers to."""

    def __init__(
        self,
        plan: Plan,
        forms: Sequence[NSForm],
        schedule: RankSchedule,
        entries: list[Entry],
        groups: list[dict[str, Any]],
        settings: Settings,
    ):
        self.plan, self.forms, self.groups, self.settings = plan, forms, groups, settings
        self.schedule = schedule
        self.entries = tuple(entries)
        self.locals = [local_shard(e.param) for e in self.entries]
        self.muon = [i for i, e in enumerate(self.entries) if groups[e.group]["use_muon"]]
        self.staged = settings.comm_dtype != settings.ns_dtype
        # (destination, this rank's piece, its bucket) to fill with NS inputs
        self.feeds: list[tuple[Tensor, Transfer, int]] = []
        self.merged: dict[tuple[int, float], Updates] = {}
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
        self.allocated += _nbytes(*(self.workspace or ()))

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
        """Owned matrices by (short side, long side, NS form): the batches of one bucket."""
        members: dict[tuple[int, int, NSForm], list[int]] = defaultdict(list)
        for j in owned:
            m = self.plan.matrices[j]
            members[(min(m.rows, m.cols), max(m.rows, m.cols), self.forms[j])].append(j)
        return members

    def batches(self, owned: Sequence[int]) -> tuple[tuple[Batch, ...], dict[int, Tensor]]:
        """Each batch of owned matrices as a new (B, s, l) stack, and each matrix's (rows, cols)
        view into its stack (a transposed view for tall matrices)."""
        batches, matrix_views = [], {}
        for (s, l, form), members in self.members(owned).items():
            stack = torch.zeros(len(members), s, l, dtype=self.settings.ns_dtype, device=self.settings.device)
            self.allocated += _nbytes(stack)
            work = Workspace.for_stack(stack, form.segments, self.workspace)
            batches.append(Batch(stack, form.coefficients, form.eps, form.segments, work))
            for b, j in enumerate(members):
                tall = self.plan.matrices[j].rows > self.plan.matrices[j].cols
                matrix_views[j] = stack[b].mT if tall else stack[b]
        return tuple(batches), matrix_views

    def bucket(self, k: int, bucket: BucketSchedule) -> BucketProgram:
        """Bucket ``k``'s exchanges, stacks, copies and updates."""
        batches, matrix = self.batches(bucket.owned)
        fed = len(self.feeds)
        group = wire_group(self.settings).group

        def region(t: Transfer) -> Tensor:
            p = t.piece
            return matrix[t.matrix][p.row : p.row + p.rows, p.col : p.col + p.cols]

        def staging(transfers: Sequence[Transfer]) -> list[Tensor]:
            views = _staging(transfers, self.settings.comm_dtype, self.settings.device)
            self.allocated += _nbytes(*views)
            return views

        to_owners = _wired(bucket.to_owners, self.settings, group)
        from_owners = _wired(bucket.from_owners, self.settings, group)
        for wired in (to_owners, from_owners):
            if wired.exchange is not None:
                self.allocated += _nbytes(wired.exchange.send, wired.exchange.receive)
        self.feeds += [(view, t, k) for t, view in to_owners.sent]
        assemble = Copies(
            [region(t) for t, _ in to_owners.received], [view for _, view in to_owners.received]
        )
        own = list(bucket.own_pieces)
        if self.staged:
            stage = staging(own)
            self.feeds += [(view, t, k) for view, t in zip(stage, own)]
            assemble.dst.extend(region(t) for t in own)
            assemble.src.extend(stage)
        else:
            self.feeds += [(region(t), t, k) for t in own]
        reads = tuple(sorted({self.entry_of(t.matrix) for _, t, _ in self.feeds[fed:]}))
        needs = tuple(sorted({self.entry_of(j) for j in self.plan_bucket(k)}))

        collect = Copies([view for _, view in from_owners.sent], [region(t) for t, _ in from_owners.sent])
        returned, own = list(from_owners.received), list(bucket.own_results)
        if self.staged:
            stage = staging(own)
            collect.dst.extend(stage)
            collect.src.extend(region(t) for t in own)
            returned += list(zip(own, stage))
        else:
            returned += [(t, region(t)) for t in own]
        mine: dict[tuple[int, float], Updates] = {}
        for t, direction in returned:
            target = _piece(self.locals[self.entry_of(t.matrix)], t.piece)
            for table in (mine, self.merged):
                u = table.setdefault(
                    self.update_class(t.matrix), Updates(*self.update_class(t.matrix), [], [])
                )
                u.params.append(target)
                u.directions.append(direction)
        return BucketProgram(
            reads,
            needs,
            to_owners.exchange,
            assemble,
            batches,
            collect,
            from_owners.exchange,
            tuple(mine.values()),
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
        lists = []
        for group, members in self._by_group(muon=True).items():
            buffer = {i: local_shard(state[self.entries[i].param]["momentum_buffer"]) for i in members}
            for s, (inputs, spread) in enumerate(stages):
                straight, through = [], []
                for i in members:
                    if i not in first or first[i] != s:
                        continue  # nothing of it is orthogonalized here (another replica sends it)
                    local = self.locals[i]
                    direct = _in_shape(feeds[i][0][0], local) if len(feeds[i]) == 1 else None
                    if direct is not None:  # the one piece is the whole shard
                        straight.append((i, direct))
                        continue
                    scratch = torch.empty_like(local)
                    self.allocated += _nbytes(scratch)
                    through.append((i, scratch))
                    spread.dst.extend(view for view, _ in feeds[i])
                    spread.src.extend(_piece(scratch, t.piece) for _, t in feeds[i])
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
