"""The errors every rank raises alike. Flags (``dmuon_fsdp._step.flags``) only say *that*
something is wrong somewhere; to say what, ``raise_alike`` shares each rank's per-parameter
findings (a second collective, on the rare path) so that every rank raises the same error naming
parameters and ranks. ``agree_on_plan`` is the one ``all_reduce`` when a program is built
(trouble anywhere, and with ``check_grads`` that every rank built the same plan).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon_fsdp._step import comm
from dmuon_fsdp._step.flags import frozen, hyper_labels, hyper_numbers
from dmuon_fsdp._step.state import local_shard, stale_layouts
from dmuon_fsdp.config import Settings, structural_options
from dmuon_fsdp.routing import group_params

if TYPE_CHECKING:
    from typing_extensions import Unpack

    # A Muon matrix as the plans see it: its name, then whatever else a plan depends on.
    Identity = tuple[str, Unpack[tuple[object, ...]]]

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


ADVICE = (
    "every rank must pass the same parameters, in the same order (names included), with the same shapes, "
    "placements and options; plain tensors under a process group count as replicated (DDP)"
)


def agree_on_plan(
    trouble: bool,
    key_digest: int,
    signature: int,
    identities: Sequence[Identity],
    group: dist.ProcessGroup,
    device: torch.device,
    compare: bool,
) -> bool:
    """When a program is built: one ``all_reduce`` telling every rank whether any rank found
    ``trouble`` or, with ``compare``, a different step key (then every rank should ``raise_alike``).
    With ``compare``, ranks whose plans' ``signature``s differ all raise the same ValueError,
    naming the first Muon matrix whose identity (``identities``: per matrix, its name and what
    else the plan depends on) differs."""
    signature = signature if compare else 0
    key_digest = key_digest if compare else 0
    values = [int(trouble), key_digest, -key_digest, signature, -signature]
    agreed = comm.all_max(torch.tensor(values, dtype=torch.int64, device=device), group).tolist()
    if agreed[0] or agreed[1] != -agreed[2]:
        return True
    if agreed[3] != -agreed[4]:
        _explain_plans(identities, group, device)
    return False


def _rows(
    values: Sequence[float], dtype: torch.dtype, group: dist.ProcessGroup, device: torch.device
) -> list:
    """Every rank's ``values`` (rows in group rank order), also when their lengths differ: the
    lengths travel first, the rows padded to the longest (a rare path: two collectives)."""
    lengths = comm.all_rows(torch.tensor([len(values)], dtype=torch.int64, device=device), group)
    width = int(lengths.max())
    row = torch.zeros(max(width, 1), dtype=dtype, device=device)
    row[: len(values)] = torch.tensor(list(values), dtype=dtype)
    table = comm.all_rows(row, group).tolist()
    return [r[:n] for r, n in zip(table, lengths.flatten().tolist(), strict=True)]


def _text(text: str, group: dist.ProcessGroup, device: torch.device) -> list[str]:
    """Every rank's ``text`` (UTF-8, 400 bytes at most)."""
    rows = _rows(list(text.encode()[:400]), torch.int32, group, device)
    return [bytes(int(b) for b in row).decode(errors="replace") for row in rows]


def _explain_plans(
    identities: Sequence[Identity], group: dist.ProcessGroup, device: torch.device
) -> NoReturn:
    digests = [zlib.crc32(repr(identity).encode()) for identity in identities]
    table = _rows(digests, torch.int64, group, device)
    head = "the ranks exchanging Muon matrices built different plans"
    if len({len(row) for row in table}) > 1:
        counts = ", ".join(f"{len(row)} on rank {r}" for r, row in enumerate(table))
        raise ValueError(f"{head}: they hold different numbers of Muon matrices ({counts}); {ADVICE}")
    differing = [j for j in range(len(digests)) if len({row[j] for row in table}) > 1]
    if not differing:
        raise ValueError(
            f"{head} from the same Muon matrices: ns_dtype, comm_dtype, bucket_bytes, ns_flops_per_byte or "
            f"overlap_backward differ; {ADVICE}"
        )
    j = differing[0]
    labels = _text(identities[j][0], group, device)
    if len(set(labels)) == 1:
        raise ValueError(
            f"{head}: Muon matrix {j} ({labels[0]}) differs in layout or Newton-Schulz form; {ADVICE}"
        )
    which = ", ".join(f"{label} on rank {r}" for r, label in enumerate(labels))
    raise ValueError(f"{head}: Muon matrix {j} is {which}; {ADVICE}")


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
        grads = {i: local_shard(g) for i, p in enumerate(params) if (g := p.grad) is not None}
        checked = [i for i, g in grads.items() if g.numel()]
        if checked:
            norms = torch._foreach_norm([grads[i] for i in checked], math.inf)
            for i, bad in zip(checked, (~torch.stack(norms).isfinite()).tolist(), strict=True):
                codes[i] |= NONFINITE if bad else 0
    return codes


def raise_alike(
    params: Sequence[Tensor],
    names: dict[Tensor, str],
    groups: Sequence[dict[str, Any]],
    group: dist.ProcessGroup | None,
    nonfinite: str,
    stale: Collection[Tensor] = (),
) -> NoReturn:
    """Share every rank's findings (collectives over ``group``; None: this rank's alone) and
    raise, on every rank alike: ValueError for sparse, misshapen or mistyped gradients and
    parameters whose layout changed (``stale``), GradientMismatchError when ranks disagree on
    which parameters have gradients, NonFiniteGradientError for inf/NaN with
    ``nonfinite="raise"``, ValueError naming a per-step or structural group option the ranks
    disagree on, and otherwise ValueError (the ranks' steps differ in another way)."""
    codes = gradient_codes(params, stale, nonfinite)
    device = params[0].device if params else torch.device("cpu")
    table = [codes] if group is None else _rows(codes, torch.int32, group, device)
    if len({len(row) for row in table}) > 1:
        counts = ", ".join(f"{len(row)} on rank {r}" for r, row in enumerate(table))
        raise ValueError(f"the ranks' optimizers hold different numbers of parameters ({counts}); {ADVICE}")

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
    if group is not None:
        _explain_options(groups, group, device)
    raise ValueError(f"the ranks' steps differ (parameters with gradients or group options); {ADVICE}")


def _explain_options(
    groups: Sequence[dict[str, Any]], group: dist.ProcessGroup, device: torch.device
) -> None:
    """Raise naming the first group option the ranks disagree on: a per-step one with every
    rank's value, else a structural one (returns when they all agree)."""
    hyper = _rows(hyper_numbers(groups), torch.float64, group, device)
    for column, label in enumerate(hyper_labels(groups)):
        values = [row[column] if column < len(row) else None for row in hyper]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"{v:g} on rank {r}" for r, v in enumerate(values) if v is not None)
            raise ValueError(
                f"ranks disagree on {label} ({per_rank}): every rank must step with the same options"
            )
    muon = [(g, options) for g, options in enumerate(groups) if options["use_muon"]]
    keys = structural_options()
    labels = [f"param group {g}'s {key}" for g, _ in muon for key in keys]
    digests = [zlib.crc32(repr(frozen(options[key])).encode()) for _, options in muon for key in keys]
    table = _rows(digests, torch.int64, group, device)
    for column, label in enumerate(labels):
        if len({row[column] if column < len(row) else None for row in table}) > 1:
            raise ValueError(f"ranks disagree on {label}: every rank must pass the same")


def raise_for(
    groups: list[dict[str, Any]], state: Any, names: dict, settings: Settings, shared: bool
) -> NoReturn:
    """Raise the error every rank agrees on (``checks.raise_alike``; a collective when ``shared``)."""
    params = group_params(groups)
    group = settings.site.group.process_group if shared else None
    raise_alike(params, names, groups, group, settings.nonfinite, stale_layouts(params, state))
