"""The binding: a planned program made into tensors on this rank, every view a step needs.

``bind`` makes them into the shared pool: each bucket takes its buffers from its slot's arenas
([Note: slots] in ``dmuon_fsdp._step.buffers``): on the way to the owners, its exchange buffers in
``comm_dtype``, one (B, s, l) stack per batch of owned matrices in ``ns_dtype`` (tall ones
transposed), a ``comm_dtype`` staging copy of own pieces when ``comm_dtype != ns_dtype`` (so
that replicas round results alike) and scratch copies of local shards; on the way back, its
exchange buffers, a row variant's numbers and the own results a later bucket of the slot would
overwrite before they are applied. What a parameter's matrices orthogonalize is written straight
into its send-buffer segment or stack region when its shard is one piece sent whole, else made
whole in scratch and spread. docs/design.md ("Memory") lists every buffer. Nothing here runs a
collective or writes a buffer: ``dmuon_fsdp._step.run`` runs what it binds.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from dmuon_fsdp._step.buffers import (
    BACK,
    FORWARD,
    RELAY,
    SLOTS,
    TO,
    WORK,
    Pool,
    Region,
    Slot,
    Wired,
    in_shape,
    piece_of,
    staging,
    wired,
)
from dmuon_fsdp._step.flags import Flags, StepKey, nonfinite_groups
from dmuon_fsdp._step.planner import Plan
from dmuon_fsdp._step.planning import NSForm, Planned
from dmuon_fsdp._step.program import (
    AdamWLists,
    Batch,
    BucketProgram,
    Copies,
    Entry,
    MuonLists,
    NewMains,
    NSInputs,
    RelayProgram,
    Stage,
    StepProgram,
    Updates,
)
from dmuon_fsdp._step.schedule import BucketSchedule, RankSchedule, Transfer
from dmuon_fsdp._step.state import MAIN, adamw_kernel, adjusted_lr, lerp_math_dtype, local_shard
from dmuon_fsdp.config import Settings
from dmuon_fsdp.newton_schulz import Workspace
from dmuon_fsdp.variants import RowBatch, RowStep, RowVariant


def bind(
    planned: Planned,
    key: StepKey,
    params: list[Tensor],
    groups: list[dict[str, Any]],
    state: Any,
    settings: Settings,
    pool: Pool,
) -> StepProgram:
    """Make every view a step of ``planned`` (as ``plan_program`` made it for ``key``) needs on
    this rank, into ``pool`` (grown first when it is too small); ``params``: the parameters of
    ``groups`` in optimizer order."""
    plan, forms, schedule = planned.plan, planned.forms, planned.schedule
    entries = [Entry(i, g, params[i]) for i, g in planned.entries]
    binder = _Binder(plan, forms, schedule, entries, planned.owner_mains, groups, state, settings, pool)
    if not pool.fits(binder.needed):  # measured only: bind again into arenas of the sizes asked
        needed = binder.needed
        del binder  # its views of the arenas that grow must not outlive them
        pool.grow(needed)
        binder = _Binder(plan, forms, schedule, entries, planned.owner_mains, groups, state, settings, pool)
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
        "collectives": len(schedule.wires),
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
        relays=tuple(r for b in buckets for r in b.relays),
        relays_before=tuple(sum(len(b.relays) for b in buckets[:k]) for k in range(len(buckets) + 1)),
        relays_of=binder.relays_of(),
        flags=flags,
        carrier=schedule.carrier,
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
        owner_mains: frozenset[int],
        groups: list[dict[str, Any]],
        state: Any,
        settings: Settings,
        pool: Pool,
    ):
        self.plan, self.forms, self.groups, self.settings = plan, forms, groups, settings
        self.schedule, self.state, self.pool = schedule, state, pool
        self.entries = tuple(entries)
        self.locals = [local_shard(e.param) for e in self.entries]
        self.mains, self.targets = self.main_weights()
        # entries whose main weight their owner holds (here or not), and all of those whose
        # state is float32 for a 16-bit parameter (a gradient of another dtype than its momentum)
        self.owner_held = frozenset(i for i, e in enumerate(self.entries) if e.position in owner_mains)
        self.wide = frozenset(self.mains) | self.owner_held
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
        self.workspace, self.grads32 = self.work_buffers()
        # Relays left to the next forward: every one bound whole, one after another, in an arena
        # of their own (they are in flight together); the buckets' ``keep`` fill their send
        # buffers, once per twin, as each way back is applied ([Note: slots])
        self.forward = pool.regions()[FORWARD, 0]
        self.forward_wires = [
            wired(wire, settings.comm_dtype, self.forward, settings.exchange_group.process_group)
            for wire in (schedule.relays if settings.in_forward else ())
        ]
        self.kept: dict[int, list[Slot]] = defaultdict(list)
        for forward_wire in self.forward_wires:
            for slot in forward_wire.sent:
                self.kept[slot.transfer.matrix].append(slot)
        self.buckets = tuple(self.bucket(k, bucket) for k, bucket in enumerate(schedule.buckets))
        self.needed[FORWARD, 0] = self.forward.used

    def work_buffers(self) -> tuple[tuple[Tensor, Tensor] | None, dict[int, Tensor]]:
        """The buffers of the work arena: one NS workspace for every batch of every bucket (they
        are orthogonalized one at a time), and AdamW's gradients of the parameters with a main
        weight, in float32 (torch's AdamW takes one dtype), by entry."""
        work, settings = self.pool.regions()[WORK, 0], self.settings
        sizes = [
            Workspace.sizes((len(batch), s, l), form.segments)
            for bucket in self.schedule.buckets
            for (s, l, form), batch in self.members(bucket.owned).items()
        ]
        workspace = (
            (
                work.take(max(y for y, _ in sizes), settings.ns_dtype),
                work.take(max(squares for _, squares in sizes), settings.ns_dtype),
            )
            if sizes
            else None
        )
        grads32 = {
            i: work.take(self.locals[i].numel(), torch.float32).view(self.locals[i].shape)
            for i in self.mains
            if not self.groups[self.entries[i].group]["use_muon"]
        }
        self.needed[WORK, 0] = work.used
        return workspace, grads32

    def main_weights(self) -> tuple[dict[int, Tensor], list[Tensor]]:
        """The entries with a main weight ([Note: main weights] in ``dmuon_fsdp._step.state``):
        its local shard by entry; and what each entry's updates go to (``targets``): its main
        weight (rounded into the parameter after) or its parameter's local shard."""
        held = [self.state[e.param] for e in self.entries]
        mains = {i: local_shard(st[MAIN]) for i, st in enumerate(held) if MAIN in st}
        return mains, [mains.get(i, local) for i, local in enumerate(self.locals)]

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
        local = local_shard(self.state[param][variant.state_key]).view(-1)
        return local[t.piece.local_row : t.piece.local_row + t.piece.rows]

    def bucket(self, k: int, bucket: BucketSchedule) -> BucketProgram:
        """Bucket ``k``'s views in its slot (see ``dmuon_fsdp._step.buffers``)."""
        regions = self.pool.regions()
        to, back = regions[TO, k % SLOTS], regions[BACK, k % SLOTS]
        batches, matrix, row_steps, owned_rows = self.batches(bucket.owned, to, back)
        group = self.settings.exchange_group.process_group
        comm_dtype = self.settings.comm_dtype

        def region(t: Transfer) -> Tensor:
            p = t.piece
            return matrix[t.matrix][p.row : p.row + p.rows, p.col : p.col + p.cols]

        # The way to the owners: NS inputs (``feeds``) into the send buffer and own stacks.
        to_owners = wired(bucket.to_owners, comm_dtype, to, group)
        feeds = [(slot.piece, slot.transfer) for slot in to_owners.sent]
        spread, assemble = Copies([], []), Copies([], [])
        for slot in to_owners.received:
            assemble.add(region(slot.transfer), slot.piece)
        own = list(bucket.own_pieces)
        if self.staged:
            for t, piece in zip(own, _kept(own, comm_dtype, to), strict=True):
                feeds.append((piece, t))
                assemble.add(region(t), piece)
        else:
            feeds += [(region(t), t) for t in own]
        stage = self.stage(feeds, spread, to)
        reads = tuple(sorted({self.entry_of(t.matrix) for _, t in feeds}))
        needs = tuple(sorted({self.entry_of(j) for j in self.plan_bucket(k)}))

        from_owners, collect, returned = self.way_back(k, bucket, back, region)

        writes = Copies([], [])  # a row variant's new state into the holders' state, its factors out
        factors = self.carry_rows(
            bucket, to_owners, from_owners, owned_rows, back, spread, assemble, collect, writes
        )
        new_mains, scratch = self.new_mains(bucket, region, factors, back)
        keep = self.keep(self.plan_bucket(k), self.kept, returned, factors)  # (relays left to the forward)
        relays = tuple(
            self.relay(g, returned, factors) for g, relay in enumerate(self.plan.relays) if relay.bucket == k
        )
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
            new_mains,
            collect,
            from_owners.exchange,
            self.updates(returned, factors, scratch),
            writes,
            keep,
            relays,
        )

    def parts(self, g: int, region: Region) -> dict[int, list[Slot]]:
        """A slot (from ``region``) for this rank's part of each matrix it relays in relay ``g``."""
        wire = self.schedule.relays[g]
        mine = {t.matrix: t for segment in wire.send for t in segment} if wire is not None else {}
        kept = staging(list(mine.values()), self.settings.comm_dtype, region)
        return {s.transfer.matrix: [s] for s in kept}

    def keep(
        self,
        matrices: Sequence[int],
        parts: dict[int, list[Slot]],
        returned: Sequence[tuple[Transfer, Tensor]],
        factors: dict[Transfer, Tensor],
    ) -> Copies:
        """The parts this rank relays of ``matrices`` ([Note: the relay] in
        ``dmuon_fsdp._step.relay``), from what it holds of each result once the way back is
        applied (``returned``: a transfer and its view per matrix; a row variant's new state,
        already in place, and ``factors``), into their ``parts`` slots, where they wait for
        their relay (a relay left to the next forward: its send buffer's, one per twin)."""
        comm_dtype = self.settings.comm_dtype
        keep = Copies([], [])
        held = {t.matrix: (t, view) for t, view in returned}
        for j in matrices:
            for slot in parts.get(j, ()):
                t = slot.transfer
                source, view = held[j]
                first = t.piece.row - source.piece.row
                keep.add(slot.piece, view[first : first + t.piece.rows])
                if slot.numbers is not None:
                    state, factors_out = _state_and_factors(slot.numbers)
                    keep.add(state, as_wire(self.row_state(t), comm_dtype))
                    keep.add(factors_out, as_wire(factors[source][first : first + t.piece.rows], comm_dtype))
        return keep

    def relay(
        self, g: int, returned: Sequence[tuple[Transfer, Tensor]], factors: dict[Transfer, Tensor]
    ) -> RelayProgram:
        """Relay ``g`` ([Note: the relay] in ``dmuon_fsdp._step.relay``), in its slot: the parts
        this rank relays, kept (after its bucket's way back, from ``returned`` and ``factors``:
        see ``keep``) and packed into the send buffer once to each twin; and what arrives,
        applied (with its rows' new state into place and its factors into a buffer of the
        slot). Left to the next forward, it is bound already, its send buffer filled by its
        buckets' ``keep``, and its factors go after it in the same arena."""
        keep, pack = Copies([], []), Copies([], [])
        if self.settings.in_forward:
            region, wire = self.forward, self.forward_wires[g]
        else:
            region = self.pool.regions()[RELAY, g % SLOTS]
            parts = self.parts(g, region)
            keep = self.keep(self.plan.relays[g].matrices, parts, returned, factors)
            group = self.settings.exchange_group.process_group
            wire = wired(self.schedule.relays[g], self.settings.comm_dtype, region, group)
            for slot in wire.sent:
                kept = parts[slot.transfer.matrix][0]
                pack.add(slot.piece, kept.piece)
                if slot.numbers is not None and kept.numbers is not None:
                    pack.add(as_wire(slot.numbers), as_wire(kept.numbers))
        writes = Copies([], [])
        relayed = self.arriving_rows(wire.received, region, writes)
        updates = self.updates([(slot.transfer, slot.piece) for slot in wire.received], relayed)
        if not self.settings.in_forward:
            self.needed[RELAY, g % SLOTS] = max(self.needed[RELAY, g % SLOTS], region.used)
        entries = tuple(sorted({e for u in updates for e in u.touched}))
        return RelayProgram(g, keep, pack, wire.exchange, updates, writes, entries)

    def relays_of(self) -> dict[Tensor, tuple[int, ...]]:
        """Each parameter's relays that bring this rank rows of it, in order."""
        out: dict[Tensor, list[int]] = defaultdict(list)
        for bucket in self.buckets:
            for relay in bucket.relays:
                for e in relay.entries:
                    out[self.entries[e].param].append(relay.index)
        return {param: tuple(relays) for param, relays in out.items()}

    def way_back(
        self, k: int, bucket: BucketSchedule, back: Region, region: Callable[[Transfer], Tensor]
    ) -> tuple[Wired, Copies, list[tuple[Transfer, Tensor]]]:
        """Bucket ``k``'s way back: results into the return buffer (``collect``), and what each
        result to apply is (``returned``); own ones stay in the stack (``region``) unless a later
        bucket of this slot would overwrite it before they are applied."""
        comm_dtype = self.settings.comm_dtype
        from_owners = wired(bucket.from_owners, comm_dtype, back, self.settings.exchange_group.process_group)
        collect = Copies([], [])
        for slot in from_owners.sent:
            collect.add(slot.piece, region(slot.transfer))
        returned = [(slot.transfer, slot.piece) for slot in from_owners.received]
        results = list(bucket.own_results)
        if self.staged or k + SLOTS < len(self.schedule.buckets):
            # through the wire's dtype (replicas round results alike), or kept from being overwritten
            copies = _kept(results, comm_dtype if self.staged else self.settings.ns_dtype, back)
            for t, piece in zip(results, copies, strict=True):
                collect.add(piece, region(t))
        else:
            copies = [region(t) for t in results]
        returned += zip(results, copies, strict=True)
        return from_owners, collect, returned

    def updates(
        self,
        returned: Sequence[tuple[Transfer, Tensor]],
        factors: dict[Transfer, Tensor],
        scratch: dict[Transfer, Tensor] | None = None,
    ) -> tuple[Updates, ...]:
        """Each result applied to its piece of the parameter: one ``Updates`` per step size. A
        parameter whose main weight its owner holds gets its rows' new values instead (and the
        owner its new main weight, from ``scratch``: see ``new_mains``)."""
        updates: dict[tuple[int, float], Updates] = {}
        for t, direction in returned:
            cls = self.update_class(t.matrix)
            row_factors = factors.get(t)
            u = updates.setdefault(cls, Updates(*cls, [], [], [] if row_factors is not None else None))
            e = self.entry_of(t.matrix)
            if e in self.owner_held:
                u.values.add(piece_of(self.locals[e], t.piece), direction)
                u.value_entries.append(e)
                if scratch and t in scratch:
                    u.values.add(piece_of(self.mains[e], t.piece), scratch[t])
                    u.value_entries.append(e)
                continue
            u.params.append(piece_of(self.targets[e], t.piece))
            u.directions.append(direction)
            u.entries.append(e)
            if e in self.mains:
                u.rounded.add(piece_of(self.locals[e], t.piece), piece_of(self.mains[e], t.piece))
                u.rounded_entries.append(e)
            if row_factors is not None:
                assert u.row_scales is not None  # a group's matrices all have its row variant, or none
                u.row_scales.append(row_factors.view(-1, 1))
        return tuple(updates.values())

    def new_mains(
        self,
        bucket: BucketSchedule,
        region: Callable[[Transfer], Tensor],
        factors: dict[Transfer, Tensor],
        back: Region,
    ) -> tuple[tuple[NewMains, ...], dict[Transfer, Tensor]]:
        """The new main weights of the matrices owned here whose main weights are held here
        ([Note: main weights] in ``dmuon_fsdp._step.state``; their owner holds them whole), made
        in float32 scratch from ``back`` and written over the results (``region``) before they
        are collected (one ``NewMains`` per step size); the scratch by own result, which the
        main weights take after the verdict (``updates``)."""
        scratch: dict[Transfer, Tensor] = {}
        made: dict[tuple[int, float], NewMains] = {}
        for t in bucket.own_results:
            e = self.entry_of(t.matrix)
            if e not in self.owner_held:
                continue
            main = piece_of(self.mains[e], t.piece)
            new_main = scratch[t] = back.take(main.numel(), torch.float32).view(main.shape)
            cls = self.update_class(t.matrix)
            row_factors = factors.get(t)
            if cls not in made:
                update = Updates(*cls, [], [], [] if row_factors is not None else None)
                made[cls] = NewMains(Copies([], []), update, Copies([], []))
            new = made[cls]
            new.take.add(new_main, main)
            new.update.params.append(new_main)
            new.update.directions.append(region(t))
            if new.update.row_scales is not None and row_factors is not None:
                new.update.row_scales.append(row_factors.view(-1, 1))
            new.spread.add(region(t), new_main)
        return tuple(made.values()), scratch

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
            if slot.numbers is not None:
                spread.add(as_wire(slot.numbers), as_wire(self.row_state(slot.transfer), comm_dtype))
        for slot in to_owners.received:
            if slot.numbers is not None:
                assemble.add(as_wire(owner_rows(slot.transfer)[0], comm_dtype), as_wire(slot.numbers))
        for t in bucket.own_pieces:
            if t.per_row:
                assemble.add(owner_rows(t)[0], self.row_state(t))
        for slot in from_owners.sent:
            if slot.numbers is not None:
                v, f = owner_rows(slot.transfer)
                state, factors_sent = _state_and_factors(slot.numbers)
                collect.add(state, as_wire(v, comm_dtype))
                collect.add(factors_sent, as_wire(f, comm_dtype))
        factors = self.arriving_rows(from_owners.received, back, writes)
        for t in bucket.own_results:
            if t.per_row:
                v, factors[t] = owner_rows(t)
                writes.add(self.row_state(t), v)
        return factors

    def arriving_rows(
        self, received: Sequence[Slot], region: Region, writes: Copies
    ) -> dict[Transfer, Tensor]:
        """The per-row numbers that arrive with ``received`` pieces (from their owner or by
        relay), applied by ``writes``: each piece's new row state into this rank's state, its
        row factors into a float32 buffer from ``region``; returns those factors by transfer."""
        comm_dtype = self.settings.comm_dtype
        factors: dict[Transfer, Tensor] = {}
        arriving = [slot for slot in received if slot.numbers is not None]
        flat = region.take(sum(slot.transfer.piece.rows for slot in arriving), torch.float32)
        offset = 0
        for slot in arriving:
            t = slot.transfer
            factors[t] = flat[offset : offset + t.piece.rows]
            assert slot.numbers is not None  # (as filtered)
            state, factors_in = _state_and_factors(slot.numbers)
            writes.add(as_wire(self.row_state(t), comm_dtype), state)
            writes.add(as_wire(factors[t], comm_dtype), factors_in)
            offset += t.piece.rows
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
            buffers = {i: local_shard(self.state[self.entries[i].param]["momentum_buffer"]) for i in members}
            for i in members:
                if i not in by_entry:
                    continue  # nothing of it in this bucket (or another replica sends it)
                local = self.locals[i]
                view = by_entry[i][0][0]
                direct = in_shape(view, local) if self.pieces[i] == 1 else None
                if direct is not None:  # the one piece is the whole shard
                    straight.append((i, direct))
                    continue
                scratch = to.take(local.numel(), buffers[i].dtype).view(local.shape)
                through.append((i, scratch))
                spread.dst.extend(view for view, _ in by_entry[i])
                spread.src.extend(piece_of(scratch, t.piece) for _, t in by_entry[i])
            # (entries with main weights apart: their gradients' dtype is not their momentum's)
            split = [
                [c for c in chosen if (c[0] in self.wide) is main]
                for chosen in (straight, through)
                for main in (False, True)
            ]
            inputs.extend(
                NSInputs(
                    group,
                    tuple(i for i, _ in chosen),
                    [buffers[i] for i, _ in chosen],
                    [d for _, d in chosen],
                    all(d.dtype == buffers[i].dtype for i, d in chosen),
                    lerp_math_dtype([buffers[i].dtype for i, _ in chosen]),
                )
                for chosen in split
                if chosen
            )
        return Stage(tuple(inputs), spread)

    def muon_lists(self, state: Any) -> tuple[MuonLists, ...]:
        lists = []
        for group, everyone in self._by_group(muon=True).items():
            # (entries with main weights apart: their gradients' dtype is not their momentum's)
            for main in (False, True):
                members = [i for i in everyone if (i in self.wide) is main]
                if not members:
                    continue
                # (those whose main weight their owner holds are decayed there: ``NewMains``)
                params = [self.targets[i] for i in members if i not in self.owner_held]
                buffers = [local_shard(state[self.entries[i].param]["momentum_buffer"]) for i in members]
                lists.append(MuonLists(group, tuple(members), params, buffers))
        return tuple(lists)

    def adamw(self, state: Any) -> tuple[AdamWLists, ...]:
        lists = []
        for group, members in self._by_group(muon=False).items():
            params = [self.targets[i] for i in members]
            states = [state[self.entries[i].param] for i in members]
            exp_avgs, exp_avg_sqs = ([local_shard(st[k]) for st in states] for k in ("exp_avg", "exp_avg_sq"))
            steps = [st["step"] for st in states]
            kernel = adamw_kernel(params)
            grads32 = [self.grads32[i] for i in members if i in self.grads32]
            rounded = Copies(
                [self.locals[i] for i in members if i in self.mains],
                [self.mains[i] for i in members if i in self.mains],
            )
            lists.append(
                AdamWLists(
                    group, tuple(members), params, exp_avgs, exp_avg_sqs, steps, kernel, grads32, rounded
                )
            )
        return tuple(lists)

    def _by_group(self, muon: bool) -> dict[int, list[int]]:
        """Entry indices (= positions in the step's gradient list) by param group, those with
        float32 state for a 16-bit parameter after the others."""
        out: dict[int, list[int]] = defaultdict(list)
        for i, e in sorted(enumerate(self.entries), key=lambda item: item[0] in self.wide):
            if self.groups[e.group]["use_muon"] == muon:
                out[e.group].append(i)
        return out


def _kept(transfers: Sequence[Transfer], dtype: torch.dtype, region: Region) -> list[Tensor]:
    """A copy of each own piece, without per-row numbers, in ``dtype`` from ``region``."""
    return [s.piece for s in staging([replace(t, per_row=0) for t in transfers], dtype, region)]


def as_wire(numbers: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Per-row numbers (float32, or as a wire of ``dtype`` holds them: by default their own)
    as that wire carries them exactly: float32 numbers themselves (a copy into a 32- or 64-bit
    wire converts them, exactly), or on a 16-bit wire their bits, as ``int16``: float32 numbers
    two elements each, and the wire's own elements (float16 or bfloat16) seen as ``int16`` too,
    so that every copy between them moves bits. A copy between 16-bit float views need not:
    CUDA's foreach copy converts each element to float and back, which turns every NaN bit
    pattern (a float32's lower half spells one now and then) into the canonical NaN."""
    return numbers.view(torch.int16) if (dtype or numbers.dtype).itemsize == 2 else numbers


def _state_and_factors(numbers: Tensor) -> tuple[Tensor, Tensor]:
    """The numbers returned with a piece, as the wire carries them (``as_wire``): the rows' new
    state, then their factors."""
    wire = as_wire(numbers)
    return wire[: wire.numel() // 2], wire[wire.numel() // 2 :]
