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
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

if not __package__:  # run by path (python recipes/x.py, torchrun recipes/x.py): the repository's recipes
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes import checkpoint, options, run_dir
from recipes.build import (
    build_model,
    build_optimizers,
    evaluate,
    gradient_norm,
    keep_this_runs_settings,
    learning_rates,
    qk_clip,
    setup_distributed,
)
from recipes.data import Corpus, batch_for_step, check_corpus, load_corpus, validation_batches
from recipes.metrics import Console, MetricsLog, flops_per_token, peak_memory_mb, peak_tflops, step_times
from recipes.model import ModelConfig, Transformer, preset
from recipes.options import UsageError, lr_factor
from recipes.run_lock import RunLock
from recipes.stop import STOPPED, StopSignals, let_threads_run


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
    return Setup(
        corpus, cfg, run_dir.make_config(args, world_size, corpus.description, corpus.byte_level, cfg)
    )


class RunFailure(Exception):
    """A file rank 0 could not write (metrics, config, summary, pruning); the message names it."""


def rank0_says(message: str | None) -> str | None:
    """Rank 0's ``message`` on every rank (a rare-path collective), so that every rank raises,
    and records for torchrun's report, the error rank 0 prints."""
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


T = TypeVar("T")


class Rank0Files:
    """Rank 0's own file work. A failure is kept, and ``agree`` (the step's one reduction)
    raises it on every rank, so none is left waiting in a collective for rank 0."""

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self.error: str | None = None

    def do(self, action: Callable[..., T], *args: Any) -> T | None:
        """``action(*args)`` on rank 0 unless an earlier write failed; an OSError is kept."""
        if self.rank != 0 or self.error is not None:
            return None
        try:
            return action(*args)
        except OSError as error:
            self.error = f"could not write {error.filename or 'the run directory'}: {error.strerror or error}"
            return None

    def agree(self, *values: float) -> list[float]:
        """Sum ``values`` over the ranks, with rank 0's failure; raises RunFailure on every rank
        after one."""
        sums = torch.tensor([float(self.error is not None), *values], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums)
        if sums[0].item():
            raise RunFailure(rank0_says(self.error) or "rank 0 could not write to the run directory")
        return sums[1:].tolist()


def take_lock(directory: Path, files: Rank0Files) -> RunLock | None:
    """Rank 0 locks the run dir (refusing a second job) and checks that it can write there;
    every rank learns the outcome."""
    lock, failure = None, None
    if files.rank == 0:
        lock = RunLock(directory)
        try:
            note = lock.acquire()
            probe = directory / "checkpoints" / ".write-test"  # a checkpoint dir made read-only
            if probe.parent.is_dir():
                probe.touch()
                probe.unlink()
            if note:
                print(note, flush=True)
        except (UsageError, OSError) as error:
            lock.release()
            lock = None
            failure = (
                error
                if isinstance(error, UsageError)
                else UsageError(f"--run-dir {directory}: cannot write {error.filename}: {error.strerror}")
            )
    failed = torch.tensor([float(failure is not None)], device=files.device)
    dist.all_reduce(failed)
    if failed.item():
        message = rank0_says(str(failure) if failure else None)
        raise UsageError(message or "rank 0 could not lock the run directory")
    return lock


def train(args: argparse.Namespace) -> dict:
    """Run training; returns {"losses": {step: loss}, "val": {step: val_loss}} (same on every rank).
    Bad input raises UsageError before the model is built and before anything is written; a
    SIGTERM or SIGINT raises Stopped after the step in progress and its checkpoint."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    setup = prepare(args, world)
    device = setup_distributed(args)
    files = Rank0Files(dist.get_rank(), device)
    with StopSignals(loud=files.rank == 0) as stop:
        lock = take_lock(Path(args.run_dir), files)
        try:  # planned under the lock: what another job writes cannot change it under us
            start = run_dir.plan_start(args, setup.config, run_dir.find_resumed(args))
            return run(args, setup, start, device, files, stop)
        finally:
            if lock:
                lock.release()


class Stopped(Exception):
    """The run stopped on a signal, after its checkpoint; the message is the line rank 0 printed."""


def resume_command(directory: Path) -> str:
    """How to continue a run in ``directory`` (its settings come from its config.json)."""
    if "LOCAL_WORLD_SIZE" not in os.environ:
        return f"python -m recipes.pretrain --resume {directory}"
    local, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    nodes = "" if local == world else f" --nnodes {world // local} (and this job's rendezvous flags)"
    return f"torchrun --nproc-per-node {local}{nodes} -m recipes.pretrain --resume {directory}"


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
    if start.checkpoint is not None:  # before the run dir changes: a bad checkpoint leaves it as it was
        settings = [
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in optimizers
        ]
        checkpoint.load(start.checkpoint, model, optimizers, schedulers)
        keep_this_runs_settings(optimizers, schedulers, settings)
    dist.barrier()  # every rank has planned from the run dir as it was before rank 0 changes it
    elapsed = files.do(run_dir.begin, start) or 0.0
    log = files.do(MetricsLog, start.run_dir, args.tensorboard, start.step + 1)
    files.agree()  # every rank writes checkpoints into the run dir rank 0 has just set up
    console = Console(rank == 0, args.no_progress, args.log_every, args.steps, start.step, args.optimizer)
    for note in start.notes:
        console.say(note)
    resuming = f"; resuming from {start.checkpoint} (step {start.step})" if start.checkpoint else ""
    console.say(
        f"{args.optimizer}: {model.num_params() / 1e6:.2f}M parameters, {world} ranks on {device}, "
        f"{corpus.description}, run dir {start.run_dir}{resuming}"
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
            files.agree()
            where = f"checkpoint {saved[1]}" if saved[1] is not None else "no checkpoint saved"
            line = (
                f"stopped by {stop.requested or 'a signal to another rank'} after step {step + 1} of "
                f"{args.steps}; {where}; resume with: {resume_command(start.run_dir)}"
            )
            console.say(line)
            console.close()
            raise Stopped(line)
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


def should_save(args: argparse.Namespace, step: int, stopping: bool, newest: int | None) -> bool:
    """Whether ``step`` (1-based, done) gets a checkpoint: every --save-every steps, the last one
    (--save-final), and a step stopped at unless the newest checkpoint (the step it holds, None
    without one) is fewer than --save-on-stop steps old."""
    return bool(
        (args.save_every and step % args.save_every == 0)
        or (args.save_final and step == args.steps)
        or (stopping and args.save_on_stop and (newest is None or step - newest >= args.save_on_stop))
    )


def save(
    args: argparse.Namespace,
    directory: Path,
    step: int,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    schedulers: Sequence[torch.optim.lr_scheduler.LRScheduler],
    console: Console,
    files: Rank0Files,
) -> Path:
    """A checkpoint of ``step``, keeping --keep-last of them: the oldest go before the save when
    the disk lacks room for one more, else after it. A failed save raises CheckpointError."""
    path = checkpoint.step_dir(directory, step)
    for old in files.do(checkpoint.make_room, directory, args.keep_last) or []:
        console.say(
            f"deleted checkpoint {old} first (--keep-last {args.keep_last}: the disk is short of room)"
        )
    checkpoint.save(path, model, optimizers, schedulers, step)
    console.say(f"saved checkpoint step {step} to {path}")
    for old in (files.do(checkpoint.prune, directory, args.keep_last) or []) if args.keep_last else []:
        console.say(f"deleted checkpoint {old} (--keep-last {args.keep_last})")
    return path


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


def record_for_torchrun(line: str) -> None:
    """Under torchrun, leave ``line`` in the rank's error file, which torchrun's failure report
    shows in its ``traceback`` field: the file has ``ErrorHandler``'s form with ``line`` in place
    of the Python traceback that ``ErrorHandler.record_exception`` puts there, once per rank."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        extra = {"py_callstack": line, "timestamp": str(int(time.time()))}
        with open(path, "w") as file:
            json.dump({"message": {"message": line, "extraInfo": extra}}, file)


def main(argv: list[str] | None = None) -> int:
    """Train; returns the exit status (the same on every rank): 0, 2 for bad input, 1 for a
    checkpoint or file that could not be read or written (one ``error: ...`` line from rank 0),
    3 (``STOPPED``) after a SIGTERM or SIGINT and its checkpoint. Under torchrun the shell gets
    torchrun's status instead (1 when a rank failed); its report shows each rank's status and the
    error line."""
    caller_group = dist.is_initialized()  # then the caller also destroys it
    try:
        train(parse_args(argv))
        return 0
    except Stopped:
        return STOPPED
    except (UsageError, checkpoint.CheckpointError, RunFailure) as error:
        if (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))) == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        record_for_torchrun(f"error: {error}")
        return 2 if isinstance(error, UsageError) else 1
    finally:
        if dist.is_initialized() and not caller_group:
            let_threads_run()  # a failed save's collectives (DCP's) leave tensors to gloo's threads
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
