"""The package's layers: every package and root module of `ringsched` has its place in one total order, and
imports only from its own unit or from units below it (so no package-level cycle can form); and no module-level
import cycle exists anywhere. The same order is written in docs/architecture.md's file map."""

from __future__ import annotations

import ast
from pathlib import Path

import ringsched

ROOT = Path(ringsched.__file__).parent
# Bottom to top. A unit is a package (`models`) or a root module (`config`); `ringsched` is the package's own
# `__init__` (the version, the lazy names).
ORDER = ("ringsched", "layout", "comm", "sampling", "sampler", "structured", "speculative", "tokenizer", "device",
         "config_checks", "config", "kv", "models", "spec", "scheduler", "stage", "process", "link", "replay",
         "server", "engine", "async_engine", "generate", "launch", "capacity", "plan", "bench")  # fmt: skip


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


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_every_unit_has_a_place_in_the_order():
    units = {_unit(m) for m in MODULES}
    assert units <= set(ORDER), f"give these a place in ORDER (and in docs/architecture.md): {units - set(ORDER)}"


def test_each_unit_imports_only_from_itself_and_below():
    rank = {u: i for i, u in enumerate(ORDER)}
    upward = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps if rank[_unit(d)] > rank[_unit(m)])
    assert not upward, f"imports that go up the order (move one side, or import it lazily with a reason): {upward}"


def test_no_import_cycle():
    cycles = sorted(name for name in MODULES if name in _reachable(name))
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_the_file_map_names_every_module():
    """docs/architecture.md's file map lists every module of the package by its path under `ringsched/`."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    paths = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if p.name != "__init__.py"]
    missing = sorted(p for p in paths if f"`{p}`" not in text)
    assert not missing, f"add these to the file map in docs/architecture.md: {missing}"
