"""Pretrain a Llama-style decoder with FSDP2 and DMuonFSDP, AdamW or torch.optim.Muon.

    torchrun --nproc-per-node 2 -m recipes.pretrain --preset cpu-demo --optimizer dmuon

CPU: gloo, fp32. CUDA: NCCL with a bf16 MixedPrecisionPolicy. The default corpus is the Python
standard library's source at byte level (no download); --data takes a nanoGPT uint16 token file
and --text a plain text file. The run dir gets config.json (every setting), metrics.jsonl (one
line per step), summary.json (at the end) and checkpoints/step_N. A used run dir is continued
only with --resume and replaced only with --overwrite. Bad input stops every rank with status 2
and one "error: ..." line before anything is built or written. `python -m recipes.pretrain`
without torchrun trains in one process.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from dmuon_fsdp import AttentionWeights, DMuonFSDP, QKClip, clip_grad_norm_, comm, param_groups
from recipes import checkpoint, options, run_dir
from recipes.data import (
    Corpus,
    batch_for_step,
    stdlib_corpus,
    text_corpus,
    token_file_corpus,
    validation_batches,
)
from recipes.metrics import MetricsLog, flops_per_token, peak_memory_mb, peak_tflops, step_times
from recipes.model import ModelConfig, Transformer, preset
from recipes.options import UsageError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return options.parse_args(argv, __doc__)


def load_corpus(args: argparse.Namespace) -> Corpus:
    """The corpus the flags name; a missing or malformed file is a UsageError naming the flag."""
    flag, path = ("--data", args.data) if args.data else ("--text", args.text) if args.text else (None, None)
    if flag is None:
        return stdlib_corpus(args.cache_dir)
    if not Path(path).exists():
        raise UsageError(f"{flag} {path}: no such file")
    if not Path(path).is_file():
        raise UsageError(f"{flag} {path}: not a file")
    path = Path(path).resolve()  # the data's identity in config.json, however it was typed
    try:
        return token_file_corpus(path, args.vocab_size) if args.data else text_corpus(path)
    except (OSError, ValueError) as error:
        raise UsageError(f"{flag} {error}") from error


def check_corpus(corpus: Corpus, cfg: ModelConfig, args: argparse.Namespace, world_size: int) -> None:
    """Both streams fit the model: ids inside the vocabulary, long enough for their windows."""
    for split, source, tokens, largest in (
        ("training", corpus.train_source, corpus.train, corpus.train_max),
        ("validation", corpus.val_source, corpus.val, corpus.val_max),
    ):
        if largest >= cfg.vocab_size:
            raise UsageError(
                f"{split} data {source}: token id {largest} is outside the vocabulary of "
                f"{cfg.vocab_size} (preset {args.preset}); pass --vocab-size {largest + 1} or more"
            )
        if len(tokens) <= cfg.seq_len + 1:
            raise UsageError(
                f"{split} data {source}: {len(tokens)} tokens are too few for one window of "
                f"--seq-len + 1 = {cfg.seq_len + 1}"
            )
    windows = max(1, args.batch_size // world_size) * args.val_batches * world_size
    if (
        len(corpus.val) < windows + cfg.seq_len
    ):  # validation_batches spaces its windows a token apart at least
        raise UsageError(
            f"validation data {corpus.val_source}: {len(corpus.val)} tokens are too few for "
            f"{windows} windows of {cfg.seq_len + 1} (--val-batches {args.val_batches}); "
            f"it needs {windows + cfg.seq_len}: lower --val-batches or --batch-size"
        )


@dataclass
class Setup:
    corpus: Corpus
    cfg: ModelConfig
    start: run_dir.RunStart


def prepare(args: argparse.Namespace, world_size: int) -> Setup:
    """Every check that needs no process group, in the order a user would fix them; reads only."""
    options.check_numbers(args, world_size)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device here")
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UsageError("--tensorboard needs the tensorboard package (pip install tensorboard)")
    corpus = load_corpus(args)
    cfg = preset(
        args.preset,
        seq_len=args.seq_len,
        vocab_size=args.vocab_size or corpus.vocab_size,
        tie_embeddings=args.tie_embeddings,
    )
    check_corpus(corpus, cfg, args, world_size)
    config = run_dir.make_config(args, world_size, corpus.description, corpus.byte_level, cfg)
    return Setup(corpus, cfg, run_dir.plan_start(args, config))


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
                variant=args.variant or "muon",
                overlap_backward=args.overlap_backward,
                **buckets,
            )
        ]
    muon, adamw = ([p for _, p in g["params"]] for g in groups)
    return [
        torch.optim.Muon(muon, lr=args.lr, weight_decay=wd),
        torch.optim.AdamW(adamw, lr=args.adamw_lr, betas=(0.9, 0.95), weight_decay=wd),
    ]


def lr_factor(args: argparse.Namespace):
    def factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if args.decay == "cosine" else 1 - progress
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * shape

    return factor


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
        else None
    )
    # An explicit mesh: without one FSDP2 uses the machine's accelerator even for a gloo CPU run.
    world = dist.get_world_size()
    if args.replicas > 1:
        mesh = init_device_mesh(
            device.type, (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(device.type, (world,))
    kwargs = {"mesh": mesh}
    if mp:
        kwargs["mp_policy"] = mp
    for block in model.layers:
        if args.compile:
            block.compile()
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


@torch.no_grad()
def evaluate(model, batches, device) -> float:
    total = torch.zeros((), device=device)
    for x, y in batches:
        total += model(x.to(device), y.to(device)).float()
    comm.all_sum(total, None)
    return total.item() / (len(batches) * dist.get_world_size())


def gradient_norm(model: torch.nn.Module, clip: float) -> float:
    """The global gradient norm before clipping; clips to ``clip`` when it is positive (as torch
    does; gradients are left untouched when they are within the norm, so that a step begun in
    backward need not be redone)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if clip > 0:
        norm = clip_grad_norm_(params, clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()


def qk_clip(
    args: argparse.Namespace, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> QKClip | None:
    """With --qk-clip or --max-logits: every attention layer records its heads' largest logits,
    and a QKClip (reducing only, without --qk-clip) for the optimizer holding W_q and W_k."""
    if args.qk_clip is None and not args.max_logits:
        return None
    layers = []
    for block in model.layers:
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
    for opt, scheduler, groups in zip(optimizers, schedulers, settings):
        for group, fresh in zip(opt.param_groups, groups):
            group.update(fresh)
        scheduler.base_lrs = [group["initial_lr"] for group in opt.param_groups]
        lrs = [
            base * factor(scheduler.last_epoch)
            for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)
        ]
        for group, lr in zip(opt.param_groups, lrs):
            group["lr"] = lr
        scheduler._last_lr = lrs


def train(args: argparse.Namespace) -> dict:
    """Run training; returns {"losses": {step: loss}, "val": {step: val_loss}} (same on every rank).
    Bad input raises UsageError before the model is built and before anything is written."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    setup = prepare(args, world)
    device = setup_distributed(args)
    rank = dist.get_rank()
    corpus, cfg, start = setup.corpus, setup.cfg, setup.start
    model = build_model(args, cfg, device)
    optimizers = build_optimizers(args, model)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(args)) for opt in optimizers]
    clip = qk_clip(args, model, optimizers[0])
    if start.checkpoint is not None:  # before the run dir changes: a bad checkpoint leaves it as it was
        settings = [
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in optimizers
        ]
        checkpoint.load(start.checkpoint, model, optimizers, schedulers)
        keep_this_runs_settings(optimizers, schedulers, settings)
    say, elapsed = print, 0.0
    dist.barrier()  # every rank has planned from the run dir as it was before rank 0 changes it
    if rank == 0:
        elapsed = run_dir.begin(start)
        for note in start.notes:
            print(note, flush=True)
    dist.barrier()  # every rank writes checkpoints into the run dir rank 0 has just set up
    val_data = validation_batches(
        corpus.val, cfg.seq_len, max(1, args.batch_size // world), args.val_batches, rank, world
    )
    log = progress = None
    flops = flops_per_token(cfg)
    peak = peak_tflops(device, args.peak_tflops)
    if rank == 0:
        log = MetricsLog(start.run_dir, args.tensorboard, start.step + 1)
        resuming = f"; resuming from {start.checkpoint} (step {start.step})" if start.checkpoint else ""
        print(
            f"{args.optimizer}: {model.num_params() / 1e6:.2f}M parameters, {world} ranks on {device}, "
            f"{corpus.description}, run dir {start.run_dir}{resuming}",
            flush=True,
        )
        if not args.no_progress:
            progress = tqdm(total=args.steps, initial=start.step, desc=args.optimizer, dynamic_ncols=True)
            say = progress.write
    history: dict = {"losses": {}, "val": {}}
    fb_times, opt_times = [], []
    began = time.perf_counter()
    for step in range(start.step, args.steps):
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        inputs, targets = batch_for_step(
            corpus.train, cfg.seq_len, args.batch_size, args.seed, step, rank, world
        )
        for block in model.layers:
            block.attention.max_logits = None  # this step's batch only
        for m, (x, y) in enumerate(zip(inputs.chunk(args.grad_accum), targets.chunk(args.grad_accum))):
            model.set_requires_gradient_sync(m == args.grad_accum - 1)
            loss = model(x.to(device), y.to(device)) / args.grad_accum
            loss.backward()
            loss_sum += loss.detach()
        grad_norm = gradient_norm(model, args.clip)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        for opt in optimizers:
            opt.step()
        logits = clip.clip([block.attention.max_logits for block in model.layers]) if clip else None
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        lr = optimizers[0].param_groups[0]["lr"]  # the lr this step used
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        for scheduler in schedulers:
            scheduler.step()
        comm.all_sum(loss_sum, None)
        train_loss = loss_sum.item() / world
        history["losses"][step + 1] = train_loss
        fb_times.append(t1 - t0)
        opt_times.append(t2 - t1)
        tokens_per_s = args.batch_size * cfg.seq_len / (t2 - t0)
        tflops = flops * tokens_per_s / world / 1e12
        record = {
            "step": step + 1,
            "train_loss": train_loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "tflops_per_rank": tflops,
            "fwd_bwd_ms": 1e3 * (t1 - t0),
            "opt_ms": 1e3 * (t2 - t1),
            "peak_memory_mb": peak_memory_mb(device),
        }
        if peak:
            record["mfu"] = tflops / peak
        if logits is not None:  # reduced over the ranks: the batch's largest logits, before any clip
            per_layer = logits.amax(dim=1).tolist()
            record.update(max_logit=max(per_layer), max_logit_per_layer=per_layer)
        if (step + 1) % args.val_every == 0 or step + 1 == args.steps:
            record["val_loss"] = history["val"][step + 1] = evaluate(model, val_data, device)
        if log:
            record["time_s"] = elapsed + time.perf_counter() - began
            log.write(record)
        if progress:
            progress.set_postfix(
                loss=f"{train_loss:.3f}",
                gnorm=f"{grad_norm:.2f}",
                tok_s=f"{tokens_per_s:.0f}",
                fb_ms=f"{record['fwd_bwd_ms']:.0f}",
                opt_ms=f"{record['opt_ms']:.1f}",
            )
            progress.update(1)
        if (args.save_every and (step + 1) % args.save_every == 0) or (
            args.save_final and step + 1 == args.steps
        ):
            path = checkpoint.step_dir(start.run_dir, step + 1)
            checkpoint.save(path, model, optimizers, schedulers, step + 1)
            if rank == 0:
                say(f"saved checkpoint step {step + 1} to {path}")
                for old in checkpoint.prune(start.run_dir, args.keep_last) if args.keep_last else []:
                    say(f"deleted checkpoint {old} (--keep-last {args.keep_last})")
    if progress:
        progress.close()
    # The run's last collective: dmuon_fsdp.comm returns once gloo has let go of its tensors, so no
    # release is left for interpreter exit, where it aborts the process (CHANGELOG, history).
    mine = torch.tensor([peak_memory_mb(device)], dtype=torch.float64, device=device)
    memory = [row[0] for row in comm.all_rows(mine, dist.group.WORLD).tolist()]
    if rank == 0 and fb_times:
        write_summary(args, start.run_dir, model, history, fb_times, opt_times, memory, device)
    if log:
        log.close()
    return history


def write_summary(
    args,
    directory: Path,
    model,
    history: dict,
    fb_times: list,
    opt_times: list,
    memory: list,
    device: torch.device,
) -> None:
    summary = {
        "name": directory.name,
        "optimizer": args.optimizer,
        "preset": args.preset,
        "world_size": len(memory),
        "device": device.type,
        "steps": args.steps,
        "params": model.num_params(),
        "lr": args.lr,
        "final_val_loss": history["val"].get(args.steps),
        **step_times([1e3 * t for t in fb_times], [1e3 * t for t in opt_times]),
        "peak_memory_mb": memory,
    }
    (directory / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"{args.optimizer}: final val loss {summary['final_val_loss']}, median step "
        f"{summary['median_step_ms']:.1f} ms, optimizer share {summary['optimizer_share']:.1%}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Train; returns the exit status: 0, or 2 for bad input and 1 for an unreadable checkpoint
    (one ``error: ...`` line from rank 0; every rank returns the same status)."""
    caller_group = dist.is_initialized()  # then the caller also destroys it
    try:
        train(parse_args(argv))
        return 0
    except (UsageError, checkpoint.CheckpointError) as error:
        if (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))) == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        return 2 if isinstance(error, UsageError) else 1
    finally:
        if dist.is_initialized() and not caller_group:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
