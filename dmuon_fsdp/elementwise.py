"""Element-wise optimizer math on local shards: Muon momentum and AdamW. No communication."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def muon_momentum(
    grads: list[Tensor], buffers: list[Tensor], momentum: float, nesterov: bool
) -> list[Tensor]:
    """``buf <- lerp(buf, grad, 1 - momentum)`` in place; returns the tensors to orthogonalize.

    With Nesterov the update is ``lerp(grad, buf, momentum)``, as in ``torch.optim.Muon``.
    """
    torch._foreach_lerp_(buffers, grads, 1.0 - momentum)
    if nesterov:
        return list(torch._foreach_lerp(grads, buffers, momentum))
    return buffers


def adamw(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step per tensor, with the same formula and bias correction as torch.optim.AdamW."""
    beta1, beta2 = betas
    for param, grad, exp_avg, exp_avg_sq, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        step += 1
        t = step.item()
        param.mul_(1.0 - lr * weight_decay)
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2**t)).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta1**t))
