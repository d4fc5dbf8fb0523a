"""The constructor's arguments are documented alike in its docstring (``Args:``) and in the
README's argument table: the same names, in the signature's order, with the signature's defaults."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from dmuon_fsdp import DMuonFSDP

README = Path(__file__).resolve().parents[1] / "README.md"
SIGNATURE = inspect.signature(DMuonFSDP.__init__).parameters
ARGUMENTS = [  # (``**other`` only catches other optimizers' names, to answer them)
    name for name, p in SIGNATURE.items() if name not in ("self", "params") and p.kind is not p.VAR_KEYWORD
]


def value(text: str):
    """A default as the docs write it: a Python literal, or a size in MiB."""
    text = text.strip().strip("`")
    size = re.fullmatch(r"(\d+) MiB", text)
    return int(size.group(1)) * 2**20 if size else ast.literal_eval(text)


def split_top_level(text: str) -> list[str]:
    """``text`` split at commas outside parentheses."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [*parts, current]


def docstring_entries() -> dict[str, str]:
    """``Args:`` of the class docstring: each argument's text, continuation lines joined."""
    section = DMuonFSDP.__doc__.split("Args:\n", 1)[1]
    entries: dict[str, str] = {}
    name = None
    for line in section.splitlines():
        entry = re.match(r"        (\w+) \(", line)
        if entry:
            name = entry.group(1)
            entries[name] = line.strip()
        elif name is not None and line.startswith("            "):
            entries[name] += " " + line.strip()
    return entries


def test_the_docstring_documents_every_argument_in_order_with_its_default():
    entries = docstring_entries()
    assert list(entries) == ["params", *ARGUMENTS]
    for name in ARGUMENTS:
        default = re.search(r"\(default: (.*)\)$", entries[name])
        assert default, f"{name}: no '(default: ...)' at the end of its entry"
        assert value(default.group(1)) == SIGNATURE[name].default, name


def test_the_readme_table_names_every_argument_with_its_default():
    text = README.read_text().split("## Arguments", 1)[1].split("\n## ", 1)[0]
    documented = {}
    for row in re.findall(r"^\| (`.*?) \| (.*?) \| .* \|$", text, re.M):
        names = re.findall(r"`(\w+)`", row[0])
        defaults = split_top_level(row[1]) if len(names) > 1 else [row[1]]
        assert len(defaults) == len(names), row
        documented.update({n: value(d) for n, d in zip(names, defaults, strict=True)})
    assert sorted(documented) == sorted(ARGUMENTS)
    for name in ARGUMENTS:
        assert documented[name] == SIGNATURE[name].default, name


def _params():
    return [nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))]


@pytest.mark.parametrize(
    "given, answer",
    [
        ({"betas": (0.9, 0.95)}, "'betas': AdamW's betas are adamw_betas here"),
        ({"amsgrad": True}, "'amsgrad': the AdamW side is torch's AdamW without amsgrad"),
        ({"fused": True}, "'fused': the AdamW side runs torch's fused AdamW where the device has one"),
        ({"foreach": False}, "'foreach': the AdamW side runs torch's fused AdamW where the device has one"),
        ({"maximize": True}, "'maximize': not supported"),
        ({"adamw_beta": (0.9, 0.9)}, "'adamw_beta': did you mean adamw_betas?"),
        ({"ns_iters": 5}, "'ns_iters': did you mean ns_steps?"),
    ],
)
def test_other_optimizers_names_are_answered_with_the_name_to_use(given, answer):
    with pytest.raises(
        TypeError, match=re.escape(f"DMuonFSDP() got an unexpected keyword argument {answer}")
    ):
        DMuonFSDP(_params(), **given)


@pytest.mark.parametrize(
    "groups, answer",
    [
        (
            lambda w, b: [{"params": [w, b], "betas": (0.9, 0.9)}],
            "param group 0: betas: the group holds Muon",
        ),
        (lambda w, b: [{"params": [w]}, {"params": [b], "amsgrad": True}], "param group 1: amsgrad: "),
        (lambda w, b: [{"params": [w, b], "fused": True}], "param group 0: fused: "),
    ],
)
def test_param_groups_with_other_optimizers_names_are_refused_naming_the_group(groups, answer):
    with pytest.raises(ValueError, match=re.escape(answer)):
        DMuonFSDP(groups(*_params()))


def test_an_adamw_group_takes_its_own_betas_and_lr():
    w, b = _params()
    opt = DMuonFSDP([{"params": [w]}, {"params": [b], "lr": 3e-3, "betas": (0.8, 0.9)}])
    assert [(g["use_muon"], g["lr"]) for g in opt.param_groups] == [(True, 0.02), (False, 3e-3)]
    assert opt.param_groups[1]["betas"] == (0.8, 0.9)
