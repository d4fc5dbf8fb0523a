"""Per-step measurements of DMuonFSDP, and the phase labels a profiler trace shows."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.autograd.profiler as autograd_profiler

PHASES = ("momentum", "adamw", "pack", "wait", "newton_schulz", "apply")


@dataclass
class StepStats:
    """What one rank did in one step.

    ``skipped`` is True when ``nonfinite="skip"`` skipped the step. Always counted, from the step
    program: ``ns_flops`` (Newton-Schulz flops this rank ran), ``bytes_sent`` and
    ``bytes_received`` (matrix pieces to and from other ranks, both exchanges; the check flags
    riding in the first exchange, ``flag_bytes`` each way, are not included) and
    ``collectives`` (all-to-alls launched). With ``timed=True``, ``seconds[phase]`` holds the
    wall time of each phase: ``momentum`` (momentum into the send buffers and local stacks,
    then its commit and weight decay), ``adamw``, ``pack`` (assembling received pieces into
    stacks, results into return buffers), ``wait`` (blocked on all-to-all), ``newton_schulz``
    and ``apply`` (the updates). On accelerators, timing synchronizes the device at every phase
    boundary, which removes the overlap of exchange and NS: time whole steps with timing off.
    """

    device: torch.device
    timed: bool = False
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    ns_flops: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    flag_bytes: int = 0
    collectives: int = 0
    skipped: bool = False

    def _sync(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label the phase ``dmuon_fsdp.<name>`` in a profiler trace (only while a profiler
        runs: a label costs two dispatched ops) and time it when ``timed``."""
        profiling = autograd_profiler._is_profiler_enabled  # torch's fast check for this purpose
        with autograd_profiler.record_function(f"dmuon_fsdp.{name}") if profiling else nullcontext():
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
