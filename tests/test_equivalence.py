"""DMuonFSDP on FSDP2-sharded parameters equals a float64 single-process Muon on full matrices."""

from __future__ import annotations

import pytest
import torch

from dmuon_fsdp import DMuonFSDP
from tests.support.models import SHAPES, VECTORS, force_ramp, initial_params, reference_run, sharded_run
from tests.support.paired_runs import BUCKET, STEPS, compare, plain_step, sharded
from tests.support.reference import relative_error
from tests.support.spawn import run_ranks
from tests.support.training import train

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


def test_a_ramped_plan_matches_float64_reference():
    """Buckets shaped into a ramp (a first bucket taken out of the LPT order; at W=2 the only
    world size where this model's plan ramps) step as exactly as the plain cut's."""
    expected_params, expected_bufs = reference_run()
    results = run_ranks(sharded_run, 2, "standard", True)
    assert all(bool(r["ramped"]) for r in results), "the planner kept the plain cut"
    errors = {name: relative_error(results[0][name], expected_params[name]) for name in SHAPES}
    errors.update(
        {n: relative_error(results[0]["buf:" + n], expected_bufs[n]) for n in SHAPES if n not in VECTORS}
    )
    bad = {k: v for k, v in errors.items() if v > TOLERANCE}
    assert not bad, f"ramped: relative errors above {TOLERANCE}: {bad}"


def ramped_and_plain(rank, world_size):
    """A ramped plan and the plain cut of one model, stepped side by side."""
    runs = []
    for options in (force_ramp(BUCKET, 1e2), {"bucket_bytes": BUCKET, "ns_flops_per_byte": 0.0}):
        model = sharded()
        runs.append((model, DMuonFSDP(model.parameters(), lr=0.02, ns_dtype=torch.float32, **options)))
    train(runs, STEPS, step=plain_step)
    (_, ramped), (_, plain) = runs
    return compare(runs), ramped.plan.buckets != plain.plan.buckets


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_ramped_plan_steps_bitwise_as_the_plain_cut(world_size):
    """The same owners, and each matrix orthogonalized alone in its batch's stack: where the
    ramp takes a first and a last bucket out of the LPT order, every parameter and state tensor
    still equals the plain cut's, bit for bit (uneven and, at W=4, empty shards)."""
    for differing, ramped in run_ranks(ramped_and_plain, world_size):
        assert ramped and differing == []
