"""A model and its optimizer through torch.distributed.checkpoint, as training loops save and
resume them: torch's state-dict helpers, then DCP (every rank of the job takes part)."""

from __future__ import annotations

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


def save(model, opt, path: str) -> None:
    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
        checkpoint_id=path,
    )


def load(model, opt, path: str) -> None:
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
