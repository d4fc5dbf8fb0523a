"""Random layouts against the float64 reference, and determinism across runs and world sizes."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.fsdp import fully_shard

from dmuon_fsdp import DMuonFSDP
from tests.support.models import sharded_run
from tests.support.reference import reference_muon_step, relative_error
from tests.support.spawn import cpu_mesh, run_ranks


class Matrices(nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.ws = nn.ParameterList(nn.Parameter(torch.empty(s)) for s in shapes)

    def forward(self, grads):
        return sum((w * g).sum() for w, g in zip(self.ws, grads, strict=True))


def _case(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(2)]
    return init, grads


def random_layout_run(rank, world_size, shapes, seed):
    init, grads = _case(shapes, seed)
    model = Matrices(shapes)
    with torch.no_grad():
        for w, x in zip(model.ws, init, strict=True):
            w.copy_(x)
    fully_shard(model, mesh=cpu_mesh())
    opt = DMuonFSDP(model.parameters(), lr=0.05, weight_decay=0.1, ns_dtype=torch.float32, bucket_bytes=4096)
    for step_grads in grads:
        model([g.float() for g in step_grads]).backward()
        opt.step()
        opt.zero_grad()
    return [w.full_tensor() for w in model.ws]


# Rows from 1 to 9 with up to 4 ranks: 1-row matrices, rows < W (empty shards), 1-column ones.
shape = st.tuples(st.integers(1, 9), st.integers(1, 12))


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    shapes=st.lists(shape, min_size=1, max_size=5), world_size=st.integers(2, 4), seed=st.integers(0, 2**16)
)
def test_random_layouts_match_the_reference(shapes, world_size, seed):
    result = run_ranks(random_layout_run, world_size, shapes, seed)[0]
    init, grads = _case(shapes, seed)
    bufs = [torch.zeros_like(x) for x in init]
    for step_grads in grads:
        for p, g, b in zip(init, step_grads, bufs, strict=True):
            reference_muon_step(p, g, b, lr=0.05, weight_decay=0.1)
    for got, want, s in zip(result, init, shapes, strict=True):
        assert relative_error(got, want) <= 1e-5, f"shape {s} at W={world_size}"


def test_same_seed_is_bitwise_identical_and_world_sizes_agree():
    first = run_ranks(sharded_run, 2, "auto")[0]
    again = run_ranks(sharded_run, 2, "auto")[0]
    for name, value in first.items():
        assert torch.equal(value, again[name]), f"two runs differ in {name}"
    for world_size in (1, 3, 4):
        other = run_ranks(sharded_run, world_size, "auto")[0]
        for name, value in first.items():
            assert relative_error(other[name], value) <= 1e-6, (world_size, name)


def _odd_layout(kind: int, shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """A gradient of ``shape`` laid out as autograd or a user may leave it: 0 contiguous, 1 expanded
    from a row, 2 from a column, 3 from one number, 4 transposed, 5 every other column."""
    r, c = shape
    return [
        lambda: torch.randn(r, c, generator=gen),
        lambda: torch.randn(c, generator=gen).expand(r, c),
        lambda: torch.randn(r, 1, generator=gen).expand(r, c),
        lambda: torch.randn((), generator=gen).expand(r, c),
        lambda: torch.randn(c, r, generator=gen).T,
        lambda: torch.randn(r, 2 * c, generator=gen)[:, ::2],
    ][kind]()


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    cases=st.lists(st.tuples(shape, st.integers(0, 5)), min_size=1, max_size=4),
    nonfinite=st.sampled_from(["raise", "skip", "ignore"]),
    seed=st.integers(0, 2**16),
)
def test_gradients_of_any_layout_step_as_contiguous_ones_and_are_only_read(cases, nonfinite, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [s for s, _ in cases]
    start = [torch.randn(s, generator=gen) for s in shapes]
    steps = [[_odd_layout(kind, s, gen) for s, kind in cases] for _ in range(2)]
    results = []
    for contiguous in (False, True):
        params = [nn.Parameter(x.clone()) for x in start]
        groups = [{"params": params[:1], "use_muon": False}, {"params": params[1:]}]  # AdamW and Muon
        opt = DMuonFSDP([g for g in groups if g["params"]], nonfinite=nonfinite)
        for grads in steps:
            for p, g in zip(params, grads, strict=True):
                p.grad = g.contiguous() if contiguous else g
            versions = [g._version for g in grads]
            opt.step()
            assert [g._version for g in grads] == versions, "the step wrote into a gradient"
        results.append(params)
    for a, b, s in zip(*results, shapes, strict=True):
        assert torch.equal(a, b), s
