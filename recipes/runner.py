"""What every recipe's run shares: ``launch`` (checks, the process group, the run lock taken for
all ranks, where the run starts, then the recipe's ``run``), ``restore`` (a resume),
``open_run`` (the run dir set up, the metrics log and console), rank 0's file work and the
step's one reduction (``Rank0Files``), checkpoints (``should_save``, ``save``), a stop on a
signal (``stop_after``: ``Stopped``, with the command that resumes) and the exit: ``main`` runs
a recipe's ``train`` and turns its errors into one ``error: ...`` line and an exit status (0
done, 2 bad input, 1 a file or checkpoint that could not be read or written, 3 stopped by
SIGTERM or SIGINT after saving a checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, Protocol, TypeVar

import torch
import torch.distributed as dist

from recipes import checkpoint, run_dir
from recipes.build import keep_this_runs_settings, setup_distributed
from recipes.metrics import Console, MetricsLog
from recipes.options import UsageError
from recipes.run_lock import RunLock
from recipes.stop import STOPPED, StopSignals, let_threads_run


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


class Stopped(Exception):
    """The run stopped on a signal, after its checkpoint; the message is the line rank 0 printed."""


def resume_command(module: str, directory: Path) -> str:
    """How to continue a run of recipe ``module`` in ``directory`` (its settings come from its
    config.json)."""
    if "LOCAL_WORLD_SIZE" not in os.environ:
        return f"python -m {module} --resume {directory}"
    local, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    nodes = "" if local == world else f" --nnodes {world // local} (and this job's rendezvous flags)"
    return f"torchrun --nproc-per-node {local}{nodes} -m {module} --resume {directory}"


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


def record_for_torchrun(line: str) -> None:
    """Under torchrun, leave ``line`` in the rank's error file, which torchrun's failure report
    shows in its ``traceback`` field: the file has ``ErrorHandler``'s form with ``line`` in place
    of the Python traceback that ``ErrorHandler.record_exception`` puts there, once per rank."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        extra = {"py_callstack": line, "timestamp": str(int(time.time()))}
        with open(path, "w") as file:
            json.dump({"message": {"message": line, "extraInfo": extra}}, file)


class Prepared(Protocol):
    config: dict  # config.json of the run


P = TypeVar("P", bound=Prepared)


def launch(
    args: argparse.Namespace,
    prepare: Callable[[argparse.Namespace, int], P],
    run: Callable[[argparse.Namespace, P, run_dir.RunStart, torch.device, Rank0Files, StopSignals], dict],
) -> dict:
    """A recipe's run: ``prepare`` (every check that needs no process group; reads only), the
    process group, the run dir locked, where the run starts planned under the lock (what another
    job writes cannot change it under us), then ``run``; a SIGTERM or SIGINT raises ``Stopped``
    after the step in progress and its checkpoint (``stop_after``)."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    setup = prepare(args, world)
    device = setup_distributed(args)
    files = Rank0Files(dist.get_rank(), device)
    with StopSignals(loud=files.rank == 0) as stop:
        lock = take_lock(Path(args.run_dir), files)
        try:
            start = run_dir.plan_start(args, setup.config, run_dir.find_resumed(args))
            return run(args, setup, start, device, files, stop)
        finally:
            if lock:
                lock.release()


def restore(start: run_dir.RunStart, model: torch.nn.Module, optimizers: list, schedulers: list) -> None:
    """Resume from ``start``'s checkpoint, if any, before the run dir changes (a bad checkpoint
    leaves it as it was); this run's flags win over the restored hyperparameters."""
    if start.checkpoint is None:
        return
    settings = [
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in optimizers
    ]
    checkpoint.load(start.checkpoint, model, optimizers, schedulers)
    keep_this_runs_settings(optimizers, schedulers, settings)


def open_run(
    args: argparse.Namespace, start: run_dir.RunStart, files: Rank0Files, headline: str
) -> tuple[float, MetricsLog | None, Console]:
    """Rank 0 sets the run dir up (once every rank has planned from it as it was) and opens the
    metrics log; every rank then writes checkpoints there. Returns the time the run took before
    (a resume), the log (rank 0's) and the console, which has said the plan's notes and
    ``headline``."""
    dist.barrier()
    elapsed = files.do(run_dir.begin, start) or 0.0
    log = files.do(MetricsLog, start.run_dir, args.tensorboard, start.step + 1)
    files.agree()
    console = Console(
        files.rank == 0, args.no_progress, args.log_every, args.steps, start.step, args.optimizer
    )
    for note in start.notes:
        console.say(note)
    resuming = f"; resuming from {start.checkpoint} (step {start.step})" if start.checkpoint else ""
    console.say(f"{headline}, run dir {start.run_dir}{resuming}")
    return elapsed, log, console


def stop_after(
    module: str,
    args: argparse.Namespace,
    step: int,
    saved: Path | None,
    start: run_dir.RunStart,
    stop: StopSignals,
    console: Console,
    files: Rank0Files,
) -> NoReturn:
    """End a run stopped by a signal after ``step`` (1-based; ``saved``: the newest checkpoint):
    say how to resume recipe ``module`` and raise ``Stopped``."""
    files.agree()
    where = f"checkpoint {saved}" if saved is not None else "no checkpoint saved"
    line = (
        f"stopped by {stop.requested or 'a signal to another rank'} after step {step} of "
        f"{args.steps}; {where}; resume with: {resume_command(module, start.run_dir)}"
    )
    console.say(line)
    console.close()
    raise Stopped(line)


def main(train: Callable[[argparse.Namespace], object], args: Callable[[], argparse.Namespace]) -> int:
    """``train(args())``; returns the exit status (the same on every rank): 0, 2 for bad input, 1 for a
    checkpoint or file that could not be read or written (one ``error: ...`` line from rank 0),
    3 (``STOPPED``) after a SIGTERM or SIGINT and its checkpoint. Under torchrun the shell gets
    torchrun's status instead (1 when a rank failed); its report shows each rank's status and the
    error line."""
    caller_group = dist.is_initialized()  # then the caller also destroys it
    try:
        train(args())
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
