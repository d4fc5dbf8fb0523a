"""Fused weights (split_sizes, num_heads) and expert stacks (flatten=False): each row block is
orthogonalized as if it were its own parameter, wherever shard boundaries fall."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from dmuon_fsdp import DMuonFSDP
from tests.support.reference import reference_muon_step, relative_error
from tests.support.spawn import cpu_mesh, run_ranks
from tests.support.training import train

# name -> (shape, group options, row blocks of the (rows, cols) view)
CASES = {
    "qkv": ((20, 16), {"split_sizes": [7, 5, 8]}, [(0, 7), (7, 5), (12, 8)]),
    "heads": ((20, 16), {"num_heads": 4}, [(0, 5), (5, 5), (10, 5), (15, 5)]),
    "experts": ((3, 6, 10), {"flatten": False}, [(0, 6), (6, 6), (12, 6)]),
}
STEPS = 3


def _data():
    gen = torch.Generator().manual_seed(7)
    init = {n: torch.randn(shape, generator=gen, dtype=torch.float64) for n, (shape, _, _) in CASES.items()}
    grads = [
        {n: torch.randn(shape, generator=gen, dtype=torch.float64) for n, (shape, _, _) in CASES.items()}
        for _ in range(STEPS)
    ]
    return init, grads


def _reference():
    init, grads = _data()
    params = {n: p.clone() for n, p in init.items()}
    bufs = {n: torch.zeros_like(p) for n, p in init.items()}
    for step_grads in grads:
        for name, (shape, _, blocks) in CASES.items():
            cols = shape[-1]
            view_p, view_b = params[name].view(-1, cols), bufs[name].view(-1, cols)
            view_g = step_grads[name].view(-1, cols)
            for start, rows in blocks:
                block_p = view_p[start : start + rows].clone()
                block_b = view_b[start : start + rows].clone()
                reference_muon_step(block_p, view_g[start : start + rows], block_b, lr=0.05, weight_decay=0.1)
                view_p[start : start + rows] = block_p
                view_b[start : start + rows] = block_b
    return params


class Fused(nn.Module):
    def __init__(self):
        super().__init__()
        init, _ = _data()
        self.ws = nn.ParameterDict({n: nn.Parameter(p.float()) for n, p in init.items()})

    def forward(self, grads):
        return sum((self.ws[n] * g).sum() for n, g in grads.items())


def _groups(model):
    return [{"params": [(n, model.ws[n])], **options} for n, (_, options, _) in CASES.items()]


def _given(loss):
    """``loss`` (the model or its DDP wrapper) as a function of the step, on ``_data()``'s gradients."""
    _, grads = _data()
    return lambda step: loss({n: g.float() for n, g in grads[step].items()})


def test_blocks_single_process():
    model = Fused()
    opt = DMuonFSDP(_groups(model), lr=0.05, weight_decay=0.1, ns_dtype=torch.float32)
    train([(model, opt)], STEPS, loss=_given(model))
    expected = _reference()
    for name in CASES:
        assert relative_error(model.ws[name].detach(), expected[name]) <= 1e-5, name


def sharded_blocks(rank, world_size, ns_algorithm):
    model = Fused()
    fully_shard(model, mesh=cpu_mesh())
    opt = DMuonFSDP(
        _groups(model), lr=0.05, weight_decay=0.1, ns_dtype=torch.float32, ns_algorithm=ns_algorithm
    )
    train([(model, opt)], STEPS, loss=_given(model))
    params = {n: model.ws[n].full_tensor() for n in CASES}
    # An optimizer over the expert stack alone: experts sharded on the expert dim stay put.
    experts_only = DMuonFSDP([{"params": [model.ws["experts"]], "flatten": False}], ns_dtype=torch.float32)
    model.ws["experts"].grad = torch.ones_like(model.ws["experts"])
    experts_only.step()
    return params, experts_only.last_step_stats.bytes_sent


@pytest.mark.parametrize("ns_algorithm", ["standard", "gram"])
def test_blocks_across_shard_boundaries_match_separate_matrices(ns_algorithm):
    # W=3 cuts 20 rows 7/7/6, so QKV's and the heads' blocks straddle ranks; one expert per rank.
    # The reference runs standard Newton-Schulz on each block; "gram" runs every block in the Gram form.
    expected = _reference()
    results = run_ranks(sharded_blocks, 3, ns_algorithm)
    for name in CASES:
        assert relative_error(results[0][0][name], expected[name]) <= 1e-5, name
    assert all(sent == 0 for _, sent in results), "experts sharded on the expert dim must not move"


def replicated_blocks(rank, world_size):
    model = Fused()
    opt = DMuonFSDP(_groups(model), lr=0.05, weight_decay=0.1, ns_dtype=torch.float32)
    train([(model, opt)], STEPS, loss=_given(DistributedDataParallel(model)))
    return {n: model.ws[n].detach() for n in CASES}


def test_blocks_of_replicated_parameters_match_separate_matrices():
    # DDP: every rank holds every block, but orthogonalizes (and feeds) only the blocks it owns.
    expected = _reference()
    first, second = run_ranks(replicated_blocks, 2)
    for name in CASES:
        assert relative_error(first[name], expected[name]) <= 1e-5, name
        assert torch.equal(first[name], second[name]), name
