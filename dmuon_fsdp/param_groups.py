"""Routing a model's parameters: hidden matrices to Muon; embeddings, output head and vectors to AdamW."""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn


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


def _heads(model: nn.Module, head: str | nn.Module | None) -> list[nn.Module]:
    """``head`` when given, else every ``nn.Linear`` whose weight is an embedding's, else the guess."""
    if isinstance(head, str):
        return [model.get_submodule(head)]
    if head is not None:
        return [head]
    embedded = {e.weight for _, e in _named(model, nn.Embedding)}
    tied = [m for _, m in _named(model, nn.Linear) if m.weight in embedded]
    if tied:
        return tied
    guess = _guessed_head(model)
    return [guess] if guess is not None else []


def routing(model: nn.Module, head: str | nn.Module | None = None) -> dict[nn.Parameter, tuple[str, bool]]:
    """Each parameter of ``model``: (its qualified name, whether it goes to Muon), by the rule of
    ``param_groups`` (trainable or not), ``head`` included; ``DMuonFSDP(route=model)`` uses it, so
    an ambiguous guess of the head warns there too."""
    to_adamw = {p for module in _heads(model, head) for p in module.parameters()}
    to_adamw.update(e.weight for _, e in _named(model, nn.Embedding))
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
    submodule or its qualified name) or, when not given: every ``nn.Linear`` whose weight *is* an
    embedding's weight (a tied head); else the last ``nn.Linear`` whose ``out_features`` is the
    vocabulary: the largest ``num_embeddings`` among the embeddings whose size no ``nn.Linear``
    takes in (so that a positional table as long as a hidden width is not taken for it; all of
    them when each size is taken in); else none, as for a head applied with
    ``F.linear(h, embedding.weight)``: every hidden ``nn.Linear`` stays on Muon. The guess warns
    (UserWarning, naming the candidates and the choice) when it is ambiguous: more than one
    ``nn.Linear`` has such an embedding's size as ``out_features``, or two embeddings are the
    largest. Pass ``head=`` to choose (the token embedding when the head is ``F.linear`` with its
    weight); it never warns. ``stacked``: Muon parameters whose qualified name contains this text
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
