"""Paired runs for overlap_backward tests: two copies of one model, one with the plain step and one
with ``overlap_backward=True``, to ``train`` side by side, and what to compare them by."""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from dmuon_fsdp import DMuonFSDP
from tests.support.spawn import cpu_mesh
from tests.support.training import full

STEPS = 4
BUCKET = 2**10  # bytes: four buckets or more at W = 1..4, so that slots are reused
# Rows that leave uneven and, at W=4, empty shards (5 -> 2, 2, 1, 0); twelve matrices, so that
# each owner has several and a bucket per owner and slot is not the whole model.
DIMS = (24, 37, 5, 13) * 3 + (24,)


class Stack(nn.Module):
    """Linear layers (each its own FSDP unit, so gradients land layer by layer in backward),
    a vector for AdamW and a tall last layer."""

    def __init__(self, dims=DIMS):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in itertools.pairwise(dims))
        self.scale = nn.Parameter(torch.ones(dims[-1]))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x * self.scale


def inputs(step, dim=DIMS[0]):
    return torch.randn(8, dim, generator=torch.Generator().manual_seed(100 + step))


def sharded(mesh=None, dims=DIMS):
    model = Stack(dims)
    mesh = mesh or cpu_mesh()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def snapshot(model, opt):
    out = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key, value in opt.state[p].items():
            if torch.is_tensor(value):
                out[f"{n}:{key}"] = full(value).clone()
    return out


def pair(make, **options):
    """Two copies of ``make()``: (model, optimizer) plain and with overlap_backward."""
    out = []
    for overlap in (False, True):
        model = make()
        opt = DMuonFSDP(model.parameters(), lr=0.02, bucket_bytes=BUCKET, overlap_backward=overlap, **options)
        out.append((model, opt))
    return out


def plain_step(model, opt, step, x=None):
    loss = model(inputs(step) if x is None else x).pow(2).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def step_apart(runs, step, x=None, before=None):
    """One ``plain_step`` of each ``(model, opt)`` of ``runs`` on ``x`` (default
    ``inputs(step)``), after ``before(i, model, opt)``; returns the losses and whether the first
    two runs' parameters differ right after (``overlap_forward``: rows still in flight)."""
    losses = []
    for i, (model, opt) in enumerate(runs):
        if before is not None:
            before(i, model, opt)
        losses.append(plain_step(model, opt, step, x))
    pairs = zip(runs[0][0].parameters(), runs[1][0].parameters(), strict=True)
    return losses, any(not torch.equal(full(p), full(q)) for p, q in pairs)


def compare(runs):
    (m0, o0), (m1, o1) = runs
    a, b = snapshot(m0, o0), snapshot(m1, o1)
    assert a.keys() == b.keys()
    return [n for n in a if not torch.equal(a[n], b[n])]
