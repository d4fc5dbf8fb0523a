"""overlap_backward=True: steps begun in FSDP2's gradient hooks equal plain steps, bitwise.

Each test trains two copies of one model side by side on every rank, one with the plain step and
one with ``overlap_backward=True``, and compares every parameter, momentum buffer and loss
bitwise. ``StepStats.started_in_backward`` shows the work really began in backward."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from spawn import cpu_mesh, run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon_fsdp
from dmuon_fsdp import DMuonFSDP, NonFiniteGradientError

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
        history.append((losses, stats.started_in_backward, stats.redone))
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
        for step, (losses, started, redone) in enumerate(history):
            assert torch.equal(losses[0], losses[1])
            assert not redone
            # the first step builds the program; later, all buckets but the last start in backward
            assert started == (0 if step == 0 else buckets - 1)


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


def accumulate(rank, world_size, sync_every_micro_batch):
    runs = pair(sharded)

    def step_fn(model, opt, step):
        losses = []
        for micro in range(2):
            if not sync_every_micro_batch:
                model.set_requires_gradient_sync(micro == 1)
            loss = model(inputs(2 * step + micro)).pow(2).sum()
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        return torch.stack(losses)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = train(runs, step_fn)
    redo_warnings = sum("redone" in str(w.message) for w in caught)
    return compare(runs), history, redo_warnings


def test_accumulation_under_no_sync_starts_in_the_last_backward():
    for differing, history, redo_warnings in run_ranks(accumulate, 2, False):
        assert differing == [] and redo_warnings == 0
        assert all(started > 0 and not redone for _, started, redone in history[1:])


def test_accumulation_synced_every_micro_batch_redoes_the_step_and_warns_once():
    for differing, history, redo_warnings in run_ranks(accumulate, 2, True):
        assert differing == [] and redo_warnings == 1
        assert all(redone for *_, redone in history[1:])


def clipped(rank, world_size, max_norm, ours):
    runs = pair(sharded)
    norms = []

    def step_fn(model, opt, step):
        loss = model(inputs(step)).pow(2).sum()
        loss.backward()
        overlapped = opt.overlap_backward
        clip = dmuon_fsdp.clip_grad_norm_ if overlapped and ours else torch.nn.utils.clip_grad_norm_
        norms.append(full(clip(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
        return loss.detach()

    history = train(runs, step_fn)
    return compare(runs), history, norms


@pytest.mark.parametrize(
    "max_norm, ours, redone",
    [(1e9, True, False), (1e9, False, False), (1e-2, True, True), (1e-2, False, True)],
    ids=["ours-unclipped", "torch-unclipped", "ours-clipped", "torch-clipped"],
)
def test_clipping_between_backward_and_step_equals_the_plain_step(max_norm, ours, redone):
    for differing, history, norms in run_ranks(clipped, 2, max_norm, ours):
        assert differing == []
        assert all(torch.equal(norms[2 * s], norms[2 * s + 1]) for s in range(STEPS))  # the same norm
        assert all(r == redone for *_, r in history[1:])
        assert all((started > 0) != redone for _, started, _ in history[1:])


def failing(rank, world_size, fault, nonfinite):
    model = sharded()
    opt = DMuonFSDP(model.parameters(), bucket_bytes=BUCKET, overlap_backward=True, nonfinite=nonfinite)
    for step in range(2):
        plain_step(model, opt, step)
    before = snapshot(model, opt)
    model(inputs(9)).pow(2).sum().backward()
    if rank == 1:
        p = model.layers[0].weight
        if fault == "nonfinite":
            p.grad.to_local()[0, 0] = float("inf")
        else:
            p.grad = None
    try:
        opt.step()
        error = None
    except (NonFiniteGradientError, dmuon_fsdp.GradientMismatchError) as e:
        error = type(e).__name__
    unchanged = all(torch.equal(v, snapshot(model, opt)[n]) for n, v in before.items())
    opt.zero_grad()
    plain_step(model, opt, 10)  # and the job goes on
    return error, unchanged, opt.last_step_stats.started_in_backward


@pytest.mark.parametrize(
    "fault, nonfinite, error",
    [
        ("nonfinite", "raise", "NonFiniteGradientError"),
        ("nonfinite", "skip", None),
        ("missing", "raise", "GradientMismatchError"),
    ],
)
def test_a_fault_on_one_rank_after_backward_gives_every_rank_the_same_verdict(fault, nonfinite, error):
    results = run_ranks(failing, 2, fault, nonfinite, timeout=120, pg_timeout=30)
    assert [r[0] for r in results] == [error, error]
    assert all(unchanged for _, unchanged, _ in results)  # nothing committed


def tensor_parallel_in_rank_order(rank, world_size):
    """DTensor parameters outside FSDP: autograd fires the hooks, in another order on each rank."""
    mesh = cpu_mesh()
    shapes = [(13, 24), (5, 37), (37, 24), (24, 13), (1, 24)]
    calls = []
    original = dist.all_to_all_single

    def recording(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
        calls.append((group.group_name, list(output_split_sizes), list(input_split_sizes)))
        return original(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

    runs = []
    for overlap in (False, True):
        torch.manual_seed(0)
        params = [nn.Parameter(distribute_tensor(torch.randn(s), mesh, [Shard(0)])) for s in shapes]
        opt = DMuonFSDP(params, bucket_bytes=256, overlap_backward=overlap)
        runs.append((params, opt))
    dist.all_to_all_single = recording
    try:
        for step in range(STEPS):
            for params, opt in runs:
                order = range(len(params)) if rank % 2 == 0 else reversed(range(len(params)))
                gen = torch.Generator().manual_seed(step)
                grads = [torch.randn(p.to_local().shape, generator=gen) for p in params]
                sum((params[i].to_local() * grads[i]).sum() for i in order).backward()
                opt.step()
                opt.zero_grad()
    finally:
        dist.all_to_all_single = original
    (p0, _), (p1, o1) = runs
    equal = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(p0, p1))
    return equal, calls, o1.last_step_stats.started_in_backward


def test_hooks_firing_in_another_order_on_each_rank_keep_every_group_in_plan_order():
    results = run_ranks(tensor_parallel_in_rank_order, 2)
    assert all(equal and started > 0 for equal, _, started in results)
    (_, calls0, _), (_, calls1, _) = results
    for name in {c[0] for c in calls0}:
        mine = [c for c in calls0 if c[0] == name]
        theirs = [c for c in calls1 if c[0] == name]
        assert len(mine) == len(theirs)
        for (_, receive0, send0), (_, receive1, send1) in zip(mine, theirs):
            assert send0[1] == receive1[0] and send1[0] == receive0[1]  # the same exchange on both


def replicated(rank, world_size):
    runs = []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = Stack()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = DMuonFSDP(model.parameters(), bucket_bytes=BUCKET, overlap_backward=overlap)
        runs.append((model, opt))
    history = train(runs, plain_step)
    return compare(runs), history, [str(w.message) for w in caught]


def test_plain_tensors_in_a_job_of_several_ranks_step_plainly_with_a_warning():
    for differing, history, messages in run_ranks(replicated, 2):
        assert differing == [] and all(started == 0 for _, started, _ in history)
        assert any("layers.0.weight" in m or "plain tensor" in m for m in messages)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_one_process_closures_schedulers_and_zero_grad_modes(set_to_none):
    """Plain tensors in one process: autograd fires the hooks with final gradients."""
    runs = pair(Stack)
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7) for _, opt in runs]

    def step_fn(model, opt, step):
        def closure():
            opt.zero_grad(set_to_none=set_to_none)
            loss = model(inputs(step)).pow(2).sum()
            loss.backward()
            return loss

        loss = opt.step(closure) if step % 2 else plain_step(model, opt, step)
        schedulers[runs.index((model, opt))].step()
        return loss.detach()

    history = train(runs, step_fn, steps=6)
    assert compare(runs) == []
    assert all(started > 0 and not redone for _, started, redone in history[1:])
    assert runs[0][1].state_dict()["param_groups"] == runs[1][1].state_dict()["param_groups"]


def reloaded_between_backward_and_step(rank, world_size):
    runs = pair(sharded)

    def step_fn(model, opt, step):
        loss = model(inputs(step)).pow(2).sum()
        loss.backward()
        if step == 2:  # the program is bound anew: what backward started is settled, then redone
            opt.load_state_dict(opt.state_dict())
        opt.step()
        opt.zero_grad()
        return loss.detach()

    history = train(runs, step_fn)
    return compare(runs), history


def test_state_loaded_between_backward_and_step_settles_what_backward_started():
    for differing, history in run_ranks(reloaded_between_backward_and_step, 2):
        assert differing == []
        assert history[2][1] == 0 and history[3][1] > 0  # step 2 ran plainly, step 3 in backward again


def divergent_option(rank, world_size):
    model = sharded()
    opt = DMuonFSDP(model.parameters(), bucket_bytes=BUCKET, overlap_backward=rank == 0)
    model(inputs(0)).pow(2).sum().backward()
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return None


def test_overlap_backward_on_some_ranks_only_raises_on_every_rank():
    messages = run_ranks(divergent_option, 2, timeout=120, pg_timeout=30)
    assert all(m is not None and "overlap_backward" in m for m in messages)


def no_muon_gradients(rank, world_size):
    """AdamW parameters only, then a step whose Muon parameters have no gradient."""
    model = sharded()
    vectors = DMuonFSDP([model.scale], overlap_backward=True)
    opt = DMuonFSDP(model.parameters(), bucket_bytes=BUCKET, overlap_backward=True)
    for step in range(3):
        plain_step(model, vectors, step)
    for layer in model.layers:
        layer.weight.requires_grad_(False)
    for step in range(3):
        plain_step(model, opt, step)
    return opt.last_step_stats.started_in_backward


def test_steps_without_muon_gradients_run():
    assert run_ranks(no_muon_gradients, 2) == [0, 0]


def nan_in_an_early_bucket(rank, world_size):
    model = sharded()
    opt = DMuonFSDP(model.parameters(), bucket_bytes=BUCKET, overlap_backward=True, nonfinite="skip")
    for step in range(2):
        plain_step(model, opt, step)
    before = snapshot(model, opt)
    x = inputs(5)
    x[0, 0] = float("nan") if rank == 1 else x[0, 0]  # every gradient NaN after the reduce-scatter
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x).pow(2).sum().backward()
        opt.step()
    stats = opt.last_step_stats
    unchanged = all(torch.equal(v, snapshot(model, opt)[n]) for n, v in before.items())
    return stats.skipped, stats.redone, stats.started_in_backward, unchanged, len(caught)


def test_a_nan_gradient_in_a_started_bucket_skips_without_a_redo():
    for skipped, redone, started, unchanged, warned in run_ranks(nan_in_an_early_bucket, 2):
        assert skipped and not redone and started > 0 and unchanged and warned == 0


def rebound_on_one_rank(rank, world_size):
    runs = pair(sharded)

    def step_fn(model, opt, step):
        loss = model(inputs(step)).pow(2).sum()
        loss.backward()
        if step == 2 and rank == 1:  # one rank's state tensor replaced: only its program is bound anew
            state = opt.state[model.layers[1].weight]
            state["momentum_buffer"] = state["momentum_buffer"].clone()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    history = train(runs, step_fn)
    return compare(runs), history


def test_a_program_bound_anew_on_one_rank_between_backward_and_step_keeps_ranks_in_step():
    for differing, history in run_ranks(rebound_on_one_rank, 2, timeout=120, pg_timeout=30):
        assert differing == [] and history[2][2] and history[3][1] > 0  # step 2 redone
