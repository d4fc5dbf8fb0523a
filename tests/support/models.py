"""Test models shared by the test modules: the shapes model (one parameter per shape, gradients
chosen exactly), its param groups and float64 reference run, and matrix shape lists of real
models for planner tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dmuon_fsdp import POLAR_EXPRESS, DMuonFSDP
from dmuon_fsdp._step import pipeline
from dmuon_fsdp._step.planner import build_plan
from tests.support.reference import reference_muon_step
from tests.support.spawn import cpu_mesh
from tests.support.training import train

# name -> shape. (5, 256) at W=4 leaves rows 2, 2, 1, 0; the three (64, 64) batch together.
MUON_A = {"w5": (5, 256), "w1": (1, 128), "w37": (37, 64), "tall": (768, 256), "conv": (6, 3, 3, 3)}
MUON_B = {"wide": (256, 768), "sq0": (64, 64), "sq1": (64, 64), "sq2": (64, 64)}
VECTORS = {"b37": (37,), "b5": (5,)}
SHAPES = {**MUON_A, **MUON_B, **VECTORS}
STEPS = 3
GROUP_A = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
GROUP_B = dict(lr=0.01, weight_decay=0.0, adjust_lr_fn="match_rms_adamw", ns_coefficients=POLAR_EXPRESS)
ADAMW = dict(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8)


class Holder(nn.Module):
    def __init__(self, init):
        super().__init__()
        self.weight = nn.Parameter(init.clone())

    def forward(self, g):
        return (self.weight * g).sum()


class ShapesModel(nn.Module):
    """One parameter per shape, initialized from ``initial_params``; the loss sum(w * g) makes
    each gradient exactly g."""

    def __init__(self):
        super().__init__()
        self.holders = nn.ModuleDict({name: Holder(p.float()) for name, p in initial_params().items()})

    def forward(self, grads):
        return sum(h(grads[name]) for name, h in self.holders.items())


def initial_params():
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=gen, dtype=torch.float64) * 0.1 for n, s in SHAPES.items()}


def gradients(step):
    gen = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()}


def loss_of(model):
    """The loss that gives ``model`` the gradients ``gradients(step)`` at each step."""
    return lambda step: model({n: g.float() for n, g in gradients(step).items()})


def make_groups(model, **options):
    h = model.holders
    return [
        {"params": [h[n].weight for n in MUON_A], **GROUP_A},
        {"params": [h[n].weight for n in MUON_B], **GROUP_B},
        {"params": [h[n].weight for n in VECTORS], "use_muon": False, **ADAMW},
    ]


def reference_run():
    params = initial_params()
    bufs = {n: torch.zeros_like(p) for n, p in params.items()}
    vectors = {n: params[n].clone().requires_grad_() for n in VECTORS}
    adamw = torch.optim.AdamW(list(vectors.values()), **ADAMW)
    for step in range(STEPS):
        grads = gradients(step)
        for names, opts in ((MUON_A, GROUP_A), (MUON_B, GROUP_B)):
            coefficients = opts.get("ns_coefficients", (3.4445, -4.7750, 2.0315))
            for n in names:
                reference_muon_step(
                    params[n],
                    grads[n],
                    bufs[n],
                    lr=opts["lr"],
                    weight_decay=opts["weight_decay"],
                    coefficients=coefficients,
                    adjust_lr_fn=opts["adjust_lr_fn"],
                )
        for n, v in vectors.items():
            v.grad = grads[n].clone()
        adamw.step()
    params.update({n: v.detach() for n, v in vectors.items()})
    return params, bufs


def sharded_run(rank, world_size, ns_algorithm, ramped=False):
    """STEPS steps of the sharded shapes model; every parameter and momentum buffer, in full.
    ``ramped``: small buckets shaped by the planner's ramp, which a model this small never
    pays for (``force_ramp``); then also whether the plan differs from the plain cut."""
    model = sharded_model()
    options = force_ramp() if ramped else {}
    opt = DMuonFSDP(make_groups(model), ns_dtype=torch.float32, ns_algorithm=ns_algorithm, **options)
    train([(model, opt)], STEPS, loss=loss_of(model))
    out = {}
    if ramped:
        plan = opt.plan
        plain = build_plan(plan.matrices, plan.costs, world_size, options["bucket_bytes"], 4, plan.param_of)
        out["ramped"] = torch.tensor(plain.buckets != plan.buckets)
    for name, holder in model.holders.items():
        p = holder.weight
        assert isinstance(p, DTensor)
        out[name] = p.full_tensor()
        if name not in VECTORS:
            out["buf:" + name] = opt.state[p]["momentum_buffer"].full_tensor()
    return out


def force_ramp(bucket_bytes: int = 2**14, ns_flops_per_byte: float = 1e5) -> dict:
    """Options under which the planner shapes a small model's buckets into a ramp: every bucket's
    host work counted as nothing (``pipeline.BUCKET_HOST_FLOPS``, in this process), small
    buckets and a link slow beside these matrices' NS."""
    pipeline.BUCKET_HOST_FLOPS = 0.0
    return {"bucket_bytes": bucket_bytes, "ns_flops_per_byte": ns_flops_per_byte}


def sharded_model() -> ShapesModel:
    """The shapes model under FSDP2 over every rank, one FSDP unit per parameter."""
    model = ShapesModel()
    mesh = cpu_mesh()
    for holder in model.holders.values():
        fully_shard(holder, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def llama_matrices(layers: int, dim: int, kv_dim: int, ffn: int) -> list[tuple[int, int]]:
    """Hidden matrices of a Llama decoder (q, k, v, o, gate, up, down per layer), as (out, in)."""
    block = [(dim, dim), (kv_dim, dim), (kv_dim, dim), (dim, dim), (ffn, dim), (ffn, dim), (dim, ffn)]
    return block * layers


LLAMA_SHAPES = {
    "gpt2-124m": llama_matrices(12, 768, 768, 3072),
    "llama-1b": llama_matrices(16, 2048, 512, 8192),
    "llama3-8b": llama_matrices(32, 4096, 1024, 14336),
    "llama3-70b": llama_matrices(80, 8192, 1024, 28672),
}
