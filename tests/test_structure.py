"""The package keeps the shape docs/design.md ("Modules") describes: a steady step runs code in
few modules, the first one plans, binds and runs, each from the record the one before made, no
call goes back up the imports, no module imports another that imports it back (type-only
imports included), and no function runs past a screenful."""

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


def steps(fn, variant: str = "muon", count: int = 3) -> list:
    """``fn(opt.step)`` for each of ``count`` steps of a small model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 12), nn.Linear(12, 8), nn.Linear(8, 16))
    opt = DMuonFSDP(param_groups(model), variant=variant)
    out = []
    for _ in range(count):
        opt.zero_grad()
        model(torch.randint(0, 16, (4, 5))).square().mean().backward()
        out.append(fn(opt.step))
    return out


def test_a_steady_step_runs_code_in_at_most_eight_modules():
    runs = steps(modules_run)
    first, steady = runs[0], runs[2]
    assert steady == runs[1] and steady < first, (first, steady)  # planning and binding ran once
    assert {"dmuon_fsdp.optimizer", "dmuon_fsdp.newton_schulz"} <= steady and len(steady) <= 8, sorted(steady)


def test_the_first_step_plans_then_binds_then_runs_each_from_the_last_ones_record():
    from dmuon_fsdp._step.binding import bind
    from dmuon_fsdp._step.planning import plan_program
    from dmuon_fsdp._step.run import StepRun

    phases = {plan_program.__code__: "plan", bind.__code__: "bind", StepRun.run.__code__: "run"}

    def traced(step):
        seen = []  # (phase, what it was given, what it returned)

        def profile(frame, event, arg):
            phase = phases.get(frame.f_code)
            if phase is not None and event == "call":
                given = {"plan": None, "bind": frame.f_locals.get("planned")}
                given["run"] = frame.f_locals["self"].program if phase == "run" else None
                seen.append([phase, given[phase], None])
            elif phase is not None and event == "return":
                next(s for s in reversed(seen) if s[0] == phase)[2] = arg

        sys.setprofile(profile)
        try:
            step()
        finally:
            sys.setprofile(None)
        return seen

    first, steady = steps(traced, count=2)
    assert [phase for phase, _, _ in first] == ["plan", "bind", "run"], first
    (_, _, planned), (_, given, program), (_, ran, _) = first
    assert given is planned and ran is program  # each phase works from the record of the one before
    assert [phase for phase, _, _ in steady] == ["run"] and steady[0][1] is program


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


def test_no_call_goes_back_up_the_imports():
    """In a first and a steady step, with Muon and with NorMuon, every call from one package
    module into another is into a module the caller imports (directly or through others), so
    no phase calls back into what drives it. By design, two callbacks: a row variant takes its
    buffers from the ``take`` the binder hands it, and the layouts' memo (``by_layout``) makes,
    the first time a layout is seen in the process, what its caller hands it (the twins)."""
    graph = {name: imports(path) for name, path in MODULES.items()}

    def below(name: str) -> set[str]:
        seen, todo = set(), [name]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reach = {name: below(name) for name in graph}

    def calls_up(step) -> set[tuple[str, str]]:
        up = set()

        def profile(frame, event, arg):
            if event == "call" and frame.f_back is not None:
                caller, callee = frame.f_back.f_globals.get("__name__"), frame.f_globals.get("__name__")
                if caller in graph and callee in graph and caller != callee and callee not in reach[caller]:
                    up.add((caller, f"{callee}.{frame.f_code.co_qualname}"))

        sys.setprofile(profile)
        try:
            step()
        finally:
            sys.setprofile(None)
        return up

    found = set().union(*steps(calls_up, count=2), *steps(calls_up, "normuon", count=2))
    memo = {("dmuon_fsdp._step.layouts", "dmuon_fsdp._step.relay._find_twins")}  # (when cold)
    assert found - memo == {("dmuon_fsdp.normuon", "dmuon_fsdp._step.buffers.Region.take")}, found


def test_what_users_catch_and_read_is_named_by_the_package():
    """Every class ``dmuon_fsdp`` exports is found under the name its tracebacks and reprs give
    (``dmuon_fsdp.NonFiniteGradientError``, not the private module it is written in), and a
    pickled one comes back."""
    import pickle

    import dmuon_fsdp

    classes = [
        getattr(dmuon_fsdp, name)
        for name in dmuon_fsdp.__all__
        if isinstance(getattr(dmuon_fsdp, name), type)
    ]
    assert {c.__name__ for c in classes} >= {"NonFiniteGradientError", "GradientMismatchError", "StepStats"}
    for c in classes:
        assert not c.__module__.startswith("dmuon_fsdp._"), c
        assert getattr(sys.modules[c.__module__], c.__qualname__) is c
    error = dmuon_fsdp.NonFiniteGradientError("inf in w")
    assert type(pickle.loads(pickle.dumps(error))) is dmuon_fsdp.NonFiniteGradientError
