"""What a run is made of: the process group, the FSDP2 model, the optimizers with their lr
schedule, QK-clip, and the two reductions every step uses (gradient norm, validation loss)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from dmuon_fsdp import AttentionWeights, DMuonFSDP, QKClip, clip_grad_norm_, param_groups
from recipes.model import ModelConfig, Transformer


def build_optimizers(args: argparse.Namespace, model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    wd = args.weight_decay
    if args.optimizer == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=wd)]
    groups = param_groups(model, lr=args.lr, weight_decay=wd)
    if args.optimizer == "dmuon":
        buckets = {} if args.bucket_mib is None else {"bucket_bytes": max(1, round(args.bucket_mib * 2**20))}
        return [
            DMuonFSDP(
                groups,
                adamw_lr=args.adamw_lr,
                adamw_weight_decay=wd,
                ns_algorithm=args.ns_algorithm or "standard",
                ns_dtype=getattr(torch, args.ns_dtype) if args.ns_dtype else None,
                variant=args.variant or "muon",
                adjust_lr_fn=args.adjust_lr_fn,
                overlap_backward=args.overlap_backward,
                overlap_forward=args.overlap_forward,
                **buckets,
            )
        ]
    muon, adamw = ([p for _, p in g["params"]] for g in groups)
    return [
        torch.optim.Muon(muon, lr=args.lr, weight_decay=wd),
        torch.optim.AdamW(adamw, lr=args.adamw_lr, betas=(0.9, 0.95), weight_decay=wd),
    ]


def setup_distributed(args: argparse.Namespace) -> torch.device:
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if not dist.is_initialized():
        if "RANK" in os.environ:  # torchrun
            dist.init_process_group("nccl" if cuda else "gloo")
        else:  # plain `python -m recipes.pretrain`: one process
            dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    if cuda:
        device = torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        )
        torch.cuda.set_device(device)
        return device
    threads = args.threads or max(
        1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    )
    torch.set_num_threads(threads)
    return torch.device("cpu")


def build_model(args: argparse.Namespace, cfg: ModelConfig, device: torch.device) -> Transformer:
    torch.manual_seed(args.seed)
    model = Transformer(cfg).to(device)
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda"
        else MixedPrecisionPolicy()  # (fully_shard's default: the parameters' own dtypes)
    )
    # An explicit mesh: without one FSDP2 uses the machine's accelerator even for a gloo CPU run.
    world = dist.get_world_size()
    if args.replicas > 1:
        mesh = init_device_mesh(
            device.type, (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks():
        if args.compile:
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> float:
    total = torch.zeros((), device=device)
    for x, y in batches:
        total += model(x.to(device), y.to(device)).float()
    dist.all_reduce(total)
    return total.item() / (len(batches) * dist.get_world_size())


def gradient_norm(model: torch.nn.Module, clip: float) -> float:
    """The global gradient norm before clipping; clips to ``clip`` when it is positive (as torch
    does; gradients are left untouched when they are within the norm, so that a step begun in
    backward need not be redone)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if clip > 0:
        norm = clip_grad_norm_(params, clip)
    else:
        norm = torch.nn.utils.get_total_norm([g for p in params if (g := p.grad) is not None])
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()


def qk_clip(args: argparse.Namespace, model: Transformer, optimizer: torch.optim.Optimizer) -> QKClip | None:
    """With --qk-clip or --max-logits: every attention layer records its heads' largest logits,
    and a QKClip (reducing only, without --qk-clip) for the optimizer holding W_q and W_k."""
    if args.qk_clip is None and not args.max_logits:
        return None
    layers = []
    for block in model.blocks():
        attention = block.attention
        attention.track_max_logits = True
        layers.append(
            AttentionWeights(
                attention.wq.weight, attention.wk.weight, attention.n_heads, attention.n_kv_heads
            )
        )
    return QKClip(
        optimizer, layers, tau=args.qk_clip, alpha=0.5 if args.qk_clip_alpha is None else args.qk_clip_alpha
    )


def keep_this_runs_settings(optimizers: list, schedulers: list, settings: list[list[dict]]) -> None:
    """After a resume, this run's flags (lr, weight decay, AdamW lr, schedule) win over the
    hyperparameters the checkpoint restored; the lr is recomputed at the resumed step."""
    for opt, scheduler, groups in zip(optimizers, schedulers, settings, strict=True):
        for group, fresh in zip(opt.param_groups, groups, strict=True):
            group.update(fresh)
        scheduler.base_lrs = [group["initial_lr"] for group in opt.param_groups]
        lrs = [
            base * factor(scheduler.last_epoch)
            for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
        ]
        for group, lr in zip(opt.param_groups, lrs, strict=True):
            group["lr"] = lr
        scheduler._last_lr = lrs


def learning_rates(args: argparse.Namespace, optimizers: list) -> dict:
    """The lr the next step uses: ``lr`` (Muon's in Muon runs) and, in Muon runs, ``adamw_lr``
    (AdamW's, for embeddings, head and vectors)."""
    if args.optimizer == "adamw":
        return {"lr": optimizers[0].param_groups[0]["lr"]}
    if args.optimizer == "torch-muon":
        return {"lr": optimizers[0].param_groups[0]["lr"], "adamw_lr": optimizers[1].param_groups[0]["lr"]}
    groups = optimizers[0].param_groups
    return {
        "lr": next(g["lr"] for g in groups if g["use_muon"]),
        "adamw_lr": next((g["lr"] for g in groups if not g["use_muon"]), None),
    }
