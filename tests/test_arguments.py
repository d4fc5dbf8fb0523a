"""The constructor's arguments are documented alike in its docstring (``Args:``) and in the
README's argument table: the same names, in the signature's order, with the signature's defaults."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from dmuon_fsdp import DMuonFSDP

README = Path(__file__).resolve().parents[1] / "README.md"
SIGNATURE = inspect.signature(DMuonFSDP.__init__).parameters
ARGUMENTS = [name for name in SIGNATURE if name not in ("self", "params")]


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
