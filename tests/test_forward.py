"""Steps finished in the next forward (``overlap_forward=True``): under HSDP and DDP the relays
across replicas are left in flight by ``step()`` and finished before each module that uses their
parameters runs. Every forward sees the parameters a plain step leaves, bitwise, and so does
everything that reads them after ``finish_step()``, a module's ``state_dict()`` or the next
``step()``."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from dmuon_fsdp import DMuonFSDP
from tests.support.paired_runs import BUCKET, Stack, inputs, sharded, snapshot, step_apart
from tests.support.spawn import run_ranks
from tests.support.training import full

STEPS = 4


def make(layout, world_size):
    if layout == "ddp":
        return DistributedDataParallel(Stack())
    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("replicate", "shard"))
    return sharded(mesh)


def forward_pairs(rank, world_size, layout, options):
    """The plain step and ``overlap_forward`` side by side: each step's losses (the forward after
    the last step), whether reading the parameters right after ``step()`` saw rows still in
    flight, and what differs at the end (after ``finish_step()``)."""
    runs = []
    for later in (False, True):
        model = make(layout, world_size)
        params = (model.module if layout == "ddp" else model).parameters()
        opt = DMuonFSDP(params, lr=0.02, bucket_bytes=BUCKET, overlap_forward=later, **options)
        runs.append((model, opt))
    losses, in_flight = zip(*(step_apart(runs, step) for step in range(STEPS)), strict=True)
    runs[1][1].finish_step()
    a, b = (snapshot(model, opt) for model, opt in runs)
    differing = [n for n in a if not torch.equal(a[n], b[n])]
    return losses, in_flight, differing, runs[1][1].plan.relays != ()


@pytest.mark.parametrize("world_size", [4, 6, 8])
def test_hsdp_forward_sees_the_plain_step(world_size):
    for losses, in_flight, differing, relays in run_ranks(forward_pairs, world_size, "hsdp", {}, timeout=300):
        assert relays, "an HSDP plan relays across replicas"
        assert all(torch.equal(a, b) for a, b in losses), (
            "a forward saw other parameters than the plain step's"
        )
        assert any(in_flight), "step() left nothing in flight"
        assert differing == []


def test_ddp_and_normuon_begun_in_backward():
    """Plain tensors under DDP (every rank a replica: each Linear's own hook finishes its weight),
    and NorMuon with steps begun in backward on HSDP, each against its plain step."""
    for layout, world_size, options in (
        ("ddp", 3, {}),
        ("hsdp", 4, {"variant": "normuon", "overlap_backward": True}),
    ):
        for losses, in_flight, differing, relays in run_ranks(forward_pairs, world_size, layout, options):
            assert relays and any(in_flight)
            assert all(torch.equal(a, b) for a, b in losses) and differing == []


def reads_before_a_forward(rank, world_size):
    """What reads the parameters between ``step()`` and the next forward sees (a module's
    ``state_dict()``, the next ``step()`` without a forward) against the plain step."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    runs = []
    for later in (False, True):
        model = sharded(mesh)
        runs.append(
            (model, DMuonFSDP(model.parameters(), lr=0.02, bucket_bytes=BUCKET, overlap_forward=later))
        )
    seen = []
    for step in range(3):
        for model, opt in runs:
            if step < 2:  # the third step reuses the second's gradients: no forward comes between
                opt.zero_grad()
                model(inputs(step)).pow(2).sum().backward()
            opt.step()
        states = [{n: full(v) for n, v in model.state_dict().items()} for model, _ in runs]
        seen.append([n for n in states[0] if not torch.equal(states[0][n], states[1][n])])
    return seen


def test_state_dicts_and_steps_without_a_forward_finish_the_relays():
    for seen in run_ranks(reads_before_a_forward, 4):
        assert seen == [[], [], []]


def idle(rank, world_size, options):
    """The relays of a flat FSDP plan, or the steps begun in backward of a one-bucket plan, over
    three steps, and the warnings they gave."""
    model = sharded()
    opt = DMuonFSDP(model.parameters(), lr=0.02, **options)
    started = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            model(inputs(step)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            started.append(opt.last_step_stats.started_in_backward)
    return opt.plan.relays, started, [str(w.message) for w in caught if "DMuonFSDP" in str(w.message)]


@pytest.mark.parametrize(
    "options,says",
    [
        ({"bucket_bytes": BUCKET, "overlap_forward": True}, "no relay across replicas"),
        ({"bucket_bytes": 2**30, "overlap_backward": True}, "nothing starts in backward"),
    ],
)
def test_an_option_with_nothing_to_do_says_so_once(options, says):
    """overlap_forward on flat FSDP (no replicas: nothing to relay), overlap_backward on a plan of
    one bucket (it carries the checks: nothing can start before step())."""
    for relays, started, said in run_ranks(idle, 2, options):
        assert relays == () and started == [0, 0, 0]
        assert len(said) == 1 and says in said[0], said
