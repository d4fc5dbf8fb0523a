"""The package keeps the shape docs/design.md ("Modules") describes: a steady step runs code in
few modules, no module imports another that imports it back (type-only imports included), and no
function runs past a screenful."""

from __future__ import annotations

import ast
import pathlib
import sys

import torch
from torch import nn

from dmuon_fsdp import DMuonFSDP, param_groups

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "dmuon_fsdp"
MODULES = {
    ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts): path
    for path in PACKAGE.rglob("*.py")
    if path.name != "__init__.py"
}


def modules_run(fn) -> set[str]:
    """The package modules whose functions ``fn`` calls, at any depth."""
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            seen.add(frame.f_globals.get("__name__", ""))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {m for m in seen if m.startswith("dmuon_fsdp.")}


def test_a_steady_step_runs_code_in_at_most_eight_modules():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 12), nn.Linear(12, 8), nn.Linear(8, 16))
    opt = DMuonFSDP(param_groups(model))
    runs = []
    for _ in range(3):
        opt.zero_grad()
        model(torch.randint(0, 16, (4, 5))).square().mean().backward()
        runs.append(modules_run(opt.step))
    first, steady = runs[0], runs[2]
    assert steady == runs[1] and steady < first, (first, steady)  # planning and binding ran once
    assert {"dmuon_fsdp.optimizer", "dmuon_fsdp.newton_schulz"} <= steady and len(steady) <= 8, sorted(steady)


def imports(path: pathlib.Path) -> set[str]:
    """The package modules ``path`` imports, type-only imports included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dmuon_fsdp"):
            for name in [f"{node.module}.{a.name}" for a in node.names] + [node.module]:
                if name in MODULES:
                    out.add(name)
    return out


def test_no_module_imports_one_that_imports_it_back():
    graph = {name: imports(path) for name, path in MODULES.items()}

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for nxt in graph[start] - seen:
            seen.add(nxt)
            if nxt == target or reaches(nxt, target, seen):
                return True
        return False

    cycles = sorted(name for name in graph if reaches(name, name, set()))
    assert len(graph) > 10 and not cycles, cycles


def test_no_function_is_longer_than_sixty_lines():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > 60:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, long
