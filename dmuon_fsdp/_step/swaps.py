"""Following parameters a framework replaced in ``param_groups``.

HF Accelerate (and the transformers Trainer through it) builds the optimizer on the unsharded
model, calls ``fully_shard``, then puts each sharded DTensor where its unsharded parameter was
in ``param_groups``. Torch's own optimizers survive that because their state is lazy; ours
exists from construction, keyed by the tensors it was given. When the optimizer notices a
replacement (cheaply, before every step), ``follow`` checks that it keeps order and shapes and
moves names and state onto the new tensors (``placed_like``: exactly, onto the new layout).

[Note: built before fully_shard]
An optimizer built before ``fully_shard`` with nobody to swap its tensors (a plain loop) would
hold the unsharded parameters, which FSDP2 took out of the model: they get no gradient, and
nothing trains. FSDP2 marks each parameter it takes (``_fsdp_orig_uid``, which its own
``FSDPParam`` keeps), so such a tensor is told apart without the model. ``param_groups(model)``
and ``route=model`` remember the model of each tensor they name (weakly); from it
``follow_fully_shard`` finds the ``FSDPParam`` that took the tensor and puts its sharded
parameter in the tensor's place in ``param_groups``, and ``follow`` goes on as for Accelerate's
swap. A marked tensor of an unknown model is an error at the first step, naming the parameter
and the fix. Every rank shards the same modules, so every rank follows, or raises, alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from dmuon_fsdp._step.state import MAIN, initial_state, local_shard
from dmuon_fsdp.routing import MODEL_OF, check_new_groups, indexed


def follow_fully_shard(groups: list[dict[str, Any]], names: dict[Tensor, str]) -> bool:
    """Put in ``groups``, in place, the sharded parameter ``fully_shard`` made of each tensor
    there that it took out of its model since (see [Note: built before fully_shard]); whether
    any was. Raises when a taken tensor's model is unknown. Asked by a step where some parameter
    has no gradient (as each taken one has none): one pass of attribute checks."""
    replaced = False
    made: dict[int, dict[int, Tensor]] = {}  # per model (by id): FSDP2's uid -> sharded parameter
    for group in groups:
        params = group["params"]
        for i, p in enumerate(params):
            uid = getattr(p, "_fsdp_orig_uid", None)
            if uid is None:
                continue
            ref = MODEL_OF.get(p)
            model = ref() if ref is not None else None
            if model is not None and id(model) not in made:
                made[id(model)] = _sharded_by_uid(model)
            new = made[id(model)].get(uid) if model is not None else None
            if new is None:
                raise RuntimeError(
                    f"{names[p]} was replaced in its model by fully_shard after this optimizer was built "
                    "(FSDP2 gives the module sharded parameters; the optimizer's unsharded one gets no "
                    "gradient, so nothing would train): build the optimizer after fully_shard, or from "
                    "param_groups(model) (or with route=model), which it then follows"
                )
            params[i], replaced = new, True
            MODEL_OF[new] = ref
    return replaced


def _sharded_by_uid(model: nn.Module) -> dict[int, Tensor]:
    """FSDP2's sharded parameters in ``model``, by the uid of the tensor each replaced."""
    out: dict[int, Tensor] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                out[fsdp_param._orig_param_uid] = fsdp_param.sharded_param
    return out


@dataclass(frozen=True)
class Followed:
    """The optimizer's bookkeeping after a replacement: (group index, parameter) in optimizer
    order, every parameter's name, and the Muon parameters' meshes (``check_new_groups``)."""

    indexed: list[tuple[int, Tensor]]
    names: dict[Tensor, str]
    meshes: dict[Any, str]


def follow(
    groups: list[dict[str, Any]],
    known: list[tuple[int, Tensor]],
    names: dict[Tensor, str],
    state: Any,
    written: bool,
) -> Followed:
    """Follow tensors replaced in ``groups`` since the optimizer knew them as ``known``:
    everything is checked first (order, shapes, meshes; errors name the parameter), then each
    replaced parameter's ``state`` moves to the new tensor, exactly when ``written`` (a step or a
    load has written state), else made anew."""
    now = indexed(groups)
    current = [p for _, p in now]
    check(known, now, names, written)
    names = {new: names[old] for (_, old), new in zip(known, current, strict=True)}
    meshes = check_new_groups(groups, names, {}, {})
    states = [state.pop(old, {}) for _, old in known]
    for (g, old), new, saved in zip(known, current, states, strict=True):
        if new is old:
            state[new] = saved
        elif written and saved:
            fresh = initial_state(new, groups[g], main=MAIN in saved)  # how each entry is placed on it
            state[new] = {
                key: value.to(new.device) if key == "step" else placed_like(value, fresh[key])
                for key, value in saved.items()
                if key in fresh  # (an entry the group's variant no longer keeps goes)
            }
        else:
            state[new] = initial_state(new, groups[g], main=False)  # (``_set_meshes`` makes a main weight)
    return Followed(now, names, meshes)


def check(
    known: list[tuple[int, Tensor]],
    current: list[tuple[int, Tensor]],
    names: dict[Tensor, str],
    keeps_values: bool,
) -> None:
    """A replacement must be one for one: same count per group, each tensor with its
    predecessor's global shape, none twice; with ``keeps_values`` (state a step or a load has
    written), state must be movable exactly (not on the meta device, dtype not narrowed). Raises
    naming the parameter; every rank sees the same shapes and dtypes, so every rank raises
    alike, before any move."""
    if [g for g, _ in current] != [g for g, _ in known]:
        raise ValueError(
            f"param_groups now hold {_group_sizes(current)} parameters per group, the optimizer was given "
            f"{_group_sizes(known)}: a framework may replace parameters one for one (same groups, order and "
            "shapes); add new ones with add_param_group"
        )
    seen: set[Tensor] = set()
    for (_, old), (_, new) in zip(known, current, strict=True):
        name = names[old]
        if not isinstance(new, Tensor):
            raise TypeError(f"{name} was replaced in param_groups by a {type(new).__name__}, not a tensor")
        if new in seen:
            raise ValueError(f"{name} was replaced in param_groups by a tensor that appears there twice")
        seen.add(new)
        if tuple(new.shape) != tuple(old.shape):
            raise ValueError(
                f"{name} was replaced in param_groups by a tensor of shape {tuple(new.shape)}: replacements "
                "must "
                "keep each parameter's (global) shape and the order"
            )
        if keeps_values and new is not old:
            _check_movable(name, old.dtype, new.dtype, old.is_meta or new.is_meta)


def _group_sizes(indexed: list[tuple[int, Tensor]]) -> list[int]:
    sizes: dict[int, int] = {}
    for g, _ in indexed:
        sizes[g] = sizes.get(g, 0) + 1
    return list(sizes.values())


def _check_movable(name: str, old_dtype: torch.dtype, new_dtype: torch.dtype, meta: bool) -> None:
    if meta:
        raise ValueError(
            f"{name}: its optimizer state holds values and cannot be moved to or from the meta device; "
            "replace the parameter with a materialized one, or build the optimizer after the model is set up"
        )
    if torch.promote_types(old_dtype, new_dtype) != new_dtype:
        raise ValueError(
            f"{name} was replaced by a {new_dtype} tensor but its state is {old_dtype}: narrowing it would "
            "not be exact; build the optimizer after the dtype change"
        )


def placed_like(value: Tensor, param: Tensor) -> Tensor:
    """``value`` (a state tensor shaped like ``param``, here a fresh state entry of the new
    parameter: plain, or a DTensor on any mesh) laid out and typed like ``param``, with the same
    values; the result owns its storage. A DTensor on
    ``param``'s mesh moves by DTensor's redistribute (Replicate -> Shard is a local slice, a
    change of shard dim an all-to-all); only one on another mesh is gathered whole. Both are
    collectives over the mesh, so every rank must replace the same parameters (frameworks do)."""
    if isinstance(value, DTensor):
        if isinstance(param, DTensor) and value.device_mesh == param.device_mesh:
            value = value.redistribute(param.device_mesh, param.placements)
        else:
            value = value.full_tensor()
    if isinstance(param, DTensor) and not isinstance(value, DTensor):  # DTensor's rule, no communication
        value = distribute_tensor(
            value.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        )
    out = torch.empty_like(param, memory_format=torch.preserve_format)
    local_shard(out).copy_(local_shard(value))
    return out
