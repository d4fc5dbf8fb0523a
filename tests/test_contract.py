"""The torch.optim contract in one process: copies, pickles, cleared state, load hooks, state
dicts of torch.optim.Muon, explicit group options, frozen parameters and torch.compile."""

from __future__ import annotations

import copy
import io
from collections import defaultdict

import pytest
import torch
from torch import nn

from dmuon_fsdp import DMuonFSDP


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))


def _grads(model, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def _steps(model, opt, steps, first=0):
    for step in range(first, first + steps):
        _grads(model, step)
        opt.step()


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_or_unpickled_optimizer_steps_as_the_original(how):
    model = _model()
    opt = DMuonFSDP(model.parameters(), lr=0.05, weight_decay=0.1, nonfinite="skip")
    _steps(model, opt, 2)
    if how == "deepcopy":
        twin_opt = copy.deepcopy(opt)
    else:
        buffer = io.BytesIO()
        torch.save(opt, buffer)
        buffer.seek(0)
        twin_opt = torch.load(buffer, weights_only=False)
    originals = [p for group in opt.param_groups for p in group["params"]]
    params = [p for group in twin_opt.param_groups for p in group["params"]]
    assert twin_opt.nonfinite == "skip" and twin_opt.param_name(params[0]) == "parameter 0 (shape (8, 6))"
    assert {k for k in vars(opt) if not k.startswith("_")} == {
        k for k in vars(twin_opt) if not k.startswith("_")
    }
    for step in range(2, 4):
        _grads(model, step)
        for p, q in zip(originals, params, strict=True):
            q.grad = p.grad.clone()
        opt.step()
        twin_opt.step()
    assert all(torch.equal(p, q) for p, q in zip(originals, params, strict=True))
    assert all(p is not q for p, q in zip(originals, params, strict=True))


@pytest.mark.parametrize("how", ["clear", "new dict", "delete one"])
def test_cleared_state_starts_afresh_like_a_new_optimizer(how):
    model, fresh_model = _model(), _model()
    opt = DMuonFSDP(model.parameters(), lr=0.05, adamw_lr=1e-2)
    _steps(model, opt, 2)
    fresh_model.load_state_dict(model.state_dict())
    fresh = DMuonFSDP(fresh_model.parameters(), lr=0.05, adamw_lr=1e-2)
    if how == "clear":
        opt.state.clear()
    elif how == "new dict":
        opt.state = defaultdict(dict)
    else:  # every parameter's entry removed one by one
        for p in list(model.parameters()):
            del opt.state[p]
    _steps(model, opt, 2, first=2)
    _steps(fresh_model, fresh, 2, first=2)
    assert _same(model, fresh_model)
    for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert opt.state[p].keys() == fresh.state[q].keys()
        assert all(torch.equal(opt.state[p][k], fresh.state[q][k]) for k in opt.state[p])


def test_load_pre_hooks_run_first_on_the_callers_dict():
    model = _model()
    opt = DMuonFSDP(model.parameters())
    _steps(model, opt, 1)
    saved = opt.state_dict()
    older = copy.deepcopy(saved)
    for entry in older["state"].values():  # an "older format": momentum under another key
        if "momentum_buffer" in entry:
            entry["momentum"] = entry.pop("momentum_buffer")
    seen = []

    def upgrade(optimizer, state_dict):
        seen.append(sorted(state_dict))
        upgraded = copy.deepcopy(state_dict)
        for entry in upgraded["state"].values():
            if "momentum" in entry:
                entry["momentum_buffer"] = entry.pop("momentum")
        return upgraded

    other = DMuonFSDP(_model(1).parameters())
    other.register_load_state_dict_pre_hook(upgrade)
    other.load_state_dict(older)
    assert seen == [["param_groups", "state"]]
    loaded = other.state_dict()
    assert all(
        torch.equal(loaded["state"][k]["momentum_buffer"], saved["state"][k]["momentum_buffer"])
        for k in saved["state"]
        if "momentum_buffer" in saved["state"][k]
    )
    with pytest.raises(ValueError, match="state dict holds"):  # without the hook it is refused
        DMuonFSDP(_model(1).parameters()).load_state_dict(older)


def test_a_torch_muon_state_dict_loads_and_the_next_steps_match_torch_muon():
    weights = [
        nn.Parameter(torch.randn(8, 6)),
        nn.Parameter(torch.randn(5, 7)),
        nn.Parameter(torch.randn(6, 6)),
    ]
    theirs = [nn.Parameter(w.detach().clone()) for w in weights]
    ours = [nn.Parameter(w.detach().clone()) for w in weights]
    options = dict(lr=0.02, weight_decay=0.1, momentum=0.9)
    muon = torch.optim.Muon(theirs, **options)
    for step in range(2):  # the third weight never gets a gradient: torch holds no state for it
        for p in theirs[:2]:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step * 10 + p.shape[0]))
        muon.step()
    for p, q in zip(theirs, ours, strict=True):
        q.data.copy_(p.data)
    opt = DMuonFSDP(ours, ns_dtype=torch.bfloat16)
    opt.load_state_dict(copy.deepcopy(muon.state_dict()))  # as saved: torch's dict holds its own tensors
    group = opt.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["momentum"]) == (0.02, 0.1, 0.9)
    for step in range(2, 4):
        for p, q in zip(theirs, ours, strict=True):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step * 10 + p.shape[0]))
            q.grad = p.grad.clone()
        muon.step()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(theirs, ours, strict=True))


def test_a_torch_muon_script_runs_with_the_class_swapped():
    """Moving from torch.optim.Muon: the same script, the class renamed, the defaults that
    differ passed explicitly (lr 1e-3 and weight_decay 0.1 are torch's), bf16 NS as torch runs."""

    def train(optimizer_cls, **extra):
        torch.manual_seed(0)
        weights = [nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(8, 16))]
        opt = optimizer_cls(weights, lr=1e-3, weight_decay=0.1, **extra)
        for _ in range(3):
            loss = (weights[0] @ weights[1]).square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return weights

    theirs = train(torch.optim.Muon)
    ours = train(DMuonFSDP, ns_dtype=torch.bfloat16)
    assert all(torch.equal(p, q) for p, q in zip(theirs, ours, strict=True))


def test_an_explicit_lr_of_a_group_that_holds_only_adamw_parameters_is_honoured():
    w, b = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(4))
    opt = DMuonFSDP([{"params": [w]}, {"params": [b], "lr": 0.1, "weight_decay": 0.5}], adamw_lr=3e-4)
    (vector,) = [g for g in opt.param_groups if not g["use_muon"]]
    assert (vector["lr"], vector["weight_decay"]) == (0.1, 0.5)
    expected = b.detach().clone().requires_grad_()
    reference = torch.optim.AdamW([expected], lr=0.1, weight_decay=0.5, betas=(0.9, 0.95), eps=1e-8)
    for _step in range(3):
        w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
        expected.grad = b.grad.clone()
        opt.step()
        reference.step()
    assert torch.allclose(b, expected, rtol=1e-6, atol=1e-7)
    mixed = DMuonFSDP([{"params": [w, b], "lr": 0.1}], adamw_lr=3e-4)  # lr is the Muon part's here
    assert sorted((g["use_muon"], g["lr"]) for g in mixed.param_groups) == [(False, 3e-4), (True, 0.1)]


def test_step_under_torch_compile_runs_eagerly_with_the_same_result():
    model, twin = _model(), _model()
    opt, eager = DMuonFSDP(model.parameters()), DMuonFSDP(twin.parameters())
    compiled = torch.compile(opt.step)

    def train_step(optimizer):
        optimizer.step()

    compiled_train_step = torch.compile(train_step)
    for step in range(3):
        _grads(model, step)
        _grads(twin, step)
        (compiled if step % 2 else compiled_train_step)(*(() if step % 2 else (opt,)))
        eager.step()
    assert _same(model, twin)


def test_a_gradient_of_another_dtype_is_named():
    w, v = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(3, 3))
    opt = DMuonFSDP([("w", w), ("v", v)])
    w.grad, v.grad = torch.randn_like(w), torch.randn_like(v)
    opt.step()
    w.grad_dtype = None  # torch 2.13: gradients of another dtype allowed
    w.grad, v.grad = torch.randn(4, 6, dtype=torch.bfloat16), torch.randn_like(v)
    with pytest.raises(ValueError, match="w: its gradient's dtype is not the parameter's"):
        opt.step()
