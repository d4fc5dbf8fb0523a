"""Pretrain a Llama-style decoder with FSDP2 and DMuonFSDP, AdamW or torch.optim.Muon.

    torchrun --nproc-per-node 2 -m recipes.pretrain --preset cpu-demo --optimizer dmuon

CPU: gloo, fp32. CUDA: NCCL with a bf16 MixedPrecisionPolicy. The default corpus is the Python
standard library's source at byte level (no download); --data takes a nanoGPT uint16 token file
and --text a plain text file. The run dir gets config.json (every setting), metrics.jsonl (one
line per step), summary.json (at the end) and checkpoints/step_N (the last step's by default).
A used run dir is continued only with --resume (flags not given again keep the run's values)
and replaced only with --overwrite; one job at a time holds it. Exit status: 0 done, 2 bad
input (one "error: ..." line, before anything is built or written), 1 a checkpoint or file that
could not be read or written (one "error: ..." line), 3 stopped by SIGTERM or SIGINT after
saving a checkpoint (the line says how to resume). `python -m recipes.pretrain` without
torchrun trains in one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

if not __package__:  # run by path (python recipes/x.py, torchrun recipes/x.py): the repository's recipes
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes import checkpoint, options, run_dir, runner
from recipes.build import (
    build_model,
    build_optimizers,
    evaluate,
    gradient_norm,
    learning_rates,
    qk_clip,
)
from recipes.data import Corpus, batch_for_step, check_corpus, load_corpus, validation_batches
from recipes.metrics import flops_per_token, peak_memory_mb, peak_tflops, step_times
from recipes.model import ModelConfig, Transformer, preset
from recipes.options import UsageError, lr_factor
from recipes.runner import Rank0Files, save, should_save
from recipes.stop import StopSignals


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return options.parse_args(argv, __doc__)


@dataclass
class Setup:
    corpus: Corpus
    cfg: ModelConfig
    config: dict  # for config.json


def prepare(args: argparse.Namespace, world_size: int) -> Setup:
    """Every check that needs no process group, in the order a user would fix them; reads only.
    A resume first takes the resumed run's settings for every flag not given again."""
    saved = run_dir.saved_config(args)
    if saved is not None:
        options.continue_run(args, saved["args"])
    options.check_numbers(args, world_size)
    run_dir.check_run_dir(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device here")
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UsageError("--tensorboard needs the tensorboard package (pip install tensorboard)")
    corpus = load_corpus(args)
    cfg = preset(
        args.preset,
        seq_len=args.seq_len,
        ffn_dim=args.ffn_dim,
        vocab_size=args.vocab_size or corpus.vocab_size,
        tie_embeddings=args.tie_embeddings,
    )
    check_corpus(corpus, cfg, args, world_size)
    config = run_dir.make_config(
        args,
        world_size,
        corpus.description,
        dataclasses.asdict(cfg),
        loss_unit="nats per byte" if corpus.byte_level else "nats per token",
        tokens_per_step=args.batch_size * cfg.seq_len,
    )
    return Setup(corpus, cfg, config)


def train(args: argparse.Namespace) -> dict:
    """Run training; returns {"losses": {step: loss}, "val": {step: val_loss}} (same on every rank).
    Bad input raises UsageError before the model is built and before anything is written; a
    SIGTERM or SIGINT raises Stopped after the step in progress and its checkpoint."""
    return runner.launch(args, prepare, run)


def run(
    args: argparse.Namespace,
    setup: Setup,
    start: run_dir.RunStart,
    device: torch.device,
    files: Rank0Files,
    stop: StopSignals,
) -> dict:
    corpus, cfg = setup.corpus, setup.cfg
    rank, world = files.rank, dist.get_world_size()
    model = build_model(args, cfg, device)
    assert isinstance(model, FSDPModule)  # (build_model shards it)
    optimizers = build_optimizers(args, model)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(args)) for opt in optimizers]
    clip = qk_clip(args, model, optimizers[0])
    runner.restore(start, model, optimizers, schedulers)
    elapsed, log, console = runner.open_run(
        args,
        start,
        files,
        f"{args.optimizer}: {model.num_params() / 1e6:.2f}M parameters, {world} ranks on {device}, "
        f"{corpus.description}",
    )
    val_data = validation_batches(
        corpus.val, cfg.seq_len, max(1, args.batch_size // world), args.val_batches, rank, world
    )
    flops, peak = flops_per_token(cfg), peak_tflops(device, args.peak_tflops)
    history: dict = {"losses": {}, "val": {}}
    fb_times, opt_times = [], []
    saved = (start.step, start.checkpoint) if start.checkpoint is not None else (None, None)
    began = time.perf_counter()
    for step in range(start.step, args.steps):
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        inputs, targets = batch_for_step(
            corpus.train, cfg.seq_len, args.batch_size, args.seed, step, rank, world
        )
        model.reset_max_logits()  # this step's batch only
        for m, (x, y) in enumerate(
            zip(inputs.chunk(args.grad_accum), targets.chunk(args.grad_accum), strict=True)
        ):
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
        logits = clip.clip(model.max_logits()) if clip else None
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        lrs = learning_rates(args, optimizers)  # the lrs this step used
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        for scheduler in schedulers:
            scheduler.step()
        # One reduction: the loss, whether any rank was signalled, whether rank 0 failed a write.
        loss_total, signalled = files.agree(loss_sum.item(), float(stop.requested is not None))
        train_loss = history["losses"][step + 1] = loss_total / world
        fb_times.append(t1 - t0)
        opt_times.append(t2 - t1)
        tokens_per_s = args.batch_size * cfg.seq_len / (t2 - t0)
        tflops = flops * tokens_per_s / world / 1e12
        record = {
            "step": step + 1,
            "train_loss": train_loss,
            "grad_norm": grad_norm,
            **lrs,
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
        record["time_s"] = elapsed + time.perf_counter() - began
        if log:
            files.do(log.write, record)
        console.step(record)
        stopping = signalled > 0 and step + 1 < args.steps
        if should_save(args, step + 1, stopping, saved[0]):
            path = save(args, start.run_dir, step + 1, model, optimizers, schedulers, console, files)
            saved = (step + 1, path)
        if stopping:
            runner.stop_after("recipes.pretrain", args, step + 1, saved[1], start, stop, console, files)
    console.close()
    # Every rank's peak memory (the exit waits for gloo's threads to let go of these tensors:
    # recipes.stop.let_threads_run).
    gathered = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([peak_memory_mb(device)], dtype=torch.float64, device=device))
    memory = [m.item() for m in gathered]
    if log:
        files.do(log.close)
    files.do(
        write_summary, args, start.run_dir, model, history, fb_times, opt_times, memory, device, saved[1]
    )
    files.agree()
    return history


def write_summary(
    args: argparse.Namespace,
    directory: Path,
    model: Transformer,
    history: dict,
    fb_times: list,
    opt_times: list,
    memory: list,
    device: torch.device,
    weights: Path | None,
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
        "checkpoint": str(weights) if weights is not None else None,
    }
    run_dir.replace_file(directory / "summary.json", json.dumps(summary, indent=2))
    if weights is not None and checkpoint.step_of(weights) == args.steps:
        kept = f"weights in {weights}"
    else:
        newest = f"; the newest checkpoint is {weights}" if weights is not None else ""
        kept = f"the final weights were not saved (--no-save-final){newest}"
    val = f"{summary['final_val_loss']:.4f}" if summary["final_val_loss"] is not None else "not measured"
    print(
        f"{args.optimizer}: final val loss {val}, median step "
        f"{summary['median_step_ms']:.1f} ms, optimizer share {summary['optimizer_share']:.1%}; {kept}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Train; the exit status (``recipes.runner.main``)."""
    return runner.main(train, lambda: parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
