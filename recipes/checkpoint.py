"""Checkpoints with torch.distributed.checkpoint: model, optimizers, schedulers, step, RNG.

Model and optimizer state are saved as sharded DTensors, so a checkpoint written at one world
size loads at another. The data position is the step number (batches are a function of it).
"""

from __future__ import annotations

from pathlib import Path

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


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``run_dir`` (DCP writes ``.metadata`` last)."""
    done = sorted(p.parent for p in (Path(run_dir) / "checkpoints").glob("step_*/.metadata"))
    return done[-1] if done else None


def _state(model: nn.Module, optimizers: list, schedulers: list, step: int) -> dict:
    return {
        "model": get_model_state_dict(model),
        "optimizers": [get_optimizer_state_dict(model, opt) for opt in optimizers],
        "schedulers": [s.state_dict() for s in schedulers],
        "step": step,
        "rng": torch.get_rng_state(),
    }


def save(path: str | Path, model: nn.Module, optimizers: list, schedulers: list, step: int) -> None:
    dcp.save(_state(model, optimizers, schedulers, step), checkpoint_id=str(path))


def load(path: str | Path, model: nn.Module, optimizers: list, schedulers: list) -> int:
    """Restore everything in place; returns the step to continue from."""
    state = _state(model, optimizers, schedulers, 0)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    for opt, opt_state in zip(optimizers, state["optimizers"]):
        set_optimizer_state_dict(model, opt, opt_state)
    for scheduler, sched_state in zip(schedulers, state["schedulers"]):
        scheduler.load_state_dict(sched_state)
    torch.set_rng_state(state["rng"])
    return int(state["step"])
