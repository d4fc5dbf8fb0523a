"""Checks before a step commits anything, agreed on by every rank so that no rank waits alone.

A step is identified by its ``StepKey``: which parameters have gradients, the Muon groups'
structural options and whether check flags travel. Nothing here is a collective of its own on
the hot path: each rank ``encode``s its findings as ``FLAG_ELEMENTS`` numbers that ride in the
step's first all-to-all (its last, for a step begun in backward), one per peer, and ``decide``
turns their element-wise maximum over the ranks into the same ``Verdict`` everywhere: go on,
skip the step, rebuild (every rank's key changed the same way), redo the step from the start (a
step begun in backward whose gradients changed afterwards, see ``dmuon_fsdp.backward``), or
explain (``dmuon_fsdp.errors``: the errors every rank raises alike, and the one ``all_reduce``
that agrees on a plan when a program is built).

Flags, per rank: [invalid, non-finite, redo, d0..d3, -d0..-d3]. Invalid is 1 for a sparse or
misshapen gradient or a parameter whose layout changed; non-finite is 1 when a gradient holds inf
or NaN; redo is 1 when gradients changed after backward began working on them;
d0..d3 are the bytes of the key's digest: the maxima of d and of -d agree only if every rank sent
the same d. Integers up to 255 are exact in every float dtype the exchange may use.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from dmuon_fsdp import comm
from dmuon_fsdp.layouts import local_shard
from dmuon_fsdp.neurons import STATE_KEY

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
    "variant",
    "normuon_beta2",
    "normuon_eps",
)

# Per-step options that every rank must step with alike (read at every step, so not in the key):
# checked through the flags too, without a rebuild when they change alike (a scheduler's lr).
HYPER = {True: ("lr", "momentum", "nesterov", "weight_decay"), False: ("lr", "betas", "eps", "weight_decay")}

FLAG_ELEMENTS = 11  # check elements per peer in the exchange that carries them
INVALID_SLOT, NONFINITE_SLOT, REDO_SLOT = 0, 1, 2  # then the digest's four bytes, then their negations

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
    REDO = "redo"  # gradients changed after backward started the step: run it again from them


def frozen(value: Any) -> Any:
    return tuple(frozen(v) for v in value) if isinstance(value, list) else value


@dataclass(frozen=True)
class StepKey:
    """What a step program is built for; two steps with equal keys run the same program."""

    has_grad: tuple[bool, ...]  # per optimizer parameter, in optimizer order
    options: tuple[tuple[Any, ...], ...]  # per Muon group, its ``STRUCTURAL`` values
    flags: bool  # whether check flags travel (with a check on)

    @classmethod
    def of(cls, groups: Sequence[dict[str, Any]], grads: Sequence[Tensor | None], flags: bool) -> StepKey:
        options = tuple(tuple(frozen(g[k]) for k in STRUCTURAL) for g in groups if g["use_muon"])
        return cls(tuple(g is not None for g in grads), options, flags)

    @cached_property
    def digest(self) -> int:
        """32-bit checksum, the same on every rank for equal keys."""
        return zlib.crc32(repr((self.has_grad, self.options, self.flags)).encode())


def _hyper(groups: Sequence[dict[str, Any]]) -> Iterator[tuple[int, str, Any]]:
    """(group index, option, value) of every group's per-step options (``HYPER``), betas split."""
    for g, group in enumerate(groups):
        for key in HYPER[group["use_muon"]]:
            if key == "betas":
                yield from ((g, f"{key}[{i}]", beta) for i, beta in enumerate(group[key]))
            else:
                yield g, key, group[key]


def hyper_numbers(groups: Sequence[dict[str, Any]]) -> list[float]:
    """Every group's per-step options as numbers, in group order."""
    return [float(value) for _, _, value in _hyper(groups)]


def hyper_labels(groups: Sequence[dict[str, Any]]) -> list[str]:
    """What each of ``hyper_numbers`` is, for messages."""
    return [f"param group {g}'s {key}" for g, key, _ in _hyper(groups)]


def hyper_digest(groups: Sequence[dict[str, Any]]) -> int:
    """32-bit checksum of the per-step options; it travels XORed into the key's digest (``encode``),
    so ranks that step with different options disagree on the digest and explain."""
    return zlib.crc32(repr(hyper_numbers(groups)).encode())


def key_agreement(key_digest: int, group: Any, device: torch.device) -> comm.Handle:
    """Start agreeing on the step key before a step (only while keys alternate, see
    ``dmuon_fsdp.build.ProgramCache``): one ``all_reduce`` of 16 bytes; ``agreed`` reads it."""
    return comm.start_max(torch.tensor([key_digest, -key_digest], dtype=torch.int64, device=device), group)


def agreed(agreement: comm.Handle, key_digest: int) -> bool:
    """Whether every rank steps with the key of ``key_digest`` (one host read)."""
    high, low = agreement.wait().tolist()
    return high == -low == key_digest


def encode(key_digest: int, invalid: bool, redo: bool = False) -> list[float]:
    """This rank's flags, with 0 in the non-finite slot (``nonfinite_indicator`` fills it);
    ``key_digest`` is the step key's digest XOR ``hyper_digest``."""
    digits = [float((key_digest >> (8 * i)) & 255) for i in range(4)]
    return [float(invalid), 0.0, float(redo), *digits, *(-d for d in digits)]


def decide(summary: Sequence[float], key_digest: int, nonfinite: str, check_grads: bool) -> Verdict:
    """The verdict from the element-wise maximum of every rank's flags (the same everywhere)."""
    high, low = summary[3:7], [-v for v in summary[7:11]]
    if summary[INVALID_SLOT] > 0 or (check_grads and high != low):
        return Verdict.EXPLAIN
    if check_grads and sum(int(d) << (8 * i) for i, d in enumerate(high)) != key_digest:
        return Verdict.REBUILD
    if summary[REDO_SLOT] > 0:  # the step's work began on gradients some rank has since seen change
        return Verdict.REDO
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


@dataclass
class Flags:
    """Where the flags sit in the buffers of the exchange carrying them: (peers, FLAG_ELEMENTS),
    at the head of every segment (``dmuon_fsdp.schedule``), and this rank's flags when nothing is
    wrong here (``values``, comm dtype, on the device) for the digest they were made for: made
    anew only when the per-step options change (``hyper_digest``)."""

    send: Tensor
    receive: Tensor
    nonfinite: Tensor  # the non-finite slot of each send segment: (peers,)
    redo: Tensor  # and the redo slot
    dtype: torch.dtype  # the exchange's
    digest: int = -1
    values: Tensor | None = None

    @classmethod
    def bind(cls, carrier: comm.Exchange) -> Flags:
        """The flags' positions in ``carrier`` (written at each step: binding writes nothing)."""
        device = carrier.send.device

        def heads(counts: list[int]) -> Tensor:
            starts = torch.tensor([sum(counts[:g]) for g in range(len(counts))], dtype=torch.int64)
            return (starts[:, None] + torch.arange(FLAG_ELEMENTS)).to(device)

        send = heads(carrier.send_counts)
        slot = {
            name: send[:, i].contiguous() for name, i in (("nonfinite", NONFINITE_SLOT), ("redo", REDO_SLOT))
        }
        return cls(send, heads(carrier.receive_counts), slot["nonfinite"], slot["redo"], carrier.send.dtype)

    def values_for(self, digest: int) -> Tensor:
        """This rank's flags for ``digest`` with nothing wrong here (the last ones, when unchanged)."""
        if digest != self.digest:
            values = torch.tensor(encode(digest, invalid=False), dtype=self.dtype)
            if self.send.device.type != "cpu":  # pinned, so that the copy does not block the host
                values = values.pin_memory().to(self.send.device, non_blocking=True)
            self.digest, self.values = digest, values
        return self.values


def stale_layouts(params: Sequence[Tensor], state: Any) -> set[Tensor]:
    """Parameters whose local shard no longer matches their state (resharded or resized); NorMuon's
    second moments match the local shard's leading (row) dims."""

    def matches(key: str, value: Tensor, local: Tensor) -> bool:
        shape = local_shard(value).shape
        return key == "step" or shape == (local.shape[: len(shape)] if key == STATE_KEY else local.shape)

    return {p for p in params if not all(matches(k, v, local_shard(p)) for k, v in state[p].items())}
