"""Pretrain a Llama-style decoder with FSDP2 and DMuonFSDP, AdamW or torch.optim.Muon.

    torchrun --nproc-per-node 2 recipes/pretrain.py --preset cpu-demo --optimizer dmuon

CPU: gloo, fp32. CUDA: NCCL with a bf16 MixedPrecisionPolicy. The default corpus is the Python
standard library's source at byte level (no download); --data takes a nanoGPT uint16 token file
and --text a plain text file. Writes metrics.jsonl, summary.json and checkpoints to the run dir.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dmuon_fsdp import DMuonFSDP, param_groups  # noqa: E402
from recipes import checkpoint  # noqa: E402
from recipes.data import (  # noqa: E402
    Corpus,
    batch_for_step,
    stdlib_corpus,
    text_corpus,
    token_file_corpus,
    validation_batches,
)
from recipes.model import PRESETS, Transformer, preset  # noqa: E402

DEFAULT_LR = {"dmuon": 0.01, "torch-muon": 0.01, "adamw": 3e-3}  # from scripts/lr_sweep.sh


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-demo", choices=sorted(PRESETS))
    p.add_argument("--optimizer", default="dmuon", choices=sorted(DEFAULT_LR))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=16, help="global sequences per optimizer step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=None, help="override the preset's sequence length")
    p.add_argument("--tie-embeddings", action="store_true", default=None)
    p.add_argument("--lr", type=float, default=None, help="peak lr (Muon lr for dmuon/torch-muon)")
    p.add_argument("--adamw-lr", type=float, default=3e-3, help="AdamW lr of embeddings/head/vectors in Muon runs")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--decay", default="cosine", choices=["cosine", "linear"])
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="clip the gradient norm (0: off)")
    p.add_argument("--val-every", type=int, default=50)
    p.add_argument("--val-batches", type=int, default=4)
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end if --save-final)")
    p.add_argument("--save-final", action="store_true")
    p.add_argument("--resume", default=None, help="checkpoint dir, or 'auto' for the newest in the run dir")
    p.add_argument("--run-dir", default=None, help="default: runs/<preset>-<optimizer>")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--replicas", type=int, default=1,
                   help="HSDP: replicate over this many groups, shard within each (world size / replicas)")
    p.add_argument("--data", default=None, help="nanoGPT-style uint16 token file")
    p.add_argument("--text", default=None, help="plain text file, byte-level tokens")
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--cache-dir", default="runs/cache")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank on CPU")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    args.run_dir = args.run_dir or f"runs/{args.preset}-{args.optimizer}"
    return args


def load_corpus(args: argparse.Namespace) -> Corpus:
    if args.data and args.text:
        raise ValueError("pass at most one of --data and --text")
    if args.data:
        return token_file_corpus(args.data, args.vocab_size)
    if args.text:
        return text_corpus(args.text)
    return stdlib_corpus(args.cache_dir)


def build_optimizers(args: argparse.Namespace, model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    wd = args.weight_decay
    if args.optimizer == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=wd)]
    groups = param_groups(model, lr=args.lr, weight_decay=wd)
    if args.optimizer == "dmuon":
        return [DMuonFSDP(groups, adamw_lr=args.adamw_lr, adamw_weight_decay=wd)]
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
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
        torch.cuda.set_device(device)
        return device
    threads = args.threads or max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))
    torch.set_num_threads(threads)
    return torch.device("cpu")


def build_model(args: argparse.Namespace, vocab_size: int, device: torch.device) -> Transformer:
    cfg = preset(args.preset, seq_len=args.seq_len, vocab_size=vocab_size, tie_embeddings=args.tie_embeddings)
    torch.manual_seed(args.seed)
    model = Transformer(cfg).to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else None
    # An explicit mesh: without one FSDP2 uses the machine's accelerator even for a gloo CPU run.
    world = dist.get_world_size()
    if world % args.replicas:
        raise ValueError(f"--replicas {args.replicas} does not divide the world size {world}")
    if args.replicas > 1:
        mesh = init_device_mesh(device.type, (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard"))
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


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


@torch.no_grad()
def evaluate(model, batches, device) -> float:
    total = torch.zeros((), device=device)
    for x, y in batches:
        total += model(x.to(device), y.to(device)).float()
    dist.all_reduce(total)
    return total.item() / (len(batches) * dist.get_world_size())


def train(args: argparse.Namespace) -> dict:
    """Run training; returns {"losses": {step: loss}, "val": {step: val_loss}} (same on every rank)."""
    device = setup_distributed(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = load_corpus(args)
    model = build_model(args, args.vocab_size or corpus.vocab_size, device)
    seq_len = model.cfg.seq_len
    if args.batch_size % (world * args.grad_accum):
        raise ValueError(f"--batch-size {args.batch_size} must divide by ranks x --grad-accum ({world * args.grad_accum})")
    optimizers = build_optimizers(args, model)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(args)) for opt in optimizers]
    run_dir = Path(args.run_dir)
    start = 0
    resume = checkpoint.latest(run_dir) if args.resume == "auto" else args.resume
    if resume:
        start = checkpoint.load(resume, model, optimizers, schedulers)
    val_data = validation_batches(corpus.val, seq_len, max(1, args.batch_size // world), args.val_batches, rank, world)
    metrics = None
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics = open(run_dir / "metrics.jsonl", "a" if resume else "w")
        resuming = f"; resuming from step {start}" if resume else ""
        print(f"{args.optimizer}: {model.num_params() / 1e6:.2f}M parameters, {world} ranks on {device}, "
              f"{corpus.description}{resuming}", flush=True)  # fmt: skip
    progress = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=start, desc=args.optimizer, dynamic_ncols=True)
    history: dict = {"losses": {}, "val": {}}
    fb_times, opt_times = [], []
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        inputs, targets = batch_for_step(corpus.train, seq_len, args.batch_size, args.seed, step, rank, world)
        if int(targets.max()) >= model.cfg.vocab_size or int(inputs.max()) >= model.cfg.vocab_size:
            raise ValueError(f"token id {int(max(inputs.max(), targets.max()))} at step {step} is outside the "
                             f"vocabulary ({model.cfg.vocab_size}); pass --vocab-size")  # fmt: skip
        for m, (x, y) in enumerate(zip(inputs.chunk(args.grad_accum), targets.chunk(args.grad_accum))):
            model.set_requires_gradient_sync(m == args.grad_accum - 1)
            loss = model(x.to(device), y.to(device)) / args.grad_accum
            loss.backward()
            loss_sum += loss.detach()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        for opt in optimizers:
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        lr = optimizers[0].param_groups[0]["lr"]  # the lr this step used
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        for scheduler in schedulers:
            scheduler.step()
        dist.all_reduce(loss_sum)
        train_loss = loss_sum.item() / world
        history["losses"][step + 1] = train_loss
        fb_times.append(t1 - t0)
        opt_times.append(t2 - t1)
        record = {"step": step + 1, "train_loss": train_loss, "lr": lr,
                  "fwd_bwd_ms": 1e3 * (t1 - t0), "opt_ms": 1e3 * (t2 - t1),
                  "tokens_per_s": args.batch_size * seq_len / (t2 - t0)}  # fmt: skip
        if (step + 1) % args.val_every == 0 or step + 1 == args.steps:
            record["val_loss"] = history["val"][step + 1] = evaluate(model, val_data, device)
        if metrics:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        if progress:
            progress.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                 fb_ms=f"{record['fwd_bwd_ms']:.0f}", opt_ms=f"{record['opt_ms']:.1f}")  # fmt: skip
            progress.update(1)
        if (args.save_every and (step + 1) % args.save_every == 0) or (args.save_final and step + 1 == args.steps):
            checkpoint.save(checkpoint.step_dir(run_dir, step + 1), model, optimizers, schedulers, step + 1)
    if progress:
        progress.close()
    memory = [None] * world
    dist.all_gather_object(memory, peak_memory_mb(device))
    if rank == 0 and fb_times:
        step_ms = [1e3 * (a + b) for a, b in zip(fb_times, opt_times)]
        skip = min(5, len(step_ms) - 1)  # warm-up steps
        summary = {
            "name": run_dir.name, "optimizer": args.optimizer, "preset": args.preset, "world_size": world,
            "device": device.type, "steps": args.steps, "params": model.num_params(), "lr": args.lr,
            "final_val_loss": history["val"].get(args.steps),
            "median_step_ms": statistics.median(step_ms[skip:]),
            "median_opt_ms": 1e3 * statistics.median(opt_times[skip:]),
            "median_fwd_bwd_ms": 1e3 * statistics.median(fb_times[skip:]),
            "peak_memory_mb": memory,
        }  # fmt: skip
        summary["optimizer_share"] = summary["median_opt_ms"] / summary["median_step_ms"]
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"{args.optimizer}: final val loss {summary['final_val_loss']}, median step "
              f"{summary['median_step_ms']:.1f} ms, optimizer share {summary['optimizer_share']:.1%}", flush=True)  # fmt: skip
    if metrics:
        metrics.close()
    return history


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    train(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
