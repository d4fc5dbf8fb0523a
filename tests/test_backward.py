"""overlap_backward=True: steps begun in FSDP2's gradient hooks equal plain steps, bitwise.

Each test trains two copies of one model side by side on every rank, one with the plain step and
one with ``overlap_backward=True``, and compares every parameter, momentum buffer and loss
bitwise. ``StepStats.started_in_backward`` shows the work really began in backward."""

from __future__ import annotations

import pytest
import torch
from spawn import cpu_mesh, run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dmuon_fsdp import DMuonFSDP

STEPS = 4
BUCKET = 2**10  # bytes: a bucket per layer or two, so that most start in backward
# Rows that leave uneven and, at W=4, empty shards (5 -> 2, 2, 1, 0).
DIMS = (24, 37, 5, 13, 24)


class Stack(nn.Module):
    """Linear layers (each its own FSDP unit, so gradients land layer by layer in backward),
    a vector for AdamW and a tall last layer."""

    def __init__(self, dims=DIMS):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(dims, dims[1:]))
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


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


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


def train(runs, step_fn, steps=STEPS):
    """``step_fn(model, opt, step) -> loss`` for both runs; per step, the losses and the overlap
    run's stats."""
    history = []
    for step in range(steps):
        losses = [step_fn(model, opt, step) for model, opt in runs]
        stats = runs[1][1].last_step_stats
        history.append((losses, stats.started_in_backward, stats.finished_in_backward, stats.redone))
    return history


def plain_step(model, opt, step):
    loss = model(inputs(step)).pow(2).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def compare(runs):
    (m0, o0), (m1, o1) = runs
    a, b = snapshot(m0, o0), snapshot(m1, o1)
    assert a.keys() == b.keys()
    return [n for n in a if not torch.equal(a[n], b[n])]


def fsdp_equal(rank, world_size, ns_algorithm):
    runs = pair(sharded, ns_algorithm=ns_algorithm, ns_dtype=torch.float32)
    history = train(runs, plain_step)
    return compare(runs), history, len(runs[1][1].plan.buckets)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_steps_begun_in_backward_equal_plain_steps(world_size):
    for differing, history, buckets in run_ranks(fsdp_equal, world_size, "standard"):
        assert differing == []
        assert buckets > 2
        for step, (losses, started, finished, redone) in enumerate(history):
            assert torch.equal(losses[0], losses[1])
            assert not redone
            # the first step builds the program; later, all buckets but the last start in backward
            assert started == (0 if step == 0 else buckets - 1)
            assert finished <= started


def test_gram_form_begun_in_backward_equals_plain():
    for differing, history, _ in run_ranks(fsdp_equal, 3, "gram"):
        assert differing == [] and history[-1][1] > 0


def hsdp_and_tp(rank, world_size, layout):
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        runs = pair(lambda: sharded(mesh))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

        def make():
            model = Stack((24, 16, 24))
            plan = {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()}
            parallelize_module(model, mesh["tp"], plan)
            fully_shard(model, mesh=mesh["dp"])
            return model

        runs = pair(make)
    history = train(runs, plain_step)
    return compare(runs), history


@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp"])
def test_hsdp_and_fsdp_tp_begun_in_backward_equal_plain(layout):
    for differing, history in run_ranks(hsdp_and_tp, 4, layout):
        assert differing == [] and history[-1][1] > 0
        assert all(not redone for *_, redone in history)
