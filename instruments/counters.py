"""Measurement instruments for tests and benchmarks: aten ops dispatched, device-to-host reads
and torch.distributed calls made while a block runs. They observe torch's public surfaces only
(a dispatch mode, ``torch.Tensor`` and ``torch.distributed`` functions), never the package's
internals."""

from __future__ import annotations

import collections
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from typing_extensions import Self


class OpCounter(TorchDispatchMode):
    """Counts every aten (and c10d, profiler) op dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class _Patches:
    """Wraps functions while active: each named attribute of each owner is replaced by
    ``self.wrap(name, original)`` on entry and restored on exit."""

    targets: tuple[tuple[Any, tuple[str, ...]], ...] = ()

    def wrap(self, name: str, original: Any) -> Any:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._originals = [
            (owner, name, getattr(owner, name)) for owner, names in self.targets for name in names
        ]
        for owner, name, original in self._originals:
            setattr(owner, name, self.wrap(name, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in self._originals:
            setattr(owner, name, original)


class HostReads(_Patches):
    """Counts Tensor.item / tolist / __bool__ / __float__ / __int__ calls while active
    (device-to-host reads on GPUs)."""

    targets = ((torch.Tensor, ("item", "tolist", "__bool__", "__float__", "__int__")),)

    def __init__(self) -> None:
        self.count = 0

    def wrap(self, name: str, original: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(tensor, *args, **kwargs)

        return read


GATHERS = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
)


class CollectiveCalls(_Patches):
    """While active: how often each torch.distributed collective (``GATHERS``,
    ``all_to_all_single``, ``all_reduce``) and DTensor's ``full_tensor`` and ``redistribute`` are
    called (``calls``), every ``all_to_all_single``'s (receive counts, send counts, element
    size) (``all_to_alls``), and the wall time spent inside those calls (``seconds``)."""

    targets = (
        (dist, (*GATHERS, "all_to_all_single", "all_reduce")),
        (DTensor, ("full_tensor", "redistribute")),
    )

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()
        self.all_to_alls: list[tuple[list[int], list[int], int]] = []
        self.seconds = 0.0

    def wrap(self, name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            if name == "all_to_all_single":
                _, sent, receive_counts, send_counts = args[:4]
                self.all_to_alls.append((list(receive_counts), list(send_counts), sent.element_size()))
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return call

    @property
    def gathers(self) -> int:
        """Calls that gather or broadcast whole tensors (``GATHERS``, ``full_tensor``, ``redistribute``)."""
        return sum(n for name, n in self.calls.items() if name not in ("all_to_all_single", "all_reduce"))


class GroupCalls(_Patches):
    """Every process group made while active (``torch.distributed.new_group`` and
    ``split_group``): per call, the function, the ranks asked for and whether the members alone
    made it (``use_local_synchronization``)."""

    targets = ((dist, ("new_group", "split_group")),)

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, bool]] = []

    def wrap(self, name: str, original: Any) -> Any:
        def make(*args: Any, **kwargs: Any) -> Any:
            if name == "split_group":  # (parent_pg, split_ranks, ...)
                splits = kwargs.get("split_ranks", args[1] if len(args) > 1 else ())
                shown: tuple = tuple(tuple(sorted(r)) for r in splits)
            else:  # (ranks, ...): None is every rank
                ranks = kwargs.get("ranks", args[0] if args else None)
                shown = tuple(sorted(ranks)) if ranks is not None else ("all",)
            self.calls.append((name, shown, bool(kwargs.get("use_local_synchronization", False))))
            return original(*args, **kwargs)

        return make
