"""QK-clip: after DMuonFSDP steps with the clip firing on some heads, parameters equal a float64
single-process reference of Muon + the same rule on full matrices, on every layout; heads under
tau are bitwise untouched; bad input raises on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from dmuon_fsdp import DMuonFSDP
from dmuon_fsdp.qk_clip import AttentionWeights, QKClip
from tests.support.spawn import run_ranks
from tests.support.training import Reference, train

HEADS, KV_HEADS, HEAD_DIM, DIM = 4, 2, 5, 8
TAU, ALPHA, STEPS = 10.0, 0.5, 3
OPTIONS = dict(lr=0.05, weight_decay=0.1, ns_dtype=torch.float32)
Q_ROWS, K_ROWS = (0, HEADS * HEAD_DIM), (HEADS * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM)


class Attention(nn.Module):
    """Separate q and k projections (20 and 10 rows), a fused qkv one (40 rows) and another."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.qkv = nn.Linear(DIM, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)  # (not clipped)

    def forward(self, step):
        x = torch.randn(6, DIM, generator=torch.Generator().manual_seed(step)).to(self.wq.weight.dtype)
        return sum(layer(x).float().pow(2).sum() for layer in (self.wq, self.wk, self.qkv, self.wo))


def layers(model):
    return [
        AttentionWeights(model.wq.weight, model.wk.weight, HEADS, KV_HEADS),
        AttentionWeights(model.qkv.weight, model.qkv.weight, HEADS, KV_HEADS, Q_ROWS, K_ROWS),
    ]


def rank_logits(step, rank, tensor_parallel=False):
    """Per layer, this rank's largest logit per query head. Layer 0: group 0 (heads 0, 1) is
    always over tau, group 1 only where a rank's extra lifts head 3 past it; layer 1 stays
    under tau except at step 1. Under tensor parallelism on (2, 2) a rank computes only the
    query heads of its tp coordinate's rows (layer 0: heads 2c, 2c + 1; the fused layer's q rows
    all sit on c = 0) and passes -inf for the others."""
    extra = 0.4 * rank
    first = torch.tensor([8.0, 12.0 + step, 9.0, 9.5 + extra])
    second = torch.tensor([5.0, 6.0, 7.0 + extra, 9.0]) + (3.0 if step == 1 else 0.0)
    if tensor_parallel:
        c = rank % 2
        first[[h for h in range(HEADS) if h // 2 != c]] = -torch.inf
        second[:] = second if c == 0 else -torch.inf
    return [first, second]


def reference_clip(params, logits):
    """The rule on full float64 matrices; ``logits`` already reduced over the ranks."""
    per_group = HEADS // KV_HEADS
    targets = [
        (params["wq.weight"], Q_ROWS[0], params["wk.weight"], 0),
        (params["qkv.weight"], Q_ROWS[0], params["qkv.weight"], K_ROWS[0]),
    ]
    for (wq, q0, wk, k0), row in zip(targets, logits, strict=True):
        for g in range(KV_HEADS):
            worst = max(row[g * per_group : (g + 1) * per_group]).item()
            if worst > TAU:
                gamma = TAU / worst
                q_rows = slice(q0 + g * per_group * HEAD_DIM, q0 + (g + 1) * per_group * HEAD_DIM)
                wq[q_rows] *= gamma**ALPHA
                wk[k0 + g * HEAD_DIM : k0 + (g + 1) * HEAD_DIM] *= gamma ** (1 - ALPHA)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def run(rank, world_size, model, loss, tensor_parallel=False):
    """``STEPS`` steps of DMuonFSDP, the clip after each, beside the float64 reference of both;
    the clip's reduced logits are checked as it goes. Each parameter's relative error from the
    reference, and per step but step 1 whether the fused layer's rows came out of the clip bitwise
    as the step left them."""
    opt = DMuonFSDP(list(model.named_parameters()), **OPTIONS)
    clip = QKClip(opt, layers(model), tau=TAU, alpha=ALPHA)
    reference = Reference(model, opt)
    untouched = []

    def after_step(step):
        before = _local(model.qkv.weight).detach().clone()
        reduced = clip.clip(rank_logits(step, rank, tensor_parallel))
        if step != 1:  # the fused layer stayed under tau: its rows are bitwise as the step left them
            untouched.append(torch.equal(before, _local(model.qkv.weight).detach()))
        every_rank = [rank_logits(step, r, tensor_parallel) for r in range(world_size)]
        expected = [torch.stack([logits[i] for logits in every_rank]).amax(0) for i in range(2)]
        assert torch.equal(reduced[0], expected[0]) and torch.equal(reduced[1], expected[1])
        reference_clip(reference.params, expected)

    train([(model, opt)], STEPS, loss=loss, reference=reference, after_step=after_step)
    held = {n: "main_weight" in opt.state[p] for n, p in model.named_parameters()}
    return (
        reference.errors(),
        untouched,
        held,
        {n: _local(p).detach().clone() for n, p in model.named_parameters()},
    )


def fsdp(rank, world_size):
    model = Attention()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return run(rank, world_size, model, model)


def hsdp(rank, world_size):
    model = Attention()
    fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    return run(rank, world_size, model, model)


def ddp(rank, world_size):
    model = Attention()
    return run(rank, world_size, model, DistributedDataParallel(model))


def ddp_bf16(rank, world_size):
    model = Attention().to(torch.bfloat16)
    return run(rank, world_size, model, DistributedDataParallel(model))


def fsdp_tp(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Attention()
    parallelize_module(
        model, mesh["tp"], {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "qkv": ColwiseParallel()}
    )
    fully_shard(model, mesh=mesh["dp"])
    return run(rank, world_size, model, model, tensor_parallel=True)


CASES = {
    "fsdp": (fsdp, [1, 2, 3, 4]),
    "hsdp": (hsdp, [4]),
    "ddp": (ddp, [2]),
    "ddp_bf16": (ddp_bf16, [3]),
    "fsdp_tp": (fsdp_tp, [4]),
}


@pytest.mark.parametrize("layout,world_size", [(k, w) for k, (_, ws) in CASES.items() for w in ws])
def test_clip_matches_float64_reference(layout, world_size):
    # W=3 cuts wq's 20 rows 7/7/6 and wk's 10 rows 4/4/2: heads straddle shard boundaries.
    results = run_ranks(CASES[layout][0], world_size)
    worst = max(e for errors, *_ in results for e in errors.values() if e is not None)
    print(f"{layout} W={world_size}: max relative error {worst:.2e}")
    for errors, untouched, _, _ in results:
        assert max(e for e in errors.values() if e is not None) <= 1e-5, errors
        assert untouched and all(untouched)
    if layout == "ddp_bf16":  # QK-clip's weights keep their main weights on every rank, the others
        # on their owner alone; the replicas stay bitwise equal
        for name in results[0][2]:
            holders = sum(held[name] for _, _, held, _ in results)
            assert holders == (world_size if name in ("wq.weight", "wk.weight", "qkv.weight") else 1), name
        for _, _, _, params in results[1:]:
            assert all(torch.equal(params[n], results[0][3][n]) for n in params)


def test_rule_single_process_bitwise_for_heads_under_tau():
    model = Attention()
    opt = DMuonFSDP(model.parameters(), **OPTIONS)
    clip = QKClip(opt, layers(model), tau=TAU, alpha=0.3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    clip.clip([torch.tensor([8.0, 20.0, 9.0, 9.5]), torch.tensor([1.0, 2.0, 3.0, 4.0])])
    wq, wk = model.wq.weight.detach(), model.wk.weight.detach()
    assert torch.equal(wq[10:], before["wq.weight"][10:]) and torch.equal(wk[5:], before["wk.weight"][5:])
    assert torch.allclose(wq[:10], before["wq.weight"][:10] * 0.5**0.3)
    assert torch.allclose(wk[:5], before["wk.weight"][:5] * 0.5**0.7)
    assert torch.equal(model.qkv.weight.detach(), before["qkv.weight"])
    report_only = QKClip(opt, layers(model), tau=None)  # reduces and returns, never scales
    now = {n: p.detach().clone() for n, p in model.named_parameters()}
    logits = [torch.full((4,), 1e6), torch.full((4,), 1e6)]
    assert torch.equal(report_only.clip(logits), torch.stack(logits))
    assert all(torch.equal(p.detach(), now[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize(
    "layer,match",
    [
        (dict(q=None, heads=4), "is not a parameter of the optimizer"),
        (dict(heads=3), "do not split into 3 heads"),
        (dict(heads=4, kv_heads=3), "do not split into 3 heads"),
        (dict(heads=2, kv_heads=2), "query heads of 10 rows, key heads of 5"),
        (dict(q="qkv", heads=4, kv_heads=2), r"needs disjoint q_rows and k_rows \(got None and None\)"),
        (
            dict(q="qkv", heads=4, kv_heads=2, q_rows=(0, 20), k_rows=(10, 20)),
            "needs disjoint q_rows and k_rows",
        ),
    ],
)
def test_bad_layers_raise(layer, match):
    model = Attention()
    opt = DMuonFSDP([model.wq.weight, model.wk.weight, model.qkv.weight])
    q = (
        {"qkv": model.qkv.weight, None: nn.Parameter(torch.zeros(20, 8))}[layer["q"]]
        if "q" in layer
        else model.wq.weight
    )
    k = model.qkv.weight if layer.get("q") == "qkv" else model.wk.weight
    options = {key: v for key, v in layer.items() if key != "q"}
    with pytest.raises(ValueError, match=match):
        QKClip(opt, [AttentionWeights(q, k, **options)], tau=TAU)


def test_errors_name_a_weight_as_the_optimizer_names_it():
    model = Attention()
    opt = DMuonFSDP(list(model.named_parameters()))  # QKClip asks opt.param_name
    with pytest.raises(ValueError, match="the 20 q rows of wq.weight do not split into 3 heads"):
        QKClip(opt, [AttentionWeights(model.wq.weight, model.wk.weight, heads=3)], tau=TAU)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)  # any optimizer: the weight's role names it
    with pytest.raises(ValueError, match=r"the 20 q rows of layers\[0\].q do not split into 3 heads"):
        QKClip(plain, [AttentionWeights(model.wq.weight, model.wk.weight, heads=3)], tau=TAU)


def bad_logits(rank, world_size, kind):
    model = Attention()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    clip = QKClip(DMuonFSDP(model.parameters()), layers(model), tau=TAU)
    logits = rank_logits(0, rank)
    if rank == 1:  # only one rank is wrong: every rank must raise, none may wait
        bad = {
            "shape": torch.zeros(3),
            "type": 1.0,
            "nan": torch.tensor([1.0, float("nan"), 1.0, 1.0]),
            "inf": torch.tensor([1.0, float("inf"), 1.0, 1.0]),
        }
        logits = logits[:1] if kind == "count" else [logits[0], bad[kind]]
    try:
        clip.clip(logits)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    "kind,message",
    [
        (
            "shape",
            "max_logits must be 2 tensors, max_logits[1] of shape (4,) (one logit per query head), on every "
            "rank",
        ),
        ("type", "max_logits must be 2 tensors, max_logits[1] of shape (4,)"),
        ("count", "max_logits must be 2 tensors, max_logits[1] of shape (4,)"),
        ("nan", "max_logits[1] holds NaN or +inf on some rank"),
        ("inf", "max_logits[1] holds NaN or +inf on some rank"),
    ],
)
def test_bad_logits_on_one_rank_raise_on_every_rank(kind, message):
    for error in run_ranks(bad_logits, 2, kind):
        assert error is not None and error.startswith(message)


def test_recipe_model_logits_after_a_clip_are_at_most_tau():
    """The recipe's tracked logits, then the rule: on the same batch, every head over tau comes
    back to tau (grouped-query attention: the group's largest), the others keep their logits."""
    from recipes.model import Transformer, preset

    torch.manual_seed(0)
    model = Transformer(preset("tiny"))  # 4 query heads, 2 key heads per layer
    opt = DMuonFSDP(model.parameters())
    tokens = torch.randint(0, 256, (3, 32))
    for block in model.layers:
        block.attention.track_max_logits = True
    model(tokens)
    seen = [block.attention.max_logits.clone() for block in model.layers]
    tau = 0.95 * float(seen[0].max())
    clip = QKClip(
        opt,
        [AttentionWeights(b.attention.wq.weight, b.attention.wk.weight, 4, 2) for b in model.layers],
        tau=tau,
    )
    assert torch.equal(clip.clip(seen), torch.stack(seen))
    for block in model.layers:
        block.attention.max_logits = None
    model(tokens)
    # The first layer's input (the embeddings) is unchanged, so its logits scale exactly.
    before, after = seen[0], model.layers[0].attention.max_logits
    groups = before.view(2, 2).amax(dim=1).repeat_interleave(2)
    assert (groups > tau).any() and not (groups > tau).all()
    assert torch.allclose(after, torch.where(groups > tau, before * tau / groups, before), rtol=1e-5)
    assert float(after.max()) == pytest.approx(tau, rel=1e-5)


def test_recipe_model_tracks_logits_in_training_forwards_only():
    from recipes.model import Transformer, preset

    model = Transformer(preset("tiny"))
    for block in model.layers:
        block.attention.track_max_logits = True
    with torch.no_grad():  # as recipes.pretrain.evaluate runs
        model(torch.randint(0, 256, (2, 16)))
    assert all(block.attention.max_logits is None for block in model.layers)
    model(torch.randint(0, 256, (2, 16)))
    assert all(block.attention.max_logits.shape == (4,) for block in model.layers)
