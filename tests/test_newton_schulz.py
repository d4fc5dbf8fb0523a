"""The Newton-Schulz module against float64 math."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dmuon_fsdp.newton_schulz import (
    GRAM_NOISE_BUDGET,
    MUON_COEFFICIENTS,
    POLAR_EXPRESS,
    Workspace,
    gram_segments,
    newton_schulz,
    ns_segments,
    orthogonalize_,
    resolve_coefficients,
    segments_flops,
    standard_segments,
)
from instruments.plans import newton_schulz_flops
from tests.support.reference import reference_orthogonalize, relative_error


@pytest.mark.parametrize("shape", [(8, 32), (32, 8), (16, 16), (1, 5), (5, 1)])
@pytest.mark.parametrize("coefficients", [MUON_COEFFICIENTS, POLAR_EXPRESS], ids=["muon", "polar"])
@pytest.mark.parametrize("algorithm", ["standard", "gram", "auto"])
def test_batched_matches_float64_reference(shape, coefficients, algorithm):
    torch.manual_seed(0)
    batch = torch.randn(3, *shape)
    out = newton_schulz(batch, resolve_coefficients(coefficients, 5), 1e-7, torch.float32, algorithm)
    assert out.shape == batch.shape and out.dtype == torch.float32
    for i in range(3):
        expected = reference_orthogonalize(batch[i], coefficients, 5, 1e-7)
        assert relative_error(out[i], expected) < 1e-5


def test_polar_express_converges_to_the_polar_factor():
    torch.manual_seed(0)
    m = torch.randn(64, 128, dtype=torch.float64)
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    out = newton_schulz(m, resolve_coefficients(POLAR_EXPRESS, 10), 1e-7, torch.float64)
    assert relative_error(out, u @ vh) < 1e-2
    singular = torch.linalg.svdvals(out)
    assert singular.min() > 0.9 and singular.max() < 1.1


def test_zero_matrix_stays_zero():
    out = newton_schulz(torch.zeros(2, 4, 6), resolve_coefficients(MUON_COEFFICIENTS, 5), 1e-7, torch.float32)
    assert torch.equal(out, torch.zeros(2, 4, 6))


def test_coefficient_lists():
    triple = (1.0, 2.0, 3.0)
    assert resolve_coefficients(triple, 3) == (triple,) * 3
    steps = [(1.0, 0.0, 0.0), (2.0, 0.0, 0.0)]
    assert resolve_coefficients(steps, 4) == ((1.0, 0.0, 0.0),) + ((2.0, 0.0, 0.0),) * 3
    assert resolve_coefficients(steps, 1) == ((1.0, 0.0, 0.0),)
    assert resolve_coefficients("polar_express", 8) == POLAR_EXPRESS


@pytest.mark.parametrize("bad", [(1.0, 2.0), [(1.0, 2.0, 3.0), (1.0,)], [], "nope", (1.0, float("nan"), 0.0)])
def test_malformed_coefficients_raise(bad):
    with pytest.raises(ValueError, match="ns_coefficients"):
        resolve_coefficients(bad, 5)


def test_flops_formula():
    assert newton_schulz_flops(4, 8, 2) == 2 * (4 * 16 * 8 + 2 * 64)
    assert newton_schulz_flops(8, 4, 2) == newton_schulz_flops(4, 8, 2)


def _run(x: torch.Tensor, coefficients, segments) -> torch.Tensor:
    out = x.clone()
    orthogonalize_(out, coefficients, 1e-7, Workspace.for_stack(out, segments), segments)
    return out


@pytest.mark.parametrize("coefficients", [MUON_COEFFICIENTS, POLAR_EXPRESS], ids=["muon", "polar"])
@pytest.mark.parametrize("segments", [(5,), (3, 2), (2, 3), (2, 1, 2), (1, 4), (1,) * 5])
@pytest.mark.parametrize("shape", [(2, 12, 40), (1, 1, 9), (3, 16, 16)])
def test_gram_form_is_the_same_polynomial(coefficients, segments, shape):
    """In float64 every grouping into Gram segments gives standard Newton-Schulz's result."""
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64)
    triples = resolve_coefficients(coefficients, 5)
    assert relative_error(_run(x, triples, segments), _run(x, triples, standard_segments(5))) < 1e-12


@pytest.mark.parametrize("segments", [(1,) * 5, (5,), (3, 2), (2, 1, 2), (1, 3, 1)])
def test_flop_count_is_the_flops_run(segments):
    """The planner's cost of a form equals what torch's FlopCounterMode counts for it."""
    x = torch.randn(2, 12, 40)
    triples = resolve_coefficients(MUON_COEFFICIENTS, 5)
    with FlopCounterMode(display=False) as counter:
        _run(x, triples, segments)
    assert counter.get_total_flops() == 2 * segments_flops(12, 40, segments)
    assert segments_flops(40, 12, segments) == segments_flops(12, 40, segments)


@pytest.mark.parametrize("shape", [(256, 688), (688, 256), (256, 256), (64, 128), (768, 2048), (1, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_picks_the_form_with_fewer_flops(shape, dtype):
    triples = resolve_coefficients(MUON_COEFFICIENTS, 5)
    chosen = ns_segments("auto", triples, dtype, *shape)
    gram, standard = gram_segments(triples, dtype), standard_segments(5)
    cheaper = gram if segments_flops(*shape, gram) < segments_flops(*shape, standard) else standard
    assert chosen == cheaper
    assert ns_segments("standard", triples, dtype, *shape) == standard
    assert ns_segments("gram", triples, dtype, *shape) == gram
    if shape[0] == shape[1]:
        assert chosen == standard, "square matrices gain nothing from the Gram form"


@pytest.mark.parametrize("steps", range(1, 9))
@pytest.mark.parametrize("coefficients", [MUON_COEFFICIENTS, POLAR_EXPRESS], ids=["muon", "polar"])
def test_restart_schedules_follow_their_rules(steps, coefficients):
    triples = resolve_coefficients(coefficients, steps)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        segments = gram_segments(triples, dtype)
        assert sum(segments) == steps and min(segments) >= 1
        if dtype.itemsize == 2:  # Gram pairs at both ends from five iterations on, else standard
            assert segments == ((2,) + (1,) * (steps - 4) + (2,) if steps >= 5 else (1,) * steps)
            continue
        limit = GRAM_NOISE_BUDGET * torch.finfo(torch.float32).eps / torch.finfo(dtype).eps
        start = 0
        for length in segments:  # each segment's R-noise growth fits the budget; one more would not
            growth = [a * a for a, _, _ in triples[start : start + length]]
            assert torch.tensor(growth[:-1], dtype=torch.float64).prod() <= limit
            if start + length < steps:
                assert torch.tensor(growth, dtype=torch.float64).prod() > limit
            start += length


@pytest.mark.parametrize("coefficients", [MUON_COEFFICIENTS, POLAR_EXPRESS], ids=["muon", "polar"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_restarts_keep_low_rank_matrices_accurate(coefficients, dtype):
    """Momentum is nearly low-rank: X X^T's rounding leaves negative eigenvalues that the Gram
    iteration amplifies. With its restarts the Gram form stays as accurate as the standard form
    (within 1.2x of its error against float64); without them it is far worse."""
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(4, 64, 8, generator=gen, dtype=torch.float64) @ torch.randn(
        4, 8, 176, generator=gen, dtype=torch.float64
    )
    m += 1e-3 * torch.randn(m.shape, generator=gen, dtype=torch.float64)
    triples = resolve_coefficients(coefficients, 5)
    expected = _run(m, triples, standard_segments(5))
    x = m.to(dtype)
    standard = relative_error(_run(x, triples, standard_segments(5)), expected)
    assert relative_error(_run(x, triples, gram_segments(triples, dtype)), expected) <= 1.2 * standard
    assert relative_error(_run(x, triples, (5,)), expected) > 1.9 * standard
