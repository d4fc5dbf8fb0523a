"""Float64, single-process reference Muon written from the formulas, independent of dmuon_fsdp."""

from __future__ import annotations

import math

import torch


def reference_orthogonalize(m: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    x = m.double().reshape(m.shape[0], -1)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / max(x.norm().item(), eps)
    triples = [coefficients] if isinstance(coefficients[0], (int, float)) else list(coefficients)
    for i in range(steps):
        a, b, c = triples[min(i, len(triples) - 1)]
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


KELLER = (3.4445, -4.7750, 2.0315)


def reference_muon_step(
    param,
    grad,
    buf,
    *,
    lr,
    momentum=0.95,
    nesterov=True,
    weight_decay=0.0,
    coefficients=KELLER,
    steps=5,
    eps=1e-7,
    adjust_lr_fn=None,
    second_moment=None,
    normuon_beta2=0.95,
    normuon_eps=1e-8,
    row_factors=None,
):
    """One Muon step on float64 full tensors, in place on ``param`` and ``buf`` (the defaults are
    torch.optim.Muon's, weight decay aside). With ``second_moment`` (one number per row of the
    matrix, updated in place), NorMuon's step: each row of the orthogonalized matrix O divided
    by sqrt(v) + eps, the result rescaled to O's Frobenius norm. With ``row_factors`` (a function
    of O giving one number per row), each row of O is scaled by its number."""
    buf.mul_(momentum).add_(grad, alpha=1 - momentum)
    update = grad + momentum * (buf - grad) if nesterov else buf
    ortho = reference_orthogonalize(update, coefficients, steps, eps)
    if second_moment is not None:
        v = second_moment.view(-1)
        v.mul_(normuon_beta2).add_(ortho.square().mean(dim=1), alpha=1 - normuon_beta2)
        normalized = ortho / (v.sqrt() + normuon_eps)[:, None]
        size = normalized.norm().item()
        ortho = normalized * (ortho.norm().item() / size) if size > 0 else normalized
    if row_factors is not None:
        ortho = ortho * row_factors(ortho)[:, None]
    rows, cols = ortho.shape
    if adjust_lr_fn == "match_rms_adamw":
        scale = 0.2 * math.sqrt(max(rows, cols))
    else:
        scale = math.sqrt(max(1.0, rows / cols))
    param.mul_(1 - lr * weight_decay)
    param.sub_(lr * scale * ortho.reshape(param.shape))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    diff = (actual.double() - expected).norm().item()
    norm = expected.norm().item()
    return diff / norm if norm > 0 else diff
