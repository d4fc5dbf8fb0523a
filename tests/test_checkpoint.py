"""Optimizer checkpoints: DCP save at one world size, load at another, continue identically."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from dmuon_fsdp import DMuonFSDP
from tests.support import checkpoints
from tests.support.models import loss_of, make_groups, sharded_model
from tests.support.reference import relative_error
from tests.support.spawn import run_ranks
from tests.support.training import train


def _snapshot(model, opt):
    out = {n: h.weight.full_tensor() for n, h in model.holders.items()}
    out.update(
        {
            f"buf:{n}": opt.state[h.weight]["momentum_buffer"].full_tensor()
            for n, h in model.holders.items()
            if "momentum_buffer" in opt.state[h.weight]
        }
    )
    return out


def save_then_continue(rank, world_size, path):
    model = sharded_model()
    opt = DMuonFSDP(make_groups(model), ns_dtype=torch.float32)
    train([(model, opt)], range(2), loss=loss_of(model))
    checkpoints.save(model, opt, path)
    train([(model, opt)], range(2, 4), loss=loss_of(model))
    return _snapshot(model, opt)


def load_then_continue(rank, world_size, path):
    model = sharded_model()
    opt = DMuonFSDP(make_groups(model), ns_dtype=torch.float32)
    checkpoints.load(model, opt, path)
    train([(model, opt)], range(2, 4), loss=loss_of(model))
    return _snapshot(model, opt)


@pytest.mark.parametrize("saved_at,loaded_at", [(4, 2), (2, 3)])
def test_reshard_on_load_continues_like_the_original(tmp_path, saved_at, loaded_at):
    original = run_ranks(save_then_continue, saved_at, str(tmp_path))[0]
    resumed = run_ranks(load_then_continue, loaded_at, str(tmp_path))[0]
    assert original.keys() == resumed.keys()
    errors = {k: relative_error(resumed[k], original[k]) for k in original}
    assert max(errors.values()) <= 1e-6, errors


def _opt(*shapes):
    params = [(f"p{i}", nn.Parameter(torch.randn(s))) for i, s in enumerate(shapes)]
    return DMuonFSDP(params)


def test_load_state_dict_rejects_mismatched_state():
    good = _opt((4, 6), (6,)).state_dict()
    with pytest.raises(ValueError, match=r"p0: saved momentum_buffer has shape \(4, 6\), expected \(5, 6\)"):
        _opt((5, 6), (6,)).load_state_dict(copy.deepcopy(good))
    missing = copy.deepcopy(good)
    del missing["state"][1]["exp_avg_sq"]
    with pytest.raises(ValueError, match="p1: state dict holds"):
        _opt((4, 6), (6,)).load_state_dict(missing)
    with pytest.raises(ValueError, match="param group"):
        _opt((4, 6), (6,), (3, 3)).load_state_dict(copy.deepcopy(good))


def test_a_recipe_checkpoint_from_before_ns_algorithm_loads(tmp_path):
    """Param-group options added after a checkpoint was written keep the new optimizer's value
    (DCP alone refuses a checkpoint that lacks a key of the state it loads into)."""
    from recipes import checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    state = checkpoint._state(model, [DMuonFSDP(model.parameters(), lr=0.03)], [], 3)
    for group in state["optimizers"][0]["param_groups"]:
        del group["ns_algorithm"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs in one process
        dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
        fresh = DMuonFSDP(model.parameters(), ns_algorithm="auto")
        assert checkpoint.load(tmp_path, model, [fresh], []) == 3
    muon = fresh.param_groups[0]
    assert muon["use_muon"] and (muon["ns_algorithm"], muon["lr"]) == ("auto", 0.03)  # lr from the checkpoint


def frozen_round_trip(rank, world_size, path):
    """A frozen (requires_grad=False) Muon weight and a frozen vector in model.parameters():
    torch's state-dict helpers leave their state out; the optimizer takes the dict back (their
    state starts afresh, untouched as they never step) and DCP round-trips it, as with AdamW."""
    model = sharded_model()
    model.holders["sq2"].weight.requires_grad_(False)
    model.holders["b5"].weight.requires_grad_(False)
    opt = DMuonFSDP(make_groups(model), ns_dtype=torch.float32)
    train([(model, opt)], range(2), loss=loss_of(model))
    checkpoints.save(model, opt, path)
    reference = _snapshot(model, opt)
    train([(model, opt)], range(2, 4), loss=loss_of(model))
    expected = _snapshot(model, opt)
    fresh = sharded_model()
    for name in ("sq2", "b5"):
        fresh.holders[name].weight.requires_grad_(False)
    fresh_opt = DMuonFSDP(make_groups(fresh), ns_dtype=torch.float32)
    checkpoints.load(fresh, fresh_opt, path)
    loaded = _snapshot(fresh, fresh_opt)
    train([(fresh, fresh_opt)], range(2, 4), loss=loss_of(fresh))
    return reference, loaded, expected, _snapshot(fresh, fresh_opt)


def test_frozen_parameters_round_trip_through_torchs_state_dict_helpers(tmp_path):
    for reference, loaded, expected, resumed in run_ranks(frozen_round_trip, 2, str(tmp_path)):
        assert loaded.keys() == reference.keys() and all(
            torch.equal(loaded[k], reference[k]) for k in reference
        )
        assert resumed.keys() == expected.keys() and all(
            torch.equal(resumed[k], expected[k]) for k in expected
        )
