"""Parameters replaced in ``param_groups`` (what Accelerate does after ``fully_shard``), or taken
out of the model by ``fully_shard`` with nobody swapping them (a plain loop): the optimizer
follows them and continues exactly as if built after sharding."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from dmuon_fsdp import DMuonFSDP, param_groups
from tests.support.spawn import cpu_mesh, run_ranks


def _model(hidden=(13, 5)) -> nn.Module:
    """An embedding, Linear layers out to each of ``hidden`` (ReLU after the first) and a head."""
    torch.manual_seed(0)  # rows 13 and 5 leave uneven shards at W=2 and an empty one at W=3
    widths = (8, *hidden)
    layers = [nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False)]
    return nn.Sequential(nn.Embedding(11, 8), layers[0], nn.ReLU(), *layers[1:], nn.Linear(widths[-1], 11))


def _shard(model: nn.Module) -> nn.Module:
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=cpu_mesh())
    return fully_shard(model, mesh=cpu_mesh())


def _swap_like_accelerate(opt, model: nn.Module, before: dict[str, nn.Parameter]) -> None:
    """Accelerate's fsdp2_switch_optimizer_parameters: each old parameter -> the one now under its name."""
    now = dict(model.named_parameters())
    by_id = {id(p): now[name] for name, p in before.items()}
    for group in opt.param_groups:
        group["params"] = [by_id[id(p)] for p in group["params"]]


def _train(model, opt, steps, started=None) -> list[float]:
    """Steps on token batches; ``started`` gets each step's buckets started in backward."""
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, 11, (6, 4), generator=g)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(1, 1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if started is not None:
            started.append(opt.last_step_stats.started_in_backward)
    return losses


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = _full(p.detach()).clone()
        out.update({f"{key}:{name}": _full(v).clone() for key, v in opt.state[p].items()})
    return out


def swapped_versus_built_after(rank, world_size, steps_before):
    """Optimizer built on the unsharded model (``steps_before`` steps there), the model sharded and
    the optimizer's parameters swapped; the reference optimizer is built after sharding (and,
    after steps, handed the swapped optimizer's state dict)."""
    model = _model()
    opt = DMuonFSDP(param_groups(model), ns_dtype=torch.float32)
    _train(model, opt, range(steps_before))
    before = _snapshot(model, opt)
    names = dict(model.named_parameters())
    _swap_like_accelerate(opt, _shard(model), names)
    state = opt.state_dict()  # follows the swap, as the next step would
    moved = _snapshot(model, opt)
    placed = _placed_like_params(model, opt)
    reference = _model()
    reference.load_state_dict({k: v for k, v in before.items() if ":" not in k})
    ref_opt = DMuonFSDP(param_groups(_shard(reference)), ns_dtype=torch.float32)
    if steps_before:
        ref_opt.load_state_dict(copy.deepcopy(state))  # torch would share the tensors
    steps = range(steps_before, steps_before + 3)
    return (
        before,
        moved,
        placed,
        _train(model, opt, steps),
        _train(reference, ref_opt, steps),
        _snapshot(model, opt),
        _snapshot(reference, ref_opt),
    )


def _placed_like_params(model, opt) -> bool:
    return all(
        type(v) is type(p) and (not isinstance(p, DTensor) or v.placements == p.placements)
        for p in model.parameters()
        for k, v in opt.state[p].items()
        if k != "step"
    )


def swapped_fresh_and_after_steps(rank, world_size):
    return [swapped_versus_built_after(rank, world_size, steps_before) for steps_before in (0, 2)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_swapped_parameters_continue_like_an_optimizer_built_after_sharding(world_size):
    """Swapped before any step (state made anew) and after 2 steps (state moved)."""
    results = [case for rank in run_ranks(swapped_fresh_and_after_steps, world_size) for case in rank]
    for before, moved, placed, losses, ref_losses, after, ref_after in results:
        assert placed  # every state tensor laid out like its new parameter
        assert before.keys() == moved.keys()
        for key in before:  # parameters untouched; state moved exactly (or made anew: zeros)
            assert torch.equal(moved[key], before[key]), key
        assert losses == ref_losses
        assert after.keys() == ref_after.keys()
        for key in after:
            assert torch.equal(after[key], ref_after[key]), key


def built_before_fully_shard(rank, world_size, steps_before, swap, hidden=(13, 5), **options):
    """``steps_before`` steps on the unsharded model, then ``fully_shard``, with Accelerate's swap
    or (``swap=False``) none, as a plain loop has; then 3 steps: the losses, the final parameters
    and state, what was warned (from construction on), and each step's buckets started in
    backward."""
    model = _model(hidden)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        opt = DMuonFSDP(param_groups(model), ns_dtype=torch.float32, **options)
        _train(model, opt, range(steps_before))
        names = dict(model.named_parameters())
        _shard(model)
        if swap:
            _swap_like_accelerate(opt, model, names)
        started = []
        losses = _train(model, opt, range(steps_before, steps_before + 3), started)
    said = [str(w.message) for w in warned if "DMuonFSDP" in str(w.message)]
    return losses, _snapshot(model, opt), said, started


def plain_loop_and_swapped(rank, world_size):
    return [
        [built_before_fully_shard(rank, world_size, steps, swap) for swap in (False, True)]
        for steps in (0, 2)
    ]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_an_optimizer_built_before_fully_shard_follows_the_sharded_parameters(world_size):
    """A plain loop (nobody swaps): the first step after ``fully_shard`` follows the parameters it
    put in the model, exactly as after Accelerate's swap (shown above to equal an optimizer built
    after sharding), before any step (state made anew) and after 2 (state moved)."""
    for plain, swapped in (pair for rank in run_ranks(plain_loop_and_swapped, world_size) for pair in rank):
        (losses, after, warned, _), (swapped_losses, swapped_after, _, _) = plain, swapped
        assert losses == swapped_losses and len(set(losses)) == 3  # the loss moves: it trains
        assert after.keys() == swapped_after.keys()
        for key in after:
            assert torch.equal(after[key], swapped_after[key]), key
        assert not warned, warned


def built_before_with_overlap(rank, world_size):
    return [
        built_before_fully_shard(
            rank, world_size, 0, False, (13, 5, 9, 7, 13), bucket_bytes=256, overlap_backward=o
        )
        for o in (False, True)
    ]


def test_built_before_fully_shard_with_overlap_backward_starts_steps_in_backward_once_it_follows():
    """Before ``fully_shard`` the parameters are plain tensors, as under DDP, which cannot start
    steps in backward; after the first step follows the sharded ones, the later steps do, with
    the plain step's results and no warning."""
    for plain, overlapped in run_ranks(built_before_with_overlap, 2):
        assert plain[0] == overlapped[0]
        for key in plain[1]:
            assert torch.equal(plain[1][key], overlapped[1][key]), key
        assert plain[2] == overlapped[2] == []
        # the first step follows and plans; from the next on, steps start in backward
        assert overlapped[3][0] == 0 and all(started > 0 for started in overlapped[3][1:]), overlapped[3]


def unknown_model_stops(rank, world_size):
    """Built from ``model.parameters()`` (no names, no model): the first step after
    ``fully_shard`` raises on every rank, before anything moves."""
    model = _model()
    opt = DMuonFSDP(model.parameters(), ns_dtype=torch.float32)
    _shard(model)
    try:
        _train(model, opt, [0])
    except RuntimeError as error:
        return str(error)
    return None


def test_an_optimizer_built_before_fully_shard_of_an_unknown_model_says_so_on_every_rank():
    messages = run_ranks(unknown_model_stops, 2)
    assert len(set(messages)) == 1 and messages[0] is not None
    assert messages[0].startswith(
        "parameter 0 (shape (11, 8)) was replaced in its model by fully_shard after "
    ), messages[0]
    assert "build the optimizer after fully_shard, or from param_groups(model)" in messages[0]


def test_a_step_without_any_gradient_warns_once():
    params, opt = _plain_opt()
    with pytest.warns(UserWarning, match=r"no parameter has a gradient, so nothing is updated") as warned:
        opt.step()
        opt.step()
    said = [w for w in warned if "no parameter has a gradient" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__  # at the caller of step()
    _step(params, opt)  # with gradients: no word


def resharded_state_moves_exactly(rank, world_size):
    """Replicated DTensor parameters (2 steps) replaced by row-sharded ones on the same mesh: the
    state is re-laid out like the new parameters, with the same values."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    weights = [torch.randn(13, 6), torch.randn(7, 13), torch.randn(13)]
    mesh = cpu_mesh()
    replicated = [nn.Parameter(distribute_tensor(w, mesh, [Replicate()])) for w in weights]
    opt = DMuonFSDP(replicated, ns_dtype=torch.float32)
    for _ in range(2):
        for p in replicated:
            p.grad = distribute_tensor(p.detach().full_tensor().cos(), mesh, [Replicate()])
        opt.step()
    before = [{k: _full(v).clone() for k, v in opt.state[p].items()} for p in replicated]
    sharded = [
        nn.Parameter(distribute_tensor(p.detach().full_tensor(), mesh, [Shard(0)])) for p in replicated
    ]
    for group in opt.param_groups:
        group["params"] = [
            sharded[next(i for i, r in enumerate(replicated) if r is p)] for p in group["params"]
        ]
    opt.state_dict()
    placements = [[v.placements for k, v in opt.state[p].items() if k != "step"] for p in sharded]
    after = [{k: _full(v).clone() for k, v in opt.state[p].items()} for p in sharded]
    return before, after, placements


def test_state_of_replicated_parameters_moves_exactly_to_sharded_ones():
    for before, after, placements in run_ranks(resharded_state_moves_exactly, 2):
        assert all(pl == (Shard(0),) for per_param in placements for pl in per_param)
        for old, new in zip(before, after, strict=True):
            assert old.keys() == new.keys()
            assert all(torch.equal(old[k], new[k]) for k in old)


def _plain_opt():
    params = [nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(6))]
    return params, DMuonFSDP([("w", params[0]), ("b", params[1])], ns_dtype=torch.float32)


def _step(params, opt):
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()


@pytest.mark.parametrize(
    "replace, match",
    [
        (
            lambda groups: groups[0]["params"].append(nn.Parameter(torch.randn(2, 2))),
            r"now hold \[2, 1\] parameters per group, the optimizer was given \[1, 1\]",
        ),
        (
            lambda groups: groups[0].__setitem__("params", [nn.Parameter(torch.randn(6, 4))]),
            r"w was replaced in param_groups by a tensor of shape \(6, 4\)",
        ),
        (
            lambda groups: groups[1].__setitem__("params", [groups[0]["params"][0]]),
            "appears there twice|shape",
        ),
        (
            lambda groups: groups[0].__setitem__("params", [torch.randn(4, 6, dtype=torch.bfloat16)]),
            r"w was replaced by a torch.bfloat16 tensor but its state is torch.float32",
        ),
        (
            lambda groups: groups[0].__setitem__("params", [torch.empty(4, 6, device="meta")]),
            "w: .*meta device",
        ),
    ],
)
def test_a_replacement_that_cannot_be_followed_exactly_names_the_parameter(replace, match):
    params, opt = _plain_opt()
    _step(params, opt)
    replace(opt.param_groups)
    with pytest.raises((ValueError, TypeError), match=match):
        opt.step()


def test_untouched_state_is_made_anew_for_a_replacement():
    """Before any step, a replacement in another dtype (Accelerate upcasting for mixed precision)
    gets fresh zero state in its own dtype, and the step goes on."""
    params, opt = _plain_opt()
    new = nn.Parameter(params[0].detach().double())
    opt.param_groups[0]["params"] = [new]
    new.grad, params[1].grad = torch.ones_like(new), torch.ones_like(params[1])
    opt.step()
    assert opt.state[new]["momentum_buffer"].dtype == torch.float64
    assert params[0] not in opt.state
    assert not torch.equal(new.detach(), params[0].detach().double())
