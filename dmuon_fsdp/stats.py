"""Per-step measurements of DMuonFSDP: NS flops and bytes on the wire, and opt-in phase times."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

PHASES = ("elementwise", "pack", "wait", "newton_schulz", "apply")


@dataclass
class StepStats:
    """What one rank did in one step.

    ``skipped`` is True when ``nonfinite="skip"`` skipped the step. Always counted: ``ns_flops`` (Newton-Schulz flops this rank ran), ``bytes_sent`` and
    ``bytes_received`` (to and from other ranks, both exchanges) and ``collectives``.
    With ``timed=True``, ``seconds[phase]`` holds the wall time of each phase: ``elementwise``
    (momentum and AdamW on local shards), ``pack`` (building send buffers, reassembling received
    ones), ``wait`` (blocked on all-to-all), ``newton_schulz`` and ``apply`` (weight decay and
    update). On accelerators, timing synchronizes the device at every phase boundary, which
    removes the overlap of exchange and NS: time whole steps with timing off.
    """

    device: torch.device
    timed: bool = False
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    ns_flops: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    collectives: int = 0
    skipped: bool = False

    def _sync(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.timed:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - start
