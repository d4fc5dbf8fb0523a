"""Moving from ``torch.optim.Muon``: the same call means the same optimizer (positional
arguments in torch's order, the rest keyword-only), and with torch's lr, weight decay and bf16
Newton-Schulz the updates are torch's, bitwise, at realistic shapes over steps with momentum."""

from __future__ import annotations

import inspect

import pytest
import torch

from dmuon_fsdp import DMuonFSDP

TORCH_ARGUMENTS = [
    "lr",
    "weight_decay",
    "momentum",
    "nesterov",
    "ns_coefficients",
    "eps",
    "ns_steps",
    "adjust_lr_fn",
]


def positional(cls) -> list[str]:
    kinds = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in kinds if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD][2:]  # self, params


def test_the_constructor_takes_torch_muons_arguments_in_its_order_and_the_rest_by_keyword():
    assert positional(torch.optim.Muon) == TORCH_ARGUMENTS
    assert positional(DMuonFSDP) == TORCH_ARGUMENTS
    extra = inspect.signature(DMuonFSDP.__init__).parameters.values()
    # the rest are keyword-only; ``**other`` only turns other optimizers' names into hints
    by_keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD)
    assert all(p.kind in by_keyword for p in list(extra)[2 + len(TORCH_ARGUMENTS) :])


@pytest.mark.parametrize("by", ["position", "keyword"])
def test_a_torch_muon_call_means_the_same_here(by):
    values = [0.03, 0.2, 0.9, False, (3.0, -4.0, 2.0), 1e-6, 4, "match_rms_adamw"]
    params = [torch.nn.Parameter(torch.randn(6, 4))]
    if by == "position":
        theirs, ours = torch.optim.Muon(params, *values), DMuonFSDP(params, *values)
    else:
        kwargs = dict(zip(TORCH_ARGUMENTS, values, strict=True))
        theirs, ours = torch.optim.Muon(params, **kwargs), DMuonFSDP(params, **kwargs)
    for name in TORCH_ARGUMENTS:
        assert ours.param_groups[0][name] == theirs.param_groups[0][name], name


SHAPES = [(64, 256), (256, 64), (128, 128), (256, 1024), (1024, 256), (96, 40)]
TALL = [s for s in SHAPES if s[0] > s[1]]
# The parameters of tall matrices are compared on their transpose (the second test), so the
# first leaves out the largest tall one, whose bf16 Newton-Schulz costs minutes where bf16 is
# emulated (no AVX512-BF16) and would be checked there for its momentum alone.
WIDE = [s for s in SHAPES if s != max(TALL)]
# Two steps: the first from zero momentum, the second with it (and Nesterov's blend); each later
# step is the same computation on new inputs (Newton-Schulz keeps no state), so differences would
# show at once. (Where bf16 is emulated, each step of these tests costs about 8 s of the suite;
# at 512 x 2048 it was 40 s.)
STEPS = 2


def train(make, start, grads, transpose=False):
    """Parameters and momentum buffers after ``grads`` (every matrix transposed with ``transpose``)."""
    flip = (lambda t: t.mT.contiguous()) if transpose else (lambda t: t)
    params = [torch.nn.Parameter(flip(x.clone())) for x in start]
    opt = make(params)
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = flip(g.clone())
        opt.step()
    bufs = [opt.state[p]["momentum_buffer"] for p in params]
    return [flip(p.detach()) for p in params], [flip(b) for b in bufs]


@pytest.mark.parametrize("nesterov", [True, False])
def test_updates_equal_torch_muons_bitwise_at_realistic_shapes(nesterov):
    """Momentum bitwise for every matrix; parameters bitwise for every matrix but tall ones, which
    torch orthogonalizes as a transposed view of the row-major matrix: its bf16 matmuls round by
    memory layout (its own result for a 2048 x 512 matrix and for the same matrix stored
    transposed differ), and DMuonFSDP keeps tall matrices transposed and contiguous."""
    torch.manual_seed(0)
    start = [torch.randn(s) * 0.02 for s in WIDE]
    grads = [[torch.randn(s) for s in WIDE] for _ in range(STEPS)]
    options = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov)
    theirs = train(lambda p: torch.optim.Muon(p, **options), start, grads)
    ours = train(lambda p: DMuonFSDP(p, **options, ns_dtype=torch.bfloat16), start, grads)
    for shape, a, b in zip(WIDE, theirs[1], ours[1], strict=True):
        assert torch.equal(a, b), f"momentum {shape}"
    for shape, a, b in zip(WIDE, theirs[0], ours[0], strict=True):
        if shape[0] <= shape[1]:
            assert torch.equal(a, b), f"parameter {shape}: max difference {(a - b).abs().max().item():.3g}"


def test_tall_matrices_equal_torch_muon_on_their_transpose_bitwise():
    """What a tall matrix's update is: torch.optim.Muon's for the same matrix stored transposed
    (match_rms_adamw, whose lr scale is the same for a matrix and its transpose)."""
    tall = TALL
    torch.manual_seed(0)
    start = [torch.randn(s) * 0.02 for s in tall]
    grads = [[torch.randn(s) for s in tall] for _ in range(STEPS)]
    options = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    theirs = train(lambda p: torch.optim.Muon(p, **options), start, grads, transpose=True)
    ours = train(lambda p: DMuonFSDP(p, **options, ns_dtype=torch.bfloat16), start, grads)
    for what in (0, 1):  # parameters, momentum buffers
        for shape, a, b in zip(tall, theirs[what], ours[what], strict=True):
            assert torch.equal(a, b), (shape, ("parameter", "momentum")[what])
