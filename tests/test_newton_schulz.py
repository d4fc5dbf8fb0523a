"""The Newton-Schulz module against float64 math."""

from __future__ import annotations

import pytest
import torch

from dmuon_fsdp.newton_schulz import (
    MUON_COEFFICIENTS,
    POLAR_EXPRESS,
    newton_schulz,
    newton_schulz_flops,
    resolve_coefficients,
)
from reference import reference_orthogonalize, relative_error


@pytest.mark.parametrize("shape", [(8, 32), (32, 8), (16, 16), (1, 5), (5, 1)])
@pytest.mark.parametrize("coefficients", [MUON_COEFFICIENTS, POLAR_EXPRESS], ids=["muon", "polar"])
def test_batched_matches_float64_reference(shape, coefficients):
    torch.manual_seed(0)
    batch = torch.randn(3, *shape)
    out = newton_schulz(batch, resolve_coefficients(coefficients, 5), 1e-7, torch.float32)
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
