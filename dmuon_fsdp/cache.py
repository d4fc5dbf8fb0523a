"""The program cache: each step key's program planned, agreed on, bound to tensors, and kept.

``plan_program`` runs the pipeline for a ``StepKey``: layouts (every rank's piece of each Muon
matrix) -> each matrix's Newton-Schulz form and cost -> plan (owners, buckets) -> agreement over
the ranks (one ``all_reduce``, with a check on) -> this rank's schedule. ``bind`` then makes
every view a step of it needs, into the shared pool: each bucket takes its buffers from its
slot's arenas ([Note: slots] in ``dmuon_fsdp.exchange``): on the way to the owners, its exchange
buffers in ``comm_dtype``, one (B, s, l) stack per batch of owned matrices in ``ns_dtype`` (tall
ones transposed), a ``comm_dtype`` staging copy of own pieces when ``comm_dtype != ns_dtype``
(so that replicas round results alike) and scratch copies of local shards; on the way back, its
exchange buffers, a row variant's numbers and the own results a later bucket of the slot would overwrite
before they are applied. What a parameter's matrices orthogonalize is written straight into its
send-buffer segment or stack region when its shard is one piece sent whole, else made whole in
scratch and spread. docs/design.md ("Memory") lists every buffer.

``ProgramCache`` keeps the plans of the step keys seen lately and their bound programs, and
decides which one a step runs: bound, bound anew, or planned.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn

import torch
from torch import Tensor

from dmuon_fsdp import comm
from dmuon_fsdp.checks import (
    FLAG_ELEMENTS,
    Flags,
    StepKey,
    agree_on_plan,
    agreed,
    key_agreement,
    nonfinite_groups,
    raise_alike,
    stale_layouts,
)
from dmuon_fsdp.exchange import (
    BACK,
    SLOTS,
    TO,
    WORK,
    BucketSchedule,
    PerRow,
    Pool,
    RankSchedule,
    Region,
    Transfer,
    Wired,
    as_wire,
    in_shape,
    piece_of,
    rank_schedule,
    rows_of,
    staging,
    wired,
)
from dmuon_fsdp.layouts import MatrixLayout, describe_params
from dmuon_fsdp.newton_schulz import Workspace, ns_segments, resolve_coefficients, segments_flops
from dmuon_fsdp.options import check_groups
from dmuon_fsdp.param_groups import group_params, indexed
from dmuon_fsdp.planner import Plan, build_plan
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
from dmuon_fsdp.state import adamw_kernel, adjusted_lr, lerp_math_dtype, local_shard, restore_state
from dmuon_fsdp.variants import RowBatch, RowStep, RowVariant, row_variant


@dataclass(frozen=True)
class Ready:
    """The program for a step; ``bound`` False when a parameter or its state changed layout
    since it was bound (the step then reports that on every rank instead of running);
    ``agreement``: the agreement on the step key under way, which the step waits for before its
    first exchange (``agreed``)."""

    program: StepProgram
    bound: bool
    agreement: comm.Handle | None = None


@dataclass(frozen=True)
class Planned:
    """A step key's plan, each matrix's NS form and this rank's schedule: a program but its
    tensors (no memory to speak of)."""

    plan: Plan
    forms: tuple[NSForm, ...]
    schedule: RankSchedule


PROGRAMS_KEPT = 4  # step keys whose programs are kept, least recently used dropped
AGREE_UNTIL_STEADY = 100  # steps a key must hold before keys are no longer agreed first


class ProgramCache:
    """The optimizer's step programs, for the step keys seen lately (``PROGRAMS_KEPT`` at most,
    each program with buffers of its own), and which one a step runs.

    Every rank must run the same program, or their exchanges would not match. With checks on, a
    program's first exchange carries every rank's key, so a step whose key changed runs the
    program in use once more, its flags tell that every rank changed alike (``Verdict.REBUILD``)
    and ``follow`` takes the new key's program, kept or planned, for the step's second run. Once
    a step returns to a key whose plan is kept (a branch used every other step, an MoE block
    some steps skip), each step also agrees on its key with one small ``all_reduce``
    (``key_agreement``, waited for before the step's first exchange) and runs that key's
    program at once, until the key has stayed the same for ``AGREE_UNTIL_STEADY`` steps. The
    kept plans and their order follow from the keys every rank agreed on; an error every rank
    raises (``raise_alike``) lets all of them go, so that no rank keeps what another did not.
    Without checks, each rank takes its key's program."""

    def __init__(self) -> None:
        self._plans: OrderedDict[StepKey, Planned] = OrderedDict()
        self._bound: dict[StepKey, StepProgram] = {}  # their programs, unless to be bound anew
        self._key: StepKey | None = None  # the key of the program in use
        self._asked: StepKey | None = None  # the key of the last step
        self._again = False  # the next ``get`` runs the last step again (after ``follow``)
        self._repeated = False  # the last two steps had one key
        self._agreeing = False  # keys are agreed before each step
        self._steady = 0  # steps since the key last changed
        self._pool: Pool | None = None  # the buffers every kept program is bound into

    @property
    def current(self) -> StepProgram | None:
        return self._bound.get(self._key) if self._key is not None else None

    @property
    def plan(self) -> Plan | None:
        """The plan in use (also when its program is to be bound anew)."""
        planned = self._plans.get(self._key) if self._key is not None else None
        return planned.plan if planned is not None else None

    @property
    def buffer_bytes(self) -> int:
        """The bytes of the buffers the kept programs share (``dmuon_fsdp.exchange``)."""
        return self._pool.nbytes if self._pool is not None else 0

    @property
    def repeated(self) -> bool:
        """Whether the last step had the key of the one before (or none came before): hooks are
        worth arming only for a program the next step is likely to run."""
        return self._repeated

    def clear(self) -> None:
        """Parameters, groups or meshes changed: plan at the next step."""
        self._plans.clear()
        self._bound.clear()
        self._key, self._agreeing, self._pool = None, False, None

    def raise_alike(
        self, groups: list[dict[str, Any]], state: Any, names: dict, settings: Settings, shared: bool
    ) -> NoReturn:
        """Let every kept program go and raise the error every rank raises alike (a collective
        when ``shared``): no rank keeps what another did not."""
        self.clear()
        _raise_alike(groups, state, names, settings, shared)

    def state_replaced(self) -> None:
        """The state tensors were replaced wholesale (``load_state_dict``): every program is bound
        anew when next used (its buffers and views go now, with the old tensors they hold, except
        a program armed for a step begun in backward, which goes at the next step)."""
        self._bound.clear()

    def follow(self) -> None:
        """Every rank's key changed alike to the last step's (``Verdict.REBUILD``): the step runs
        again (no agreement needed: the flags were one) with its key's program."""
        assert self._asked is not None  # a step ran: ``get`` set it
        self._use(self._asked)
        self._again = True

    def _use(self, key: StepKey) -> None:
        if key == self._key:
            self._steady += 1
            self._agreeing &= self._steady < AGREE_UNTIL_STEADY
        else:
            self._agreeing |= key in self._plans  # a return to a key seen lately
            self._key, self._steady = key, 0

    def get(
        self,
        key: StepKey,
        params: list[Tensor],
        groups: list[dict[str, Any]],
        state: Any,
        names: dict,
        settings: Settings,
    ) -> Ready:
        """The program for a step of ``key`` (see the class docstring); ``params`` are the
        parameters of ``groups`` in optimizer order."""
        again, self._again, agreement = self._again, False, None
        if not again:
            self._repeated, self._asked = self._asked in (None, key), key
        checked = settings.check_grads and key.checked and len(settings.site.ranks) > 1  # flags travel
        if checked and self._agreeing and not again:
            agreement = key_agreement(key.digest, settings.site.group.process_group, settings.device)
            # A plan to make, or steps begun in backward: agreed first; else while its NS inputs
            # are made (every rank keeps the same plans: an agreed key means the same program)
            if key not in self._plans or settings.in_backward:
                if not agreed(agreement, key.digest):
                    self.raise_alike(groups, state, names, settings, shared=True)
                agreement = None
            self._use(key)
        elif not checked or self._key is None:
            self._use(key)
        in_use = self._key
        assert in_use is not None  # ``_use`` set it, now or at an earlier step
        program = self.current
        if self._pool is None:
            self._pool = Pool(settings.device)
        if program is None or program.generation != self._pool.generation or program.moved(params, state):
            self._bound.pop(in_use, None)
            del program
            restore_state(groups, state)  # state cleared by hand starts afresh
            planned = self._plans.get(in_use)
            if planned is None:
                while len(self._plans) >= PROGRAMS_KEPT:
                    self._bound.pop(self._plans.popitem(last=False)[0], None)
                planned = self._plans[in_use] = plan_program(in_use, groups, state, names, settings)
            generation = self._pool.generation
            program = bind(
                planned.plan, planned.forms, planned.schedule, in_use, groups, state, settings, self._pool
            )
            if self._pool.generation != generation:  # the pool grew: the others bind anew when used
                self._bound.clear()
            if stale_layouts(params, state):  # every rank hears of it at the verdict
                return Ready(program, bound=False, agreement=agreement)  # (not kept: bound to old state)
            self._bound[in_use] = program
        self._plans.move_to_end(in_use)
        return Ready(program, bound=True, agreement=agreement)


def _raise_alike(
    groups: list[dict[str, Any]], state: Any, names: dict, settings: Settings, shared: bool
) -> NoReturn:
    """Raise the error every rank agrees on (``checks.raise_alike``; a collective when ``shared``)."""
    params = group_params(groups)
    group = settings.site.group.process_group if shared else None
    raise_alike(params, names, groups, group, settings.nonfinite, stale_layouts(params, state))


def _forms(
    matrices: Sequence[MatrixLayout], groups: Sequence[dict[str, Any]], dtype: torch.dtype
) -> list[NSForm]:
    """Each matrix's form, from the options of its parameter's group (``groups[j]``)."""
    out = []
    for m, group in zip(matrices, groups, strict=True):
        coefficients = resolve_coefficients(group["ns_coefficients"], group["ns_steps"])
        segments = ns_segments(group["ns_algorithm"], coefficients, dtype, m.rows, m.cols)
        variant = row_variant(group)
        settings = variant.settings(group) if variant is not None else ()
        out.append(NSForm(coefficients, float(group["eps"]), segments, variant, settings))
    return out


def plan_program(
    key: StepKey, groups: list[dict[str, Any]], state: Any, names: dict, settings: Settings
) -> Planned:
    """A new plan for ``key`` and this rank's schedule; with a check on, one ``all_reduce``
    tells every rank of any rank's trouble and (with ``check_grads``) that all built the same
    plan."""
    muon = [
        (g, p)
        for (g, p), has in zip(indexed(groups), key.has_grad, strict=True)
        if has and groups[g]["use_muon"]
    ]
    described = [(p, names[p], groups[g]) for g, p in muon]
    layouts, param_of = describe_params(described, settings.site.ranks)
    forms = _forms(layouts, [described[i][2] for i in param_of], settings.ns_dtype)
    costs = [segments_flops(m.rows, m.cols, f.segments) for m, f in zip(layouts, forms, strict=True)]
    site = settings.site.group
    plan = build_plan(
        layouts,
        costs,
        len(site.peers),
        settings.bucket_bytes,
        settings.comm_dtype.itemsize,
        param_of,
    )
    trouble = bool(stale_layouts(group_params(groups), state))
    group = site.process_group if key.checked else None
    shared = group is not None
    if group is not None:
        identities = [
            (f"{m.name} ({m.rows}x{m.cols})", m.pieces, m.replicas, cost)
            for m, cost in zip(layouts, costs, strict=True)
        ]
        trouble = agree_on_plan(
            trouble,
            key.digest,
            plan.signature() ^ settings.in_backward,  # where the flags ride and on which group
            identities,
            group,
            settings.device,
            settings.check_grads,
        )
    if trouble:
        _raise_alike(groups, state, names, settings, shared)
    # Options set in param_groups since construction, checked once every rank agreed on them
    check_groups(groups)
    # Made after the agreement: steps begun in backward have a group of their own.
    exchange = wire_group(settings)
    # A step begun in backward always carries flags: every rank must agree on redoing it.
    flag_elements = FLAG_ELEMENTS if key.checked or settings.in_backward else 0
    rowed = frozenset(j for j, form in enumerate(forms) if form.variant is not None)
    per_row = PerRow(rowed, width=2 if settings.comm_dtype.itemsize == 2 else 1)  # float32 bits
    # Steps begun in backward start the buckets before the carrier from hooks, as many as the
    # slots hold with one to spare for the carrier (see dmuon_fsdp.program, the bucket loop).
    carrier = min(SLOTS - 1, len(plan.buckets) - 1) if settings.in_backward else 0
    schedule = rank_schedule(plan, exchange.rank, exchange.peers, flag_elements, max(carrier, 0), per_row)
    return Planned(plan, tuple(forms), schedule)


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
    entries = [
        Entry(i, g, p)
        for i, ((g, p), has) in enumerate(zip(indexed(groups), key.has_grad, strict=True))
        if has
    ]
    binder = _Binder(plan, forms, schedule, entries, groups, state, settings, pool)
    if not pool.fits(binder.needed):  # measured only: bind again into arenas of the sizes asked
        pool.grow(binder.needed)
        binder = _Binder(plan, forms, schedule, entries, groups, state, settings, pool)
    buckets = binder.buckets
    wire = schedule.buckets[schedule.carrier].to_owners
    carrier = buckets[schedule.carrier].to_owners  # bound to ``wire``: None when it is
    flags = Flags.bind(carrier) if carrier is not None and wire is not None and wire.flag_elements else None
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
        device=settings.device,
        checked=nonfinite_groups(binder.locals),
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
            (
                work.take(max(y for y, _ in sizes), settings.ns_dtype),
                work.take(max(squares for _, squares in sizes), settings.ns_dtype),
            )
            if sizes
            else None
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
        return group, adjusted_lr(1.0, self.groups[group]["adjust_lr_fn"], m.rows, m.cols)

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
    ) -> tuple[tuple[Batch, ...], dict[int, Tensor], tuple[RowStep, ...], dict[int, tuple[Tensor, Tensor]]]:
        """Each batch of owned matrices as a (B, s, l) stack from ``to``, each matrix's (rows,
        cols) view into its stack (a transposed view for tall matrices), and the row variants'
        steps on the batches of their groups, with each matrix's row state and row factors (from
        ``back``; see [Note: row variants] in ``dmuon_fsdp.variants``)."""
        batches, matrix_views = [], {}
        row_batches: dict[RowVariant, list[RowBatch]] = defaultdict(list)
        for (s, l, form), members in self.members(owned).items():
            stack = to.take(len(members) * s * l, self.settings.ns_dtype).view(len(members), s, l)
            work = Workspace.for_stack(stack, form.segments, self.workspace)
            batches.append(Batch(stack, form.coefficients, form.eps, form.segments, work))
            for b, j in enumerate(members):
                matrix_views[j] = stack[b].mT if self.tall(j) else stack[b]
            if form.variant is not None:
                shapes = {j: (self.plan.matrices[j].rows, self.plan.matrices[j].cols) for j in members}
                row_batches[form.variant].append(RowBatch(stack, shapes, form.settings))
        steps: list[RowStep] = []
        owned_rows: dict[int, tuple[Tensor, Tensor]] = {}
        for variant, bound in row_batches.items():
            step = variant.bind(bound, self.settings.ns_dtype, back.take)
            if step is not None:
                steps.append(step)
                matrices = [j for batch in bound for j in batch.shapes]
                owned_rows.update(zip(matrices, zip(step.state, step.factors, strict=True), strict=True))
        return tuple(batches), matrix_views, tuple(steps), owned_rows

    def row_state(self, t: Transfer) -> Tensor:
        """This rank's row state of ``t``'s rows (its group's row variant's)."""
        variant = self.forms[t.matrix].variant
        assert variant is not None  # asked of transfers that carry per-row numbers
        param = self.entries[self.entry_of(t.matrix)].param
        return rows_of(local_shard(self.state[param][variant.state_key]), t.piece)

    def bucket(self, k: int, bucket: BucketSchedule) -> BucketProgram:
        """Bucket ``k``'s views in its slot (see ``dmuon_fsdp.exchange``)."""
        regions = self.pool.regions()
        to, back = regions[TO, k % SLOTS], regions[BACK, k % SLOTS]
        batches, matrix, row_steps, owned_rows = self.batches(bucket.owned, to, back)
        group = wire_group(self.settings).process_group
        comm_dtype, ns_dtype = self.settings.comm_dtype, self.settings.ns_dtype

        def region(t: Transfer) -> Tensor:
            p = t.piece
            return matrix[t.matrix][p.row : p.row + p.rows, p.col : p.col + p.cols]

        def kept(transfers: Sequence[Transfer], dtype: torch.dtype, region: Region) -> list[Tensor]:
            """A copy of each own piece, without per-row numbers, in ``dtype`` from ``region``."""
            return [s.piece for s in staging([replace(t, per_row=0) for t in transfers], dtype, region)]

        # The way to the owners: NS inputs (``feeds``) into the send buffer and own stacks.
        to_owners = wired(bucket.to_owners, comm_dtype, to, group)
        feeds = [(slot.piece, slot.transfer) for slot in to_owners.sent]
        spread, assemble = Copies([], []), Copies([], [])
        for slot in to_owners.received:
            assemble.add(region(slot.transfer), slot.piece)
        own = list(bucket.own_pieces)
        if self.staged:
            for t, piece in zip(own, kept(own, comm_dtype, to), strict=True):
                feeds.append((piece, t))
                assemble.add(region(t), piece)
        else:
            feeds += [(region(t), t) for t in own]
        stage = self.stage(feeds, spread, to)
        reads = tuple(sorted({self.entry_of(t.matrix) for _, t in feeds}))
        needs = tuple(sorted({self.entry_of(j) for j in self.plan_bucket(k)}))

        # The way back: results into the return buffer; own ones stay in the stack unless a
        # later bucket of this slot would overwrite it before they are applied.
        from_owners = wired(bucket.from_owners, comm_dtype, back, group)
        collect = Copies([], [])
        for slot in from_owners.sent:
            collect.add(slot.piece, region(slot.transfer))
        returned = [(slot.transfer, slot.piece) for slot in from_owners.received]
        results = list(bucket.own_results)
        if self.staged or k + SLOTS < len(self.schedule.buckets):
            # through the wire's dtype (replicas round results alike), or kept from being overwritten
            copies = kept(results, comm_dtype if self.staged else ns_dtype, back)
            for t, piece in zip(results, copies, strict=True):
                collect.add(piece, region(t))
        else:
            copies = [region(t) for t in results]
        returned += zip(results, copies, strict=True)

        writes = Copies([], [])  # a row variant's new state into the holders' state, its factors out
        factors = self.carry_rows(
            bucket, to_owners, from_owners, owned_rows, back, spread, assemble, collect, writes
        )
        updates: dict[tuple[int, float], Updates] = {}
        for t, direction in returned:
            cls = self.update_class(t.matrix)
            row_factors = factors.get(t)
            u = updates.setdefault(cls, Updates(*cls, [], [], [] if row_factors is not None else None))
            u.params.append(piece_of(self.locals[self.entry_of(t.matrix)], t.piece))
            u.directions.append(direction)
            if row_factors is not None:
                assert u.factors is not None  # a group's matrices all have its row variant, or none
                u.factors.append(row_factors.view(-1, 1))
        for name, r in ((TO, to), (BACK, back)):
            self.needed[name, k % SLOTS] = max(self.needed[name, k % SLOTS], r.used)
        return BucketProgram(
            reads,
            needs,
            stage,
            to_owners.exchange,
            assemble,
            batches,
            row_steps,
            collect,
            from_owners.exchange,
            tuple(updates.values()),
            writes,
        )

    def carry_rows(
        self,
        bucket: BucketSchedule,
        to_owners: Wired,
        from_owners: Wired,
        owned_rows: dict[int, tuple[Tensor, Tensor]],
        back: Region,
        spread: Copies,
        assemble: Copies,
        collect: Copies,
        writes: Copies,
    ) -> dict[Transfer, Tensor]:
        """A row variant's numbers around one bucket's exchanges ([Note: row variants] in
        ``dmuon_fsdp.variants``; ``owned_rows[j]``: the owner's row state and row factors of matrix j):
        the holders' row state into the send buffer (``spread``) and from the receive buffer or
        own rows into the owner's (``assemble``); the owner's new state and factors into the
        return buffer (``collect``), and from it (or the owner's, for own results) into the
        holders' state and a factor buffer from ``back`` (``writes``). Returns the row factors
        of each transfer returned to this rank (each returns one matrix's piece, so they are
        distinct: ``exchange.check``). Float32 everywhere but on the wire, which
        carries their bits (``as_wire``)."""
        comm_dtype = self.settings.comm_dtype

        def owner_rows(t: Transfer) -> tuple[Tensor, Tensor]:
            v, f = owned_rows[t.matrix]
            return v[t.piece.row : t.piece.row + t.piece.rows], f[t.piece.row : t.piece.row + t.piece.rows]

        for slot in to_owners.sent:
            if slot.per_row is not None:
                spread.add(slot.per_row, as_wire(self.row_state(slot.transfer), comm_dtype))
        for slot in to_owners.received:
            if slot.per_row is not None:
                assemble.add(as_wire(owner_rows(slot.transfer)[0], comm_dtype), slot.per_row)
        for t in bucket.own_pieces:
            if t.per_row:
                assemble.add(owner_rows(t)[0], self.row_state(t))
        for slot in from_owners.sent:
            if slot.per_row is not None:
                v, f = owner_rows(slot.transfer)
                collect.add(slot.row_state, as_wire(v, comm_dtype))
                collect.add(slot.row_factors, as_wire(f, comm_dtype))
        factors: dict[Transfer, Tensor] = {}
        arriving = [slot for slot in from_owners.received if slot.per_row is not None]
        flat = back.take(sum(slot.transfer.piece.rows for slot in arriving), torch.float32)
        offset = 0
        for slot in arriving:
            t = slot.transfer
            factors[t] = flat[offset : offset + t.piece.rows]
            writes.add(as_wire(self.row_state(t), comm_dtype), slot.row_state)
            writes.add(as_wire(factors[t], comm_dtype), slot.row_factors)
            offset += t.piece.rows
        for t in bucket.own_results:
            if t.per_row:
                v, factors[t] = owner_rows(t)
                writes.add(self.row_state(t), v)
        return factors

    def stage(self, feeds: list[tuple[Tensor, Transfer]], spread: Copies, to: Region) -> Stage:
        """Where one bucket's NS inputs are written (``feeds``: destination and piece): per Muon
        group, straight into the destination when it is the parameter's one piece and its whole
        shard, else through a scratch copy of the local shard (from ``to``) that ``spread``
        copies into place (a parameter with pieces in several buckets is made whole in each)."""
        by_entry: dict[int, list[tuple[Tensor, Transfer]]] = defaultdict(list)
        for view, t in feeds:
            by_entry[self.entry_of(t.matrix)].append((view, t))
        inputs: list[NSInputs] = []
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
                    lerp_math_dtype(buffers[i].dtype for i, _ in chosen),
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
            kernel = adamw_kernel(params)
            lists.append(AdamWLists(group, tuple(members), params, exp_avgs, exp_avg_sqs, steps, kernel))
        return tuple(lists)

    def _by_group(self, muon: bool) -> dict[int, list[int]]:
        """Entry indices (= positions in the step's gradient list) by param group."""
        out: dict[int, list[int]] = defaultdict(list)
        for i, e in enumerate(self.entries):
            if self.groups[e.group]["use_muon"] == muon:
                out[e.group].append(i)
        return out
