"""Checks on gradients before a step, agreed on by every rank so that no rank waits alone.

Nothing here is a collective of its own on the hot path: each rank's findings ride in the
step's first all-to-all as ``FLAG_ELEMENTS`` numbers per peer (``flag_values`` and
``nonfinite_indicator``), and one read of their maximum over the ranks tells every rank the same
``Verdict``: go on, skip the step, rebuild the plan (every rank's gradients or group options
changed in the same way), or explain. Only to explain does a second collective share each
rank's per-parameter findings (``explain``), so that every rank raises the same error naming
parameters and ranks.

Flags, per rank: [invalid, non-finite, d0..d3, -d0..-d3] where invalid is 1 for a sparse or
misshapen gradient or a parameter whose layout changed, non-finite is 1 when a gradient holds
inf or NaN, and d0..d3 are the bytes of a digest of which parameters have gradients, the Muon
groups' structural options and whether flags travel: the maximum of d and of -d agree only if
every rank sent the same d. Integers up to 255 are exact in every float dtype the exchange may
use (fp16, bf16, fp32, fp64).
"""

from __future__ import annotations

import enum
import math
import zlib
from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon_fsdp import comm
from dmuon_fsdp.layouts import local_shard
from dmuon_fsdp.planner import Plan
from dmuon_fsdp.program import StepProgram
from dmuon_fsdp.schedule import FLAG_ELEMENTS

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


class Verdict(enum.Enum):
    GO = "go"
    SKIP = "skip"  # a non-finite gradient somewhere, nonfinite="skip"
    REBUILD = "rebuild"  # every rank's key changed the same way: build the new plan, run again
    EXPLAIN = "explain"  # something is wrong: every rank calls ``explain`` and raises


def digest(key: object) -> int:
    """32-bit checksum of a step key (has-gradient bits and group options), the same on every rank."""
    return zlib.crc32(repr(key).encode())


def flag_values(invalid: bool, key_digest: int) -> list[float]:
    """This rank's flags, with 0 in the non-finite slot (``nonfinite_indicator`` fills it)."""
    digits = [(key_digest >> (8 * i)) & 255 for i in range(4)]
    values = [float(invalid), 0.0] + [float(d) for d in digits] + [-float(d) for d in digits]
    assert len(values) == FLAG_ELEMENTS
    return values


def nonfinite_indicator(grads: list[Tensor], found: Tensor, one: Tensor) -> Tensor:
    """``found`` (a 1-element float32 tensor) <- 1 when some gradient holds inf or NaN, else 0;
    device ops only. The check is torch's own for AMP (``GradScaler``'s kernel, one pass over
    the gradients) with a scale of ``one`` (1.0): it multiplies each gradient by 1.0 in place,
    which changes no value, so gradients must be writable (as after backward)."""
    found.zero_()
    if grads:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
    return found


def report(prog: StepProgram, key: tuple, local: list[Tensor] | None, nonfinite: str) -> Tensor | None:
    """This rank's findings into the program's first exchange (device ops only): its normal
    flags, or what differs here (``local`` None: invalid gradients; another key). Returns the
    non-finite indicator when that check is on."""
    indicator = None
    if nonfinite != "ignore" and local is not None:
        indicator = nonfinite_indicator(local, prog.found, prog.one)
    if prog.flags is not None:
        values = prog.flags.values
        if local is None or key != prog.key:
            found = flag_values(key == prog.key, digest(key))
            values = torch.tensor(found, dtype=values.dtype, device=values.device)
        prog.write_flags(values, indicator)
    return indicator


def verdict(prog: StepProgram, receive: Tensor | None, local: list[Tensor] | None, indicator: Tensor | None,
            nonfinite: str, check_grads: bool) -> Verdict:  # fmt: skip
    """The step's verdict, the same on every rank, from at most one device-to-host read: the
    maximum of every rank's flags (``receive``, the first exchange's buffer) or, without flags,
    this rank's own findings."""
    if receive is not None:
        summary = prog.flag_summary(receive)
    else:
        summary = flag_values(local is None, prog.digest)
        if indicator is not None:
            summary[1] = indicator.item()
    return decide(summary, prog.digest, nonfinite, check_grads)


def decide(summary: list[float], key_digest: int, nonfinite: str, check_grads: bool) -> Verdict:
    """The verdict from the element-wise maximum of every rank's flags (the same everywhere)."""
    high, low = summary[2:6], [-v for v in summary[6:10]]
    if summary[0] > 0 or (check_grads and high != low):
        return Verdict.EXPLAIN
    if check_grads and sum(int(d) << (8 * i) for i, d in enumerate(high)) != key_digest:
        return Verdict.REBUILD
    if summary[1] > 0:  # some rank has a non-finite gradient
        return {"raise": Verdict.EXPLAIN, "skip": Verdict.SKIP}.get(nonfinite, Verdict.GO)
    return Verdict.GO


def agree_on_plan(trouble: bool, key_digest: int, plan: Plan, group: dist.ProcessGroup, device: torch.device,
                  compare: bool) -> bool:  # fmt: skip
    """When a plan is (re)built: one ``all_reduce`` telling every rank whether any rank found
    ``trouble`` or, with ``compare``, a different step key (then every rank should ``explain``).
    With ``compare``, raises ValueError on every rank when the ranks built different plans."""
    signature = plan.signature() if compare else 0
    key_digest = key_digest if compare else 0
    values = [int(trouble), key_digest, -key_digest, signature, -signature]
    agreed = comm.all_max(torch.tensor(values, dtype=torch.int64, device=device), group).tolist()
    if agreed[0] or agreed[1] != -agreed[2]:
        return True
    if agreed[3] != -agreed[4]:
        raise ValueError(
            f"the {plan.world_size} ranks exchanging Muon matrices built different plans: their Muon "
            "parameters (shapes, placements or group options) differ. Plain tensors under a "
            "process group are treated as replicated on every rank (DDP)"
        )
    return False


def gradient_codes(params: list[Tensor], relayouted: Collection[Tensor], nonfinite: str) -> list[int]:
    """This rank's findings, one bit set per parameter (a rare path: reads every gradient)."""
    codes = []
    for p in params:
        code = RELAYOUT if p in relayouted else 0
        if p.grad is not None:
            code |= HAS_GRAD
            if p.grad.layout != torch.strided:
                code |= SPARSE
            elif local_shard(p.grad).shape != local_shard(p).shape:
                code |= MISSHAPEN
        codes.append(code)
    if nonfinite != "ignore" and not any(code & INVALID_BITS for code in codes):
        checked = [i for i, code in enumerate(codes) if code & HAS_GRAD and local_shard(params[i].grad).numel()]
        if checked:
            norms = torch._foreach_norm([local_shard(params[i].grad) for i in checked], math.inf)
            for i, bad in zip(checked, (~torch.stack(norms).isfinite()).tolist()):
                codes[i] |= NONFINITE if bad else 0
    return codes


def explain(
    params: list[Tensor],
    names: dict[Tensor, str],
    group: dist.ProcessGroup | None,
    nonfinite: str,
    relayouted: Collection[Tensor] = (),
) -> None:
    """Share every rank's per-parameter findings (one ``all_reduce``) and raise, on every rank
    alike: ValueError for sparse or misshapen gradients and relayouted parameters,
    GradientMismatchError when ranks disagree on which parameters have gradients,
    NonFiniteGradientError for inf/NaN unless ``nonfinite`` is "skip" or "ignore". Returns when
    there is nothing of these to report."""
    codes = gradient_codes(params, relayouted, nonfinite)
    device = params[0].device if params else torch.device("cpu")
    table = [codes] if group is None else comm.all_rows(torch.tensor(codes, dtype=torch.int32, device=device), group).tolist()
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
