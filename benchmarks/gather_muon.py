"""Baseline: Muon that all-gathers every matrix and runs Newton-Schulz on every rank.

What a straightforward FSDP2 port does (``full_tensor()`` per matrix, keep your own rows); used
only by the benchmarks, to measure what DMuonFSDP saves. Same momentum, NS and update formulas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import ParamsT

from dmuon_fsdp import newton_schulz
from dmuon_fsdp._step.state import adjusted_lr
from dmuon_fsdp.newton_schulz import resolve_coefficients


class GatherAllMuon(torch.optim.Optimizer):
    def __init__(
        self,
        params: ParamsT,
        lr: float = 0.02,
        momentum: float = 0.95,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, ns_steps=ns_steps))
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        # (the closure is in torch.optim.Optimizer's signature; this baseline never took one)
        if closure is not None:
            raise TypeError("GatherAllMuon.step takes no closure")
        for group in self.param_groups:
            coefficients = resolve_coefficients((3.4445, -4.7750, 2.0315), group["ns_steps"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p]["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"])
                full = update.full_tensor() if isinstance(update, DTensor) else update
                ortho = newton_schulz(full.reshape(full.shape[0], -1), coefficients, 1e-7, self.ns_dtype)
                local = p.to_local() if isinstance(p, DTensor) else p
                if isinstance(p, DTensor):
                    start = p.device_mesh.get_local_rank() * -(-p.shape[0] // p.device_mesh.size())
                    ortho = ortho[start : start + local.shape[0]]
                scale = adjusted_lr(group["lr"], None, full.shape[0], ortho.shape[1])
                local.add_(ortho.view(local.shape), alpha=-scale)
