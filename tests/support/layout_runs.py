"""Runs shared by the layout tests: DMuonFSDP and the float64 reference Muon on full matrices, step
by step on the same gradients, and the checks every layout must pass (exactness, each matrix
orthogonalized once in the job, the bytes the plan predicts, no gathers)."""

from __future__ import annotations

import torch
from reference import reference_muon_step, relative_error
from torch import nn
from torch.distributed.tensor import DTensor

from dmuon_fsdp import DMuonFSDP
from dmuon_fsdp.exchange import SLOTS
from instruments.counters import CollectiveCalls

# "auto" runs (5, 16), the conv (6, 27) and (8, 40) in the Gram form and (13, 9), (9, 13) in the
# standard one, so every layout of test_meshes runs both forms; the reference is standard
# Newton-Schulz.
# Buckets of 256 bytes a rank: several per step, so that later buckets reuse earlier ones' slots.
OPTIONS = dict(lr=0.05, weight_decay=0.1, ns_dtype=torch.float32, ns_algorithm="auto", bucket_bytes=256)
STEPS = 3
TOLERANCE = 1e-5
REFERENCE_OPTIONS = ("lr", "weight_decay", "adjust_lr_fn", "normuon_beta2", "normuon_eps")  # from each group

# (5, 16) leaves an empty shard at 4 ranks; (13, 9) and (9, 13) split unevenly on both mesh dims.
SHAPES = {"w5": (5, 16), "w13": (13, 9), "w9": (9, 13), "conv": (6, 3, 3, 3), "tall": (40, 8)}
SHAPES |= {f"{n}_b": s for n, s in SHAPES.items()}  # twice as many: more buckets than slots


class Weights(nn.Module):
    """One parameter per shape; the loss sum(w * g) makes each gradient g (averaged over ranks)."""

    def __init__(self, shapes):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.ws = nn.ParameterDict(
            {n: nn.Parameter(torch.randn(s, generator=gen) * 0.1) for n, s in shapes.items()}
        )

    def forward(self, step):
        gen = torch.Generator().manual_seed(100 + step)
        # A replicated DTensor's local tensor is the whole weight; FSDP2 unshards to plain tensors.
        local = [w.to_local() if isinstance(w, DTensor) else w for w in self.ws.values()]
        return sum((w * torch.randn(w.shape, generator=gen)).sum() for w in local)


def given_gradients(model):
    """A loss function for models whose forward DTensor cannot run (uneven tensor parallelism):
    it sets every gradient directly, random local shards, equal on the ranks that replicate
    them (read back by ``full_tensor``), and returns a zero loss."""

    def loss(step):
        for p in model.parameters():
            seed = 1000 * step + sum(c * 10**i for i, c in enumerate(p.device_mesh.get_coordinate()))
            local = torch.randn(p.to_local().shape, generator=torch.Generator().manual_seed(seed))
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        return torch.zeros((), requires_grad=True)

    return loss


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def matrices(tensor, group):
    """The Muon matrices of a full parameter (views), as ``group`` orthogonalizes them: each of a
    stack's (``flatten=False``), each ``split_sizes`` or ``num_heads`` row block on its own."""
    stacks = list(tensor) if not group["flatten"] and tensor.ndim > 2 else [tensor]
    out = []
    for m in stacks:
        sizes = group["split_sizes"] or [m.shape[0] // (group["num_heads"] or 1)] * (group["num_heads"] or 1)
        out += list(m.split(sizes))
    return out


def train(model, groups, loss_fn, steps=STEPS, **options):
    """``steps`` steps of DMuonFSDP (``OPTIONS`` and ``options``) and of the reference on the
    same full gradients (Muon parameters only, each matrix as its group says; NorMuon's second
    moments kept per matrix for its groups); counts what each step did. A parameter without a
    gradient in a step is left alone by both. Full tensors are read outside ``step`` only, for
    the comparison."""
    opt = DMuonFSDP(groups, **{**OPTIONS, **options})
    muon = {p: group for group in opt.param_groups if group["use_muon"] for p in group["params"]}
    params = {n: p for n, p in model.named_parameters() if p in muon}
    ref = {n: full(p).detach().double().clone() for n, p in params.items()}
    bufs = {n: torch.zeros_like(p) for n, p in ref.items()}
    moments = {
        n: [torch.zeros(m.shape[0], dtype=torch.float64) for m in matrices(ref[n], muon[p])]
        for n, p in params.items()
        if muon[p]["variant"] == "normuon"
    }
    counts = {
        "ns_matrices": 0,
        "a2a": 0,
        "gathers": 0,
        "sent": 0,
        "planned": 0,
        "matrices": 0,
        "owned": 0,
        "buckets": 0,
    }
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
        counts["buckets"] = max(counts["buckets"], len(plan.buckets))
        for n in grads:
            group = muon[params[n]]
            views = zip(*(matrices(t, group) for t in (ref[n], grads[n], bufs[n])), strict=True)
            options = {
                k: group[k] for k in ("lr", "weight_decay", "adjust_lr_fn", "normuon_beta2", "normuon_eps")
            }
            for b, (p, g, buf) in enumerate(views):
                second_moment = moments[n][b] if n in moments else None
                reference_muon_step(p, g, buf, **options, second_moment=second_moment)
    errors = {n: relative_error(full(p).detach(), ref[n]) for n, p in params.items()}
    return errors, counts


def check(results, min_owners, reuses_slots=True):
    """Every rank's ``train`` results: within ``TOLERANCE`` of the reference, each matrix
    orthogonalized exactly once in the whole job, NS spread over at least ``min_owners`` ranks,
    no gathers, and the bytes each rank sent equal to its plan's count; with ``reuses_slots``,
    more buckets than buffer slots (later buckets reuse earlier ones' buffers)."""
    errors = {n: max(r[0][n] for r in results) for n in results[0][0]}
    print(f"max relative error {max(errors.values()):.2e}")  # shown with pytest -s
    assert max(errors.values()) <= TOLERANCE, errors
    counts = [r[1] for r in results]
    assert sum(c["ns_matrices"] for c in counts) == counts[0]["matrices"]
    assert sum(c["owned"] for c in counts) == counts[0]["matrices"]
    assert sum(1 for c in counts if c["owned"]) >= min_owners
    for c in counts:
        assert c["gathers"] == 0 and c["sent"] == c["planned"]
    assert not reuses_slots or counts[0]["buckets"] > SLOTS, f"{counts[0]['buckets']} buckets"
    return errors
