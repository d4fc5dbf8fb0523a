"""overlap_backward=True: steps begun in FSDP2's gradient hooks equal plain steps, bitwise.

Each test trains two copies of one model side by side on every rank (``paired_runs``), one with
the plain step and one with ``overlap_backward=True``, and compares every parameter, state
tensor and loss bitwise. ``StepStats.started_in_backward`` shows the work really began in
backward."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon_fsdp
from dmuon_fsdp import DMuonFSDP, param_groups
from dmuon_fsdp._step.buffers import SLOTS
from tests.support.models import force_ramp
from tests.support.moe import moe_block
from tests.support.paired_runs import (
    BUCKET,
    STEPS,
    Stack,
    compare,
    inputs,
    pair,
    plain_step,
    sharded,
)
from tests.support.spawn import run_ranks
from tests.support.training import full, train


def fsdp_equal(rank, world_size, ns_algorithm, variant="muon"):
    runs = pair(sharded, ns_algorithm=ns_algorithm, ns_dtype=torch.float32, variant=variant)
    history = train(runs, STEPS, step=plain_step)
    return compare(runs), history, len(runs[1][1].plan.buckets)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_steps_begun_in_backward_equal_plain_steps(world_size):
    for differing, history, buckets in run_ranks(fsdp_equal, world_size, "standard"):
        assert differing == []
        assert buckets > SLOTS  # later buckets take the slots of those begun in backward
        for step, (losses, started, redone) in enumerate(history):
            assert torch.equal(losses[0], losses[1])
            assert not redone
            # the first step builds the program; later, the buckets before the flags' carrier
            # (as many as the slots hold, but one) start in backward
            assert started == (0 if step == 0 else SLOTS - 1)


def ramped_equal(rank, world_size):
    ramp = force_ramp(BUCKET, 1e2)  # (pair's bucket_bytes)
    runs = pair(sharded, ns_dtype=torch.float32, ns_flops_per_byte=ramp["ns_flops_per_byte"])
    history = train(runs, STEPS, step=plain_step)
    plan = runs[1][1].plan
    first = {plan.matrices[j].rows for j in plan.buckets[0].matrices}
    return compare(runs), history, len(plan.buckets[0].matrices), first


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_ramps_small_first_bucket_begun_in_backward_equals_plain(world_size):
    """With a ramped plan, the bucket started in backward is the ramp's small first one."""
    for differing, history, first_size, rows in run_ranks(ramped_equal, world_size):
        assert differing == [] and first_size == 1 and rows == {24}  # one matrix: the last layer's
        assert [started for _, started, _ in history[1:]] == [SLOTS - 1] * (STEPS - 1)


def test_gram_form_begun_in_backward_equals_plain():
    for differing, history, _ in run_ranks(fsdp_equal, 3, "gram"):
        assert differing == [] and history[-1][1] > 0


def test_normuon_begun_in_backward_equals_plain():
    # NorMuon's second moments: sent from the hooks' stages, written at apply after the verdict
    for differing, history, _ in run_ranks(fsdp_equal, 3, "standard", "normuon"):
        assert differing == [] and history[-1][1] > 0


def hsdp_and_tp(rank, world_size, layout):
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        runs = pair(lambda: sharded(mesh))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

        def make():
            model = Stack((24, 16, 24) * 3)  # enough matrices for two buckets
            plan = {f"layers.{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(6)}
            parallelize_module(model, mesh["tp"], plan)
            fully_shard(model, mesh=mesh["dp"])
            return model

        runs = pair(make)
    history = train(runs, STEPS, step=plain_step)
    return compare(runs), history


@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp"])
def test_hsdp_and_fsdp_tp_begun_in_backward_equal_plain(layout):
    for differing, history in run_ranks(hsdp_and_tp, 4, layout):
        assert differing == [] and history[-1][1] > 0
        assert all(not redone for *_, redone in history)


def experts_pair(rank, world_size):
    """torchtitan's MoE layout (dense and expert meshes), the MoE block skipped at step 2: the
    gradient set changes and returns, so steps switch between two kept programs."""
    runs = []
    for overlap in (False, True):
        model = moe_block("unflatten", 3, 2, 2)
        groups = param_groups(model, stacked="experts")
        runs.append((model, DMuonFSDP(groups, lr=0.02, bucket_bytes=2**9, overlap_backward=overlap)))

    def step_fn(model, opt, step):
        loss = model(step, use_experts=step != 2)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    history = train(runs, 7, step=step_fn)
    return compare(runs), history


def test_experts_on_their_own_mesh_begun_in_backward_equal_plain():
    for differing, history in run_ranks(experts_pair, 4):
        assert differing == []
        assert all(not redone for *_, redone in history)
        # The hooks serve the program of a set that held for two steps: step 2's set is another
        # (what backward started is settled), steps 3 and 4 follow a change (no hooks).
        assert [started > 0 for _, started, _ in history] == [False, True, False, False, False, True, True]


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
        history = train(runs, STEPS, step=step_fn)
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

    history = train(runs, STEPS, step=step_fn)
    return compare(runs), history, norms


@pytest.mark.parametrize(
    "max_norm, ours, redone",
    [(1e9, True, False), (1e9, False, False), (1e-5, True, True), (1e-5, False, True)],
    ids=["ours-unclipped", "torch-unclipped", "ours-clipped", "torch-clipped"],
)
def test_clipping_between_backward_and_step_equals_the_plain_step(max_norm, ours, redone):
    for differing, history, norms in run_ranks(clipped, 2, max_norm, ours):
        assert differing == []
        assert all(torch.equal(norms[2 * s], norms[2 * s + 1]) for s in range(STEPS))  # the same norm
        assert all(r == redone for *_, r in history[1:])
        assert all((started > 0) != redone for _, started, _ in history[1:])


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

    history = train(runs, 6, step=step_fn)
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

    history = train(runs, STEPS, step=step_fn)
    return compare(runs), history


def test_state_loaded_between_backward_and_step_settles_what_backward_started():
    for differing, history in run_ranks(reloaded_between_backward_and_step, 2):
        assert differing == []
        assert history[2][1] == 0 and history[3][1] > 0  # step 2 ran plainly, step 3 in backward again


def test_a_deep_copy_steps_as_the_original_and_hooks_its_own_parameters():
    model = Stack()
    opt = DMuonFSDP(model.parameters(), lr=0.02, bucket_bytes=BUCKET, overlap_backward=True)
    for step in range(2):
        plain_step(model, opt, step)
    twin = copy.deepcopy({"model": model, "opt": opt})  # the optimizer with the model it steps
    twin_model, twin_opt = twin["model"], twin["opt"]
    for step in range(2, 5):
        plain_step(model, opt, step)
        plain_step(twin_model, twin_opt, step)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters(), strict=True))
    assert opt.last_step_stats.started_in_backward > 0 and twin_opt.last_step_stats.started_in_backward > 0


def test_hooks_run_eagerly_under_compiled_autograd():
    # Compiled autograd would trace the hooks (and with them the async all-to-all) into its
    # graph; they are excluded from compilation, and the steps stay those of the plain step.
    records = []

    class Messages(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    def run(overlap):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16, bias=False) for _ in range(4)])
        opt = DMuonFSDP(model.parameters(), bucket_bytes=2**10, overlap_backward=overlap)
        started = []
        for step in range(3):
            loss = model(inputs(step, 16)).pow(2).sum()
            with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
                loss.backward()
            opt.step()
            opt.zero_grad()
            started.append(opt.last_step_stats.started_in_backward)
        return [p.detach() for p in model.parameters()], started

    logger, handler = logging.getLogger("torch._dynamo"), Messages()
    torch._logging.set_logs(dynamo=logging.INFO)
    logger.addHandler(handler)
    try:
        (plain, _), (overlapped, started) = run(False), run(True)
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()
    assert records, "dynamo logged nothing: the check would see nothing"
    assert not [m for m in records if "dmuon_fsdp" in m], "dynamo traced the package's code"
    assert started[1:] == [1, 1]
    assert all(torch.equal(a, b) for a, b in zip(plain, overlapped, strict=True))


def hooks_never_fire(rank, world_size):
    """Gradients given by assignment, as a framework that does not call post-accumulate-grad hooks
    (or a torch whose FSDP2 does not) would leave them: what started in backward, and the
    warnings."""
    model = sharded()
    opt = DMuonFSDP(model.parameters(), lr=0.02, bucket_bytes=BUCKET, overlap_backward=True)
    started = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            for i, p in enumerate(model.parameters()):
                p.grad = torch.ones_like(p) * (step + i + 1) * 1e-3
            opt.step()
            opt.zero_grad()
            started.append(opt.last_step_stats.started_in_backward)
    return started, [str(w.message) for w in caught if "DMuonFSDP" in str(w.message)]


def test_hooks_that_never_fire_are_named_once():
    for started, said in run_ranks(hooks_never_fire, 2):
        assert started == [0, 0, 0]
        assert len(said) == 1 and "none of their post-accumulate-grad hooks fired" in said[0], said
