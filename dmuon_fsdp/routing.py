"""A model's parameters in the optimizer: routed (hidden matrices to Muon; embeddings, output
head and vectors to AdamW) by ``param_groups`` or ``route=``, each given a name for messages,
and each param group split into its Muon and AdamW parts (``split_group``) and checked before
it is added (``check_new_groups``). Other optimizers' names get the name to use. Tensors named
here are remembered with their model (``MODEL_OF``), so that an optimizer built before
``fully_shard`` can follow the sharded parameters (``dmuon_fsdp._step.swaps``).
"""

from __future__ import annotations

import difflib
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial
from torch.utils.weak import WeakIdKeyDictionary

from dmuon_fsdp._step import comm
from dmuon_fsdp._step.layouts import describe_params
from dmuon_fsdp.config import GROUP_OPTIONS, OPTIMIZER_WIDE, check_groups


def _named(model: nn.Module, kind: type[nn.Module]) -> list[tuple[str, Any]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, kind)]


def _guessed_head(model: nn.Module) -> nn.Module | None:
    """The last ``nn.Linear`` whose ``out_features`` is the vocabulary, or None. The vocabulary is
    the largest ``num_embeddings`` among the tables whose size no ``nn.Linear`` takes in (logits
    feed nothing; a positional table as long as a hidden width does), or among all tables when each
    is. Warns when another ``nn.Linear`` or an equally large table makes the choice ambiguous."""
    embeddings = _named(model, nn.Embedding)
    linears = _named(model, nn.Linear)
    taken_in = {m.in_features for _, m in linears}
    tables = [(name, e) for name, e in embeddings if e.num_embeddings not in taken_in] or embeddings
    sizes = {e.num_embeddings for _, e in tables}
    candidates = [(name, m) for name, m in linears if m.out_features in sizes]
    if not candidates:
        return None
    vocab = max(sizes)
    vocabularies = [name for name, e in tables if e.num_embeddings == vocab]
    heads = [name for name, m in candidates if m.out_features == vocab]
    chosen = heads[-1] if heads else None
    if len(candidates) > 1 or (heads and len(vocabularies) > 1):
        listed = ", ".join(f"{name} ({m.out_features})" for name, m in candidates)
        warnings.warn(
            f"dmuon_fsdp cannot tell the output head for sure: nn.Linear {listed} have out_features equal "
            f"to an nn.Embedding's num_embeddings; taking {vocab} (embedding {', '.join(vocabularies)}) as "
            f"the vocabulary, the head is {chosen if chosen is not None else 'none'}. Pass head= to choose "
            "(the head or its name; the token embedding when the head is F.linear with its weight)",
            stacklevel=5,  # the caller of param_groups or of DMuonFSDP(route=)
        )
    return model.get_submodule(chosen) if chosen is not None else None


# What ``head=`` and ``adamw=`` take: a module of the model or its qualified name, or several.
Modules = nn.Module | str | Sequence[nn.Module | str]
# ``adamw=`` takes those, or a predicate on each (qualified name, parameter).
Chosen = Modules | Callable[[str, Tensor], bool]


def _modules(model: nn.Module, given: Modules | None, argument: str) -> list[nn.Module]:
    """The submodules of ``model`` that ``given`` names (modules, qualified names, or a list of
    them); an error says what ``argument`` accepts."""
    if given is None:
        return []
    items = [given] if isinstance(given, nn.Module | str) else given
    if not isinstance(items, Sequence):
        raise TypeError(
            f"{argument} takes a submodule of the model, its qualified name, or a list of them; "
            f"got {type(given).__name__}"
        )
    inside = {id(m) for m in model.modules()}
    out = []
    for item in items:
        if isinstance(item, str):
            try:
                out.append(model.get_submodule(item))
            except AttributeError:
                raise ValueError(f"{argument}: the model has no submodule {item!r}") from None
        elif isinstance(item, nn.Module):
            if id(item) not in inside:
                raise ValueError(f"{argument}: a {type(item).__name__} that is not a submodule of the model")
            out.append(item)
        else:
            raise TypeError(
                f"{argument} takes submodules of the model or their qualified names; "
                f"got a {type(item).__name__}"
            )
    return out


def _heads(model: nn.Module, head: Modules | None) -> tuple[list[nn.Module], str]:
    """``head`` when given, else every ``nn.Linear`` whose weight is an embedding's, else the
    guess; and how they were found."""
    if head is not None:
        return _modules(model, head, "head="), "the output head (head=)"
    embedded = {e.weight for _, e in _named(model, nn.Embedding)}
    tied = [m for _, m in _named(model, nn.Linear) if m.weight in embedded]
    if tied:
        return tied, "the output head (tied to an embedding)"
    guess = _guessed_head(model)
    return ([guess] if guess is not None else []), "the output head (out_features = the vocabulary)"


@dataclass(frozen=True)
class Route:
    """One parameter's optimizer and the rule that chose it (``Routing``)."""

    name: str
    shape: tuple[int, ...]
    muon: bool
    rule: str
    trainable: bool


class Routing:
    """Which optimizer each parameter of ``model`` gets, by ``param_groups``' rules, and why
    (``print`` it for a table). AdamW gets, by the first rule that holds: vectors (ndim < 2);
    the modules and parameters ``adamw`` names (modules, qualified names, or a predicate on
    (name, parameter)); the output head (``head``: one module, its name, or several; else an
    ``nn.Linear`` tied to an embedding, else the guess, see ``param_groups``); ``nn.Embedding``
    weights; a parameter whose matrix has one row (a leading dim of 1: cls, register and query
    tokens, position tables such as timm's (1, n, d), a (1, d) weight; for ``stacked``
    parameters, the second dim). Muon gets the other matrices, conv kernels as (dim0, -1)
    matrices, and the parameters whose names contain a text of ``stacked`` as stacks of
    matrices. Frozen parameters are routed too (``trainable`` False); ``param_groups`` leaves
    them out. ``DMuonFSDP(groups, route=Routing(model, ...))`` routes flat groups so."""

    def __init__(
        self,
        model: nn.Module,
        head: Modules | None = None,
        stacked: str | Sequence[str] = (),
        adamw: Chosen = (),
    ) -> None:
        self.stacked = (stacked,) if isinstance(stacked, str) else tuple(stacked)
        if not all(isinstance(text, str) for text in self.stacked):
            raise TypeError(f"stacked= takes a text or a list of texts (parts of names); got {stacked!r}")
        named = dict(model.named_parameters())
        if callable(adamw) and not isinstance(adamw, nn.Module):
            chosen = {p for name, p in named.items() if adamw(name, p)}
        else:
            chosen = {p for m in _modules(model, adamw, "adamw=") for p in m.parameters()}
        heads, found = _heads(model, head)
        head_params = {p for m in heads for p in m.parameters()}
        embedded = {e.weight for _, e in _named(model, nn.Embedding)}
        self.routes: dict[Tensor, Route] = {}
        for name, p in named.items():
            MODEL_OF[p] = weakref.ref(model)
            stack = any(text in name for text in self.stacked)
            rows = p.shape[1] if stack and p.ndim > 2 else p.shape[0] if p.ndim else 0
            rule = (
                "AdamW: a vector (ndim < 2)"
                if p.ndim < 2
                else "AdamW: named by adamw="
                if p in chosen
                else f"AdamW: {found}"
                if p in head_params
                else "AdamW: an embedding"
                if p in embedded
                else "AdamW: one row, not a matrix (a token or a (1, n) weight)"
                if rows == 1
                else "Muon: a stack of matrices (stacked=)"
                if stack
                else "Muon: a hidden matrix"
                if p.ndim == 2
                else "Muon: a kernel, as a (dim0, -1) matrix"
            )
            self.routes[p] = Route(name, tuple(p.shape), rule.startswith("Muon"), rule, p.requires_grad)

    def __str__(self) -> str:
        width = max((len(r.name) for r in self.routes.values()), default=4)
        lines = [f"{'parameter':<{width}}  {'shape':<18} rule"]
        for r in self.routes.values():
            frozen = "" if r.trainable else " (frozen: left out)"
            lines.append(f"{r.name:<{width}}  {str(r.shape):<18} {r.rule}{frozen}")
        muon = sum(r.trainable and r.muon for r in self.routes.values())
        adamw = sum(r.trainable and not r.muon for r in self.routes.values())
        lines.append(f"{muon} trainable parameters on Muon, {adamw} on AdamW")
        return "\n".join(lines)


# Each tensor ``Routing`` named -> its model (weakly): see [Note: built before fully_shard].
MODEL_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()


# ``param_groups``' own arguments and the options a Muon group takes (optimizer-wide ones are
# the optimizer's).
_MUON_OPTIONS = tuple(option for option in GROUP_OPTIONS if not option.startswith("adamw_"))


def param_groups(
    model: nn.Module,
    head: Modules | None = None,
    stacked: str | Sequence[str] = (),
    adamw: Chosen = (),
    **muon_options: Any,
) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters into Muon and AdamW groups, by ``Routing``'s rules
    (``print(Routing(model, ...))`` shows each parameter's and why).

    AdamW gets every ``nn.Embedding`` weight, the output head, every parameter with fewer than
    two dims, every parameter whose matrix has one row (tokens, (1, n) weights) and the modules
    or parameters ``adamw`` names (modules of the model, qualified names, a list of them, or a
    predicate on (name, parameter): a VLA's patch embedding and state and action projections,
    say); Muon gets the remaining matrices (and conv kernels). The head is ``head`` (a submodule
    or its qualified name, or a list of them: a VLA's language head and action head) or, when
    not given: every ``nn.Linear`` whose weight *is* an embedding's weight (a tied head); else
    the last ``nn.Linear`` whose ``out_features`` is the vocabulary: the largest
    ``num_embeddings`` among the embeddings whose size no ``nn.Linear`` takes in (so that a
    positional table as long as a hidden width is not taken for it; all of them when each size
    is taken in); else none, as for a head applied with ``F.linear(h, embedding.weight)``: every
    hidden ``nn.Linear`` stays on Muon. The guess warns (UserWarning, naming the candidates and
    the choice) when it is ambiguous: more than one ``nn.Linear`` has such an embedding's size as
    ``out_features``, or two embeddings are the largest. Pass ``head=`` to choose (the token
    embedding when the head is ``F.linear`` with its weight); it never warns. ``stacked``: Muon
    parameters whose qualified name contains this text (or one of these) are stacks of matrices
    along dim 0, orthogonalized one by one (MoE expert stacks ``[E, m, n]``, e.g.
    ``stacked="experts"``): they form a Muon group of their own with ``flatten=False`` (2-D
    weights it matches, such as torchtitan's ``shared_experts``, are orthogonalized as before:
    ``flatten`` only tells a >2-D weight's matrices). ``muon_options`` (lr, weight_decay, ...: a
    Muon group's options) go into the Muon groups, and anything else is refused; AdamW options
    come from the optimizer's ``adamw_*`` arguments. Works before or after ``fully_shard``.
    Groups carry parameter names, so errors name the parameter. Code that builds the optimizer
    from its own flat groups (the transformers ``Trainer``) gets the same routing with
    ``DMuonFSDP(groups, route=model)``, or ``route=Routing(model, head=..., stacked=...,
    adamw=...)`` (set ``flatten=False`` on the groups holding stacks).

    Example: ``DMuonFSDP(param_groups(model, lr=0.02), adamw_lr=3e-3)``.
    """
    _refuse_unknown(muon_options)
    routes = Routing(model, head, stacked, adamw)
    muon: list[tuple[str, Tensor]] = []
    stacks: list[tuple[str, Tensor]] = []
    adamw_params: list[tuple[str, Tensor]] = []
    for p, route in routes.routes.items():
        if p.requires_grad:
            stack = route.muon and any(text in route.name for text in routes.stacked)
            (stacks if stack else muon if route.muon else adamw_params).append((route.name, p))
    groups: list[dict[str, Any]] = []
    if muon:
        groups.append({"params": muon, "use_muon": True, **muon_options})
    if stacks:
        groups.append({"params": stacks, "use_muon": True, **muon_options, "flatten": False})
    if adamw_params:
        groups.append({"params": adamw_params, "use_muon": False})
    return groups


def _refuse_unknown(muon_options: dict[str, Any]) -> None:
    """A keyword ``param_groups`` does not take: a TypeError naming it and what to do instead."""
    for option in muon_options:
        if option in _MUON_OPTIONS:
            continue
        close = difflib.get_close_matches(option, [*_MUON_OPTIONS, "head", "adamw", "stacked"], n=1)
        where = (
            "an optimizer-wide option: pass it to DMuonFSDP"
            if option in OPTIMIZER_WIDE
            else "AdamW's settings are DMuonFSDP's adamw_* arguments"
            if option.startswith("adamw_")
            else f"did you mean {close[0]}?"
            if close
            else f"it takes head, adamw, stacked and a Muon group's options ({', '.join(_MUON_OPTIONS)})"
        )
        raise TypeError(f"param_groups() got an unexpected keyword argument {option!r}: {where}")


def group_params(groups: Sequence[dict[str, Any]]) -> list[Tensor]:
    """The parameters in ``param_groups`` now, in optimizer order."""
    return [p for group in groups for p in group["params"]]


def indexed(groups: Sequence[dict[str, Any]]) -> list[tuple[int, Tensor]]:
    """(group index, parameter) for each parameter in ``param_groups``, in optimizer order."""
    return [(g, p) for g, group in enumerate(groups) for p in group["params"]]


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


def _check_joins(
    p: Tensor,
    name: str,
    known: dict[Tensor, str],
    names: dict[Tensor, str],
    route: dict[Tensor, Route] | None,
) -> None:
    """A parameter may join the optimizer once, and with ``route``, only from that model."""
    if p in known or p in names:  # torch's wording for the case, then which parameter
        where = "some parameters appear in more than one parameter group" if p in known else "a param group"
        first = known.get(p, names.get(p))
        raise ValueError(f"{where}: {name} is passed to the optimizer twice (first as {first})")
    if route is not None and p not in route:
        raise ValueError(f"{name} is not a parameter of the model given as route")


def split_group(
    param_group: dict[str, Any],
    first_index: int,
    known: dict[Tensor, str],
    defaults: dict[str, Any],
    route: dict[Tensor, Route] | None = None,
    first_group: int = 0,
) -> tuple[list[dict[str, Any]], dict[Tensor, str]]:
    """Route a param group's parameters: a Muon group and/or an AdamW group, and each
    parameter's name for messages (``known``: the names already taken; ``first_group``: the
    index the first new group will have, for messages). Without ``use_muon`` in
    the group, matrices go to Muon, or with ``route`` (parameter -> its ``Route``, see
    ``Routing``) what it says. The group's own lr, betas, eps and weight_decay are
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
        _check_joins(p, name, known, names, route)
        if route is not None and not isinstance(item, tuple):
            name = route[p].name
        to_muon = use_muon if use_muon is not None else route[p].muon if route is not None else p.ndim >= 2
        if to_muon and p.ndim < 2:
            raise ValueError(
                f"{name} has shape {tuple(p.shape)} but its group sets use_muon=True: Muon needs a matrix "
                "(ndim >= 2)"
            )
        if p.is_complex():
            raise ValueError(f"{name}: complex parameters are not supported")
        names[p] = name
        (muon if to_muon else adamw).append(item)
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
