"""Checks on gradients before a step, agreed on by every rank so that no rank waits alone.

One ``all_reduce`` of four integers per step carries every question: is any rank's gradient
invalid (sparse, misshapen) or non-finite, and do all ranks agree on which parameters have
gradients (a rank that has a gradient the others lack would otherwise enter exchanges they never
join, and hang). Details for the error message are gathered only when something is wrong, and
every rank raises the same error.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from dmuon_fsdp import comm

NONFINITE_POLICIES = ("raise", "skip", "ignore")


class GradientMismatchError(RuntimeError):
    """Ranks disagree on which parameters have a gradient this step."""


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds inf or NaN (with ``nonfinite="raise"``)."""


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nonfinite(grads: list[Tensor]) -> list[bool]:
    if not grads:
        return []
    norms = torch._foreach_norm([g.float() if not g.is_floating_point() else g for g in grads])
    return (~torch.stack(norms).isfinite()).tolist()


def check_gradients(
    params: list[Tensor],
    names: dict[Tensor, str],
    group: dist.ProcessGroup | None,
    nonfinite: str,
    verify_agreement: bool,
    invalid: list[str] | None = None,
) -> bool:
    """Validate this step's gradients on every rank; False means skip the step everywhere.

    Raises, on every rank alike, ValueError for sparse gradients and gradients shaped unlike
    their parameter, GradientMismatchError when ranks disagree on which parameters have
    gradients, and NonFiniteGradientError for inf/NaN when ``nonfinite == "raise"``. ``invalid``
    carries the caller's own findings (one message each), raised the same way.
    """
    with_grad = [p for p in params if p.grad is not None]
    invalid = list(invalid or [])
    for p in with_grad:
        if p.grad.layout != torch.strided:
            invalid.append(f"{names[p]}: sparse gradients are not supported ({p.grad.layout})")
        elif _local(p.grad).shape != _local(p).shape:
            invalid.append(
                f"{names[p]}: gradient shard {tuple(_local(p.grad).shape)} does not match the "
                f"parameter shard {tuple(_local(p).shape)}"
            )
    bad = []
    if nonfinite != "ignore" and not invalid:
        flags = _nonfinite([_local(p.grad) for p in with_grad])
        bad = [names[p] for p, flag in zip(with_grad, flags) if flag]
    if group is None or (not verify_agreement and nonfinite == "ignore"):
        # Nothing to agree on (with both checks off, a local error may leave other ranks waiting).
        if invalid:
            raise ValueError("; ".join(invalid))
        return _decide(bad, nonfinite)
    mask = bytes(p.grad is not None for p in params)
    digest = zlib.crc32(mask) if verify_agreement else 0
    device = params[0].device if params else torch.device("cpu")
    local = torch.tensor([int(bool(invalid)), int(bool(bad)), digest, -digest], device=device)
    flags = comm.all_max(local, group).tolist()
    mismatch = flags[2] != -flags[3]
    if not (flags[0] or flags[1] or mismatch):
        return True
    reports = comm.all_gather_objects((invalid, mask, bad), group)
    if flags[0]:
        raise ValueError("; ".join(f"rank {r}: {msg}" for r, (msgs, _, _) in enumerate(reports) for msg in msgs))
    if mismatch:
        raise GradientMismatchError(_mismatch_message(params, names, [m for _, m, _ in reports]))
    return _decide([f"{name} (rank {r})" for r, (_, _, names_) in enumerate(reports) for name in names_], nonfinite)


def _decide(bad: list[str], nonfinite: str) -> bool:
    if bad and nonfinite == "raise":
        raise NonFiniteGradientError(
            f"non-finite gradient in {', '.join(bad)}; pass nonfinite='skip' to skip such steps"
        )
    return not (bad and nonfinite == "skip")


def _mismatch_message(params: list[Tensor], names: dict[Tensor, str], masks: list[bytes]) -> str:
    lines = []
    for i, p in enumerate(params):
        have = [r for r, m in enumerate(masks) if m[i]]
        if 0 < len(have) < len(masks):
            lacking = [r for r in range(len(masks)) if r not in have]
            lines.append(f"{names[p]}: gradient on ranks {have}, None on ranks {lacking}")
    return (
        "ranks disagree on which parameters have gradients, so their exchanges would not match: "
        + "; ".join(lines)
        + ". Every rank must run backward through the same parameters (or set the same grads to None)."
    )
