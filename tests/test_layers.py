"""The house's floors (issue 30): imports run downward only - engine -> telemetry -> forensics ->
dashboard, with the command modules (``<layer>/commands/``) on top - no module imports a private
name from another file, and no two modules import each other. Walked statically over every file,
imports inside functions included (a lazy import is still a dependency)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOORS = {"engine": 0, "telemetry": 1, "forensics": 2, "dashboard": 3}
COMMANDS = 4                       # the top floor: every <layer>.commands module


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(module: str) -> int:
    parts = module.split(".")
    return COMMANDS if len(parts) > 1 and parts[1] == "commands" else FLOORS[parts[0]]


def _typing_only(tree: ast.AST) -> set[int]:
    """The ids of import nodes under ``if TYPE_CHECKING:`` (annotations only: never run)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            out |= {id(n) for b in node.body for n in ast.walk(b)}
    return out


def imports(path: Path, runtime_only: bool = False):
    """(imported module, names taken from it, line) for every import of a kvledger module;
    ``runtime_only``: leave out the imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _typing_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in FLOORS:
                    yield a.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in FLOORS:
            yield node.module, [a.name for a in node.names], node.lineno


MODULES = {module_name(p): p for top in FLOORS for p in sorted((ROOT / top).rglob("*.py"))}


def test_the_walk_sees_the_house():
    assert {"engine.llm", "engine.commands.main", "telemetry.recorder", "forensics.queries.catalog",
            "dashboard.app"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_downward_only(module):
    here = floor(module)
    up = [f"line {line}: {target} (floor {floor(target)} > {here})"
          for target, _, line in imports(MODULES[module]) if floor(target) > here]
    assert not up, f"{module} imports upward: " + "; ".join(up)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_crosses_a_file(module):
    private = [f"line {line}: {name} from {target}" for target, names, line in imports(MODULES[module])
               for name in names if name.startswith("_") and target != module]
    assert not private, f"{module} imports private names: " + "; ".join(private)


def test_no_import_cycles():
    """No module reaches itself through the imports it runs (a package's ``__init__`` counts as the
    module ``pkg``; importing ``pkg.sub`` is an edge to ``pkg.sub`` only; annotations-only imports
    under ``if TYPE_CHECKING:`` run never and are left out)."""
    graph = {m: set() for m in MODULES}
    for m, p in MODULES.items():
        for target, names, _ in imports(p, runtime_only=True):
            for t in [target] + [f"{target}.{n}" for n in names]:
                if t in MODULES and t != m:
                    graph[m].add(t)
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(cycles)


def test_no_module_below_the_commands_imports_one():
    """The command modules are reached only through the registry (by name), never imported below."""
    below = [f"{m} line {line}: {t}" for m, p in MODULES.items() if floor(m) < COMMANDS
             for t, _, line in imports(p) if floor(t) == COMMANDS]
    assert not below, "; ".join(below)
