"""From the optimizer's parameters to a step program, and when to make a new one.

A program is compiled for a step *key*: which parameters have gradients, the Muon groups'
structural options, and whether check flags travel. ``Programs`` keeps the current one, builds a
new one when the key changes (layouts -> planner -> schedule -> binding, with plan agreement
over the ranks when a check is on) and rebinds the same plan when a parameter's storage or a
state tensor was replaced. With ``check_grads`` over several ranks a changed key does not
rebuild on one rank alone: the step runs the old program, its flags tell every rank, and all
rebuild together (``Verdict.REBUILD``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dmuon_fsdp import binding, comm, grad_checks
from dmuon_fsdp.layouts import describe_params, local_shard
from dmuon_fsdp.planner import Plan, build_plan
from dmuon_fsdp.program import Entry, StepProgram
from dmuon_fsdp.schedule import FLAG_ELEMENTS, RankSchedule, rank_schedule

# Muon group options compiled into the step program: changing one rebuilds it.
STRUCTURAL = ("ns_steps", "ns_coefficients", "ns_algorithm", "eps", "adjust_lr_fn", "flatten", "split_sizes", "num_heads")


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def step_key(groups: list[dict[str, Any]], grads: list[Tensor | None], flags: bool) -> tuple:
    """(which parameters have gradients, each Muon group's structural options, whether flags travel)."""
    options = tuple(tuple(_frozen(g[k]) for k in STRUCTURAL) for g in groups if g["use_muon"])
    return tuple(g is not None for g in grads), options, flags


def relayouted(params: list[Tensor], state: Any) -> set[Tensor]:
    """Parameters whose local shard no longer matches their state (resharded or resized)."""
    return {p for p in params
            if any(key != "step" and local_shard(v).shape != local_shard(p).shape for key, v in state[p].items())}  # fmt: skip


@dataclass(frozen=True)
class Sources:
    """What a program is compiled from; ``indexed`` holds (group index, parameter) in optimizer order."""

    indexed: list[tuple[int, Tensor]]
    names: dict[Tensor, str]
    groups: list[dict[str, Any]]
    state: Any
    mesh: Any  # the exchange mesh (None: plain tensors)
    exchange: comm.ExchangeGroup
    bucket_bytes: int
    ns_dtype: torch.dtype
    comm_dtype: torch.dtype
    device: torch.device
    check_grads: bool


class Programs:
    """The optimizer's current step program (``current``; None before the first step)."""

    def __init__(self) -> None:
        self.current: StepProgram | None = None
        self.stale = False  # the state was replaced wholesale (load_state_dict): bind anew

    def for_step(
        self, key: tuple, params: list[Tensor], state: Any, sources: Callable[[], Sources],
        explain: Callable[[bool], None], check_grads: bool,
    ) -> tuple[StepProgram, bool]:  # fmt: skip
        """The program for this step, and whether its views still point at the parameters and
        state (False: a parameter was resized or resharded, which the step reports).
        ``sources`` is called only to build or bind."""
        prog = self.current
        agreeing = check_grads and prog is not None and prog.flags is not None
        if prog is None or (key != prog.key and not agreeing):
            self.current = prog = None  # its buffers go before the new ones are allocated
            prog = self.current = self._build(key, sources(), explain)
        if self.stale or prog.moved(params, state):
            if relayouted(params, state):
                return prog, False
            plan, schedule, key = prog.plan, prog.schedule, prog.key
            self.current = prog = None
            prog = self.current = self._bind(plan, schedule, key, sources())
        return prog, True

    def _build(self, key: tuple, src: Sources, explain: Callable[[bool], None]) -> StepProgram:
        """A new plan for ``key``; with a check on, one ``all_reduce`` tells every rank of any
        rank's trouble and (with ``check_grads``) that all built the same plan."""
        muon = [(p, src.names[p], src.groups[g]) for (g, p), has in zip(src.indexed, key[0])
                if has and src.groups[g]["use_muon"]]  # fmt: skip
        layouts, param_of = describe_params(muon, src.ns_dtype, comm.default_world_size(), src.mesh)
        peers = src.exchange.peers
        plan = build_plan(layouts, len(peers), src.bucket_bytes, src.comm_dtype.itemsize, param_of)
        params = [p for _, p in src.indexed]
        trouble = bool(relayouted(params, src.state))
        shared = key[2] and src.exchange.group is not None
        if shared:
            digest = grad_checks.digest(key)
            trouble = grad_checks.agree_on_plan(trouble, digest, plan, src.exchange.group, src.device, src.check_grads)
        if trouble:
            explain(shared)
        schedule = rank_schedule(plan, src.exchange.rank, peers, FLAG_ELEMENTS if key[2] else 0)
        return self._bind(plan, schedule, key, src)

    def _bind(self, plan: Plan, schedule: RankSchedule, key: tuple, src: Sources) -> StepProgram:
        self.stale = False
        entries = [Entry(i, g, p) for i, ((g, p), has) in enumerate(zip(src.indexed, key[0])) if has]
        digest = grad_checks.digest(key)
        return binding.build_program(
            plan, schedule, entries, src.groups, src.state, key=key, digest=digest,
            flag_values=grad_checks.flag_values(False, digest), ns_dtype=src.ns_dtype,
            comm_dtype=src.comm_dtype, device=src.device,
        )  # fmt: skip
