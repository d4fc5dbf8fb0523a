"""NorMuon (``variant="normuon"``): each matrix's rows normalized by their running second moments
on the owner, which holds the whole matrix. Equal to the float64 reference on full matrices on
every layout, not to a shard-local normalization; its state is placed like the rows, checkpoints
and reshards; bad options and a checkpoint of the other variant are named."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from dmuon_fsdp import DMuonFSDP
from instruments.plans import chunk_row_counts
from tests.support import checkpoints
from tests.support.layout_runs import SHAPES, Weights, against_reference, check, given_gradients
from tests.support.reference import KELLER, reference_muon_step, reference_orthogonalize, relative_error
from tests.support.spawn import cpu_mesh, run_ranks
from tests.support.training import full, train

NORMUON = dict(variant="normuon", normuon_beta2=0.9, normuon_eps=1e-6)
# Fused QKV rows cut at 5 and 9 (over 4 ranks: 4, 4, 4, 1 rows), 2 heads of 6 rows, an expert stack
BLOCKS = {"qkv": (13, 9), "heads": (12, 10), "experts": (3, 8, 12)}


def fsdp(rank, world_size, ns_algorithm):
    model = Weights(SHAPES)
    fully_shard(model, mesh=cpu_mesh())
    return against_reference(
        model, list(model.named_parameters()), model, ns_algorithm=ns_algorithm, **NORMUON
    )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fsdp_equals_the_reference_with_uneven_and_empty_shards(world_size):
    check(run_ranks(fsdp, world_size, "auto"), min_owners=world_size)


def test_gram_form():
    check(run_ranks(fsdp, 3, "gram"), min_owners=3)


def layouts(rank, world_size, layout):
    model = Weights(SHAPES)
    loss = model
    if layout == "hsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    elif layout == "ddp":
        loss = DistributedDataParallel(model)
    else:  # FSDP + TP, uneven on both mesh dims
        model = nn.Sequential(nn.Linear(9, 13, bias=False), nn.Linear(13, 9, bias=False))
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        loss = given_gradients(model)
    return against_reference(model, list(model.named_parameters()), loss, **NORMUON)


@pytest.mark.parametrize("layout,world_size", [("hsdp", 4), ("ddp", 3), ("fsdp_tp", 4)])
def test_hsdp_ddp_and_fsdp_tp(layout, world_size):
    check(run_ranks(layouts, world_size, layout), min_owners=2, reuses_slots=layout != "fsdp_tp")


def blocks_and_mixed_groups(rank, world_size):
    model = Weights({**BLOCKS, "muon": (7, 5)})
    fully_shard(model, mesh=cpu_mesh(), shard_placement_fn=lambda p: Shard(1 if p.ndim == 3 else 0))
    ws = model.ws
    groups = [
        {"params": [("ws.qkv", ws["qkv"])], "split_sizes": [5, 4, 4]},
        {"params": [("ws.heads", ws["heads"])], "num_heads": 2},
        {"params": [("ws.experts", ws["experts"])], "flatten": False},
        {"params": [("ws.muon", ws["muon"])], "variant": "muon"},  # the other variant beside
    ]
    return against_reference(model, groups, model, **NORMUON)


def test_row_blocks_heads_experts_and_a_muon_group_beside():
    check(run_ranks(blocks_and_mixed_groups, 4), min_owners=4)


def test_one_process():
    model = Weights({**SHAPES, **BLOCKS})
    groups = [{"params": [(f"ws.{n}", p)], "flatten": n != "experts"} for n, p in model.ws.items()]
    errors, _ = against_reference(model, groups, model, **NORMUON)
    assert max(errors.values()) <= 1e-5, errors


def shard_local(rank, world_size):
    """The distributed run, and what normalizing each rank's rows by their own Frobenius norm
    (a shard-local approximation) would give."""
    model = Weights({"w": (8, 6)})
    fully_shard(model, mesh=cpu_mesh())
    errors, _ = against_reference(model, list(model.named_parameters()), model, steps=1, **NORMUON)
    w = full(model.ws["w"]).detach().double()
    return errors["ws.w"], w


def test_differs_from_a_shard_local_normalization():
    (error, ours), _ = run_ranks(shard_local, 2)
    assert error <= 1e-5
    model = Weights({"w": (8, 6)})  # the same start and first gradient, in one process
    initial, grad = model.ws["w"].detach().double(), _first_gradient(model)
    exact = initial.clone()
    reference_muon_step(
        exact,
        grad,
        torch.zeros(8, 6, dtype=torch.float64),
        lr=0.05,
        weight_decay=0.1,
        second_moment=torch.zeros(8, dtype=torch.float64),
        normuon_beta2=0.9,
        normuon_eps=1e-6,
    )
    # The first step with O_hat rescaled to O's norm on each rank's rows (0-3 and 4-7) alone
    update = grad + 0.95 * (0.05 * grad - grad)  # Nesterov, from a zero momentum buffer
    ortho = reference_orthogonalize(update, KELLER, 5, 1e-7)
    normalized = ortho / ((0.1 * ortho.square().mean(dim=1)).sqrt() + 1e-6)[:, None]
    start = 0
    for count in chunk_row_counts(8, 2):
        rows = slice(start, start + count)
        normalized[rows] *= ortho[rows].norm() / normalized[rows].norm()
        start += count
    local = initial * (1 - 0.05 * 0.1) - 0.05 * (8 / 6) ** 0.5 * normalized
    assert relative_error(ours, exact) <= 1e-5
    print(f"relative difference from the shard-local normalization {relative_error(ours, local):.2e}")
    assert relative_error(ours, local) > 1e-3


def _first_gradient(model):
    model(0).backward()
    return model.ws["w"].grad.double()


def test_bad_options_name_their_group():
    w = nn.Parameter(torch.randn(4, 4))
    for option, value, message in [
        ("variant", "adam", "variant must be one of"),
        ("normuon_beta2", 1.0, "normuon_beta2 must be in [0, 1)"),
        ("normuon_eps", 0.0, "normuon_eps must be a finite number > 0"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"param group 1: {message}")):
            DMuonFSDP([{"params": [nn.Parameter(torch.randn(3, 3))]}, {"params": [w], option: value}])


def test_state_is_placed_like_the_rows_and_a_checkpoint_keeps_its_variant():
    model = Weights(BLOCKS)
    groups = [{"params": [(f"ws.{n}", p)], "flatten": n != "experts"} for n, p in model.ws.items()]
    opt = DMuonFSDP(groups, **NORMUON)
    shapes = {n: tuple(opt.state[p]["neuron_second_moment"].shape) for n, p in model.ws.items()}
    assert shapes == {"qkv": (13,), "heads": (12,), "experts": (3, 8)}
    saved = opt.state_dict()
    muon = DMuonFSDP(groups)
    with pytest.raises(ValueError, match="param group 0: the state dict was saved with variant='normuon'"):
        muon.load_state_dict(saved)
    with pytest.raises(ValueError, match="saved with variant='muon'"):
        DMuonFSDP(groups, **NORMUON).load_state_dict(muon.state_dict())


def save_then_continue(rank, world_size, path):
    model = Weights(SHAPES)
    fully_shard(model, mesh=cpu_mesh())
    opt = DMuonFSDP(model.named_parameters(), ns_dtype=torch.float32, **NORMUON)
    train([(model, opt)], range(2), loss=model)
    checkpoints.save(model, opt, path)
    train([(model, opt)], range(2, 4), loss=model)
    return _snapshot(model, opt)


def load_then_continue(rank, world_size, path):
    model = Weights(SHAPES)
    fully_shard(model, mesh=cpu_mesh())
    opt = DMuonFSDP(model.named_parameters(), ns_dtype=torch.float32, **NORMUON)
    checkpoints.load(model, opt, path)
    train([(model, opt)], range(2, 4), loss=model)
    return _snapshot(model, opt)


def _snapshot(model, opt):
    out = {n: full(p).detach() for n, p in model.named_parameters()}
    out.update({f"v:{n}": full(opt.state[p]["neuron_second_moment"]) for n, p in model.named_parameters()})
    return out


def test_checkpoint_reshards_from_4_to_2_ranks(tmp_path):
    original = run_ranks(save_then_continue, 4, str(tmp_path))[0]
    resumed = run_ranks(load_then_continue, 2, str(tmp_path))[0]
    errors = {k: relative_error(resumed[k], original[k]) for k in original}
    assert max(errors.values()) <= 1e-6, errors


def test_a_variant_changed_between_steps_keeps_the_momentum():
    def run(switch):
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(6, 4))
        opt = DMuonFSDP([("w", w)])
        for step in range(3):
            if step == 1 and switch:
                opt.param_groups[0]["variant"] = "normuon"
            w.grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
            opt.step()
        return opt.state[w]

    muon, switched = run(False), run(True)
    assert torch.equal(muon["momentum_buffer"], switched["momentum_buffer"])  # the same gradients
    assert "neuron_second_moment" not in muon and switched["neuron_second_moment"].shape == (6,)
    assert switched["neuron_second_moment"].min() > 0  # made at the switch, updated since


def test_float64_newton_schulz_and_a_zero_row():
    params = {"w": nn.Parameter(torch.randn(6, 4)), "v": nn.Parameter(torch.randn(5, 7))}
    grads = {
        "w": torch.randn(6, 4).index_fill_(0, torch.tensor([2]), 0.0),
        "v": torch.randn(5, 7),
    }  # a dead row
    opt = DMuonFSDP(list(params.items()), ns_dtype=torch.float64, **NORMUON)
    ref = {n: p.detach().double().clone() for n, p in params.items()}
    bufs = {n: torch.zeros_like(r) for n, r in ref.items()}
    moments = {n: torch.zeros(r.shape[0], dtype=torch.float64) for n, r in ref.items()}
    for _ in range(3):
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()
        for n in ref:
            options = dict(lr=0.02, second_moment=moments[n], normuon_beta2=0.9, normuon_eps=1e-6)
            reference_muon_step(ref[n], grads[n].double(), bufs[n], **options)
    for n, p in params.items():
        assert relative_error(p.detach(), ref[n]) <= 1e-6 and p.isfinite().all()


def test_options_set_between_steps_are_checked_at_the_next_step():
    w = nn.Parameter(torch.randn(4, 4))
    opt = DMuonFSDP([("w", w)], **NORMUON)
    w.grad = torch.randn(4, 4)
    opt.step()
    opt.param_groups[0]["normuon_beta2"] = 1.5
    with pytest.raises(
        ValueError, match=re.escape("param group 0: normuon_beta2 must be in [0, 1), got 1.5")
    ):
        opt.step()


def test_flatten_changed_between_steps_remakes_the_second_moments():
    w = nn.Parameter(torch.randn(3, 8, 12))
    opt = DMuonFSDP([{"params": [("w", w)], "flatten": False}], **NORMUON)
    for flatten, shape in ((False, (3, 8)), (True, (3,)), (False, (3, 8))):
        opt.param_groups[0]["flatten"] = flatten
        w.grad = torch.randn(3, 8, 12)
        opt.step()
        assert tuple(opt.state[w]["neuron_second_moment"].shape) == shape
        assert opt.state[w]["neuron_second_moment"].min() > 0
