"""The optimizer state each parameter holds, on this rank's local shard (``local_shard``), and
the element-wise math on it as foreach ops over lists: the state made and restored, what Muon
orthogonalizes, its step size, and AdamW through ``torch.optim``'s own functional
implementation. No communication."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypedDict

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as torch_adamw
from torch.optim.optimizer import _default_to_fused_or_foreach
from torch.utils.weak import WeakIdKeyDictionary

from dmuon_fsdp.config import row_state_keys, row_variant
from dmuon_fsdp.variants import row_shape, row_state_like


def local_shard(t: Tensor) -> Tensor:
    """This rank's part of a DTensor (in-place ops on it update the DTensor), or a plain tensor
    itself. Reads the local tensor directly: ``to_local()`` on a parameter returns a new view
    per call, one aten op per parameter on every step."""
    return t._local_tensor if isinstance(t, DTensor) else t


# [Note: main weights] A parameter stored in a 16-bit float type cannot take a Muon update
# below half its spacing (2^-8 of its magnitude in bfloat16: 6e-4 at 0.15, where an update of lr
# 2e-3 moves an entry about 3e-4): rounded to nearest, most vanish. With ``main_weights`` (the
# default) such a parameter keeps a float32 copy (``main_weight``, in its state) and float32
# moments; weight decay, AdamW and every Muon update are applied to the main weight, and the
# rows they touch are rounded into the parameter. Where the main weight lives:
# - A sharded parameter (FSDP2, HSDP, tensor parallel): placed like it, each holder the main rows
#   of its shard (4 bytes per element of the local shard). Muon updates from the owner or by
#   relay are applied to them and rounded into the parameter right after (``Updates.rounded``).
# - A Muon parameter every rank holds whole (DDP, replicated tensors): on one rank only, its
#   *home* (``planning.main_homes``: balanced, fixed for the parameters and meshes, whatever a
#   step's gradients), which owns each of its matrices in every plan. After NS the owner makes
#   the new main weight in float32 scratch (decay, then the update) and writes it over the result
#   (``NewMains``): every holder receives its rows' new values instead of their direction, by
#   the same exchanges and relays, and copies them into the parameter (``Updates.values``,
#   rounding); the owner's main weight takes the scratch after the verdict. So 4 bytes per
#   element of the parameters a rank owns, about 1/W of the model, instead of all of it.
#   ``QKClip`` scales its weights on every holder: those keep their main weights on every rank.
# Every rank rounds the same float32 numbers alike, so replicas stay bitwise equal. A checkpoint
# carries the main weights a rank holds: under DDP each rank's (DCP saves each once); a state
# dict without one this rank holds (rank 0's alone, loaded everywhere) makes it from the
# parameter, alike. What is written into the parameter by anything else (a load, a copy) is
# taken into the main weight before the next step (``MainWeights``).
LOW_PRECISION = (torch.bfloat16, torch.float16)


def keeps_main(p: Tensor, group: dict[str, Any]) -> bool:
    """Whether ``p`` keeps a float32 main weight ([Note: main weights])."""
    return bool(group["main_weights"]) and p.dtype in LOW_PRECISION


def holds_main(p: Tensor, group: dict[str, Any], homes: Mapping[Tensor, int], rank: int) -> bool:
    """Whether plan rank ``rank`` holds ``p``'s main weight: ``p`` keeps one, and its home
    (``homes``, when it has one) is ``rank``."""
    return keeps_main(p, group) and homes.get(p, rank) == rank


def state_keys(group: dict[str, Any], p: Tensor, main: bool) -> tuple[str, ...]:
    """The state entries of parameter ``p`` of ``group``: Muon's momentum buffer (and its row
    variant's row state), or AdamW's ``step`` and moments; and its main weight, with ``main``."""
    if not group["use_muon"]:
        keys: tuple[str, ...] = ("step", "exp_avg", "exp_avg_sq")
    else:
        variant = row_variant(group)
        keys = ("momentum_buffer",) if variant is None else ("momentum_buffer", variant.state_key)
    return (*keys, MAIN) if main else keys


MAIN = "main_weight"


def main_weight(p: Tensor) -> Tensor:
    """A float32 copy of ``p``, placed like it."""
    return p.detach().to(torch.float32, copy=True)


def initial_state(p: Tensor, group: dict[str, Any], main: bool) -> dict[str, Tensor]:
    """A parameter's optimizer state before its first step, placed like the parameter: Muon's
    momentum buffer (and its row variant's row state, placed like the parameter's rows), or
    AdamW's moments and ``step`` (a plain tensor on the parameter's device, where fused AdamW
    reads it); for a 16-bit parameter that keeps a main weight, the moments in float32, and with
    ``main`` (this rank holds it: ``holds_main``) the main weight."""
    wide = keeps_main(p, group)
    zeros = torch.zeros_like(p, dtype=torch.float32 if wide else p.dtype, memory_format=torch.preserve_format)
    if group["use_muon"]:
        state = {"momentum_buffer": zeros}
        variant = row_variant(group)
        if variant is not None:
            state[variant.state_key] = row_state_like(p, group["flatten"])
    else:
        step = torch.zeros((), dtype=torch.float32, device=p.device)
        state = {"step": step, "exp_avg": zeros, "exp_avg_sq": torch.zeros_like(zeros)}
    if wide and main:
        state[MAIN] = main_weight(p)
    return state


def restore_state(
    groups: Sequence[dict[str, Any]], state: Any, homes: Mapping[Tensor, int], rank: int
) -> None:
    """Make afresh the state that was cleared or removed by hand (``opt.state.clear()``, ``del
    opt.state[p]``, a new ``opt.state``): a parameter missing a state entry of its kind starts as
    before its first step, as with torch's optimizers (whose state is lazy). A group whose
    ``variant`` or ``flatten`` changed keeps its momentum: the row state of its variant starts at
    zero in the new shape, another variant's goes. A main weight is kept where plan rank
    ``rank`` holds it (``holds_main``) and goes elsewhere."""
    every = row_state_keys() | {MAIN}
    for group in groups:
        variant = row_variant(group)
        row_key = variant.state_key if variant is not None else None
        for p in group["params"]:
            main = holds_main(p, group, homes, rank)
            keys = state_keys(group, p, main)
            held = state.get(p, {})
            missing = [key for key in keys if key not in held]
            if set(missing) - {row_key, MAIN}:
                state[p] = initial_state(p, group, main)
                continue
            for key in every - set(keys):  # another variant's row state goes, a main weight not held
                held.pop(key, None)
            if MAIN in missing:  # (a state saved without one, or held elsewhere: from the parameter)
                held[MAIN] = main_weight(p)
            reshaped = (
                row_key is not None
                and row_key not in missing
                and held[row_key].shape != row_shape(p, group["flatten"])
            )
            if row_key is not None and (row_key in missing or reshaped):
                held[row_key] = row_state_like(p, group["flatten"])  # (``flatten`` changed)


def restore_loaded(
    groups: Sequence[dict[str, Any]],
    state: Any,
    saved: dict[Tensor, dict[str, Any]],
    homes: Mapping[Tensor, int],
    rank: int,
) -> None:
    """After torch's ``load_state_dict``: the state the dict did not hold made afresh
    (``restore_state``), each AdamW ``step`` a float32 tensor on its parameter's device, where
    fused AdamW reads it, and the float32 state of a parameter with a main weight float32 as
    saved (``saved``: each parameter's entries in the dict; torch casts them to the parameter's
    dtype)."""
    restore_state(groups, state, homes, rank)
    for group in groups:
        for p in group["params"]:
            held = state[p]
            if "step" in held:
                held["step"] = held["step"].to(device=p.device, dtype=torch.float32)
            if not keeps_main(p, group):  # (its state is float32 also where its main weight is not)
                continue
            for key, value in saved.get(p, {}).items():
                if key == "step" or (key == MAIN and MAIN not in held):  # (held by another rank)
                    continue
                if isinstance(value, Tensor) and value.dtype == torch.float32:
                    held[key] = value.to(device=p.device, copy=True)


def stale_layouts(params: Sequence[Tensor], state: Any) -> set[Tensor]:
    """Parameters whose local shard no longer matches their state (resharded or resized); a row
    variant's state matches the local shard's leading (row) dims."""

    row_keys = row_state_keys()

    def matches(key: str, value: Tensor, local: Tensor) -> bool:
        shape = local_shard(value).shape
        return key == "step" or shape == (local.shape[: len(shape)] if key in row_keys else local.shape)

    return {p for p in params if not all(matches(k, v, local_shard(p)) for k, v in state[p].items())}


@dataclass(frozen=True)
class MuonStep:
    """A Muon group's per-step options, read once per step (``muon_steps``): ``lr`` a float, or
    when the group's lr is a tensor that tensor on the parameters' device, used there and never
    read on the host (a device read each step, otherwise, on a GPU)."""

    lr: float | Tensor
    momentum: float
    nesterov: bool
    weight_decay: float

    def decay_factor(self) -> float | Tensor:
        """1 - lr * weight_decay (decoupled weight decay with the unadjusted lr)."""
        return 1.0 - self.lr * self.weight_decay

    def alpha(self, scale: float) -> float | Tensor:
        """-lr * scale, an update's step size (``scale``: ``adjusted_lr`` of lr 1)."""
        return self.lr * -scale


def muon_steps(groups: Sequence[dict[str, Any]], device: torch.device) -> list[MuonStep | None]:
    """Each param group's ``MuonStep`` for this step (None for AdamW groups, whose options go to
    torch's AdamW as they are)."""
    out: list[MuonStep | None] = []
    for g in groups:
        if not g["use_muon"]:
            out.append(None)
            continue
        lr = g["lr"]  # (a tensor of any one-element shape, as torch's optimizers take, used as 0-dim)
        lr = lr.to(device, non_blocking=True).reshape(()) if isinstance(lr, Tensor) else float(lr)
        out.append(MuonStep(lr, float(g["momentum"]), bool(g["nesterov"]), float(g["weight_decay"])))
    return out


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """The Muon step size for a rows x cols matrix, as in ``torch.optim.Muon``."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def lerp_math_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype | None:
    """The type torch's lerp computes its weight in for tensors of all ``dtypes`` (float64 for
    float64 tensors, else float32), or None when they differ."""
    kinds = {torch.float64 if d == torch.float64 else torch.float32 for d in dtypes}
    return kinds.pop() if len(kinds) == 1 else None


@lru_cache(maxsize=64)  # read at every step, made once per momentum and math type
def _complement(momentum: float, math_dtype: torch.dtype) -> float:
    """1 - momentum as torch's lerp computes it for a weight of ``momentum``: in ``math_dtype``.
    For momentum in [0.5, 1] the difference is exact there (Sterbenz), so the double returned is
    that very number."""
    return float(1 - torch.tensor(momentum, dtype=math_dtype))


def muon_input(
    dst: list[Tensor],
    buffers: list[Tensor],
    grads: list[Tensor],
    momentum: float,
    nesterov: bool,
    in_place: bool,
    math_dtype: torch.dtype | None,
) -> None:
    """``dst`` <- what ``torch.optim.Muon`` orthogonalizes, bitwise: the new momentum buffer
    ``b' = b.lerp(g, 1 - momentum)`` (computed here, not committed: ``buffers`` are only read), or
    with Nesterov ``g.lerp(b', momentum)``, in the buffers' dtype (``in_place``: ``dst`` has it;
    else through temporaries; ``math_dtype``: ``lerp_math_dtype`` of the buffers). torch's lerp
    computes ``g.lerp(b', m)`` for m >= 0.5 as ``b' - (b' - g) * (1 - m)``, which is
    ``b'.lerp_(g, 1 - m)`` to the bit when the weight is the same ``1 - m`` (below 0.5, where lerp
    takes its other form): so b' stays in place."""
    if grads and grads[0].dtype != buffers[0].dtype:  # 16-bit gradients, float32 momentum
        _lerp_across(dst, buffers, grads, momentum, nesterov)
        return
    new = dst if in_place else torch._foreach_lerp(buffers, grads, 1.0 - momentum)
    if in_place:
        torch._foreach_copy_(dst, buffers)
        torch._foreach_lerp_(dst, grads, 1.0 - momentum)
    if nesterov:
        if momentum >= 0.5 and math_dtype is not None:
            torch._foreach_lerp_(new, grads, _complement(momentum, math_dtype))
        else:  # torch's other form, or lists whose math types differ: as torch writes it
            new = torch._foreach_lerp(grads, new, momentum)
    if new is not dst:
        torch._foreach_copy_(dst, new)


def _lerp_across(
    dst: list[Tensor], buffers: list[Tensor], grads: list[Tensor], momentum: float, nesterov: bool
) -> None:
    """``muon_input`` for gradients of another dtype than the buffers' (lerp takes one dtype):
    each lerp as ``a * (1 - w) + b * w``, in the buffers' dtype ([Note: main weights])."""
    new = torch._foreach_mul(buffers, momentum)  # (``_lerp_across_`` into a new list)
    torch._foreach_add_(new, grads, alpha=1.0 - momentum)
    if nesterov:
        _lerp_across_(new, grads, momentum)
    torch._foreach_copy_(dst, new)


def _lerp_across_(buffers: list[Tensor] | tuple[Tensor, ...], grads: list[Tensor], momentum: float) -> None:
    """``buffers.lerp_(grads, 1 - momentum)`` for gradients of another dtype."""
    torch._foreach_mul_(buffers, momentum)
    torch._foreach_add_(buffers, grads, alpha=1.0 - momentum)


def commit_momentum(buffers: list[Tensor], grads: list[Tensor], momentum: float) -> None:
    """``buffers.lerp_(grads, 1 - momentum)``, as ``_lerp_across`` where their dtypes differ."""
    if grads and grads[0].dtype != buffers[0].dtype:
        _lerp_across_(buffers, grads, momentum)
    else:
        torch._foreach_lerp_(buffers, grads, 1.0 - momentum)


class MainWeights:
    """What was written into parameters with a main weight by anything but a step ([Note: main
    weights]): each one's version counters (its own and its local shard's) after the step last
    wrote it (``note``); before a step, ``take`` copies into the main weight each local shard
    that moved since and no longer equals the main weight rounded (a load of other weights, a
    copy; a checkpoint loaded with its main weights equals them, which stay)."""

    def __init__(self) -> None:
        self._versions: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def note(self, params: Iterable[Tensor]) -> None:
        for p in params:
            self._versions[p] = (p._version, local_shard(p)._version)

    @torch.no_grad()
    def take(self, params: Iterable[Tensor], state: Any) -> None:
        for p in params:
            main = state.get(p, {}).get(MAIN)
            if main is None or self._versions.get(p) == (p._version, local_shard(p)._version):
                continue
            local, mine = local_shard(p), local_shard(main)
            if not torch.equal(mine.to(local.dtype), local):
                mine.copy_(local)
            self.note([p])


class AdamWKernel(TypedDict):
    """Which of ``torch.optim.adamw.adamw``'s implementations runs: its ``fused`` and ``foreach``."""

    fused: bool
    foreach: bool


def adamw_kernel(params: list[Tensor]) -> AdamWKernel:
    """``fused`` where torch has a fused AdamW for these tensors (CUDA, CPU, ...), else ``foreach``."""
    fused, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=True)
    return {"fused": fused, "foreach": foreach}


def adamw(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    group: dict[str, Any],
    kernel: AdamWKernel,
) -> None:
    """One ``torch.optim.AdamW`` step of ``group``'s settings on these local tensors. The fused
    kernel gets contiguous gradients: on CPU (torch 2.13.0) it reads a strided gradient as if it
    were contiguous, so ``torch.optim.AdamW(fused=True)`` itself steps wrongly with one."""
    beta1, beta2 = group["betas"]
    if kernel["fused"] and not all(g.is_contiguous() for g in grads):
        grads = [g.contiguous() for g in grads]
    lr = group["lr"]
    if isinstance(lr, Tensor):  # (any one-element shape; torch's foreach AdamW takes a number)
        lr = lr.reshape(()) if kernel["fused"] else float(lr)
    torch_adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=lr,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
        **kernel,
    )


def check_saved_state(name: str, param: Tensor, group: dict[str, Any], saved: dict[str, Any]) -> None:
    """``saved`` (from a state dict) must hold the state keys of the parameter's kind, each
    shaped like the parameter (a row variant's state like its rows, ``step`` aside), or
    nothing (the parameter then starts afresh)."""
    expected = set(state_keys(group, param, main=False))  # (a main weight is taken when saved, else made)
    if saved and set(saved) - {MAIN} != expected:
        raise ValueError(f"{name}: state dict holds {sorted(saved)}, expected {sorted(expected)}")
    for key, value in saved.items():
        shape = row_shape(param, group["flatten"]) if key in row_state_keys() else tuple(param.shape)
        if key != "step" and tuple(value.shape) != shape:
            raise ValueError(f"{name}: saved {key} has shape {tuple(value.shape)}, expected {shape}")


def check_state_dict(state_dict: dict[str, Any], groups: list[dict[str, Any]], names: dict) -> None:
    """A state dict to load must match the optimizer group by group and parameter by parameter.
    A group saved without ``use_muon`` (``torch.optim.Muon``'s) matches a Muon group."""
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    if len(saved_groups) != len(groups):
        raise ValueError(f"state dict has {len(saved_groups)} param groups, this optimizer {len(groups)}")
    for index, (saved, group) in enumerate(zip(saved_groups, groups, strict=True)):
        kind = saved.get("use_muon", True if "ns_steps" in saved else None)
        if len(saved["params"]) != len(group["params"]) or kind != group["use_muon"]:
            theirs, ours = len(saved["params"]), len(group["params"])
            raise ValueError(
                f"param group {index}: state dict has {theirs} parameters (use_muon="
                f"{saved.get('use_muon')}), this optimizer {ours} (use_muon={group['use_muon']})"
            )
        variant = saved.get("variant", "muon")
        if group["use_muon"] and variant != group["variant"]:
            raise ValueError(
                f"param group {index}: the state dict was saved with variant={variant!r}, this optimizer's "
                f"group has variant={group['variant']!r}: build the optimizer with the variant the run was "
                "saved with (a state dict resumes its run as it was)"
            )
        for key, p in zip(saved["params"], group["params"], strict=True):
            check_saved_state(names[p], p, group, saved_state.get(key, {}))
