"""The package's layers: the model, the transports, the KV pool and sampling know nothing of the stage process,
the server or the process side; and no module-level import cycle exists anywhere in `ringsched`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ringsched

ROOT = Path(ringsched.__file__).parent
LOWER = ["ringsched.models", "ringsched.comm", "ringsched.kv_cache", "ringsched.sampling"]
UPPER = ("ringsched.stage", "ringsched.server", "ringsched.process")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _top_level_imports(name: str) -> set[str]:
    """ringsched modules `name` imports when it is imported (not those imported inside functions, which are
    deliberate lazy imports, nor those under TYPE_CHECKING)."""
    tree = ast.parse(MODULES[name].read_text())
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in [node] if not isinstance(node, (ast.If, ast.Try)) else ast.walk(node):
            if isinstance(sub, ast.Import):
                out.update(a.name for a in sub.names if a.name.startswith("ringsched"))
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.module.startswith("ringsched"):
                submodules = {f"{sub.module}.{a.name}" for a in sub.names} & set(MODULES)
                out.update(submodules)
                if len(submodules) < len(sub.names):  # names defined in the module itself (not its submodules)
                    out.add(sub.module)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _top_level_imports(name) for name in MODULES}


def _reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("lower", LOWER)
def test_lower_layers_import_nothing_above_them(lower):
    for name in (m for m in MODULES if m == lower or m.startswith(lower + ".")):
        bad = sorted(m for m in _reachable(name) if m.startswith(UPPER))
        assert not bad, f"{name} imports (directly or through others) {bad}"


def test_no_import_cycle():
    cycles = sorted(name for name in MODULES if name in _reachable(name))
    assert not cycles, f"modules on an import cycle: {cycles}"
