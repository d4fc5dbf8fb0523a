"""What one rank did in one step (``StepStats``) and the phases a step is timed in
(``PHASES``; ``dmuon_fsdp._step.program`` says what each does)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.autograd.profiler as autograd_profiler

# The phases of a step, in order (``dmuon_fsdp._step.run`` says what each does); ``wait`` recurs.
PHASES = ("momentum", "wait", "commit", "adamw", "assemble", "newton_schulz", "return", "apply")


@dataclass
class StepStats:
    """What one rank did in one step.

    ``skipped`` is True when ``nonfinite="skip"`` skipped the step (nothing else is counted
    then). Counted for every step that ran: ``ns_matrices`` (matrices this rank orthogonalized,
    counted as each batch runs), ``ns_flops`` (their Newton-Schulz flops), ``bytes_sent`` and
    ``bytes_received`` (matrix pieces to and from other ranks, both exchanges; the check flags
    riding in one exchange, ``flag_bytes`` each way, and a row variant's numbers, one or two per
    row, are not included),
    ``collectives`` (all-to-alls launched) and ``buffer_bytes`` (the buffers the optimizer keeps
    between steps: the two slots' exchange buffers, stacks of owned matrices, staging and scratch
    copies, and the NS workspace, which every bucket and every kept program share:
    ``dmuon_fsdp._step.buffers``).
    With ``timed=True``, ``seconds[phase]`` holds the time of each of ``PHASES``, summed over the
    step: on CPU the host's (``wait``: blocked on an all-to-all); on accelerators the device's,
    between events recorded on the current stream at the phase's start and end (``wait``: the
    stream waiting for an exchange), read with one synchronization when the step ends
    (``settle_times``), so that timing leaves the overlap of exchange and NS as it is.

    With ``overlap_backward``: ``started_in_backward`` counts the buckets whose NS inputs and
    exchange to owners began in backward, and ``redone`` is True when the step was redone from
    gradients that changed after backward began it (the count is then the redone step's, 0).
    Phase times leave out the work done in hooks (it is labelled in a profiler trace).
    """

    device: torch.device
    timed: bool = False
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    ns_matrices: int = 0
    ns_flops: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    flag_bytes: int = 0
    collectives: int = 0
    buffer_bytes: int = 0
    skipped: bool = False
    started_in_backward: int = 0
    redone: bool = False
    _events: list[tuple[str, Any, Any]] = field(default_factory=list, repr=False)  # to read at the end

    def count(
        self, ns_flops: int, bytes_sent: int, bytes_received: int, flag_bytes: int, collectives: int
    ) -> None:
        """What the step program does every step (``StepProgram.counts``)."""
        self.ns_flops, self.bytes_sent, self.bytes_received = ns_flops, bytes_sent, bytes_received
        self.flag_bytes, self.collectives = flag_bytes, collectives

    def settle_times(self) -> None:
        """Add the device times of the phases timed by events to ``seconds`` (one wait, for the
        last event)."""
        if self._events:
            self._events[-1][2].synchronize()
            for name, begin, end in self._events:
                self.seconds[name] += begin.elapsed_time(end) / 1000.0
            self._events.clear()

    @contextmanager
    def label(self, name: str) -> Iterator[None]:
        """Label ``dmuon_fsdp.<name>`` in a profiler trace (only while a profiler runs: a label
        costs two dispatched ops), untimed: as for work in backward's hooks (on a side stream,
        amid backward)."""
        profiling = autograd_profiler._is_profiler_enabled  # torch's fast check for this purpose
        with autograd_profiler.record_function(f"dmuon_fsdp.{name}") if profiling else nullcontext():
            yield

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label the phase ``dmuon_fsdp.<name>`` and time it when ``timed``."""
        with self.label(name):
            if not self.timed:
                yield
                return
            if self.device.type != "cpu":
                module = torch.get_device_module(self.device)
                begin, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
                begin.record()
                try:
                    yield
                finally:
                    end.record()
                    self._events.append((name, begin, end))
                return
            start = time.perf_counter()
            try:
                yield
            finally:
                self.seconds[name] += time.perf_counter() - start
