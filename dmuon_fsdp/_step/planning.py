"""Planning a step key's program: ``plan_program`` runs the pipeline for a ``StepKey``: the
parameters with gradients -> layouts (every rank's piece of each Muon matrix) -> each matrix's
Newton-Schulz form and cost -> plan (owners, buckets) -> agreement over the ranks (one
``all_reduce``, with a check on) -> this rank's schedule. The result (``Planned``) holds no
tensors; ``dmuon_fsdp._step.binding`` makes it into tensors.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dmuon_fsdp._step.buffers import SLOTS
from dmuon_fsdp._step.errors import agree_on_plan
from dmuon_fsdp._step.flags import FLAG_ELEMENTS, StepKey
from dmuon_fsdp._step.layouts import MatrixLayout, describe_params
from dmuon_fsdp._step.planner import Plan, assign_owners, build_plan
from dmuon_fsdp._step.schedule import PerRow, RankSchedule, rank_schedule
from dmuon_fsdp._step.state import LOW_PRECISION, keeps_main, stale_layouts
from dmuon_fsdp.config import Settings, check_groups, row_settings
from dmuon_fsdp.newton_schulz import Coefficients, ns_segments, resolve_coefficients, segments_flops
from dmuon_fsdp.routing import indexed

if TYPE_CHECKING:
    from dmuon_fsdp.variants import RowVariant


@dataclass(frozen=True)
class NSForm:
    """How one matrix is orthogonalized: its group's NS settings and the form for its shape;
    ``variant``: its group's row variant and the ``settings`` it reads (see [Note: row
    variants] in ``dmuon_fsdp.variants``)."""

    coefficients: tuple[Coefficients, ...]
    eps: float
    segments: tuple[int, ...]
    variant: RowVariant | None = None
    settings: tuple[float, ...] = ()


@dataclass(frozen=True)
class Trouble:
    """Some rank found a reason not to step while planning, and every rank knows (the plan's
    agreement); ``shared``: that agreement ran on a group, so the error's findings are shared."""

    shared: bool


@dataclass(frozen=True)
class Planned:
    """A step key's plan, each matrix's NS form, this rank's schedule and the parameters it
    steps: a program but its tensors (no memory to speak of)."""

    plan: Plan
    forms: tuple[NSForm, ...]
    schedule: RankSchedule
    entries: tuple[tuple[int, int], ...]  # (position, param group) of each parameter with a gradient
    owner_mains: frozenset[int] = frozenset()  # positions of those whose main weight one owner holds


def _forms(
    matrices: Sequence[MatrixLayout], groups: Sequence[dict[str, Any]], dtype: torch.dtype
) -> list[NSForm]:
    """Each matrix's form, from the options of its parameter's group (``groups[j]``)."""
    out = []
    for m, group in zip(matrices, groups, strict=True):
        coefficients = resolve_coefficients(group["ns_coefficients"], group["ns_steps"])
        segments = ns_segments(group["ns_algorithm"], coefficients, dtype, m.rows, m.cols)
        out.append(NSForm(coefficients, float(group["eps"]), segments, *row_settings(group)))
    return out


def main_homes(
    groups: list[dict[str, Any]],
    names: dict,
    ranks: Sequence[int],
    everywhere: Collection[Tensor] = (),
    previous: Mapping[Tensor, int] | None = None,
) -> dict[Tensor, int]:
    """The home (a plan rank) of each Muon parameter in a 16-bit type that every rank of the
    exchange (``ranks``) holds whole, as under DDP, but those in ``everywhere`` (whose main
    weights every holder keeps: ``QKClip`` scales them there): its owner in every plan and the
    one rank holding its main weight ([Note: main weights] in ``dmuon_fsdp._step.state``).
    Longest-processing-time-first over their NS work (rows x cols x the short side of each
    matrix), so that each rank holds about 1/W of them; those of ``previous`` (the homes before
    the parameters or meshes changed, over the same ranks) stay where they were. Depends only on
    the parameters' order, shapes and placements: every rank derives the same homes."""
    every = indexed(groups)
    candidates = [
        (p, names[p], groups[g])
        for g, p in every
        if groups[g]["use_muon"] and p.dtype in LOW_PRECISION and p not in everywhere
    ]
    layouts, param_of = describe_params(candidates, ranks)
    whole, costs = [True] * len(candidates), [0] * len(candidates)
    for m, i in zip(layouts, param_of, strict=True):
        whole[i] = whole[i] and len(m.full_holders) == len(ranks)
        costs[i] += m.rows * m.cols * min(m.rows, m.cols)
    chosen = [i for i in range(len(candidates)) if whole[i]]
    kept = previous or {}
    allowed = [(kept[p],) if (p := candidates[i][0]) in kept else None for i in chosen]
    owners, _ = assign_owners([costs[i] for i in chosen], len(ranks), allowed)
    return {candidates[i][0]: owner for i, owner in zip(chosen, owners, strict=True)}


def _homes(
    positions: Sequence[int],
    described: Sequence[tuple[Tensor, str, dict]],
    param_of: Sequence[int],
    homes: Mapping[Tensor, int],
) -> tuple[frozenset[int], list[int | None]]:
    """Of the Muon parameters with a gradient (``described``, at ``positions``), the positions of
    those whose main weight one rank holds (they keep one, and have a home: ``main_homes``),
    and each of their matrices' home, which owns it every step (None: any owner)."""
    held = [p in homes and keeps_main(p, group) for p, _, group in described]
    owner_mains = frozenset(i for i, h in zip(positions, held, strict=True) if h)
    return owner_mains, [homes[described[i][0]] if held[i] else None for i in param_of]


def plan_program(
    key: StepKey, groups: list[dict[str, Any]], state: Any, names: dict, settings: Settings
) -> Planned | Trouble:
    """A new plan for ``key`` and this rank's schedule; with a check on, one ``all_reduce``
    tells every rank of any rank's trouble and (with ``check_grads``) that all built the same
    plan."""
    every = indexed(groups)
    entries = tuple((i, g) for i, ((g, _), has) in enumerate(zip(every, key.has_grad, strict=True)) if has)
    described = [(every[i][1], names[every[i][1]], groups[g]) for i, g in entries if groups[g]["use_muon"]]
    layouts, param_of = describe_params(described, settings.site.ranks)
    forms = _forms(layouts, [described[i][2] for i in param_of], settings.ns_dtype)
    costs = [segments_flops(m.rows, m.cols, f.segments) for m, f in zip(layouts, forms, strict=True)]
    positions = [i for i, g in entries if groups[g]["use_muon"]]  # (of ``described``)
    owner_mains, homes = _homes(positions, described, param_of, settings.homes)
    site = settings.site.group
    plan = build_plan(
        layouts,
        costs,
        len(site.peers),
        settings.bucket_bytes,
        settings.comm_dtype.itemsize,
        param_of,
        settings.ns_flops_per_byte,
        settings.in_forward,
        homes,
    )
    trouble = bool(stale_layouts([p for _, p in every], state))
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
        return Trouble(shared)
    # Options set in param_groups since construction, checked once every rank agreed on them
    check_groups(groups)
    exchange = settings.exchange_group  # after the agreement: every rank asks for the group alike
    # A step begun in backward always carries flags: every rank must agree on redoing it.
    flag_elements = FLAG_ELEMENTS if key.checked or settings.in_backward else 0
    rowed = frozenset(j for j, form in enumerate(forms) if form.variant is not None)
    per_row = PerRow.on_wire(rowed, settings.comm_dtype.itemsize)
    # Steps begun in backward start the buckets before the carrier from hooks, as many as the
    # slots hold with one to spare for the carrier (see dmuon_fsdp._step.run, the bucket loop).
    carrier = min(SLOTS - 1, len(plan.buckets) - 1) if settings.in_backward else 0
    schedule = rank_schedule(plan, exchange.rank, exchange.peers, flag_elements, max(carrier, 0), per_row)
    return Planned(plan, tuple(forms), schedule, entries, owner_mains)
