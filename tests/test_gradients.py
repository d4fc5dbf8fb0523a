"""Gradients as autograd and users make them: expanded (stride 0), transposed or otherwise
non-contiguous gradients step exactly as their contiguous copies, as torch's optimizers take
them, and the step never writes into a gradient."""

from __future__ import annotations

import pytest
import torch

from dmuon_fsdp import DMuonFSDP

SHAPES = [(8, 6), (6, 8), (5,)]


def odd_gradients(kind: str) -> list[torch.Tensor]:
    torch.manual_seed(1)
    out = []
    for shape in SHAPES:
        if kind == "expanded":  # as the backward of a sum or a broadcast gives them
            out.append(torch.randn(shape[-1]).expand(shape))
        elif kind == "transposed":
            out.append(torch.randn(tuple(reversed(shape))).T if len(shape) == 2 else torch.randn(shape))
        else:  # every other element of a larger tensor
            out.append(torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2])
    return out


@pytest.mark.parametrize("nonfinite", ["raise", "skip", "ignore"])
@pytest.mark.parametrize("kind", ["expanded", "transposed", "strided"])
def test_odd_gradients_step_as_their_contiguous_copies_and_are_not_written(kind, nonfinite):
    torch.manual_seed(0)
    start = [torch.randn(s) for s in SHAPES]
    results = []
    for contiguous in (False, True):
        params = [torch.nn.Parameter(x.clone()) for x in start]
        opt = DMuonFSDP(params, lr=0.02, weight_decay=0.1, nonfinite=nonfinite)
        for _ in range(3):
            grads = odd_gradients(kind)
            for p, g in zip(params, grads, strict=True):
                p.grad = g.contiguous() if contiguous else g
            versions, values = [g._version for g in grads], [g.clone() for g in grads]
            opt.step()
            assert [g._version for g in grads] == versions, "the step wrote into a gradient"
            assert all(torch.equal(g, v) for g, v in zip(grads, values, strict=True))
        results.append([p.detach().clone() for p in params])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    # torch's own optimizers take such gradients too (the bar this test holds DMuonFSDP to)
    params = [torch.nn.Parameter(x.clone()) for x in start]
    for p, g in zip(params, odd_gradients(kind), strict=True):
        p.grad = g
    torch.optim.AdamW(params).step()


def test_a_non_finite_expanded_gradient_is_still_found():
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = DMuonFSDP(params, lr=0.02, nonfinite="skip")
    for p in params:
        p.grad = torch.full((p.shape[-1],), float("nan")).expand(p.shape)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert opt.last_step_stats.skipped
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
