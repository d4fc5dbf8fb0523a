"""The tests' one training loop (``train``), and the float64 reference Muon that can follow a run
step by step on the same full gradients (``Reference``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import torch
from torch.distributed.tensor import DTensor

from instruments.counters import CollectiveCalls
from tests.support.reference import reference_muon_step, relative_error

COUNTS = ("ns_matrices", "a2a", "gathers", "sent", "planned", "matrices", "owned", "buckets")
REFERENCE_OPTIONS = ("lr", "weight_decay", "adjust_lr_fn", "normuon_beta2", "normuon_eps")  # from each group


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def train(
    runs,
    steps: int | Iterable[int],
    *,
    loss: Callable[[int], torch.Tensor] | None = None,
    step: Callable | None = None,
    reference: Reference | None = None,
    after_step: Callable[[int], None] | None = None,
) -> list[tuple[list[torch.Tensor], int, bool]]:
    """Train each ``(model, optimizer)`` of ``runs`` side by side, one step of each in turn, and
    return per step the runs' losses and the last run's ``StepStats``: ``(losses,
    started_in_backward, redone)``. ``steps`` is a count (steps 0, 1, ...) or the step numbers.

    A step is ``loss(step).backward()``, ``opt.step()``, ``opt.zero_grad()``; a step of another
    shape (micro-batches, clipping, a closure) is ``step(model, opt, step)``, which returns the loss.
    A ``reference`` (a ``Reference`` of the one run, plain steps) reads the full gradients between
    backward and ``opt.step()``, counts what the step did and takes it in float64.
    ``after_step(step)`` comes last in each step."""
    if (loss is None) == (step is None):
        raise ValueError("train takes either loss or step")
    history = []
    for i in range(steps) if isinstance(steps, int) else steps:
        losses = []
        for model, opt in runs:
            if step is not None:
                losses.append(step(model, opt, i))
                continue
            value = loss(i)
            value.backward()
            if reference is None:
                opt.step()
                opt.zero_grad()
            else:
                reference.read_gradients()
                with CollectiveCalls() as calls:
                    opt.step()
                opt.zero_grad()
                reference.step(calls)
            losses.append(value.detach())
        if after_step is not None:
            after_step(i)
        stats = runs[-1][1].last_step_stats
        history.append((losses, stats.started_in_backward, stats.redone))
    return history


def matrices(tensor, group):
    """The Muon matrices of a full parameter (views), as ``group`` orthogonalizes them: each of a
    stack's (``flatten=False``), each ``split_sizes`` or ``num_heads`` row block on its own."""
    stacks = list(tensor) if not group["flatten"] and tensor.ndim > 2 else [tensor]
    out = []
    for m in stacks:
        sizes = group["split_sizes"] or [m.shape[0] // (group["num_heads"] or 1)] * (group["num_heads"] or 1)
        out += list(m.split(sizes))
    return out


class Reference:
    """The float64 reference Muon on full matrices beside a DMuonFSDP run: its Muon parameters
    (``params``, by name), each matrix as its group says, with the group's options; a row
    variant's state kept per matrix for its groups: NorMuon's second moments, or for another
    variant the state ``row_reference(O, state, group)`` updates in place and whose row factors
    it returns. A parameter without a gradient in a step is
    left alone. ``counts`` sums what the run's steps did: matrices orthogonalized, all-to-alls,
    gathers, bytes sent and planned, the plan's matrices and this rank's, the most buckets. Full
    tensors are read outside ``opt.step()`` only."""

    def __init__(self, model, opt, row_reference=None):
        self.opt, self.row_reference = opt, row_reference
        self.groups = {p: group for group in opt.param_groups if group["use_muon"] for p in group["params"]}
        self.named = {n: p for n, p in model.named_parameters() if p in self.groups}
        self.params = {n: full(p).detach().double().clone() for n, p in self.named.items()}
        self.bufs = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.moments = {
            n: [
                torch.zeros(m.shape[0], dtype=torch.float64) for m in matrices(self.params[n], self.groups[p])
            ]
            for n, p in self.named.items()
            if self.groups[p]["variant"] != "muon"
        }
        self.counts = dict.fromkeys(COUNTS, 0)
        self.grads = {}

    def read_gradients(self):
        self.grads = {n: full(p.grad).double() for n, p in self.named.items() if p.grad is not None}

    def step(self, calls: CollectiveCalls):
        """Count the run's step (``calls``: its collectives), then take it on ``params``."""
        opt, counts = self.opt, self.counts
        counts["ns_matrices"] += opt.last_step_stats.ns_matrices
        counts["a2a"] += calls.calls["all_to_all_single"]
        counts["gathers"] += calls.gathers
        plan = opt.plan
        counts["sent"] += opt.last_step_stats.bytes_sent
        counts["planned"] += plan.elements_moved(opt.exchange_rank) * 4
        counts["matrices"] += len(plan.matrices)
        counts["owned"] += sum(1 for o in plan.owners if o == opt.exchange_rank)
        counts["buckets"] = max(counts["buckets"], len(plan.buckets))
        for n, grad in self.grads.items():
            group = self.groups[self.named[n]]
            views = zip(*(matrices(t, group) for t in (self.params[n], grad, self.bufs[n])), strict=True)
            options = {k: group[k] for k in REFERENCE_OPTIONS}
            for b, (p, g, buf) in enumerate(views):
                state = self.moments[n][b] if n in self.moments else None
                if group["variant"] in ("muon", "normuon"):
                    reference_muon_step(p, g, buf, **options, second_moment=state)
                else:
                    factors = partial(self.row_reference, state=state, group=group)
                    reference_muon_step(p, g, buf, **options, row_factors=factors)

    def errors(self) -> dict[str, float | None]:
        """Each parameter's relative error from the reference's: of its float32 main weight where
        it keeps one (a bfloat16 parameter is that, rounded); None for a 16-bit parameter whose
        main weight another rank holds (its owner, under DDP): that rank tells."""
        state, low = self.opt.state, (torch.bfloat16, torch.float16)
        out: dict[str, float | None] = {}
        for n, p in self.named.items():
            main = state.get(p, {}).get("main_weight")
            elsewhere = main is None and p.dtype in low and self.groups[p]["main_weights"]
            out[n] = (
                None
                if elsewhere
                else relative_error(full(p if main is None else main).detach(), self.params[n])
            )
        return out
