"""No process group: plain tensors, schedulers, state_dict, routing and argument errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dmuon_fsdp import MUON_COEFFICIENTS, POLAR_EXPRESS, DMuonFSDP, param_groups
from dmuon_fsdp._step.run import PHASES
from dmuon_fsdp.newton_schulz import gram_segments, resolve_coefficients, segments_flops, standard_segments
from tests.support.models import SHAPES, STEPS, VECTORS, ShapesModel, gradients, make_groups, reference_run
from tests.support.reference import reference_muon_step, relative_error


def test_plain_tensors_without_process_group_match_reference():
    assert not dist.is_initialized()
    model = ShapesModel()
    opt = DMuonFSDP(make_groups(model), ns_dtype=torch.float32)
    for step in range(STEPS):
        model({n: g.float() for n, g in gradients(step).items()}).backward()
        opt.step()
        opt.zero_grad()
    expected, bufs = reference_run()
    for name in SHAPES:
        p = model.holders[name].weight
        assert relative_error(p.detach(), expected[name]) < 1e-5, name
        if name not in VECTORS:
            assert relative_error(opt.state[p]["momentum_buffer"], bufs[name]) < 1e-5, name


def test_scheduler_changes_the_step_of_both_muon_and_adamw_parts():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(6, 10, dtype=torch.float64))
    b = nn.Parameter(torch.randn(6, dtype=torch.float64))
    opt = DMuonFSDP([w, b], lr=0.1, momentum=0.9, ns_dtype=torch.float64, adamw_lr=0.01)
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    ref_w, buf = w.detach().clone(), torch.zeros_like(w)
    ref_b = b.detach().clone().requires_grad_()
    ref_adamw = torch.optim.AdamW([ref_b], lr=0.01, betas=(0.9, 0.95), weight_decay=0.0)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_adamw, lambda s: 0.5**s)
    for step in range(3):
        gw, gb = torch.randn_like(w), torch.randn_like(b)
        w.grad, b.grad, ref_b.grad = gw, gb, gb.clone()
        opt.step()
        reference_muon_step(ref_w, gw, buf, lr=0.1 * 0.5**step, momentum=0.9)
        ref_adamw.step()
        sched.step()
        ref_sched.step()
    assert relative_error(w.detach(), ref_w) < 1e-12
    assert relative_error(b.detach(), ref_b.detach()) < 1e-12


def test_state_exists_at_construction_and_round_trips():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = DMuonFSDP(model.parameters(), lr=0.05)
    state = opt.state_dict()["state"]
    assert sorted(state) == [0, 1, 2, 3]
    # Group 0 holds the two weights (Muon), group 1 the two biases (AdamW).
    assert [set(state[i]) == {"momentum_buffer"} for i in range(4)] == [True, True, False, False]
    assert set(state[2]) == set(state[3]) == {"step", "exp_avg", "exp_avg_sq"}

    def train(optimizer, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x = torch.randn(32, 8, generator=gen)
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    train(opt, 2, seed=1)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())  # state_dict() shares the live tensors
    train(opt, 2, seed=2)
    continued = {k: v.clone() for k, v in model.state_dict().items()}

    model.load_state_dict(saved_model)
    fresh = DMuonFSDP(model.parameters(), lr=0.05)
    fresh.load_state_dict(saved_opt)
    train(fresh, 2, seed=2)
    for k, v in model.state_dict().items():
        assert torch.equal(v, continued[k]), k


class TinyLM(nn.Module):
    def __init__(self, tied):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.block = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50, bias=False)
        if tied:
            self.head.weight = self.embed.weight


@pytest.mark.parametrize("tied", [False, True])
def test_param_groups_route_embeddings_and_head_to_adamw(tied):
    model = TinyLM(tied)
    groups = param_groups(model, lr=0.03)
    muon = [n for n, _ in groups[0]["params"]]
    adamw = [n for n, _ in groups[1]["params"]]
    assert muon == ["block.weight"] and groups[0]["lr"] == 0.03
    expected = ["embed.weight", "block.bias", "norm.weight", "norm.bias"] + ([] if tied else ["head.weight"])
    assert adamw == expected
    opt = DMuonFSDP(groups, adamw_lr=1e-3)
    assert opt.param_groups[1]["lr"] == 1e-3 and not opt.param_groups[1]["use_muon"]


def test_route_gives_flat_groups_the_routing_of_param_groups():
    """The transformers Trainer's decay / no-decay groups, routed by the model."""
    model = TinyLM(tied=False)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    groups = [
        {"params": decay, "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if all(p is not d for d in decay)], "weight_decay": 0.0},
    ]
    opt = DMuonFSDP(groups, route=model)
    reference = DMuonFSDP(param_groups(model))

    def routed(o, muon):
        return {id(p) for g in o.param_groups if g["use_muon"] == muon for p in g["params"]}

    assert routed(opt, True) == routed(reference, True) == {id(model.block.weight)}
    assert routed(opt, False) == routed(reference, False)
    assert [g["weight_decay"] for g in opt.param_groups if g["use_muon"]] == [0.1]
    with pytest.raises(ValueError, match=r"norm.weight has shape \(16,\)"):  # named by the model
        DMuonFSDP([{"params": [model.norm.weight], "use_muon": True}], route=model)
    with pytest.raises(ValueError, match=r"parameter 0 \(shape \(3, 3\)\) is not a parameter of the model"):
        DMuonFSDP([nn.Parameter(torch.ones(3, 3))], route=model)


def test_param_groups_named_head():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    groups = param_groups(model, head="1")
    assert [n for n, _ in groups[0]["params"]] == ["0.weight"]
    assert "1.weight" in [n for n, _ in groups[1]["params"]]


def test_named_parameters_and_mixed_group_split():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    opt = DMuonFSDP(model.named_parameters(), lr=0.02, adamw_lr=0.001, adamw_weight_decay=0.1)
    assert [g["param_names"] for g in opt.param_groups] == [["0.weight", "1.weight"], ["0.bias", "1.bias"]]
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(0.02, 0.0), (0.001, 0.1)]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(momentum=1.0), "momentum"),
        (dict(ns_steps=0), "ns_steps"),
        (dict(adjust_lr_fn="nope"), "adjust_lr_fn"),
        (dict(ns_coefficients=[(1.0, 2.0)]), "ns_coefficients"),
        (dict(weight_decay=math.nan), "weight_decay"),
        (dict(bucket_bytes=0), "bucket_bytes"),
        (dict(ns_algorithm="fast"), "ns_algorithm must be one of"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DMuonFSDP([nn.Parameter(torch.zeros(3, 3))], **kwargs)


@pytest.mark.parametrize(
    "name,value,match",
    [
        ("nonfinite", "warn", "nonfinite must be one of"),
        ("check_grads", "yes", "check_grads must be True or False"),
        ("overlap", None, "overlap must be True or False"),
        ("time_phases", 1, "time_phases must be True or False"),
    ],
)
def test_an_option_set_between_steps_is_checked_at_assignment(name, value, match):
    opt = DMuonFSDP([nn.Parameter(torch.zeros(3, 3))])
    before = getattr(opt, name)
    with pytest.raises(ValueError, match=match):
        setattr(opt, name, value)
    assert getattr(opt, name) == before


def test_options_that_shape_the_buffers_are_fixed_and_the_others_take_effect():
    w = nn.Parameter(torch.randn(4, 6))
    opt = DMuonFSDP([("w", w)], ns_dtype=torch.float64)
    for name, value in (("ns_dtype", torch.float32), ("comm_dtype", torch.float32), ("bucket_bytes", 2**10)):
        with pytest.raises(AttributeError, match=f"{name} is fixed at construction"):
            setattr(opt, name, value)
    assert opt.ns_dtype == torch.float64 and opt.comm_dtype is None and opt.bucket_bytes == 128 * 2**20
    w.grad = torch.full_like(w, float("nan"))
    opt.nonfinite = "skip"  # read at the next step
    before = w.detach().clone()
    opt.step()
    assert opt.last_step_stats.skipped and torch.equal(w.detach(), before)
    opt.time_phases = True
    w.grad = torch.randn_like(w)
    opt.step()
    assert not opt.last_step_stats.skipped and opt.last_step_stats.seconds["newton_schulz"] > 0


def test_param_name_is_the_name_errors_use():
    w, v, b = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3))
    named = DMuonFSDP([("layer.weight", w)])
    unnamed = DMuonFSDP([v, b])
    assert named.param_name(w) == "layer.weight"
    assert (
        unnamed.param_name(v) == "parameter 0 (shape (3, 3))"
        and unnamed.param_name(b) == "parameter 1 (shape (3,))"
    )
    with pytest.raises(KeyError, match="not a parameter of this optimizer"):
        named.param_name(v)


def test_use_muon_on_a_vector_names_it():
    with pytest.raises(ValueError, match="'bias'|bias"):
        DMuonFSDP([{"params": [("bias", nn.Parameter(torch.zeros(3)))], "use_muon": True}])


def test_optimizer_wide_option_in_a_group_raises():
    with pytest.raises(ValueError, match="ns_dtype"):
        DMuonFSDP([{"params": [nn.Parameter(torch.zeros(3, 3))], "ns_dtype": torch.float64}])


def test_empty_parameter_list_raises():
    with pytest.raises(ValueError, match="empty"):
        DMuonFSDP([])


def test_plan_is_cached_and_rebuilt_when_the_set_of_matrices_changes():
    ws = [nn.Parameter(torch.randn(4, 6)) for _ in range(3)]
    opt = DMuonFSDP(ws)

    def step(with_grad):
        for w in ws:
            w.grad = torch.randn_like(w) if any(w is g for g in with_grad) else None
        opt.step()
        return opt.plan

    first = step(ws)
    assert step(ws) is first
    fewer = step(ws[:2])
    assert fewer is not first and len(fewer.matrices) == 2
    untouched = ws[2].detach().clone()
    step(ws[:2])
    assert torch.equal(ws[2].detach(), untouched), "a parameter without grad must not move"


def _expected_after_a_step(w, coefficients, steps):
    """Sets a random w.grad; returns w after one momentum-free float64 reference Muon step."""
    expected = w.detach().clone()
    w.grad = torch.randn_like(w)
    reference_muon_step(
        expected,
        w.grad,
        torch.zeros_like(expected),
        lr=0.02,
        momentum=0.0,
        coefficients=coefficients,
        steps=steps,
    )
    return expected


def _stepped_once(shape):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(shape, dtype=torch.float64))
    opt = DMuonFSDP([w], ns_dtype=torch.float64, momentum=0.0)
    w.grad = torch.randn_like(w)
    opt.step()
    return w, opt


def test_a_replaced_parameter_storage_is_followed():
    # p.data = ... keeps the Parameter but swaps its storage (as model.to(...) does): the step
    # program's views are made anew, and the new values get the update.
    w, opt = _stepped_once((6, 4))
    w.data = torch.randn(6, 4, dtype=torch.float64)
    expected = _expected_after_a_step(w, (3.4445, -4.7750, 2.0315), 5)
    opt.step()
    assert relative_error(w.detach(), expected) < 1e-12


def test_load_state_dict_into_a_running_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = DMuonFSDP(model.parameters(), lr=0.05)

    def train(steps, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            model(torch.randn(32, 8, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()

    train(2, seed=1)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())
    train(2, seed=2)
    continued = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)  # new state tensors: the program's views must follow them
    train(2, seed=2)
    for k, v in model.state_dict().items():
        assert torch.equal(v, continued[k]), k


def test_changed_group_options_take_effect_at_the_next_step():
    w, opt = _stepped_once((5, 7))
    first = opt.plan
    opt.param_groups[0]["ns_coefficients"] = "polar_express"
    opt.param_groups[0]["ns_steps"] = 6
    expected = _expected_after_a_step(w, POLAR_EXPRESS, 6)
    opt.step()
    assert opt.plan is not first
    assert relative_error(w.detach(), expected) < 1e-12


def test_a_changed_ns_algorithm_runs_the_gram_form_at_the_next_step():
    w, opt = _stepped_once((8, 40))
    opt.param_groups[0]["ns_algorithm"] = "gram"
    expected = _expected_after_a_step(w, MUON_COEFFICIENTS, 5)
    opt.step()
    segments = gram_segments(resolve_coefficients(MUON_COEFFICIENTS, 5), torch.float64)
    assert opt.plan.costs[0] == segments_flops(8, 40, segments) != segments_flops(8, 40, standard_segments(5))
    assert opt.last_step_stats.ns_flops == segments_flops(8, 40, segments)
    assert relative_error(w.detach(), expected) < 1e-12  # the same polynomial, in float64
    opt.param_groups[0]["ns_algorithm"] = "fast"
    w.grad = torch.randn_like(w)
    with pytest.raises(ValueError, match="ns_algorithm must be one of"):
        opt.step()


def test_a_state_dict_from_before_ns_algorithm_loads_and_keeps_this_optimizers_value():
    w, opt = _stepped_once((8, 40))
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        del group["ns_algorithm"]
    other = DMuonFSDP([w], ns_dtype=torch.float64, momentum=0.0, ns_algorithm="gram")
    other.load_state_dict(saved)
    assert other.param_groups[0]["ns_algorithm"] == "gram"
    w.grad = torch.randn_like(w)
    other.step()
    assert other.plan.costs[0] != segments_flops(8, 40, standard_segments(5))


@pytest.mark.parametrize("ns_algorithm", ["standard", "gram"])
def test_an_empty_matrix_beside_others_steps(ns_algorithm):
    # The empty matrix is planned and batched like any other, and changes nothing beside it: w
    # steps exactly as it does alone.
    torch.manual_seed(0)
    empty, w = nn.Parameter(torch.zeros(5, 0)), nn.Parameter(torch.randn(4, 6))
    alone = nn.Parameter(w.detach().clone())
    opt = DMuonFSDP([empty, w], ns_algorithm=ns_algorithm)
    reference = DMuonFSDP([alone], ns_algorithm=ns_algorithm)
    for _ in range(2):
        empty.grad, w.grad = torch.zeros(5, 0), torch.randn(4, 6)
        alone.grad = w.grad.clone()
        opt.step()
        reference.step()
    assert [(m.rows, m.cols) for m in opt.plan.matrices] == [(5, 0), (4, 6)]
    assert opt.last_step_stats.ns_matrices == 2
    assert torch.equal(w.detach(), alone.detach()) and not torch.equal(w.detach(), alone.grad)


def test_profiler_trace_shows_the_step_phases():
    model = ShapesModel()
    opt = DMuonFSDP(make_groups(model), ns_dtype=torch.float32)
    model({n: g.float() for n, g in gradients(0).items()}).backward()
    opt.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    names = {event.name for event in prof.events()}
    labelled = {n.removeprefix("dmuon_fsdp.") for n in names if n.startswith("dmuon_fsdp.")}
    assert labelled == set(PHASES), labelled  # the one phase vocabulary, every phase labelled


def _ops_and_reads(blocks, **options):
    from instruments.counters import HostReads, OpCounter
    from recipes.model import Transformer, preset

    torch.manual_seed(0)
    model = Transformer(preset("tiny", n_layers=blocks, dim=8, n_heads=2, n_kv_heads=1, ffn_dim=16))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = DMuonFSDP(param_groups(model), **options)
    opt.step()
    with OpCounter() as counter, HostReads() as reads:
        opt.step()
    return sum(counter.ops.values()), reads.count


def test_steady_state_step_work_does_not_grow_with_the_model():
    # A step dispatches a fixed number of ops per param group, bucket and NS batch; three times
    # the blocks (and parameters) dispatch exactly as many. One device-to-host read with the
    # checks on, none with them off.
    small, large = _ops_and_reads(2), _ops_and_reads(6)
    assert small == large and small[0] <= 150 and small[1] == 1, (small, large)
    assert _ops_and_reads(6, check_grads=False, nonfinite="ignore")[1] == 0


def test_a_replaced_state_tensor_is_followed():
    w = nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    opt = DMuonFSDP([w], ns_dtype=torch.float64, momentum=0.5)
    w.grad = torch.randn_like(w)
    opt.step()
    buf = torch.randn_like(w)
    opt.state[w]["momentum_buffer"] = buf.clone()  # replaced by hand: the next step uses and updates it
    expected = w.detach().clone()
    w.grad = torch.randn_like(w)
    reference_muon_step(expected, w.grad, buf, lr=0.02, momentum=0.5)
    opt.step()
    assert relative_error(w.detach(), expected) < 1e-12
    assert relative_error(opt.state[w]["momentum_buffer"], buf) < 1e-12


def test_nonfinite_check_flags_inf_and_nan_and_changes_no_gradient():
    from dmuon_fsdp._step.flags import nonfinite_groups, nonfinite_indicator

    def indicator(grads):
        return nonfinite_indicator(
            [[grads[i] for i in g] for g in nonfinite_groups(grads)], torch.device("cpu")
        )

    grads = [torch.full((4,), 60000.0, dtype=torch.float16), torch.tensor([-0.0, 2.5]), torch.zeros(0, 3)]
    before = [g.clone() for g in grads]
    versions = [g._version for g in grads]
    assert indicator(grads).item() == 0
    assert [g._version for g in grads] == versions, "the check only reads"
    assert all(
        torch.equal(g, b) and torch.equal(g.signbit(), b.signbit())
        for g, b in zip(grads, before, strict=True)
    )
    for bad in (float("nan"), float("inf"), -float("inf")):
        grads[1][0] = bad
        assert math.isnan(indicator(grads).item())  # anything but 0 is found
