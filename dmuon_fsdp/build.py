"""Building a step program: from the parameters to a plan, agreed on, bound to tensors.

``build_program`` runs the pipeline for a ``StepKey``: layouts (every rank's piece of each Muon
matrix) -> each matrix's Newton-Schulz form and cost -> plan (owners, buckets) -> agreement over
the ranks (one ``all_reduce``, with a check on) -> this rank's schedule -> buffers and views
(``dmuon_fsdp.bind``). ``ProgramCache`` keeps the program and decides whether a step needs a new
one, the same one bound to new tensors, or the one it has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import Tensor

from dmuon_fsdp import checks, elementwise, errors
from dmuon_fsdp.bind import Settings, bind, indexed, wire_group
from dmuon_fsdp.checks import FLAG_ELEMENTS, StepKey
from dmuon_fsdp.layouts import MatrixLayout, describe_params
from dmuon_fsdp.newton_schulz import ns_segments, resolve_coefficients, segments_flops
from dmuon_fsdp.planner import build_plan
from dmuon_fsdp.program import NSForm, StepProgram
from dmuon_fsdp.schedule import rank_schedule


@dataclass(frozen=True)
class Ready:
    """The program for a step; ``bound`` False when a parameter or its state changed layout
    since it was bound (the step then reports that on every rank instead of running)."""

    program: StepProgram
    bound: bool


class ProgramCache:
    """The optimizer's step program and when to make it anew."""

    def __init__(self) -> None:
        self._program: StepProgram | None = None
        self._rebind = False

    @property
    def current(self) -> StepProgram | None:
        return self._program

    def clear(self) -> None:
        """Parameters, groups or meshes changed: build at the next step."""
        self._program = None

    def state_replaced(self) -> None:
        """The state tensors were replaced wholesale (``load_state_dict``): bind anew."""
        self._rebind = True

    def get(
        self,
        key: StepKey,
        params: list[Tensor],
        groups: list[dict[str, Any]],
        state: Any,
        names: dict,
        settings: Settings,
    ) -> Ready:
        """The program for a step of ``key`` (``checks.build_now`` says when to build);
        ``params`` are the parameters of ``groups`` in optimizer order."""
        program = self._program
        agreeing = settings.check_grads and program is not None and program.flags is not None
        if checks.build_now(program.key if program is not None else None, key, agreeing):
            self._program = None  # its buffers go before the new ones are allocated
            elementwise.restore_state(groups, state)
            self._program = build_program(key, groups, state, names, settings)
        elif self._rebind or program.moved(params, state):
            elementwise.restore_state(groups, state)  # state cleared by hand starts afresh
            if checks.stale_layouts(params, state):
                return Ready(program, bound=False)
            self._program = None
            self._program = bind(program.plan, program.forms, program.schedule, key, groups, state, settings)
        self._rebind = False
        return Ready(self._program, bound=True)


def _params(groups: Sequence[dict[str, Any]]) -> list[Tensor]:
    return [p for group in groups for p in group["params"]]


def explain(
    groups: list[dict[str, Any]], state: Any, names: dict, settings: Settings, shared: bool
) -> NoReturn:
    """Raise the error every rank agrees on (``errors.explain``; a collective when ``shared``)."""
    params = _params(groups)
    group = settings.site.group.group if shared else None
    errors.explain(params, names, groups, group, settings.nonfinite, checks.stale_layouts(params, state))


def _forms(
    matrices: Sequence[MatrixLayout], groups: Sequence[dict[str, Any]], dtype: torch.dtype
) -> list[NSForm]:
    """Each matrix's form, from the options of its parameter's group (``groups[j]``)."""
    out = []
    for m, group in zip(matrices, groups):
        coefficients = resolve_coefficients(group["ns_coefficients"], group["ns_steps"])
        segments = ns_segments(group["ns_algorithm"], coefficients, dtype, m.rows, m.cols)
        out.append(NSForm(coefficients, float(group["eps"]), segments))
    return out


def build_program(
    key: StepKey, groups: list[dict[str, Any]], state: Any, names: dict, settings: Settings
) -> StepProgram:
    """A new plan and program for ``key``; with a check on, one ``all_reduce`` tells every rank
    of any rank's trouble and (with ``check_grads``) that all built the same plan."""
    muon = [(g, p) for (g, p), has in zip(indexed(groups), key.has_grad) if has and groups[g]["use_muon"]]
    described = [(p, names[p], groups[g]) for g, p in muon]
    layouts, param_of = describe_params(described, settings.site.ranks)
    forms = _forms(layouts, [described[i][2] for i in param_of], settings.ns_dtype)
    costs = [segments_flops(m.rows, m.cols, f.segments) for m, f in zip(layouts, forms)]
    site = settings.site.group
    plan = build_plan(
        layouts,
        costs,
        len(site.peers),
        settings.bucket_bytes,
        settings.comm_dtype.itemsize,
        param_of,
        backward_order=settings.in_backward,
    )
    trouble = bool(checks.stale_layouts(_params(groups), state))
    shared = key.flags and site.group is not None
    if shared:
        identities = [
            (f"{m.name} ({m.rows}x{m.cols})", m.pieces, m.replicas, cost) for m, cost in zip(layouts, costs)
        ]
        trouble = errors.agree_on_plan(
            trouble,
            key.digest,
            plan.signature(),
            identities,
            site.group,
            settings.device,
            settings.check_grads,
        )
    if trouble:
        explain(groups, state, names, settings, shared)
    # Made after the agreement: steps begun in backward have a group of their own.
    exchange = wire_group(settings)
    # A step begun in backward always carries flags: every rank must agree on redoing it.
    flags = FLAG_ELEMENTS if key.flags or settings.in_backward else 0
    schedule = rank_schedule(plan, exchange.rank, exchange.peers, flags, flags_last=settings.in_backward)
    return bind(plan, forms, schedule, key, groups, state, settings)
