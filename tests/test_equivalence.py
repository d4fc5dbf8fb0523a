"""DMuonFSDP on FSDP2-sharded parameters equals a float64 single-process Muon on full matrices."""

from __future__ import annotations

import pytest
import torch

from tests.support.models import SHAPES, VECTORS, initial_params, reference_run, sharded_run
from tests.support.reference import relative_error
from tests.support.spawn import run_ranks

TOLERANCE = 1e-5


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("ns_algorithm", ["standard", "gram"])
def test_matches_float64_reference(world_size, ns_algorithm):
    """The reference runs standard Newton-Schulz; "gram" runs the Gram form with its fp32
    restarts on every matrix (Keller coefficients in group A, Polar Express in group B)."""
    expected_params, expected_bufs = reference_run()
    initial = initial_params()
    results = run_ranks(sharded_run, world_size, ns_algorithm)
    errors = {}
    for name in SHAPES:
        errors[name] = relative_error(results[0][name], expected_params[name])
        moved = results[0][name].double() - initial[name]
        errors["delta:" + name] = relative_error(moved, expected_params[name] - initial[name])
        if name not in VECTORS:
            errors["buf:" + name] = relative_error(results[0]["buf:" + name], expected_bufs[name])
    print(f"W={world_size} {ns_algorithm} max relative error {max(errors.values()):.2e}", errors)
    bad = {k: v for k, v in errors.items() if v > TOLERANCE}
    assert not bad, f"W={world_size} {ns_algorithm}: relative errors above {TOLERANCE}: {bad}"
    for other in results[1:]:
        for name, value in other.items():
            assert torch.equal(value, results[0][name]), f"ranks disagree on {name}"
