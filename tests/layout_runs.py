"""Runs shared by the layout tests: DMuonFSDP and the float64 reference Muon on full matrices, step
by step on the same gradients, and the checks every layout must pass (exactness, each matrix
orthogonalized once in the job, the bytes the plan predicts, no gathers)."""

from __future__ import annotations

import torch
from instruments import CollectiveCalls
from reference import reference_muon_step, relative_error
from torch.distributed.tensor import DTensor

from dmuon_fsdp import DMuonFSDP

# "auto" runs (5, 16), the conv (6, 27) and (8, 40) in the Gram form and (13, 9), (9, 13) in the
# standard one, so every layout of test_meshes runs both forms; the reference is standard
# Newton-Schulz.
OPTIONS = dict(lr=0.05, weight_decay=0.1, ns_dtype=torch.float32, ns_algorithm="auto")
REFERENCE = dict(lr=0.05, weight_decay=0.1)
STEPS = 3
TOLERANCE = 1e-5


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def train(model, groups, loss_fn, stacked=(), steps=STEPS):
    """``steps`` steps of DMuonFSDP and of the reference on the same full gradients (Muon
    parameters only); counts what each step did. ``stacked``: parameters whose dim 0 indexes
    matrices (expert stacks). A parameter without a gradient in a step is left alone by both.
    Full tensors are read outside ``step`` only, for the comparison."""
    opt = DMuonFSDP(groups, **OPTIONS)
    muon = {p for group in opt.param_groups if group["use_muon"] for p in group["params"]}
    params = {n: p for n, p in model.named_parameters() if p in muon}
    ref = {n: full(p).detach().double().clone() for n, p in params.items()}
    bufs = {n: torch.zeros_like(p) for n, p in ref.items()}
    counts = {"ns_matrices": 0, "a2a": 0, "gathers": 0, "sent": 0, "planned": 0, "matrices": 0, "owned": 0}
    for step in range(steps):
        loss_fn(step).backward()
        grads = {n: full(p.grad).double() for n, p in params.items() if p.grad is not None}
        with CollectiveCalls() as calls:
            opt.step()
        counts["ns_matrices"] += opt.last_step_stats.ns_matrices
        counts["a2a"] += calls.calls["all_to_all_single"]
        counts["gathers"] += calls.gathers
        opt.zero_grad()
        plan = opt.plan
        counts["sent"] += opt.last_step_stats.bytes_sent
        counts["planned"] += plan.elements_moved(opt.exchange_rank) * 4
        counts["matrices"] += len(plan.matrices)
        counts["owned"] += sum(1 for o in plan.owners if o == opt.exchange_rank)
        for n in grads:
            matrices = zip(ref[n], grads[n], bufs[n]) if n in stacked else [(ref[n], grads[n], bufs[n])]
            for p, g, b in matrices:
                reference_muon_step(p, g, b, **REFERENCE)
    errors = {n: relative_error(full(p).detach(), ref[n]) for n, p in params.items()}
    return errors, counts


def check(results, min_owners):
    """Every rank's ``train`` results: within ``TOLERANCE`` of the reference, each matrix
    orthogonalized exactly once in the whole job, NS spread over at least ``min_owners`` ranks,
    no gathers, and the bytes each rank sent equal to its plan's count."""
    errors = {n: max(r[0][n] for r in results) for n in results[0][0]}
    print(f"max relative error {max(errors.values()):.2e}")  # shown with pytest -s
    assert max(errors.values()) <= TOLERANCE, errors
    counts = [r[1] for r in results]
    assert sum(c["ns_matrices"] for c in counts) == counts[0]["matrices"]
    assert sum(c["owned"] for c in counts) == counts[0]["matrices"]
    assert sum(1 for c in counts if c["owned"]) >= min_owners
    for c in counts:
        assert c["gathers"] == 0 and c["sent"] == c["planned"]
    return errors
