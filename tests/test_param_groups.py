"""param_groups' guess of the output head: tied by identity, the token embedding's vocabulary, warnings."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dmuon_fsdp import DMuonFSDP, param_groups

VOCAB, WIDTH = 57, 64
# Positional tables longer than the vocabulary: as long as the model is wide (the report), as fc1 is.
SEQS = [WIDTH, 4 * WIDTH]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(h)))


class GPT(nn.Module):
    """``head``: "functional" (``F.linear`` with the token embedding's weight), "tied" (an
    ``nn.Linear`` holding that weight) or "untied"; the head module is registered before the
    blocks, so registration order alone cannot tell it."""

    def __init__(self, head, seq):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(seq, WIDTH)
        if head != "functional":
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if head == "tied":
            self.head.weight = self.wte.weight
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, tokens):
        h = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[-1]))
        for layer in self.layers:
            h = layer(h)
        return self.head(h) if hasattr(self, "head") else F.linear(h, self.wte.weight)


def split(groups):
    """(Muon parameter names, AdamW parameter names)."""
    muon = [n for g in groups if g["use_muon"] for n, _ in g["params"]]
    adamw = [n for g in groups if not g["use_muon"] for n, _ in g["params"]]
    return muon, adamw


def routed_without_warning(model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return split(param_groups(model, **kwargs))


HIDDEN = [f"layers.{i}.{fc}.weight" for i in (0, 1) for fc in ("fc1", "fc2")]
VECTORS = [f"layers.{i}.{fc}.bias" for i in (0, 1) for fc in ("fc1", "fc2")]


@pytest.mark.parametrize("seq", SEQS)
def test_functional_head_keeps_every_hidden_linear_on_muon(seq):
    # The report (seq 64): wpe's 64 rows (the width, fc2's out_features) were taken for a
    # vocabulary, so layers.1.fc2.weight went to AdamW, silently.
    model = GPT("functional", seq)
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, VOCAB)
    muon, adamw = routed_without_warning(model)
    assert muon == HIDDEN
    assert adamw == ["wte.weight", "wpe.weight", *VECTORS]


@pytest.mark.parametrize("seq", SEQS)
def test_linear_tied_to_the_embedding_is_the_head(seq):
    muon, adamw = routed_without_warning(GPT("tied", seq))
    assert muon == HIDDEN
    assert adamw == ["wte.weight", "wpe.weight", *VECTORS]  # the shared weight once


def test_tie_by_identity_beats_the_guess():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(32, 8)
            self.head = nn.Linear(8, 32, bias=False)
            self.head.weight = self.embed.weight
            self.up = nn.Linear(8, 32)  # out_features the vocabulary: the guess alone would take it
            self.down = nn.Linear(32, 8)

    muon, adamw = routed_without_warning(Model())
    assert muon == ["up.weight", "down.weight"]
    assert adamw == ["embed.weight", "up.bias", "down.bias"]


@pytest.mark.parametrize("seq", SEQS)
def test_untied_head_is_found_wherever_it_is_registered(seq):
    muon, adamw = routed_without_warning(GPT("untied", seq))
    assert muon == HIDDEN
    assert adamw == ["wte.weight", "wpe.weight", "head.weight", *VECTORS]


class WideHidden(nn.Module):
    """Hidden layers as wide as the vocabulary, and an untied head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.up = nn.Linear(8, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 32)


def test_ambiguous_guess_warns_naming_candidates_and_choice():
    with pytest.warns(UserWarning) as caught:
        muon, adamw = split(param_groups(WideHidden()))
    assert muon == ["up.weight", "mid.weight"] and "head.weight" in adamw
    [warning] = caught
    message = str(warning.message)
    assert "up (32), mid (32), head (32)" in message
    assert "(embedding embed)" in message and "the head is head." in message and "head=" in message
    assert warning.filename == __file__  # points at the caller


def test_equally_large_tables_warn():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(64, 16)
            self.positions = nn.Embedding(64, 16)
            self.fc = nn.Linear(16, 64)  # a hidden layer, or a head: cannot tell

    with pytest.warns(UserWarning, match=r"nn.Linear fc \(64\).*embedding tokens, positions.*head is fc\."):
        param_groups(Model())


@pytest.mark.parametrize("head", ["head", "mid", "embed"])
def test_explicit_head_silences_the_ambiguous_guess(head):
    model = WideHidden()
    with pytest.warns(UserWarning, match="Pass head= to choose"):
        param_groups(model)
    muon, adamw = routed_without_warning(model, head=head)
    chosen = [] if head == "embed" else [f"{head}.weight"]
    assert muon == [n for n in ("up.weight", "mid.weight", "head.weight") if n not in chosen]
    assert set(chosen) <= set(adamw)


def test_route_warns_too_and_follows_the_same_guess():
    model = WideHidden()
    with pytest.warns(UserWarning, match="cannot tell the output head") as caught:
        opt = DMuonFSDP([{"params": list(model.parameters())}], route=model)
    assert caught[0].filename == __file__
    muon = [id(p) for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    assert muon == [id(model.up.weight), id(model.mid.weight)]


# VLAs (tests/support/vla.py): a pi0-shaped policy routed as Muon's authors route theirs.


def pi0_routing(**extra):
    from tests.support.vla import Pi0

    model = Pi0()
    patch = model.vlm.model.vision_tower.embeddings.patch_embedding
    return model, param_groups(
        model, head=[model.action_out_proj], adamw=[patch, model.action_in_proj, "state_proj"], **extra
    )


def test_a_vla_routes_only_hidden_matrices_to_muon():
    """Hidden matrices of the vision tower, projector, language model, action expert and time MLP
    go to Muon; the patch embedding and input projections (adamw=), the action head (head=),
    embeddings and the (1, 2, width) query tokens (one row: not a matrix) go to AdamW."""
    model, groups = pi0_routing()
    muon, adamw = split(groups)
    hidden = ("self_attn.", "mlp.", "multi_modal_projector.", "action_time_mlp_")
    named = model.named_parameters()
    expected = [n for n, p in named if p.ndim == 2 and n.endswith(".weight") and any(h in n for h in hidden)]
    assert muon == expected and len(muon) == 43
    ends = {"query_tokens", "action_out_proj.weight", "state_proj.weight", "action_in_proj.weight"}
    assert ends <= set(adamw)
    assert "vlm.model.vision_tower.embeddings.patch_embedding.weight" in adamw


def test_routing_says_each_parameters_rule_and_route_takes_it():
    from dmuon_fsdp import Routing

    model, groups = pi0_routing()
    patch = model.vlm.model.vision_tower.embeddings.patch_embedding
    routes = Routing(
        model,
        head=model.action_out_proj,
        adamw=lambda name, p: name in ("action_in_proj.weight", "state_proj.weight") or p is patch.weight,
    )
    table = str(routes)
    assert "query_tokens" in table and "one row" in table and "named by adamw=" in table and "head=" in table
    assert table.splitlines()[-1] == "43 trainable parameters on Muon, 46 on AdamW"
    flat = [{"params": list(model.parameters())}]
    opt = DMuonFSDP(flat, route=routes)
    assert [(opt.param_name(p), g["use_muon"]) for g in opt.param_groups for p in g["params"]] == [
        (n, g["use_muon"]) for g in groups for n, _ in g["params"]
    ]


@pytest.mark.parametrize(
    "kwargs,error,says",
    [
        ({"head": 3}, TypeError, "head= takes a submodule of the model, its qualified name, or a list"),
        ({"adamw": [nn.Linear(2, 2)]}, ValueError, "adamw=: a Linear that is not a submodule of the model"),
        ({"adamw": ["no.such"]}, ValueError, "adamw=: the model has no submodule 'no.such'"),
        ({"adamw": [1.5]}, TypeError, "adamw= takes submodules of the model or their qualified names"),
        ({"stacked": [3]}, TypeError, "stacked= takes a text or a list of texts"),
        ({"adamw_lr": 1e-3}, TypeError, "AdamW's settings are DMuonFSDP's adamw_* arguments"),
        ({"overlap_forward": True}, TypeError, "an optimizer-wide option: pass it to DMuonFSDP"),
        ({"momentun": 0.9}, TypeError, "did you mean momentum?"),
    ],
)
def test_param_groups_refuses_what_it_does_not_take(kwargs, error, says):
    with pytest.raises(error, match=re.escape(says)):
        param_groups(GPT("untied", WIDTH), **kwargs)
