"""The step's buffers: a few arenas that every bucket of every kept program takes its views from.

[Note: slots] A step runs its buckets one after another, and at most ``SLOTS`` of them hold
buffers at once: bucket k takes its views from slot ``k % SLOTS``. A slot has two arenas, one
for the bucket's way to its owners (send and receive buffers, the stacks of owned matrices,
staging and scratch: alive from making its NS inputs to collecting its results) and one for
its way back (send and receive buffers, NorMuon's rows, own results kept for the update: alive
from its Newton-Schulz to its update). With two slots, bucket k+1 travels while bucket k's NS
runs, and bucket k+2 takes bucket k's arenas once k is through with them; the step loop
(``dmuon_fsdp.program``) orders its work so. One more arena holds the NS workspace, used by one
batch at a time. So the buffers are a small multiple of the largest bucket (``bucket_bytes``),
whatever the depth of the model, and the programs kept for other gradient sets share them
(one program runs at a time).

A program is bound into the pool as it is (``Region.take`` hands out views in order); if some
arena was too small, binding asked for meta tensors past its end, and the pool grows to what
was asked (``Pool.grow``) before binding again. Growing replaces arenas, so programs bound
before must be bound anew (``Pool.generation`` tells them apart).
"""

from __future__ import annotations

import torch
from torch import Tensor

SLOTS = 2  # buckets whose buffers are alive at once (see [Note: slots])
ALIGN = 64  # bytes: every view starts on such a boundary (any dtype's, and vector loads')

TO, BACK, WORK = "to owners", "back", "workspace"


def arena_names() -> list[tuple[str, int]]:
    return [(way, s) for s in range(SLOTS) for way in (TO, BACK)] + [(WORK, 0)]


class Region:
    """Views of one arena, handed out from its start; past its end, meta tensors (the binding
    is then only measured: ``used`` says how much it needed)."""

    def __init__(self, arena: Tensor | None, device: torch.device) -> None:
        self.arena, self.device = arena, device
        self.used = 0

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        if not numel:  # a real tensor: an exchange with nothing to move is still a collective
            return torch.empty(0, dtype=dtype, device=self.device)
        start = -(-self.used // ALIGN) * ALIGN
        self.used = start + numel * dtype.itemsize
        if self.arena is None or self.used > self.arena.numel():
            return torch.empty(numel, dtype=dtype, device="meta")
        return self.arena[start : self.used].view(dtype)


class Pool:
    """The arenas of ``arena_names()`` on one device (bytes, zeroed when made: a binding writes
    nothing into them, so that binding anew never touches an exchange in flight; every view is
    written before it is read)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.arenas: dict[tuple[str, int], Tensor] = {}
        self.generation = 0

    def regions(self) -> dict[tuple[str, int], Region]:
        """A fresh region per arena (one bucket's binding, or the workspace's)."""
        return {name: Region(self.arenas.get(name), self.device) for name in arena_names()}

    def fits(self, needed: dict[tuple[str, int], int]) -> bool:
        return all(n <= self.size(name) for name, n in needed.items())

    def size(self, name: tuple[str, int]) -> int:
        arena = self.arenas.get(name)
        return arena.numel() if arena is not None else 0

    def grow(self, needed: dict[tuple[str, int], int]) -> None:
        """Make the arenas that are smaller than ``needed`` anew at that size (their old views go
        stale: ``generation`` moves on)."""
        for name, n in needed.items():
            if n > self.size(name):
                self.arenas.pop(name, None)  # freed before the larger one is made
                self.arenas[name] = torch.zeros(n, dtype=torch.uint8, device=self.device)
        self.generation += 1

    @property
    def nbytes(self) -> int:
        return sum(arena.numel() for arena in self.arenas.values())
