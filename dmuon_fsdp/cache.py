"""The program cache: each step key's program planned, agreed on, bound and kept.

``plan_program`` runs the pipeline for a ``StepKey``: layouts (every rank's piece of each Muon
matrix) -> each matrix's Newton-Schulz form and cost -> plan (owners, buckets) -> agreement over
the ranks (one ``all_reduce``, with a check on) -> this rank's schedule; ``dmuon_fsdp.binding``
then makes it into tensors. ``ProgramCache`` keeps the plans of the step keys seen lately and
their bound programs, and decides which one a step runs: bound, bound anew, or planned.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import Tensor

from dmuon_fsdp import comm
from dmuon_fsdp.binding import bind
from dmuon_fsdp.checks import (
    FLAG_ELEMENTS,
    StepKey,
    agree_on_plan,
    agreed,
    key_agreement,
    raise_alike,
    stale_layouts,
)
from dmuon_fsdp.config import Settings, row_variant
from dmuon_fsdp.exchange import (
    SLOTS,
    PerRow,
    Pool,
    RankSchedule,
    rank_schedule,
)
from dmuon_fsdp.layouts import MatrixLayout, describe_params
from dmuon_fsdp.newton_schulz import ns_segments, resolve_coefficients, segments_flops
from dmuon_fsdp.options import check_groups
from dmuon_fsdp.param_groups import group_params, indexed
from dmuon_fsdp.planner import Plan, build_plan
from dmuon_fsdp.program import (
    NSForm,
    StepProgram,
)
from dmuon_fsdp.state import restore_state


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
            self._pool = Pool(settings.device, release=self._bound.clear)
        if program is None or program.generation != self._pool.generation or program.moved(params, state):
            self._bound.pop(in_use, None)
            del program
            restore_state(groups, state)  # state cleared by hand starts afresh
            planned = self._plans.get(in_use)
            if planned is None:
                while len(self._plans) >= PROGRAMS_KEPT:
                    self._bound.pop(self._plans.popitem(last=False)[0], None)
                planned = self._plans[in_use] = plan_program(in_use, groups, state, names, settings)
            # (a pool that grows lets every kept program go first: they bind anew when used)
            program = bind(
                planned.plan, planned.forms, planned.schedule, in_use, groups, state, settings, self._pool
            )
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
    exchange = settings.exchange_group  # after the agreement: every rank asks for the group alike
    # A step begun in backward always carries flags: every rank must agree on redoing it.
    flag_elements = FLAG_ELEMENTS if key.checked or settings.in_backward else 0
    rowed = frozenset(j for j, form in enumerate(forms) if form.variant is not None)
    per_row = PerRow(rowed, width=2 if settings.comm_dtype.itemsize == 2 else 1)  # float32 bits
    # Steps begun in backward start the buckets before the carrier from hooks, as many as the
    # slots hold with one to spare for the carrier (see dmuon_fsdp.program, the bucket loop).
    carrier = min(SLOTS - 1, len(plan.buckets) - 1) if settings.in_backward else 0
    schedule = rank_schedule(plan, exchange.rank, exchange.peers, flag_elements, max(carrier, 0), per_row)
    return Planned(plan, tuple(forms), schedule)
