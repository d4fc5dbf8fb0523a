"""bfloat16 weights keep their updates (``main_weights``, on by default): each bf16 parameter keeps
a float32 main weight that the step updates and rounds into it. Four matrices at SigLIP's weight
scale (std 0.15, where bf16's spacing is 1e-3 and a Muon update at lr 2e-3 about 3e-4), 100
steps: the accumulated change against a float64 reference's, in one process and sharded (FSDP2,
DDP, HSDP with ``overlap_forward``, replicas bitwise equal), a checkpoint that resumes exactly,
writes into the parameters that the main weights take, and AdamW alike."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from dmuon_fsdp import DMuonFSDP
from tests.support.spawn import run_ranks
from tests.support.training import full

SHAPES = [(64, 128), (128, 128), (128, 64), (96, 200)]
STEPS, LR, SCALE = 100, 2e-3, 0.15


class Matrices(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weights = nn.ParameterList(
            nn.Parameter((torch.randn(s, generator=gen, dtype=torch.float64) * SCALE).to(dtype, copy=True))
            for s in SHAPES
        )


def gradients(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]


def set_grads(model: Matrices, step: int) -> None:
    for p, g in zip(model.weights, gradients(step), strict=True):
        g = g.to(p.dtype)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g


def changes(model: Matrices, start: list[torch.Tensor]) -> list[torch.Tensor]:
    return [full(p).detach().double() - s for p, s in zip(model.weights, start, strict=True)]


@functools.cache
def reference(steps: int = STEPS) -> list[torch.Tensor]:
    """The accumulated change of a float64 run in one process."""
    model = Matrices(torch.float64)
    start = [p.detach().clone() for p in model.weights]
    opt = DMuonFSDP(model.parameters(), lr=LR, ns_dtype=torch.float64)
    for step in range(steps):
        set_grads(model, step)
        opt.step()
    return changes(model, start)


def cosines(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    pairs = zip(got, want, strict=True)
    return [float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0)) for a, b in pairs]


def trained(
    layout: str = "one", main_weights: bool = True, steps: int = STEPS, **options
) -> tuple[list[torch.Tensor], Matrices]:
    model = Matrices(torch.bfloat16)
    start = [p.detach().double().clone() for p in model.weights]
    if layout == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
    opt = DMuonFSDP(model.parameters(), lr=LR, main_weights=main_weights, **options)
    for step in range(steps):
        set_grads(model, step)
        opt.step()
    opt.finish_step()
    return changes(model, start), model, opt


def test_bf16_weights_keep_their_updates_in_one_process():
    want = reference()
    kept = cosines(trained()[0], want)
    lost = cosines(trained(main_weights=False)[0], want)
    assert min(kept) >= 0.99, kept
    assert max(lost) < 0.9, lost  # rounded to nearest in bf16, most updates vanish


SHARDED_STEPS = 30  # (sharded steps cost more; rounded to nearest, 30 already move at cosine 0.69-0.84)


def sharded(rank, world_size, layout, options):
    got, model, opt = trained(layout, steps=SHARDED_STEPS, **options)
    local = [p.to_local() if isinstance(p, DTensor) else p.detach() for p in model.weights]
    mains = [opt.state[p].get("main_weight") for p in model.weights]
    main_bytes = [
        m.to_local().nbytes if isinstance(m, DTensor) else m.nbytes if m is not None else 0 for m in mains
    ]
    return got, [t.clone() for t in local], main_bytes


@pytest.mark.parametrize(
    "layout,world_size,options",
    [
        ("fsdp", 3, {}),
        ("one", 3, {}),
        ("one", 2, {"overlap_forward": True, "bucket_bytes": 2**14}),
        ("hsdp", 4, {"overlap_forward": True, "bucket_bytes": 2**14}),
    ],
)
def test_bf16_weights_keep_their_updates_sharded_and_replicas_stay_equal(layout, world_size, options):
    """FSDP2 (uneven shards: each rank the main rows of its shard), plain tensors under DDP
    (every rank a replica: each main weight held by its owner alone, which sends the new rows;
    the relay carries them to the others) and HSDP, with the relays left to the next forward."""
    want = reference(SHARDED_STEPS)
    results = run_ranks(sharded, world_size, layout, options, timeout=300)
    for got, _, _ in results:
        assert min(cosines(got, want)) >= 0.99, cosines(got, want)
    if layout != "fsdp":  # replicas hold the same rows, bitwise (HSDP: ranks 0 and 2, 1 and 3)
        twins = [(a, b) for a in range(world_size) for b in range(a)] if layout == "one" else [(0, 2), (1, 3)]
        for a, b in twins:
            assert all(torch.equal(x, y) for x, y in zip(results[a][1], results[b][1], strict=True))
    held = [bytes_ for _, _, bytes_ in results]  # main weight bytes by rank and parameter
    whole = [4 * math.prod(s) for s in SHAPES]
    if layout == "one":  # DDP: each main weight on one rank, whole; every rank holds some
        for i, size in enumerate(whole):
            assert sorted(h[i] for h in held) == [0] * (world_size - 1) + [size], [h[i] for h in held]
        assert all(sum(h) for h in held)
    else:  # one main weight per replica, its rows where they are held
        replicas = 2 if layout == "hsdp" else 1
        assert [sum(h[i] for h in held) for i in range(len(SHAPES))] == [replicas * size for size in whole]


def test_a_checkpoint_resumes_exactly_and_a_write_is_taken():
    """Save after 10 steps, load into a fresh model and optimizer (the main weights come back in
    float32, not cast to the parameters' bf16 as torch casts state), and the next 10 steps equal
    the uninterrupted run's bitwise; a weight written into a parameter between steps is what the
    next step starts from."""
    model = Matrices(torch.bfloat16)
    opt = DMuonFSDP(model.parameters(), lr=LR)
    for step in range(10):
        set_grads(model, step)
        opt.step()
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    resumed = Matrices(torch.bfloat16)
    resumed_opt = DMuonFSDP(resumed.parameters(), lr=LR)
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    assert all(s["main_weight"].dtype == torch.float32 for s in resumed_opt.state.values())
    for step in range(10, 20):
        for m, o in ((model, opt), (resumed, resumed_opt)):
            set_grads(m, step)
            o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters(), strict=True))
    with torch.no_grad():
        model.weights[0].fill_(0.25)  # a write the main weight takes before the next step
    opt.param_groups[0]["lr"] = 0.0
    set_grads(model, 20)
    opt.step()
    assert torch.equal(model.weights[0], torch.full_like(model.weights[0], 0.25))


def ddp_resumes(rank, world_size):
    """Five steps, then three runs on: uninterrupted, from this rank's own state dict, and from
    rank 0's (what a rank-0 ``torch.save`` keeps: the main weights rank 0 holds)."""
    runs = []
    for _ in range(3):
        model = Matrices(torch.bfloat16)
        runs.append((model, DMuonFSDP(model.parameters(), lr=LR)))
    first, opt = runs[0]
    for step in range(5):
        set_grads(first, step)
        opt.step()
    saved = [copy.deepcopy(first.state_dict()), copy.deepcopy(opt.state_dict())]
    shared = [saved[1]]
    torch.distributed.broadcast_object_list(shared, src=0)
    for (model, o), state in zip(runs[1:], (saved[1], shared[0]), strict=True):
        model.load_state_dict(saved[0])
        o.load_state_dict(state)
    held = [[p for p in model.parameters() if "main_weight" in o.state[p]] for model, o in runs]
    counts = [len(h) for h in held]
    for step in range(5, 10):
        for model, o in runs:
            set_grads(model, step)
            o.step()
    return counts, [[p.detach().clone() for p in model.parameters()] for model, _ in runs]


def test_under_ddp_each_rank_saves_the_main_weights_it_holds_and_resumes_exactly():
    """Under DDP a rank's state dict holds the main weights it owns: loaded back, the next steps
    equal the uninterrupted run's bitwise; rank 0's loaded on every rank (the others' main weights
    made again from the parameters) keeps the replicas bitwise equal, each main weight on its
    owner alone."""
    results = run_ranks(ddp_resumes, 2, timeout=300)
    for counts, (uninterrupted, own, _) in results:
        assert counts[0] == counts[1] == counts[2] and 0 < counts[0] < len(SHAPES), counts
        assert all(torch.equal(a, b) for a, b in zip(uninterrupted, own, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(results[0][1][2], results[1][1][2], strict=True))
    assert sum(counts[0] for counts, _ in results) == len(SHAPES)


def test_adamw_on_bf16_keeps_its_updates():
    """A bf16 vector on AdamW whose steps (1e-5 each) are far below its spacing (1e-3 at 0.15)
    moves as float32's does after 100 of them (off: it does not move)."""

    def run(dtype, main_weights=True):
        p = nn.Parameter(torch.full((64,), 0.15, dtype=dtype))
        start = p.detach().double().clone()
        opt = DMuonFSDP([p], adamw_lr=1e-5, main_weights=main_weights)
        for step in range(100):
            noise = torch.randn(64, generator=torch.Generator().manual_seed(step))
            p.grad = (1 + 0.1 * noise).to(dtype)
            opt.step()
        return p.detach().double() - start

    want = run(torch.float32)
    assert float(F.cosine_similarity(run(torch.bfloat16), want, dim=0)) >= 0.99
    assert not run(torch.bfloat16, main_weights=False).any()
