"""QK-clip (MuonClip: Kimi K2, arXiv 2507.20534): after the optimizer step, shrink the query and
key rows of attention heads whose largest pre-softmax logit went past ``tau``.

For a head with S, the largest logit q . k / sqrt(d_head) of the step's batch over every rank,
gamma = tau / S when S > tau: its W_q rows are multiplied by gamma^alpha and its W_k rows by
gamma^(1 - alpha), so its logits shrink by gamma. Grouped-query attention shares a key head
among the query heads of a group, so the group is the unit, as in Megatron-LM: gamma comes from
the group's largest logit and scales all of the group's query heads and its key head. A group
at or under tau is not touched at all (bitwise). Fused QKV weights name the rows of q and of k.

Every rank scales the rows of its own shard only (FSDP2 rows split anywhere, HSDP, DDP replicas,
tensor-parallel heads): the per-head logits are first reduced with MAX over the ranks that hold
these layers (all of them, or ``group``: a pipeline stage's ranks), one ``all_reduce`` of layers x
heads numbers, so every copy of a row gets the same factor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dmuon_fsdp._step import comm
from dmuon_fsdp._step.layouts import param_boxes
from dmuon_fsdp._step.state import MAIN, local_shard


@dataclass(frozen=True)
class AttentionWeights:
    """One attention layer: its query and key projection weights (out_features x in_features),
    ``heads`` query heads and ``kv_heads`` key heads (None: as many as query heads). For a fused
    QKV weight pass it as both ``q`` and ``k`` with ``q_rows`` / ``k_rows``, the [start, stop)
    rows of each."""

    q: Tensor
    k: Tensor
    heads: int
    kv_heads: int | None = None
    q_rows: tuple[int, int] | None = None
    k_rows: tuple[int, int] | None = None


def _namer(optimizer: torch.optim.Optimizer, known: set[Tensor]) -> Callable[[Tensor, str], str]:
    """(parameter, fallback) -> the name the optimizer gives it (DMuonFSDP's ``param_name``),
    or the fallback for other optimizers and for tensors it does not hold."""
    param_name = getattr(optimizer, "param_name", None)
    return lambda p, fallback: param_name(p) if param_name is not None and p in known else fallback


def _first_row(param: Tensor, name: str) -> int:
    """The global index of the first row of this rank's block of ``param``, after checking that
    DTensor places every rank's block as a rectangle (``layouts.param_boxes``)."""
    if not isinstance(param, DTensor):
        return 0
    param_boxes(param, name)
    return compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)[1][0]


class QKClip:
    """QK-clip for ``layers`` of a model trained by ``optimizer``: call ``clip(max_logits)`` after
    each ``optimizer.step()``, with one tensor per layer holding each query head's largest
    pre-softmax logit of the step on this rank (``-inf`` for heads this rank did not compute,
    e.g. other tensor-parallel ranks' heads). Returns the logits reduced over all ranks (layers x
    heads; rows padded with -inf), the same on every rank, for logging. ``tau=None`` only
    reduces and returns them (logging without clipping).

    Bad input raises ``ValueError`` on every rank: at construction (a weight that is not one of
    the optimizer's parameters, head counts that do not divide the rows, a fused weight without
    disjoint row ranges), and in ``clip`` (a missing or misshapen entry, NaN or +inf) after the
    reduction, so no rank is left waiting. The weights are held as given: after a framework
    replaces the optimizer's parameters, build a new QKClip.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        layers: Sequence[AttentionWeights],
        tau: float | None = 100.0,
        alpha: float = 0.5,
        group: Any = None,
    ):
        if tau is not None and not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
            raise ValueError(
                f"tau must be a finite number > 0 (or None: only reduce the logits), got {tau!r}"
            )
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
        known = {p for group in optimizer.param_groups for p in group["params"]}
        names = _namer(optimizer, known)
        self.tau, self.alpha, self.layers, self.group = tau, float(alpha), tuple(layers), group
        self._finish_step: Callable[[], None] = getattr(optimizer, "finish_step", lambda: None)
        self._state = optimizer.state  # (main weights are scaled too: [Note: main weights])
        self._ranges = [self._check(i, layer, known, names) for i, layer in enumerate(self.layers)]
        self._first_rows = {
            p: _first_row(p, names(p, f"shape {tuple(p.shape)}"))
            for layer in self.layers
            for p in (layer.q, layer.k)
        }
        self.width = max((layer.heads for layer in self.layers), default=0)
        # every holder scales its rows in float32, main weights included: each keeps its own
        keep_mains = getattr(optimizer, "_keep_main_weights_on_every_holder", None)
        if keep_mains is not None:
            keep_mains(list(self._first_rows))

    @staticmethod
    def _check(
        i: int, layer: AttentionWeights, known: set, names: Callable[[Tensor, str], str]
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """The (q rows, k rows) ranges of layer ``i``, after checking it."""
        kv_heads = layer.kv_heads or layer.heads
        ranges = []
        for role, param, rows, heads in (
            ("q", layer.q, layer.q_rows, layer.heads),
            ("k", layer.k, layer.k_rows, kv_heads),
        ):
            name = names(param, f"layers[{i}].{role}")
            if param not in known:
                raise ValueError(
                    f"layers[{i}].{role} ({name}, shape {tuple(param.shape)}) is not a parameter of the "
                    "optimizer"
                )
            if param.ndim != 2:
                raise ValueError(
                    f"layers[{i}].{role} ({name}) has shape {tuple(param.shape)}: a 2-D weight is needed"
                )
            start, stop = rows if rows is not None else (0, param.shape[0])
            if not 0 <= start < stop <= param.shape[0]:
                raise ValueError(
                    f"layers[{i}].{role}_rows {rows} is not a row range of {name} ({param.shape[0]} rows)"
                )
            if not (isinstance(heads, int) and heads > 0 and (stop - start) % heads == 0):
                raise ValueError(
                    f"layers[{i}]: the {stop - start} {role} rows of {name} do not split into {heads} heads"
                )
            ranges.append((start, stop))
        if layer.q is layer.k and (
            layer.q_rows is None
            or layer.k_rows is None
            or max(ranges[0][0], ranges[1][0]) < min(ranges[0][1], ranges[1][1])
        ):
            raise ValueError(
                f"layers[{i}]: a fused weight passed as both q and k needs disjoint q_rows and k_rows "
                f"(got {layer.q_rows} and {layer.k_rows})"
            )
        if layer.heads % kv_heads:
            raise ValueError(
                f"layers[{i}]: {layer.heads} query heads do not split into {kv_heads} key-head groups"
            )
        (q0, q1), (k0, k1) = ranges
        if (q1 - q0) // layer.heads != (k1 - k0) // kv_heads:
            raise ValueError(
                f"layers[{i}]: query heads of {(q1 - q0) // layer.heads} rows, key heads of "
                f"{(k1 - k0) // kv_heads}: they must match"
            )
        return ranges[0], ranges[1]

    def clip(self, max_logits: Sequence[Tensor]) -> Tensor:
        """Reduce ``max_logits`` (one (heads,) tensor per layer) over the ranks, clip, and return
        the reduced table (layers x heads)."""
        device = self.layers[0].q.device if self.layers else torch.device("cpu")
        table = torch.full((len(self.layers), self.width + 2), -math.inf, device=device)
        table[:, self.width :] = 0.0  # flags: a wrong shape, NaN or +inf
        for i, layer in enumerate(self.layers):
            given = max_logits[i] if i < len(max_logits) else None
            if not isinstance(given, Tensor) or tuple(given.shape) != (layer.heads,):
                table[i, self.width] = 1.0
                continue
            table[i, : layer.heads].copy_(given.detach())
        logits = table[:, : self.width]
        table[:, self.width + 1] = (logits.isnan() | (logits == math.inf)).any(dim=1)  # -inf pads
        if len(max_logits) > len(self.layers):
            table[:, self.width] = 1.0
        if comm.default_world_size() > 1:
            comm.all_max(table, self.group)
        host = table.cpu()  # the one device-to-host read
        self._raise_for(host[:, self.width :].tolist())
        if self.tau is not None:
            self._finish_step()  # (the rows scaled must hold the whole step's update)
            self._scale(host[:, : self.width])
        return table[:, : self.width]

    def _raise_for(self, flags: list[list[float]]) -> None:
        for i, (shape, nan) in enumerate(flags):
            if shape:
                raise ValueError(
                    f"max_logits must be {len(self.layers)} tensors, max_logits[{i}] of shape "
                    f"({self.layers[i].heads},) (one logit per query head), on every rank; some "
                    "rank passed another count, type or shape"
                )
            if nan:
                raise ValueError(f"max_logits[{i}] holds NaN or +inf on some rank")

    def _scale(self, logits: Tensor) -> None:
        """Row factors (computed on the host from ``logits``) of every weight with a clipped
        group, applied to its local rows."""
        factors: dict[Tensor, Tensor] = {}
        for layer, row_logits, ((q0, q1), (k0, k1)) in zip(self.layers, logits, self._ranges, strict=True):
            groups = layer.kv_heads or layer.heads
            worst = row_logits[: layer.heads].view(groups, -1).amax(dim=1)
            if not bool((worst > self.tau).any()):
                continue
            gamma = torch.where(worst > self.tau, self.tau / worst, torch.ones_like(worst))
            for param, start, stop, power in (
                (layer.q, q0, q1, self.alpha),
                (layer.k, k0, k1, 1.0 - self.alpha),
            ):
                rows = factors.setdefault(param, torch.ones(param.shape[0]))
                rows[start:stop] *= gamma.pow(power).repeat_interleave((stop - start) // groups)
        with torch.no_grad():
            for param, rows in factors.items():
                local, first = (
                    local_shard(param),
                    self._first_rows[param],
                )  # the shard read now: storage may change
                main = self._state.get(param, {}).get(MAIN)
                if not local.shape[0]:
                    continue
                if main is None:
                    local.mul_(rows[first : first + local.shape[0], None].to(local))
                else:  # scaled in float32, then rounded into the parameter, as a step does
                    mine = local_shard(main)
                    mine.mul_(rows[first : first + local.shape[0], None].to(mine))
                    local.copy_(mine)
