"""Checks on gradients before a step, agreed on by every rank so that no rank waits alone.

One ``all_reduce`` of four integers per step carries every question: is any rank's gradient
invalid (sparse, misshapen, or its parameter resharded under the optimizer) or non-finite, and
do all ranks agree on which parameters have gradients (a rank that has a gradient the others
lack would otherwise enter exchanges they never join, and hang). Only when something is wrong
does a second ``all_reduce`` share each rank's per-parameter findings, so that every rank raises
the same error naming parameters and ranks.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon_fsdp import comm

NONFINITE_POLICIES = ("raise", "skip", "ignore")

HAS_GRAD, NONFINITE, SPARSE, MISSHAPEN, RELAYOUT = 1, 2, 4, 8, 16
INVALID = {
    SPARSE: ": sparse gradients are not supported",
    MISSHAPEN: ": its gradient shard does not match the parameter shard",
    RELAYOUT: " changed layout after the optimizer was built: its optimizer state no longer matches "
    "the parameter's local shard",
}
INVALID_BITS = SPARSE | MISSHAPEN | RELAYOUT


class GradientMismatchError(RuntimeError):
    """Ranks disagree on which parameters have a gradient this step."""


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds inf or NaN (with ``nonfinite="raise"``)."""


def _codes(params: list[Tensor], relayouted: Collection[Tensor], nonfinite: str) -> list[int]:
    """This rank's findings, one bit set per parameter."""
    codes = []
    for p in params:
        code = RELAYOUT if p in relayouted else 0
        if p.grad is not None:
            code |= HAS_GRAD
            if p.grad.layout != torch.strided:
                code |= SPARSE
            elif comm.local_shard(p.grad).shape != comm.local_shard(p).shape:
                code |= MISSHAPEN
        codes.append(code)
    if nonfinite != "ignore" and not any(code & INVALID_BITS for code in codes):
        checked = [i for i, code in enumerate(codes) if code & HAS_GRAD]
        if checked:
            norms = torch._foreach_norm([comm.local_shard(params[i].grad) for i in checked])
            for i, bad in zip(checked, (~torch.stack(norms).isfinite()).tolist()):
                codes[i] |= NONFINITE if bad else 0
    return codes


def check_gradients(
    params: list[Tensor],
    names: dict[Tensor, str],
    group: dist.ProcessGroup | None,
    nonfinite: str,
    verify_agreement: bool,
    relayouted: Collection[Tensor] = (),
) -> bool:
    """Validate this step's gradients on every rank; False means skip the step everywhere.

    Raises, on every rank alike, ValueError for sparse or misshapen gradients and for parameters
    in ``relayouted``, GradientMismatchError when ranks disagree on which parameters have
    gradients, and NonFiniteGradientError for inf/NaN when ``nonfinite == "raise"``.
    """
    codes = _codes(params, relayouted, nonfinite)
    invalid = any(code & INVALID_BITS for code in codes)
    bad = any(code & NONFINITE for code in codes)
    if group is None or (not verify_agreement and nonfinite == "ignore"):
        # Nothing to agree on (with both checks off, a local error may leave other ranks waiting).
        return _verdict([codes], params, names, nonfinite)
    digest = zlib.crc32(bytes(code & HAS_GRAD for code in codes)) if verify_agreement else 0
    device = params[0].device if params else torch.device("cpu")
    flags = comm.all_max(torch.tensor([int(invalid), int(bad), digest, -digest], device=device), group).tolist()
    if not (flags[0] or flags[1] or flags[2] != -flags[3]):
        return True
    table = comm.all_rows(torch.tensor(codes, dtype=torch.int32, device=device), group).tolist()
    return _verdict(table, params, names, nonfinite)


def _verdict(table: list[list[int]], params: list[Tensor], names: dict[Tensor, str], nonfinite: str) -> bool:
    """Raise or decide from every rank's codes (``table[rank][param]``)."""
    prefix = (lambda rank: f"rank {rank}: ") if len(table) > 1 else (lambda rank: "")
    invalid = [f"{prefix(r)}{names[params[i]]}{reason}" for r, row in enumerate(table)
               for i, code in enumerate(row) for bit, reason in INVALID.items() if code & bit]  # fmt: skip
    if invalid:
        raise ValueError("; ".join(invalid))
    lines = []
    for i, p in enumerate(params):
        have = [r for r, row in enumerate(table) if row[i] & HAS_GRAD]
        if 0 < len(have) < len(table):
            lacking = [r for r in range(len(table)) if r not in have]
            lines.append(f"{names[p]}: gradient on ranks {have}, None on ranks {lacking}")
    if lines:
        raise GradientMismatchError(
            "ranks disagree on which parameters have gradients, so their exchanges would not match: "
            + "; ".join(lines)
            + ". Every rank must run backward through the same parameters (or set the same grads to None)."
        )
    bad = [f"{names[params[i]]} (rank {r})" for r, row in enumerate(table) for i, code in enumerate(row) if code & NONFINITE]
    if bad and nonfinite == "raise":
        raise NonFiniteGradientError(f"non-finite gradient in {', '.join(bad)}; pass nonfinite='skip' to skip such steps")
    return not (bad and nonfinite == "skip")
