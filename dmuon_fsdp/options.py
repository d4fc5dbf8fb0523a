"""The checks of param groups, their options and saved state that give clear errors before
anything runs, and hints for other optimizers' names (the options themselves and their
vocabularies are in ``dmuon_fsdp.config``)."""

from __future__ import annotations

import difflib
import math
from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor, Partial

from dmuon_fsdp import comm
from dmuon_fsdp.config import ADJUST_LR_FNS, NS_ALGORITHMS, OPTIMIZER_WIDE, VARIANTS, row_state_keys
from dmuon_fsdp.layouts import describe_params
from dmuon_fsdp.newton_schulz import resolve_coefficients
from dmuon_fsdp.state import state_keys
from dmuon_fsdp.variants import row_shape

# Other optimizers' names, with what DMuonFSDP has in their place.
_ADAMW_BETAS = "AdamW's betas are adamw_betas here (Muon's own decay is momentum)"
_ADAMW_KERNEL = "the AdamW side runs torch's fused AdamW where the device has one, else foreach: no flag"
_NOT_ADAMW_FLAGS = {
    "amsgrad": "the AdamW side is torch's AdamW without amsgrad: there is no such option",
    "foreach": _ADAMW_KERNEL,
    "fused": _ADAMW_KERNEL,
    "maximize": "not supported: minimize the negated objective",
    "capturable": "not supported: the step is not CUDA-graph capturable",
    "differentiable": "not supported: the step runs under no_grad",
    "decoupled_weight_decay": "weight decay is decoupled already (weight_decay, adamw_weight_decay)",
}


def refuse_other_names(given: dict[str, Any], known: list[str]) -> None:
    """Keyword arguments the constructor does not take: a TypeError naming the first, with the
    name to use when it is another optimizer's (AdamW's ``betas``, ...) or a near miss."""
    for name in given:
        hint = _ADAMW_BETAS if name == "betas" else _NOT_ADAMW_FLAGS.get(name)
        if hint is None:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]}?" if close else "see DMuonFSDP's docstring for its arguments"
        raise TypeError(f"DMuonFSDP() got an unexpected keyword argument {name!r}: {hint}")


def _refuse_other_group_names(group: dict[str, Any], index: int, has_muon: bool) -> None:
    """A param group with AdamW's flags, or AdamW's ``betas`` where Muon parameters would take
    it for nothing: a ValueError naming the group and what to use."""
    for name, hint in _NOT_ADAMW_FLAGS.items():
        if name in group:
            raise ValueError(f"param group {index}: {name}: {hint}")
    if has_muon and "betas" in group:
        raise ValueError(
            f"param group {index}: betas: the group holds Muon parameters, which have no betas; "
            "give its AdamW part adamw_betas (in the group, or on the optimizer), Muon's decay is momentum"
        )


def check_lr(lr: Any) -> None:
    """An lr that is a tensor must hold one element (torch's rule)."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}")


def _non_negative(group: dict[str, Any], *keys: str) -> None:
    check_lr(group["lr"])
    for key in keys:
        value = float(group[key])
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{key} must be a finite number >= 0, got {group[key]!r}")


def split_group(
    param_group: dict[str, Any],
    first_index: int,
    known: dict[Tensor, str],
    defaults: dict[str, Any],
    route: dict[Tensor, tuple[str, bool]] | None = None,
    first_group: int = 0,
) -> tuple[list[dict[str, Any]], dict[Tensor, str]]:
    """Route a param group's parameters: a Muon group and/or an AdamW group, and each
    parameter's name for messages (``known``: the names already taken; ``first_group``: the
    index the first new group will have, for messages). Without ``use_muon`` in
    the group, matrices go to Muon, or with ``route`` (parameter -> (name, to Muon), see
    ``param_groups.routing``) what it says. The group's own lr, betas, eps and weight_decay are
    AdamW's when all of its parameters go to AdamW (``use_muon=False``, or only vectors); in a
    group that also holds Muon parameters they are Muon's, and its AdamW part takes the
    group's (or the optimizer's) ``adamw_*`` values."""
    group = dict(param_group)
    for key in OPTIMIZER_WIDE:
        if key in group:
            raise ValueError(f"{key} is optimizer-wide and cannot be set per param group")
    params = group.pop("params")
    params = [params] if isinstance(params, Tensor) else list(params)
    use_muon = group.pop("use_muon", None)
    if use_muon not in (None, True, False):
        raise ValueError(f"use_muon must be True, False or unset, got {use_muon!r}")
    names: dict[Tensor, str] = {}
    muon: list[Tensor | tuple[str, Tensor]] = []  # the items as given: tensors or (name, tensor)
    adamw: list[Tensor | tuple[str, Tensor]] = []
    for i, item in enumerate(params):
        name, p = item if isinstance(item, tuple) else (f"parameter {first_index + i}", item)
        if not isinstance(p, Tensor):
            raise TypeError(f"{name} is a {type(p).__name__}, not a tensor")
        if not isinstance(item, tuple):
            name = f"{name} (shape {tuple(p.shape)})"
        if p in known or p in names:  # torch's wording for the case, then which parameter
            where = (
                "some parameters appear in more than one parameter group" if p in known else "a param group"
            )
            first = known.get(p, names.get(p))
            raise ValueError(f"{where}: {name} is passed to the optimizer twice (first as {first})")
        if route is not None and p not in route:
            raise ValueError(f"{name} is not a parameter of the model given as route")
        if route is not None and not isinstance(item, tuple):
            name = route[p][0]
        route_to_muon = (
            use_muon if use_muon is not None else route[p][1] if route is not None else p.ndim >= 2
        )
        if route_to_muon and p.ndim < 2:
            raise ValueError(
                f"{name} has shape {tuple(p.shape)} but its group sets use_muon=True: Muon needs a matrix "
                "(ndim >= 2)"
            )
        if p.is_complex():
            raise ValueError(f"{name}: complex parameters are not supported")
        names[p] = name
        (muon if route_to_muon else adamw).append(item)
    _refuse_other_group_names(group, first_group, bool(muon or not adamw))
    new_groups = []
    if muon or not adamw:
        new_groups.append({**group, "params": muon, "use_muon": True})
    if adamw:
        adamw_group = {**group, "params": adamw, "use_muon": False}
        for key in ("lr", "betas", "eps", "weight_decay"):
            if muon or key not in group:
                adamw_group[key] = group.get(f"adamw_{key}", defaults[f"adamw_{key}"])
        new_groups.append(adamw_group)
    return new_groups, names


def check_muon_group(group: dict[str, Any]) -> None:
    _non_negative(group, "lr", "weight_decay", "eps")
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {group['momentum']}")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        fn = group["adjust_lr_fn"]
        raise ValueError(
            f"Adjust learning rate function {fn} is not supported (adjust_lr_fn: one of {ADJUST_LR_FNS})"
        )
    resolve_coefficients(group["ns_coefficients"], group["ns_steps"])
    if group["ns_algorithm"] not in NS_ALGORITHMS:
        raise ValueError(f"ns_algorithm must be one of {NS_ALGORITHMS}, got {group['ns_algorithm']!r}")
    split_sizes, num_heads = group["split_sizes"], group["num_heads"]
    if split_sizes is not None and num_heads is not None:
        raise ValueError("set at most one of split_sizes and num_heads")
    if split_sizes is not None and not (
        len(split_sizes) > 0
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in split_sizes)
    ):
        raise ValueError(f"split_sizes must be a non-empty list of positive integers, got {split_sizes!r}")
    if num_heads is not None and not (
        isinstance(num_heads, int) and not isinstance(num_heads, bool) and num_heads > 0
    ):
        raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}")
    if not isinstance(group["flatten"], bool):
        raise ValueError(f"flatten must be True or False, got {group['flatten']!r}")
    if group["variant"] not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {group['variant']!r}")
    for variant in VARIANTS.values():  # every variant's options are in every Muon group
        if variant is not None:
            variant.check(group)


def check_groups(groups: list[dict[str, Any]], first_index: int = 0) -> None:
    """Check the options of param groups (numbered from ``first_index``); an error names its group."""
    for index, group in enumerate(groups, start=first_index):
        try:
            (check_muon_group if group["use_muon"] else check_adamw_group)(group)
        except ValueError as e:
            raise ValueError(f"param group {index}: {e}") from None


def check_adamw_group(group: dict[str, Any]) -> None:
    _non_negative(group, "lr", "weight_decay", "eps")
    betas = group["betas"]
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"AdamW betas must be two numbers in [0, 1), got {betas}")


def check_saved_state(name: str, param: Tensor, group: dict[str, Any], saved: dict[str, Any]) -> None:
    """``saved`` (from a state dict) must hold the state keys of the parameter's kind, each
    shaped like the parameter (a row variant's state like its rows, ``step`` aside), or
    nothing (the parameter then starts afresh)."""
    expected = set(state_keys(group))
    if saved and set(saved) != expected:
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


def check_new_groups(
    new_groups: list[dict[str, Any]],
    names: dict[Tensor, str],
    defaults: dict[str, Any],
    meshes: dict[Any, str],
    first_index: int = 0,
) -> dict[Any, str]:
    """Validate hyper-parameters and layouts of groups about to be added to the optimizer (as
    param groups ``first_index`` on: a bad option's error names its group).

    ``meshes`` maps each mesh the Muon parameters seen so far live on (None: plain tensors) to
    the name of one parameter on it; returns it updated (see ``exchange_ranks``).
    """
    meshes = dict(meshes)
    for index, new in enumerate(new_groups, start=first_index):
        merged = {**defaults, **new}
        check_groups([merged], index)
        for item in new["params"]:
            p = item[1] if isinstance(item, tuple) else item
            name = names[p]
            if isinstance(p, DTensor):
                if any(isinstance(pl, Partial) for pl in p.placements):
                    raise NotImplementedError(f"{name} has Partial placements {p.placements}")
                if p.device.type != p.device_mesh.device_type:
                    raise NotImplementedError(
                        f"{name} is on {p.device} but its mesh on {p.device_mesh.device_type}: "
                        "offloaded parameters (CPUOffloadPolicy) are not supported"
                    )
                if p.device_mesh.get_coordinate() is None:
                    raise ValueError(f"{name} lives on {p.device_mesh}, which does not include this rank")
            if not new["use_muon"]:
                continue
            describe_params([(p, name, merged)])  # raises for unsupported layouts
            comm.check_backend(p, name)
            meshes.setdefault(p.device_mesh if isinstance(p, DTensor) else None, name)
    comm.exchange_ranks(meshes)
    return meshes
