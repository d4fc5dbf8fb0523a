"""Runs shared by the layout tests: DMuonFSDP and the float64 reference Muon on full matrices,
step by step on the same gradients (``against_reference``), and the checks every layout must pass
(exactness, each matrix orthogonalized once in the job, the bytes the plan predicts, no gathers)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dmuon_fsdp import DMuonFSDP
from dmuon_fsdp._step.buffers import SLOTS
from tests.support.training import Reference, train

# "auto" runs (5, 16), the conv (6, 27) and (8, 40) in the Gram form and (13, 9), (9, 13) in the
# standard one, so every layout of test_meshes runs both forms; the reference is standard
# Newton-Schulz.
# Buckets of 256 bytes a rank: several per step, so that later buckets reuse earlier ones' slots.
OPTIONS = dict(lr=0.05, weight_decay=0.1, ns_dtype=torch.float32, ns_algorithm="auto", bucket_bytes=256)
STEPS = 3
TOLERANCE = 1e-5

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


def against_reference(model, groups, loss, steps=STEPS, row_reference=None, **options):
    """``train`` DMuonFSDP (``OPTIONS`` and ``options``) on ``groups`` with the float64
    ``Reference`` following it (``row_reference``: a row variant's, see ``Reference``): each Muon
    parameter's relative error from the reference, and what the steps did
    (``Reference.counts``)."""
    opt = DMuonFSDP(groups, **{**OPTIONS, **options})
    reference = Reference(model, opt, row_reference)
    train([(model, opt)], steps, loss=loss, reference=reference)
    opt.finish_step()  # (``overlap_forward``: the last step's relays)
    return reference.errors(), reference.counts


def check(results, min_owners, reuses_slots=True):
    """Every rank's ``against_reference`` results: within ``TOLERANCE`` of the reference, each matrix
    orthogonalized exactly once in the whole job, NS spread over at least ``min_owners`` ranks,
    no gathers, and the bytes each rank sent equal to its plan's count; with ``reuses_slots``,
    more buckets than buffer slots (later buckets reuse earlier ones' buffers)."""
    # (a main weight held by one rank: its error there, and some rank holds each)
    errors = {n: max(e for r in results if (e := r[0][n]) is not None) for n in results[0][0]}
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
