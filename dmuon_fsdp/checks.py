"""Checks before a step commits anything, agreed on by every rank so that no rank waits alone.

A step is identified by its ``StepKey``: which parameters have gradients, the Muon groups'
structural options and whether check flags travel. Nothing here is a collective of its own on
the hot path: each rank ``encode``s its findings as ``FLAG_ELEMENTS`` numbers that ride in the
step's first all-to-all, one per peer, and ``decide`` turns their element-wise maximum over the
ranks into the same ``Verdict`` everywhere: go on, skip the step, rebuild (every rank's key
changed the same way), or explain. Only to explain does ``explain`` share each rank's
per-parameter findings (a second collective), so that every rank raises the same error naming
parameters and ranks. When a program is built, ``agree_on_plan`` is the one ``all_reduce``.

Flags, per rank: [invalid, non-finite, d0..d3, -d0..-d3]. Invalid is 1 for a sparse or misshapen
gradient or a parameter whose layout changed; non-finite is 1 when a gradient holds inf or NaN;
d0..d3 are the bytes of the key's digest: the maxima of d and of -d agree only if every rank sent
the same d. Integers up to 255 are exact in every float dtype the exchange may use.
"""

from __future__ import annotations

import enum
import math
import zlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon_fsdp import comm
from dmuon_fsdp.layouts import local_shard

NONFINITE_POLICIES = ("raise", "skip", "ignore")

# Muon group options built into a step program: changing one rebuilds it.
STRUCTURAL = (
    "ns_steps",
    "ns_coefficients",
    "ns_algorithm",
    "eps",
    "adjust_lr_fn",
    "flatten",
    "split_sizes",
    "num_heads",
)

FLAG_ELEMENTS = 10  # check elements per peer in the first exchange
INVALID_SLOT, NONFINITE_SLOT = 0, 1  # then the digest's four bytes, then their negations

HAS_GRAD, NONFINITE, SPARSE, MISSHAPEN, STALE_LAYOUT, MISTYPED = 1, 2, 4, 8, 16, 32
INVALID = {
    SPARSE: ": sparse gradients are not supported",
    MISSHAPEN: ": its gradient shard does not match the parameter shard",
    MISTYPED: ": its gradient's dtype is not the parameter's (a grad_dtype other than the parameter's)",
    STALE_LAYOUT: " changed layout after the optimizer was built: its optimizer state no longer matches "
    "the parameter's local shard",
}
INVALID_BITS = SPARSE | MISSHAPEN | STALE_LAYOUT | MISTYPED


class GradientMismatchError(RuntimeError):
    """Ranks disagree on which parameters have a gradient this step."""


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds inf or NaN (with ``nonfinite="raise"``)."""


class Verdict(enum.Enum):
    GO = "go"
    SKIP = "skip"  # a non-finite gradient somewhere, nonfinite="skip"
    REBUILD = "rebuild"  # every rank's key changed the same way: build the new program, run again
    EXPLAIN = "explain"  # something is wrong: every rank calls ``explain`` and raises


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


@dataclass(frozen=True)
class StepKey:
    """What a step program is built for; two steps with equal keys run the same program."""

    has_grad: tuple[bool, ...]  # per optimizer parameter, in optimizer order
    options: tuple[tuple[Any, ...], ...]  # per Muon group, its ``STRUCTURAL`` values
    flags: bool  # whether check flags travel in the first exchange

    @classmethod
    def of(cls, groups: Sequence[dict[str, Any]], grads: Sequence[Tensor | None], flags: bool) -> StepKey:
        options = tuple(tuple(_frozen(g[k]) for k in STRUCTURAL) for g in groups if g["use_muon"])
        return cls(tuple(g is not None for g in grads), options, flags)

    @cached_property
    def digest(self) -> int:
        """32-bit checksum, the same on every rank for equal keys."""
        return zlib.crc32(repr((self.has_grad, self.options, self.flags)).encode())


def build_now(built: StepKey | None, key: StepKey, agreeing: bool) -> bool:
    """Whether to build a program for ``key`` before the step runs. With nothing built, or a
    changed key, yes, unless the built program carries flags (``agreeing``): then it runs once
    more, its flags tell every rank of the change, and all rebuild together (``Verdict.REBUILD``)."""
    return built is None or (key != built and not agreeing)


def encode(key_digest: int, invalid: bool) -> list[float]:
    """This rank's flags, with 0 in the non-finite slot (``nonfinite_indicator`` fills it)."""
    digits = [float((key_digest >> (8 * i)) & 255) for i in range(4)]
    return [float(invalid), 0.0, *digits, *(-d for d in digits)]


def decide(summary: Sequence[float], key_digest: int, nonfinite: str, check_grads: bool) -> Verdict:
    """The verdict from the element-wise maximum of every rank's flags (the same everywhere)."""
    high, low = summary[2:6], [-v for v in summary[6:10]]
    if summary[INVALID_SLOT] > 0 or (check_grads and high != low):
        return Verdict.EXPLAIN
    if check_grads and sum(int(d) << (8 * i) for i, d in enumerate(high)) != key_digest:
        return Verdict.REBUILD
    if summary[NONFINITE_SLOT] > 0:  # some rank has a non-finite gradient
        return {"raise": Verdict.EXPLAIN, "skip": Verdict.SKIP}.get(nonfinite, Verdict.GO)
    return Verdict.GO


def nonfinite_indicator(grads: list[Tensor], found: Tensor, one: Tensor) -> Tensor:
    """``found`` (a 1-element float32 tensor) <- 1 when some gradient holds inf or NaN, else 0;
    device ops only. The check is torch's own for AMP (``GradScaler``'s kernel, one pass over
    the gradients) with a scale of ``one`` (1.0): it multiplies each gradient by 1.0 in place,
    which changes no value, so gradients must be writable (as after backward)."""
    found.zero_()
    if grads:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
    return found


def stale_layouts(params: Sequence[Tensor], state: Any) -> set[Tensor]:
    """Parameters whose local shard no longer matches their state (resharded or resized)."""
    return {
        p
        for p in params
        if any(key != "step" and local_shard(v).shape != local_shard(p).shape for key, v in state[p].items())
    }


def agree_on_plan(
    trouble: bool,
    key_digest: int,
    signature: int,
    world_size: int,
    group: dist.ProcessGroup,
    device: torch.device,
    compare: bool,
) -> bool:
    """When a program is built: one ``all_reduce`` telling every rank whether any rank found
    ``trouble`` or, with ``compare``, a different step key (then every rank should ``explain``).
    With ``compare``, raises ValueError on every rank when the ranks built plans with different
    ``signature``s."""
    signature = signature if compare else 0
    key_digest = key_digest if compare else 0
    values = [int(trouble), key_digest, -key_digest, signature, -signature]
    agreed = comm.all_max(torch.tensor(values, dtype=torch.int64, device=device), group).tolist()
    if agreed[0] or agreed[1] != -agreed[2]:
        return True
    if agreed[3] != -agreed[4]:
        raise ValueError(
            f"the {world_size} ranks exchanging Muon matrices built different plans: their Muon "
            "parameters (shapes, placements or group options) differ. Plain tensors under a "
            "process group are treated as replicated on every rank (DDP)"
        )
    return False


def gradient_codes(params: Sequence[Tensor], stale: Collection[Tensor], nonfinite: str) -> list[int]:
    """This rank's findings, one bit set per parameter (a rare path: reads every gradient)."""
    codes = []
    for p in params:
        code = STALE_LAYOUT if p in stale else 0
        if p.grad is not None:
            code |= HAS_GRAD
            if p.grad.layout != torch.strided:
                code |= SPARSE
            elif local_shard(p.grad).shape != local_shard(p).shape:
                code |= MISSHAPEN
            elif p.grad.dtype != p.dtype:
                code |= MISTYPED
        codes.append(code)
    if nonfinite != "ignore" and not any(code & INVALID_BITS for code in codes):
        checked = [
            i for i, code in enumerate(codes) if code & HAS_GRAD and local_shard(params[i].grad).numel()
        ]
        if checked:
            norms = torch._foreach_norm([local_shard(params[i].grad) for i in checked], math.inf)
            for i, bad in zip(checked, (~torch.stack(norms).isfinite()).tolist()):
                codes[i] |= NONFINITE if bad else 0
    return codes


def explain(
    params: Sequence[Tensor],
    names: dict[Tensor, str],
    group: dist.ProcessGroup | None,
    nonfinite: str,
    stale: Collection[Tensor] = (),
) -> NoReturn:
    """Share every rank's per-parameter findings (one ``all_reduce`` over ``group``; None: this
    rank's alone) and raise, on every rank alike: ValueError for sparse or misshapen gradients
    and parameters whose layout changed (``stale``), GradientMismatchError when ranks disagree
    on which parameters have gradients, NonFiniteGradientError for inf/NaN with
    ``nonfinite="raise"``, and otherwise ValueError: the ranks' Muon group options differ (what
    is left when the digests disagree)."""
    codes = gradient_codes(params, stale, nonfinite)
    device = params[0].device if params else torch.device("cpu")
    if group is None:
        table = [codes]
    else:
        table = comm.all_rows(torch.tensor(codes, dtype=torch.int32, device=device), group).tolist()

    def prefix(rank: int) -> str:
        return f"rank {rank}: " if len(table) > 1 else ""

    invalid = [
        f"{prefix(r)}{names[params[i]]}{reason}"
        for r, row in enumerate(table)
        for i, code in enumerate(row)
        for bit, reason in INVALID.items()
        if code & bit
    ]
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
    bad = [
        f"{names[params[i]]} (rank {r})"
        for r, row in enumerate(table)
        for i, code in enumerate(row)
        if code & NONFINITE
    ]
    if bad and nonfinite == "raise":
        raise NonFiniteGradientError(
            f"non-finite gradient in {', '.join(bad)}; pass nonfinite='skip' to skip such steps"
        )
    raise ValueError(
        f"ranks disagree on the Muon param groups' options ({', '.join(STRUCTURAL)}): every rank must pass "
        "the same"
    )
