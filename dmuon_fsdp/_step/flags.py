"""The step key and the flags: checks before a step commits anything, agreed on by every rank so
that no rank waits alone.

A step is identified by its ``StepKey``: which parameters have gradients, the Muon groups'
structural options and whether check flags travel. Nothing here is a collective of its own on
the hot path: each rank ``encode``s its findings as ``FLAG_ELEMENTS`` numbers that ride in the
step's first all-to-all (its last, for a step begun in backward), one per peer, and ``decide``
turns their element-wise maximum over the ranks into the same ``Verdict`` everywhere: go on,
skip the step, rebuild (every rank's key changed the same way), redo the step from the start (a
step begun in backward whose gradients changed afterwards, see ``dmuon_fsdp.backward``), or
raise. Flags only say *that* something is wrong somewhere; ``dmuon_fsdp._step.errors`` says
what, on every rank alike.

Flags, per rank: [invalid, non-finite, redo, d0..d3, -d0..-d3, t0..t3, -t0..-t3]. Invalid is 1
for a sparse or misshapen gradient or a parameter whose layout changed; non-finite is 1 when a
gradient holds inf or NaN; redo is 1 when gradients changed after backward began working on
them; d0..d3 are the bytes of the key's digest: the maxima of d and of -d agree only if every
rank sent the same d; t0..t3 those of a digest of the per-step options given as tensors (a
tensor lr), made on the device (``tensor_flags``: a tensor option is never read on the host), 0
when there are none. Integers up to 255 are exact in every float dtype the exchange may use.
"""

from __future__ import annotations

import enum
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dmuon_fsdp._step import comm
from dmuon_fsdp.config import HYPER

if TYPE_CHECKING:
    from typing_extensions import Unpack

    # A Muon matrix as the plans see it: its name, then whatever else a plan depends on.
    Identity = tuple[str, Unpack[tuple[object, ...]]]


FLAG_ELEMENTS = 19  # check elements per peer in the exchange that carries them


INVALID_SLOT, NONFINITE_SLOT, REDO_SLOT = 0, 1, 2  # then the digest's four bytes, then their negations


TENSOR_SLOTS = slice(11, 19)  # the tensor options' digest: four bytes, then their negations


class Verdict(enum.Enum):
    GO = "go"
    SKIP = "skip"  # a non-finite gradient somewhere, nonfinite="skip"
    REBUILD = "rebuild"  # every rank's key changed the same way: build the new program, run again
    RAISE = "raise"  # something is wrong: every rank raises the same error (``raise_alike``)
    REDO = "redo"  # gradients changed after backward started the step: run it again from them


def frozen(value: Any) -> Any:
    return tuple(frozen(v) for v in value) if isinstance(value, list) else value


@dataclass(frozen=True)
class StepKey:
    """What a step program is built for; two steps with equal keys run the same program."""

    has_grad: tuple[bool, ...]  # per optimizer parameter, in optimizer order
    options: tuple[tuple[Any, ...], ...]  # per Muon group its structural options; then main_weights
    checked: bool  # whether check flags travel (with a check on)

    @classmethod
    def of(
        cls,
        groups: Sequence[dict[str, Any]],
        grads: Sequence[Tensor | None],
        checked: bool,
        keys: Sequence[str],
    ) -> StepKey:
        """The key of a step with these ``grads`` (``keys``: ``config.structural_options()``, of
        the Muon groups; every group's ``main_weights``)."""
        options = tuple(tuple(frozen(g[k]) for k in keys) for g in groups if g["use_muon"])
        options += (tuple(bool(g["main_weights"]) for g in groups),)
        return cls(tuple(g is not None for g in grads), options, checked)

    @cached_property
    def digest(self) -> int:
        """32-bit checksum, the same on every rank for equal keys."""
        return zlib.crc32(repr((self.has_grad, self.options, self.checked)).encode())


def _hyper(groups: Sequence[dict[str, Any]]) -> Iterator[tuple[int, str, Any]]:
    """(group index, option, value) of every group's per-step options (``HYPER``), betas split."""
    for g, group in enumerate(groups):
        for key in HYPER[group["use_muon"]]:
            if key == "betas":
                yield from ((g, f"{key}[{i}]", beta) for i, beta in enumerate(group[key]))
            else:
                yield g, key, group[key]


def hyper_numbers(groups: Sequence[dict[str, Any]]) -> list[float]:
    """Every group's per-step options as numbers, in group order (tensors read: for messages)."""
    return [float(value) for _, _, value in _hyper(groups)]


def tensor_options(groups: Sequence[dict[str, Any]]) -> list[Tensor]:
    """The per-step options given as tensors (a tensor lr), in group order."""
    return [value for _, _, value in _hyper(groups) if isinstance(value, Tensor)]


def hyper_labels(groups: Sequence[dict[str, Any]]) -> list[str]:
    """What each of ``hyper_numbers`` is, for messages."""
    return [f"param group {g}'s {key}" for g, key, _ in _hyper(groups)]


def hyper_digest(groups: Sequence[dict[str, Any]]) -> int:
    """32-bit checksum of the per-step options given as numbers (those given as tensors count
    by position: ``tensor_flags`` carries their values); it travels XORed into the key's digest
    (``encode``), so ranks that step with different options disagree on the digest and raise
    alike."""
    numbers = [None if isinstance(v, Tensor) else float(v) for _, _, v in _hyper(groups)]
    return zlib.crc32(repr(numbers).encode())


# Odd multipliers of the tensor options' float32 bits in their digest (by position), below 2**31
_WEIGHTS = (1000003, 2000029, 3000017, 4000037, 5000011)


def tensor_flags(tensors: Sequence[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The flags of the tensor options' digest (``TENSOR_SLOTS``, in ``dtype`` on ``device``):
    the four bytes of sum(bits_i * w_i) mod 2**32 over their float32 bits, then their negations;
    device ops only, nothing copied from the host but a tensor option kept there (without
    waiting)."""
    digest = torch.zeros((), dtype=torch.int64, device=device)
    for i, t in enumerate(tensors):
        value = t.detach().reshape(()).to(device, torch.float32, non_blocking=True)
        bits = value.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        digest = (digest + bits * _WEIGHTS[i % len(_WEIGHTS)]) % 2**32
    digits = torch.stack([(digest >> shift) & 255 for shift in (0, 8, 16, 24)])
    return torch.cat([digits, -digits]).to(dtype)


def key_agreement(key_digest: int, group: Any, device: torch.device) -> comm.Handle:
    """Start agreeing on the step key before a step (only while keys alternate, see
    ``dmuon_fsdp._step.runtime.ProgramCache``): one ``all_reduce`` of 16 bytes; ``agreed`` reads it."""
    return comm.start_max(torch.tensor([key_digest, -key_digest], dtype=torch.int64, device=device), group)


def agreed(agreement: comm.Handle, key_digest: int) -> bool:
    """Whether every rank steps with the key of ``key_digest`` (one host read)."""
    high, low = agreement.wait().tolist()
    return high == -low == key_digest


def encode(key_digest: int, invalid: bool, redo: bool = False) -> list[float]:
    """This rank's flags, with 0 in the non-finite slot (``nonfinite_indicator`` fills it);
    ``key_digest`` is the step key's digest XOR ``hyper_digest``."""
    digits = [float((key_digest >> (8 * i)) & 255) for i in range(4)]
    return [float(invalid), 0.0, float(redo), *digits, *(-d for d in digits), *[0.0] * 8]


def decide(summary: Sequence[float], key_digest: int, nonfinite: str, check_grads: bool) -> Verdict:
    """The verdict from the element-wise maximum of every rank's flags (the same everywhere)."""
    high, low = summary[3:7], [-v for v in summary[7:11]]
    tensors = summary[TENSOR_SLOTS]
    if check_grads and tensors[:4] != [-v for v in tensors[4:]]:  # ranks' tensor options differ
        return Verdict.RAISE
    if summary[INVALID_SLOT] > 0 or (check_grads and high != low):
        return Verdict.RAISE
    if check_grads and sum(int(d) << (8 * i) for i, d in enumerate(high)) != key_digest:
        return Verdict.REBUILD
    if summary[REDO_SLOT] > 0:  # the step's work began on gradients some rank has since seen change
        return Verdict.REDO
    if summary[NONFINITE_SLOT] != 0:  # some rank has a non-finite gradient (NaN: see nonfinite_indicator)
        return {"raise": Verdict.RAISE, "skip": Verdict.SKIP}.get(nonfinite, Verdict.GO)
    return Verdict.GO


def nonfinite_indicator(groups: list[list[Tensor]], device: torch.device) -> Tensor:
    """A (1,) float32 tensor on ``device``: NaN when some gradient holds inf or NaN, else 0;
    device ops only, and the gradients are only read (expanded or otherwise unwritable ones
    too). ``groups``: the gradients with elements, by dtype (``nonfinite_groups``). Each gradient's
    largest magnitude (a foreach norm of order inf: a large finite fp16 value stays finite) times
    0 is 0 when finite and NaN otherwise; their sum is the indicator, and the verdict counts
    anything but 0 as found (``decide``; maxima over ranks keep NaN)."""
    parts = [
        torch.stack(torch._foreach_norm(grads, ord=math.inf)).mul_(0.0).sum(0, keepdim=True)
        for grads in groups
    ]
    if len(parts) == 1 and parts[0].dtype == torch.float32:  # the common case: one more op saved
        return parts[0]
    return sum((part.float() for part in parts), torch.zeros(1, device=device))


def nonfinite_groups(grads: Sequence[Tensor]) -> tuple[tuple[int, ...], ...]:
    """Indices of the gradients ``nonfinite_indicator`` reads, by dtype: those with elements (an
    empty shard has no largest magnitude)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        if g.numel():
            by_dtype.setdefault(g.dtype, []).append(i)
    return tuple(tuple(indices) for indices in by_dtype.values())


@dataclass
class Flags:
    """Where the flags sit in the buffers of the exchange carrying them: (peers, FLAG_ELEMENTS),
    at the head of every segment (``dmuon_fsdp._step.schedule``), and this rank's flags when nothing is
    wrong here (``values``, comm dtype, on the device) for the digest they were made for: made
    anew only when the per-step options change (``hyper_digest``)."""

    send: Tensor
    receive: Tensor
    nonfinite: Tensor  # the non-finite slot of each send segment: (peers,)
    redo: Tensor  # and the redo slot
    tensors: Tensor  # and the tensor options' slots: (peers, 8)
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
        tensors = send[:, TENSOR_SLOTS].contiguous()
        receive = heads(carrier.receive_counts)
        return cls(send, receive, slot["nonfinite"], slot["redo"], tensors, carrier.send.dtype)

    def values_for(self, digest: int) -> Tensor:
        """This rank's flags for ``digest`` with nothing wrong here (the last ones, when unchanged)."""
        if digest != self.digest:
            values = torch.tensor(encode(digest, invalid=False), dtype=self.dtype)
            if self.send.device.type != "cpu":  # pinned, so that the copy does not block the host
                values = values.pin_memory().to(self.send.device, non_blocking=True)
            self.digest, self.values = digest, values
        assert self.values is not None  # made for the first digest: digests are never -1 (crc32s)
        return self.values
