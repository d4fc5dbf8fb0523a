"""Per-step measurements of DMuonFSDP, and the phase labels a profiler trace shows."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.autograd.profiler as autograd_profiler

# The phases of a step, in order (``dmuon_fsdp.program`` says what each does); ``wait`` recurs.
PHASES = ("momentum", "wait", "commit", "adamw", "assemble", "newton_schulz", "return", "apply")


@dataclass
class StepStats:
    """What one rank did in one step.

    ``skipped`` is True when ``nonfinite="skip"`` skipped the step (nothing else is counted
    then). Counted for every step that ran: ``ns_matrices`` (matrices this rank orthogonalized,
    counted as each batch runs), ``ns_flops`` (their Newton-Schulz flops), ``bytes_sent`` and
    ``bytes_received`` (matrix pieces to and from other ranks, both exchanges; the check flags
    riding in one exchange, ``flag_bytes`` each way, and NorMuon's row statistics, one or two
    numbers per row, are not included),
    ``collectives`` (all-to-alls launched) and ``buffer_bytes`` (the buffers the optimizer keeps
    between steps: the two slots' exchange buffers, stacks of owned matrices, staging and scratch
    copies, and the NS workspace, which every bucket and every kept program share:
    ``dmuon_fsdp.buffers``).
    With ``timed=True``, ``seconds[phase]`` holds the wall time of each of ``PHASES`` (``wait``:
    blocked on all-to-all, summed over the step). On accelerators, timing synchronizes the device
    at every phase boundary, which removes the overlap of exchange and NS: time whole steps with
    timing off.

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

    def count(
        self, ns_flops: int, bytes_sent: int, bytes_received: int, flag_bytes: int, collectives: int
    ) -> None:
        """What the step program does every step (``StepProgram.counts``)."""
        self.ns_flops, self.bytes_sent, self.bytes_received = ns_flops, bytes_sent, bytes_received
        self.flag_bytes, self.collectives = flag_bytes, collectives

    def _sync(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)

    @contextmanager
    def label(self, name: str) -> Iterator[None]:
        """Label ``dmuon_fsdp.<name>`` in a profiler trace (only while a profiler runs: a label
        costs two dispatched ops), untimed: as for work in backward's hooks, where timing's
        device synchronization would wait on other ranks."""
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
            self._sync()
            start = time.perf_counter()
            try:
                yield
            finally:
                self._sync()
                self.seconds[name] += time.perf_counter() - start
