"""Checkpoints with torch.distributed.checkpoint: model, optimizers, schedulers, step, RNG.

Model and optimizer state are saved as sharded DTensors, so a checkpoint written at one world
size loads at another. The data position is the step number (batches are a function of it).
A checkpoint is ``<run dir>/checkpoints/step_NNNNNNN``; it is complete once DCP has written its
``.metadata`` (the last file a save writes).
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


class CheckpointError(Exception):
    """A checkpoint that could not be read or written; the message names it and the cause."""


def step_of(path: Path) -> int | None:
    """The step a checkpoint directory holds, from its name ``step_N``; None for other names."""
    digits = path.name.removeprefix("step_")
    return int(digits) if path.name.startswith("step_") and digits.isdigit() else None


def step_number(path: Path) -> int:
    """The step of a path known to be a checkpoint directory (``step_of`` finds one)."""
    step = step_of(path)
    if step is None:
        raise ValueError(f"{path} is not a checkpoint directory (step_N)")
    return step


def is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file()


def all_steps(run_dir: str | Path) -> list[Path]:
    """Every checkpoint directory of a run (named step_N), complete or not, oldest first."""
    found = {
        p: step
        for p in (Path(run_dir) / "checkpoints").glob("step_*")
        if p.is_dir() and (step := step_of(p)) is not None
    }
    return sorted(found, key=found.__getitem__)


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``run_dir``."""
    done = [p for p in all_steps(run_dir) if is_complete(p)]
    return done[-1] if done else None


def prune(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints; returns what was deleted.
    Incomplete ones are left for the user to look at."""
    done = [p for p in all_steps(run_dir) if is_complete(p)]
    old = done[: max(0, len(done) - keep)]
    for path in old:
        shutil.rmtree(path)
    return old


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


ROOM_MARGIN = 1.1  # a checkpoint grows a little from save to save (optimizer state, step counts)


def make_room(run_dir: str | Path, keep: int) -> list[Path]:
    """Before a save under ``--keep-last keep``: when the disk has less free room than the newest
    complete checkpoint takes (with a margin), delete the oldest complete ones down to
    ``keep - 1`` first, so that a disk holding ``keep`` checkpoints suffices; otherwise nothing
    (``prune`` after the save keeps the newest ``keep``, and a failed save loses none). Returns
    what was deleted."""
    done = [p for p in all_steps(run_dir) if is_complete(p)]
    if not keep or len(done) < keep or shutil.disk_usage(done[-1]).free > ROOM_MARGIN * _size(done[-1]):
        return []
    return prune(run_dir, keep - 1)


def _state(model: nn.Module, optimizers: Sequence, schedulers: Sequence, step: int) -> dict:
    return {
        "model": get_model_state_dict(model),
        "optimizers": [get_optimizer_state_dict(model, opt) for opt in optimizers],
        "schedulers": [s.state_dict() for s in schedulers],
        "step": step,
        "rng": torch.get_rng_state(),
    }


def _cause(error: BaseException) -> str:
    """The first line of the first failing rank's error. DCP gathers every rank's failure into a
    CheckpointException (a BaseException) that every rank raises, so all name the same cause."""
    if isinstance(error, dcp.CheckpointException) and error.failures:
        rank, (error, _) = min(error.failures.items())
        cause = f"{type(error).__name__}: {error} (rank {rank})"
    else:
        cause = f"{type(error).__name__}: {error}"
    return cause.splitlines()[0]


def save(path: str | Path, model: nn.Module, optimizers: Sequence, schedulers: Sequence, step: int) -> None:
    """Save with DCP; a failure (a full disk, a directory that cannot be written) is a
    CheckpointError naming the checkpoint and the cause, on every rank. What the failed save
    wrote stays: without .metadata it is incomplete, and a resume skips it."""
    try:
        dcp.save(_state(model, optimizers, schedulers, step), checkpoint_id=str(path))
    except (Exception, dcp.CheckpointException) as error:
        raise CheckpointError(f"checkpoint {path} could not be saved: {_cause(error)}") from error


def _read(state: dict, path: str | Path, **kwargs: Any) -> None:
    """``dcp.load`` into ``state``; any failure becomes a CheckpointError naming the checkpoint
    and the cause."""
    try:
        dcp.load(state, checkpoint_id=str(path), **kwargs)
    except (Exception, dcp.CheckpointException) as error:
        raise CheckpointError(f"checkpoint {path} could not be loaded: {_cause(error)}") from error


def _without_newer_group_options(state: dict, path: str | Path) -> None:
    """Leave out of ``state`` the param-group options the checkpoint predates (``ns_algorithm``
    came after the first checkpoints): the optimizer keeps its own value for them, where DCP
    would refuse the whole checkpoint for a key it lacks."""
    try:
        saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except Exception:
        return  # an unreadable checkpoint: _read names the cause
    for i, opt_state in enumerate(state["optimizers"]):
        for g, group in enumerate(opt_state["param_groups"]):
            for key in [
                k for k in group if f"optimizers.{i}.param_groups.{g}.{k}" not in saved and k != "params"
            ]:
                del group[key]


def load(path: str | Path, model: nn.Module, optimizers: Sequence, schedulers: Sequence) -> int:
    """Restore everything in place; returns the step to continue from. Raises CheckpointError
    for a checkpoint DCP cannot read (a missing or corrupt shard, another model)."""
    state = _state(model, optimizers, schedulers, 0)
    _without_newer_group_options(state, path)
    _read(state, path)
    set_model_state_dict(model, state["model"])
    for opt, opt_state in zip(optimizers, state["optimizers"], strict=True):
        set_optimizer_state_dict(model, opt, opt_state)
    for scheduler, sched_state in zip(schedulers, state["schedulers"], strict=True):
        scheduler.load_state_dict(sched_state)
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def load_model(path: str | Path, model: nn.Module) -> None:
    """Only the model part, into a plain (unsharded) model in one process without a process
    group, whatever number of ranks wrote the checkpoint (DCP reshards on load)."""
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # DCP warns that it loads in a single process: that is the point
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        _read(state, path, no_dist=True)
    model.load_state_dict(state["model"])
