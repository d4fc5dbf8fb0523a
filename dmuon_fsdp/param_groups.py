"""Routing a model's parameters: hidden matrices to Muon; embeddings, output head and vectors to AdamW."""

from __future__ import annotations

from typing import Any

from torch import nn


def _output_heads(model: nn.Module, head: str | nn.Module | None) -> set[nn.Parameter]:
    if isinstance(head, str):
        head = model.get_submodule(head)
    if isinstance(head, nn.Module):
        return set(head.parameters())
    vocab_sizes = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    projections = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features in vocab_sizes]
    return {projections[-1].weight} if projections else set()


def routing(model: nn.Module, head: str | nn.Module | None = None) -> dict[nn.Parameter, tuple[str, bool]]:
    """Each parameter of ``model``: (its qualified name, whether it goes to Muon), by the rule of
    ``param_groups`` (trainable or not)."""
    to_adamw: set[nn.Parameter] = _output_heads(model, head)
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            to_adamw.add(module.weight)
    return {p: (name, p.ndim >= 2 and p not in to_adamw) for name, p in model.named_parameters()}


def param_groups(
    model: nn.Module,
    head: str | nn.Module | None = None,
    stacked: str | tuple[str, ...] = (),
    **muon_options: Any,
) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters into Muon and AdamW groups.

    AdamW gets every ``nn.Embedding`` weight, the output head and every parameter with fewer than
    two dims; Muon gets the remaining matrices (and conv kernels). The head is ``head`` (a
    submodule or its qualified name) or, when not given, the last registered ``nn.Linear`` whose
    ``out_features`` equals an embedding's ``num_embeddings`` (the vocabulary projection); a head
    tied to the embedding is the embedding's own parameter. Pass ``head=`` when the heuristic
    does not fit the model. ``stacked``: Muon parameters whose qualified name contains this text
    (or one of these) are stacks of matrices along dim 0, orthogonalized one by one (MoE expert
    stacks ``[E, m, n]``, e.g. ``stacked="experts"``): they form a Muon group of their own with
    ``flatten=False`` (2-D weights it matches, such as torchtitan's ``shared_experts``, are
    orthogonalized as before: ``flatten`` only tells a >2-D weight's matrices). ``muon_options``
    (lr, weight_decay, ...) go into the Muon groups; AdamW options come from the optimizer's
    ``adamw_*`` arguments. Works before or after ``fully_shard``. Groups carry parameter names,
    so errors name the parameter. Code that builds the optimizer from its own flat groups (the
    transformers ``Trainer``) gets the same routing with ``DMuonFSDP(groups, route=model)``
    (``stacked`` has no counterpart there: set ``flatten=False`` on the groups holding experts).

    Example: ``DMuonFSDP(param_groups(model, lr=0.02), adamw_lr=3e-4)``.
    """
    stacked = (stacked,) if isinstance(stacked, str) else tuple(stacked)
    muon, stacks, adamw = [], [], []
    for p, (name, to_muon) in routing(model, head).items():
        if p.requires_grad:
            stack = to_muon and any(text in name for text in stacked)
            (stacks if stack else muon if to_muon else adamw).append((name, p))
    groups: list[dict[str, Any]] = []
    if muon:
        groups.append({"params": muon, "use_muon": True, **muon_options})
    if stacks:
        groups.append({"params": stacks, "use_muon": True, **muon_options, "flatten": False})
    if adamw:
        groups.append({"params": adamw, "use_muon": False})
    return groups
