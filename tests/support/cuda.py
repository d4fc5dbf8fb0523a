"""CUDA's and NCCL's semantics where they differ from CPU's and gloo's, emulated on CPU (see
``../shared/notes/pitfalls.md``, "What CPU + gloo cannot show"), and a run serialized so that a
race shows as a bit difference. Each is a context manager that wraps a torch function while it
is active (``instruments.counters``' patches)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from instruments.counters import _Patches

HALF = (torch.float16, torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of its width: equal only if every bit is."""
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(-1).view(width)


class CudaForeachCopy(_Patches):
    """``torch._foreach_copy_`` as CUDA runs it: its fast path loads each element in its math
    type and stores it back, so a copy between two float16 or bfloat16 tensors turns every NaN
    bit pattern into the canonical NaN (CPU's copy is a memcpy). Other pairs copy as they do."""

    targets = ((torch, ("_foreach_copy_",)),)

    def wrap(self, name: str, original: Any) -> Any:
        def copy(dst, src, non_blocking=False):
            for d, s in zip(dst, src, strict=True):
                if d.dtype == s.dtype and d.dtype in HALF:
                    d.copy_(s.float().to(d.dtype))
                else:
                    d.copy_(s)

        return copy


class Serialized(_Patches):
    """Every collective the optimizer launches completes before the call returns (and the device
    is synchronized after it, on accelerators): the same run with nothing in flight, so that a
    buffer written or read while its collective runs differs bit for bit from it."""

    targets = ((dist, ("all_to_all_single", "all_reduce")),)

    def wrap(self, name: str, original: Any) -> Any:
        def call(*args, **kwargs):
            asked = kwargs.pop("async_op", False)
            _synchronize()
            work = original(*args, async_op=True, **kwargs)
            work.wait()
            _synchronize()
            return work if asked else None

        return call


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
