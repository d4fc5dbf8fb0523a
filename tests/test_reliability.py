"""Bad input and faults on several ranks: the same clear error everywhere, never a hang."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from dmuon_fsdp import DMuonFSDP, GradientMismatchError, NonFiniteGradientError
from tests.support.models import gradients, make_groups, sharded_model
from tests.support.spawn import run_ranks


def _backward(model, step=0):
    model({n: g.float() for n, g in gradients(step).items()}).backward()


def _outcome(fn):
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def grad_scenarios(rank, world_size, comm_dtype):
    out = {}
    model = sharded_model()
    opt = DMuonFSDP(make_groups(model), ns_dtype=torch.float32, comm_dtype=comm_dtype)
    w5 = model.holders["w5"].weight

    # Frozen or unused on every rank: skipped consistently, the parameter does not move.
    _backward(model)
    w5.grad = None
    before = w5.full_tensor()
    out["none_everywhere"] = _outcome(opt.step)
    out["w5_unchanged"] = torch.equal(w5.full_tensor(), before)
    opt.zero_grad()

    # None on one rank only: the classic hang, turned into an error on every rank.
    _backward(model)
    if rank == 1:
        model.holders["tall"].weight.grad = None
    out["none_on_one_rank"] = _outcome(opt.step)
    opt.zero_grad()

    # A NaN on rank 0 only.
    _backward(model)
    if rank == 0:
        model.holders["wide"].weight.grad.to_local()[0, 0] = float("nan")
    out["nan_raise"] = _outcome(opt.step)
    state_before = opt.state[model.holders["sq0"].weight]["momentum_buffer"].full_tensor()
    params_before = {n: h.weight.full_tensor() for n, h in model.holders.items()}
    opt.nonfinite = "skip"
    out["nan_skip"] = _outcome(opt.step)
    out["skipped"] = opt.last_step_stats.skipped
    out["skip_changed_nothing"] = all(
        torch.equal(h.weight.full_tensor(), params_before[n]) for n, h in model.holders.items()
    ) and torch.equal(opt.state[model.holders["sq0"].weight]["momentum_buffer"].full_tensor(), state_before)
    opt.nonfinite = "ignore"
    out["nan_ignore"] = _outcome(opt.step)
    out["nan_spread"] = bool(model.holders["wide"].weight.full_tensor().isnan().any())
    opt.zero_grad()

    # Group options: changed alike on every rank, the plan is rebuilt; on one rank only, an error.
    _backward(model)
    opt.param_groups[0]["ns_steps"] = 4
    out["options_alike"] = _outcome(opt.step)
    if rank == 0:
        opt.param_groups[1]["eps"] = 1e-6
    out["options_differ"] = _outcome(opt.step)
    return out


@pytest.mark.parametrize("comm_dtype", [torch.float32, torch.bfloat16])
def test_gradient_problems_raise_the_same_error_on_every_rank(comm_dtype):
    results = run_ranks(grad_scenarios, 2, comm_dtype)
    for _rank, r in enumerate(results):
        assert r["none_everywhere"] is None and r["w5_unchanged"]
        kind, message = r["none_on_one_rank"]
        assert kind == GradientMismatchError.__name__
        assert "parameter 3 (shape (768, 256))" in message  # the "tall" matrix, passed unnamed
        assert "None on ranks [1]" in message
        kind, message = r["nan_raise"]
        assert kind == NonFiniteGradientError.__name__ and "(rank 0)" in message
        assert r["nan_skip"] is None and r["skipped"] and r["skip_changed_nothing"]
        assert r["nan_ignore"] is None and r["nan_spread"]
        assert r["options_alike"] is None
        kind, message = r["options_differ"]
        assert kind == "ValueError" and "ranks disagree on param group 1's eps" in message
    assert results[0]["none_on_one_rank"] == results[1]["none_on_one_rank"]
    assert results[0]["nan_raise"] == results[1]["nan_raise"]


def construction_errors(rank, world_size):
    mesh_a = init_device_mesh("cpu", (world_size,), mesh_dim_names=("a",))
    alone = DeviceMesh.from_group(dist.new_subgroups(1)[0], "cpu")  # each rank's own: who holds y elsewhere?
    on_a = nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh_a, [Shard(0)]))
    on_own = nn.Parameter(distribute_tensor(torch.randn(6, 4), alone, [Shard(0)]))
    return _outcome(lambda: DMuonFSDP([("x.weight", on_a), ("y.weight", on_own)]))


def test_a_parameter_on_a_mesh_outside_the_others_ranks_is_named():
    for rank, (kind, message) in enumerate(run_ranks(construction_errors, 2)):
        assert kind == "ValueError" and "'y.weight'" in message
        assert f"hold it on ranks [{rank}], but Muon matrices move between ranks [0, 1]" in message


class FailingNewtonSchulz(TorchDispatchMode):
    """Raises in the first batched matmul-add, as only Newton-Schulz dispatches them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.baddbmm.out:
            raise RuntimeError("injected fault in Newton-Schulz")
        return func(*args, **(kwargs or {}))


def faulty_rank(rank, world_size):
    model = sharded_model()
    opt = DMuonFSDP(make_groups(model), ns_dtype=torch.float32)
    _backward(model)
    start = time.monotonic()
    with FailingNewtonSchulz() if rank == 1 else contextlib.nullcontext():
        outcome = _outcome(opt.step)
    return outcome, time.monotonic() - start


def test_a_rank_failing_inside_step_does_not_strand_the_others():
    results = run_ranks(faulty_rank, 2, pg_timeout=5.0, timeout=120)
    (kind1, message1), _ = results[1]
    assert "injected fault" in message1
    outcome0, waited = results[0]
    assert outcome0 is not None, "rank 0 must see an error, not hang or finish"
    assert waited < 60


def test_model_changed_after_construction():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 6))
    opt = DMuonFSDP([("w", w)])
    w.grad = torch.randn_like(w)
    opt.step()
    extra = nn.Parameter(torch.randn(5, 3))
    opt.add_param_group({"params": [("extra", extra)]})
    w.grad, extra.grad = torch.randn_like(w), torch.randn_like(extra)
    before = extra.detach().clone()
    opt.step()
    assert len(opt.plan.matrices) == 2 and not torch.equal(extra.detach(), before)
    w.data = torch.randn(8, 6)  # resized behind the optimizer's back
    w.grad = torch.randn_like(w)
    with pytest.raises(ValueError, match="'?w'? changed layout|w changed layout"):
        opt.step()


def test_parameter_passed_twice_is_named():
    w = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="b.*twice.*a"):
        DMuonFSDP([{"params": [("a", w)]}, {"params": [("b", w)]}])
    with pytest.raises(ValueError, match="twice"):
        DMuonFSDP([w, w])


def test_sparse_and_complex_are_named():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = DMuonFSDP([("emb.weight", emb.weight)])
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="emb.weight: sparse"):
        opt.step()
    with pytest.raises(ValueError, match="z.*complex"):
        DMuonFSDP([("z", nn.Parameter(torch.zeros(3, 3, dtype=torch.complex64)))])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(momentum=-0.1), "momentum"),
        (dict(ns_steps=1.5), "ns_steps"),
        (dict(eps=-1.0), "eps"),
        (dict(adamw_betas=(0.9, 1.0)), "betas"),
        (dict(ns_coefficients=[(1.0, 2.0, 3.0), "x"]), "ns_coefficients"),
        (dict(nonfinite="warn"), "nonfinite"),
    ],
)
def test_more_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DMuonFSDP([nn.Parameter(torch.zeros(3, 3)), nn.Parameter(torch.zeros(3))], **kwargs)


def test_a_rejected_group_leaves_the_optimizer_unchanged():
    w, b = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(4))
    opt = DMuonFSDP([("w", w)])
    before = (len(opt.param_groups), len(opt.state))
    with pytest.raises(ValueError, match="betas"):
        opt.add_param_group(
            {"params": [("w2", nn.Parameter(torch.randn(3, 3))), ("b", b)], "adamw_betas": (0.9, 2.0)}
        )
    assert (len(opt.param_groups), len(opt.state)) == before
    opt.add_param_group({"params": [("b", b)]})  # the same parameter is accepted afterwards
    assert len(opt.param_groups) == 2


def test_a_group_torch_rejects_leaves_the_optimizer_unchanged():
    # torch requires names on every group or on none: checked after ours, and undone.
    w, v = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(5, 3))
    opt = DMuonFSDP([("w", w)])
    with pytest.raises(ValueError, match="names"):
        opt.add_param_group({"params": [v]})
    assert len(opt.param_groups) == 1 and v not in opt.state
    opt.add_param_group({"params": [("v", v)]})  # a correct retry is accepted
    w.grad, v.grad = torch.randn_like(w), torch.randn_like(v)
    before = v.detach().clone()
    opt.step()
    assert not torch.equal(v.detach(), before)


def divergent_inputs(rank, world_size, case):
    """Inputs that differ on one rank only: every rank must raise the same error, nothing stepped."""
    from instruments.counters import CollectiveCalls

    torch.manual_seed(0)
    weights = {f"w{i}": nn.Parameter(torch.randn(8, 8)) for i in range(4)}
    bias = nn.Parameter(torch.zeros(8))
    named = list(weights.items())
    if case == "order" and rank == 1:
        named = named[::-1]  # same shapes, another order: would exchange rows of other matrices
    opt = DMuonFSDP([{"params": named, "lr": 0.02}, {"params": [("bias", bias)], "use_muon": False}])
    for p in [*weights.values(), bias]:
        p.grad = torch.ones_like(p)
    out = {}
    if case in ("lr", "momentum", "betas"):
        opt.step()  # the program is built; then the per-step options change
        if case == "lr":
            for group in opt.param_groups:  # alike on every rank (a scheduler): no rebuild
                group["lr"] *= 0.5
            plan = opt.plan
            with CollectiveCalls() as calls:
                opt.step()
            out["alike"] = (opt.plan is plan, calls.calls["all_reduce"])
            opt.param_groups[0]["lr"] = 0.02 if rank == 0 else 0.05
        elif case == "momentum":
            opt.param_groups[0]["momentum"] = 0.9 + 0.05 * rank
        else:
            opt.param_groups[1]["betas"] = (0.9, 0.95 if rank == 0 else 0.99)
    if case == "dtype" and rank == 1:
        weights["w2"].grad_dtype = None
        weights["w2"].grad = torch.ones(8, 8, dtype=torch.bfloat16)
    before = {n: p.detach().clone() for n, p in weights.items()}
    out["error"] = _outcome(opt.step)
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in weights.items())
    return out


@pytest.mark.parametrize(
    "case,expected",
    [
        ("order", "Muon matrix 0 is w0 (8x8) on rank 0, w3 (8x8) on rank 1"),
        ("lr", "ranks disagree on param group 0's lr (0.02 on rank 0, 0.05 on rank 1)"),
        ("momentum", "ranks disagree on param group 0's momentum (0.9 on rank 0, 0.95 on rank 1)"),
        ("betas", "ranks disagree on param group 1's betas[1] (0.95 on rank 0, 0.99 on rank 1)"),
        ("dtype", "rank 1: w2: its gradient's dtype is not the parameter's"),
    ],
)
def test_rank_divergent_inputs_raise_the_same_error_everywhere(case, expected):
    results = run_ranks(divergent_inputs, 2, case, timeout=120, pg_timeout=30)
    for r in results:
        kind, message = r["error"]
        assert kind == "ValueError" and expected in message, message
        assert r["unchanged"], "nothing may be committed before the verdict"
        if case == "lr":
            assert r["alike"] == (True, 0), "options changed alike on every rank: no rebuild, no agreement"
    assert results[0]["error"] == results[1]["error"]
