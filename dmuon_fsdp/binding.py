"""Binding a rank's schedule to tensors: every buffer and view of a step program, made once.

Buffers: per bucket a send and a receive buffer for each exchange (``comm_dtype``, laid out as
the schedule says), a (B, s, l) stack per batch of owned matrices of one shape, NS settings and
NS form (``ns_dtype``; tall matrices stored transposed, so they batch with wide ones of the same
sides), and one NS workspace shared by all stacks. Own pieces never enter an exchange buffer;
when ``comm_dtype`` differs from ``ns_dtype`` they pass through a local ``comm_dtype`` staging
buffer instead, so that every rank's copy of a result is rounded alike (replicas stay equal).

Views: what a parameter's matrices orthogonalize is written straight into its destination (a
send-buffer segment or a stack region, viewed in the local shard's shape) when the local shard
is a single piece sent whole; otherwise into a scratch copy of the shard, spread by one foreach
copy. Buffers live as long as the program and are reused every step: on CUDA, steps must run
on one stream (or be synchronized when it changes), as the exchanges are ordered on it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dmuon_fsdp import elementwise
from dmuon_fsdp.layouts import Piece, local_shard
from dmuon_fsdp.newton_schulz import Coefficients, Workspace, resolve_coefficients
from dmuon_fsdp.planner import Plan
from dmuon_fsdp.program import (
    AdamWLists,
    Batch,
    BucketProgram,
    Copies,
    Entry,
    Exchange,
    Flags,
    MomentumInput,
    MuonLists,
    StepProgram,
    Updates,
)
from dmuon_fsdp.schedule import FLAG_ELEMENTS, BucketSchedule, RankSchedule, Transfer, Wire


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
    return _views(torch.empty(sum(t.piece.numel for t in transfers), dtype=dtype, device=device), [transfers], 0)[0]


def _exchange(wire: Wire | None, dtype: torch.dtype, device: torch.device):
    """(Exchange, [(transfer, send view)], [(transfer, receive view)]) of one wire."""
    if wire is None:
        return None, [], []
    send_counts, receive_counts = wire.send_counts, wire.receive_counts
    send = torch.zeros(sum(send_counts), dtype=dtype, device=device)
    receive = torch.zeros(sum(receive_counts), dtype=dtype, device=device)
    pairs = []
    for buffer, segments in ((send, wire.send), (receive, wire.receive)):
        views = _views(buffer, segments, wire.flags)
        pairs.append([(t, v) for segment, vs in zip(segments, views) for t, v in zip(segment, vs)])
    return Exchange(send, receive, send_counts, receive_counts), pairs[0], pairs[1]


def _flag_index(counts: list[int], device: torch.device) -> Tensor:
    """Positions of every segment's flags in a buffer: (segments, FLAG_ELEMENTS)."""
    starts = torch.tensor([sum(counts[:g]) for g in range(len(counts))], dtype=torch.int64)
    return (starts[:, None] + torch.arange(FLAG_ELEMENTS)).to(device)


@dataclass(frozen=True)
class _Stack:
    """A batch's stack and NS settings, before the shared workspace exists."""

    stack: Tensor
    coefficients: tuple[Coefficients, ...]
    eps: float
    segments: tuple[int, ...]


def _stacks(plan: Plan, owned: Sequence[int], settings: Callable, dtype: torch.dtype, device: torch.device):
    """Batches of owned matrices by (s, l, NS settings, NS form), each a new (B, s, l) stack,
    and each matrix's (rows, cols) view into its stack (a transposed view for tall matrices)."""
    members: dict[tuple, list[int]] = defaultdict(list)
    for j in owned:
        m = plan.matrices[j]
        members[(min(m.rows, m.cols), max(m.rows, m.cols), *settings(j), m.ns_segments)].append(j)
    stacks, matrix_views = [], {}
    for (s, l, coefficients, eps, segments), batch in members.items():
        stack = torch.zeros(len(batch), s, l, dtype=dtype, device=device)
        stacks.append(_Stack(stack, coefficients, eps, segments))
        for b, j in enumerate(batch):
            matrix_views[j] = stack[b].mT if plan.matrices[j].rows > plan.matrices[j].cols else stack[b]
    return stacks, matrix_views


def _shared_workspace(stacks: list[_Stack]) -> tuple[Tensor, Tensor] | None:
    """Flat buffers large enough for every stack's ``Workspace``: they share one, being
    orthogonalized one at a time."""
    if not stacks:
        return None
    sizes = [Workspace.sizes(s.stack.shape, s.segments) for s in stacks]
    return tuple(stacks[0].stack.new_empty(max(size)) for size in zip(*sizes))


def _in_shape(view: Tensor, local: Tensor) -> Tensor | None:
    """``view`` seen in the local shard's shape, when it is the whole shard and can be."""
    if view.shape == local.shape:
        return view
    return view.view(local.shape) if view.numel() == local.numel() and view.is_contiguous() else None


class _Binder:
    """Builds one program; holds what every part of the build refers to."""

    def __init__(self, plan, schedule, entries, groups, ns_dtype, comm_dtype, device):
        self.plan, self.schedule, self.groups = plan, schedule, groups
        self.entries = tuple(entries)
        self.locals = [local_shard(e.param) for e in self.entries]
        self.muon = [i for i, e in enumerate(self.entries) if groups[e.group]["use_muon"]]
        self.ns_dtype, self.comm_dtype, self.device = ns_dtype, comm_dtype, device
        self.staged = comm_dtype != ns_dtype
        self.feeds: list[tuple[Tensor, Transfer]] = []  # (destination, this rank's piece) to fill
        self.merged: dict[tuple[int, float], Updates] = {}

    def entry_of(self, j: int) -> int:
        return self.muon[self.plan.param_of[j]]

    def settings(self, j: int) -> tuple:
        group = self.groups[self.entries[self.entry_of(j)].group]
        return resolve_coefficients(group["ns_coefficients"], group["ns_steps"]), float(group["eps"])

    def update_class(self, j: int) -> tuple[int, float]:
        group = self.entries[self.entry_of(j)].group
        m = self.plan.matrices[j]
        return group, elementwise.adjusted_lr(1.0, self.groups[group]["adjust_lr_fn"], m.rows, m.cols)

    def bucket(self, bucket: BucketSchedule) -> tuple:
        """One bucket's exchanges, copies and updates (its stacks still without workspace)."""
        stacks, matrix = _stacks(self.plan, bucket.owned, self.settings, self.ns_dtype, self.device)

        def region(t: Transfer) -> Tensor:
            p = t.piece
            return matrix[t.matrix][p.row : p.row + p.rows, p.col : p.col + p.cols]

        gather, sent, received = _exchange(bucket.gather, self.comm_dtype, self.device)
        self.feeds += [(view, t) for t, view in sent]
        assemble = Copies([region(t) for t, _ in received], [view for _, view in received])
        local = list(bucket.gather_local)
        if self.staged:
            stage = _staging(local, self.comm_dtype, self.device)
            self.feeds += list(zip(stage, local))
            assemble.dst.extend(region(t) for t in local)
            assemble.src.extend(stage)
        else:
            self.feeds += [(region(t), t) for t in local]

        scatter, sent, received = _exchange(bucket.scatter, self.comm_dtype, self.device)
        results = Copies([view for _, view in sent], [region(t) for t, _ in sent])
        local = list(bucket.scatter_local)
        if self.staged:
            stage = _staging(local, self.comm_dtype, self.device)
            results.dst.extend(stage)
            results.src.extend(region(t) for t in local)
            received += list(zip(local, stage))
        else:
            received += [(t, region(t)) for t in local]
        mine: dict[tuple[int, float], Updates] = {}
        for t, update in received:
            target = _piece(self.locals[self.entry_of(t.matrix)], t.piece)
            for table in (mine, self.merged):
                u = table.setdefault(self.update_class(t.matrix), Updates(*self.update_class(t.matrix), [], []))
                u.targets.append(target)
                u.updates.append(update)
        return gather, assemble, stacks, results, scatter, tuple(mine.values())

    def momentum(self, state: Any) -> tuple[tuple[MuonLists, ...], Copies]:
        """Per Muon group: where its inputs are written, straight or through scratch + pack."""
        feeds: dict[int, list[tuple[Tensor, Transfer]]] = defaultdict(list)
        for view, t in self.feeds:
            feeds[self.entry_of(t.matrix)].append((view, t))
        pack = Copies([], [])
        lists = []
        for group, members in self._by_group(muon=True).items():
            straight, through = [], []
            for i in members:
                local = self.locals[i]
                if not feeds[i]:
                    continue  # nothing of it is orthogonalized here (another replica sends it)
                direct = _in_shape(feeds[i][0][0], local) if len(feeds[i]) == 1 else None
                if direct is not None:  # the one piece is the whole shard
                    straight.append((i, direct))
                    continue
                scratch = torch.empty_like(local)
                through.append((i, scratch))
                pack.dst.extend(view for view, _ in feeds[i])
                pack.src.extend(_piece(scratch, t.piece) for _, t in feeds[i])
            buffer = {i: local_shard(state[self.entries[i].param]["momentum_buffer"]) for i in members}
            inputs = tuple(
                MomentumInput(tuple(i for i, _ in chosen), [buffer[i] for i, _ in chosen], [d for _, d in chosen],
                              all(d.dtype == buffer[i].dtype for i, d in chosen))
                for chosen in (straight, through) if chosen
            )  # fmt: skip
            params = [self.locals[i] for i in members]
            lists.append(MuonLists(group, tuple(members), params, [buffer[i] for i in members], inputs))
        return tuple(lists), pack

    def adamw(self, state: Any) -> tuple[AdamWLists, ...]:
        lists = []
        for group, members in self._by_group(muon=False).items():
            params = [self.locals[i] for i in members]
            states = [state[self.entries[i].param] for i in members]
            exp_avgs, exp_avg_sqs = ([local_shard(st[k]) for st in states] for k in ("exp_avg", "exp_avg_sq"))
            lists.append(AdamWLists(group, tuple(members), params, exp_avgs, exp_avg_sqs, [st["step"] for st in states],
                                    elementwise.adamw_kernel(params)))  # fmt: skip
        return tuple(lists)

    def _by_group(self, muon: bool) -> dict[int, list[int]]:
        """Entry indices (= positions in the step's gradient list) by param group."""
        out: dict[int, list[int]] = defaultdict(list)
        for i, e in enumerate(self.entries):
            if self.groups[e.group]["use_muon"] == muon:
                out[e.group].append(i)
        return out


def build_program(
    plan: Plan,
    schedule: RankSchedule,
    entries: Sequence[Entry],
    groups: list[dict[str, Any]],
    state: Any,
    *,
    key: tuple,
    digest: int,
    flag_values: list[float],
    ns_dtype: torch.dtype,
    comm_dtype: torch.dtype,
    device: torch.device,
) -> StepProgram:
    """Allocate every buffer and make every view a step of ``plan`` needs on this rank.

    ``entries`` are the parameters with gradients; the Muon ones in the order ``plan.param_of``
    numbers them. ``flag_values`` (see ``grad_checks``) are written into the first exchange.
    """
    binder = _Binder(plan, schedule, entries, groups, ns_dtype, comm_dtype, device)
    parts = [binder.bucket(bucket) for bucket in schedule.buckets]
    flat = _shared_workspace([stack for part in parts for stack in part[2]])
    buckets = tuple(
        BucketProgram(gather, assemble, tuple(Batch(s.stack, s.coefficients, s.eps, s.segments,
                                                    Workspace.for_stack(s.stack, s.segments, flat))
                                              for s in stacks), results, scatter, updates)
        for gather, assemble, stacks, results, scatter, updates in parts
    )  # fmt: skip
    muon, pack = binder.momentum(state)
    flags = None
    first = buckets[0].gather
    if first is not None and schedule.buckets[0].gather.flags:
        values = torch.tensor(flag_values, dtype=comm_dtype, device=device)
        send = _flag_index(first.send_counts, device)
        flags = Flags(send, _flag_index(first.receive_counts, device), send[:, 1].contiguous(), values)
        first.send.index_put_((flags.send,), values)
    return StepProgram(
        key=key, digest=digest, plan=plan, schedule=schedule, entries=binder.entries,
        storage=tuple(t.data_ptr() for t in binder.locals), grad_shapes=[t.shape for t in binder.locals],
        found=torch.zeros(1, device=device), one=torch.ones((), device=device),
        state_slots=tuple((e.param, key, value) for e in binder.entries for key, value in state[e.param].items()),
        muon=muon, adamw=binder.adamw(state), pack=pack, buckets=buckets, flags=flags,
        all_updates=tuple(binder.merged.values()), counts=_counts(plan, schedule, buckets, flags, comm_dtype),
    )  # fmt: skip


def _counts(plan: Plan, schedule: RankSchedule, buckets, flags: Flags | None, dtype: torch.dtype) -> dict[str, int]:
    size = dtype.itemsize
    return {
        "ns_flops": sum(plan.matrices[j].cost for bucket in schedule.buckets for j in bucket.owned),
        "bytes_sent": schedule.elements(sent=True) * size,
        "bytes_received": schedule.elements(sent=False) * size,
        "flag_bytes": flags.send.numel() * size if flags is not None else 0,
        "collectives": sum(e is not None for b in buckets for e in (b.gather, b.scatter)),
    }
