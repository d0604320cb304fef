"""The package's layers: every package and root module of `ringsched` has its place in one total order, and
imports only from its own unit or from units below it, so no package-level cycle can form; and no import cycle
exists between modules either. Every import counts: at module level, inside a function (a lazy import) and under
`TYPE_CHECKING` (a type-only one). The same order is docs/architecture.md's file map."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import ringsched

ROOT = Path(ringsched.__file__).parent
# Bottom to top. A unit is a package (`models`) or a root module (`config`); `ringsched` is the package's own
# `__init__`, the face that lazily names the engines (so at the top).
ORDER = (
    "version", "cache_dir", "refusals", "layout", "device", "tokenizer", "detokenizer", "sampling", "speculative",
    "config_checks", "config", "comm", "kernels", "weights", "kv", "attention", "models", "spec", "scheduler",
    "stage", "process", "link", "replay", "server", "engine", "async_engine", "generate", "launch", "capacity",
    "plan", "bench", "ringsched",
)  # fmt: skip


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imported(source: str) -> set[str]:
    """Every ringsched module `source` imports, wherever the import statement is (module level, a function body,
    `if TYPE_CHECKING:`); `from package import module` counts as an import of that module."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("ringsched"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ringsched"):
            assert node.level == 0, "use absolute imports"
            submodules = {f"{node.module}.{a.name}" for a in node.names} & set(MODULES)
            out.update(submodules)
            if len(submodules) < len(node.names):  # names defined in the module itself (not its submodules)
                out.add(node.module)
    return out


def _imports(name: str) -> set[str]:
    return {m for m in _imported(MODULES[name].read_text()) if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


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
    assert not set(ORDER) - units, f"ORDER names units that no longer exist: {set(ORDER) - units}"


def test_each_unit_imports_only_from_itself_and_below():
    rank = {u: i for i, u in enumerate(ORDER)}
    upward = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps if rank[_unit(d)] > rank[_unit(m)])
    assert not upward, f"imports that go up the order (move one side): {upward}"


def test_no_import_cycle():
    cycles = sorted(name for name in MODULES if name in _reachable(name))
    assert not cycles, f"modules on an import cycle (lazy and type-only imports count): {cycles}"


def test_the_checks_see_lazy_and_type_only_imports():
    """The graph is built from every import statement: a lazy one and a type-only one are edges too."""
    lazy = "def f():\n    from ringsched.config import EngineConfig\n"
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ringsched.kv.cache import BlockTable\n"
    assert _imported(lazy) == {"ringsched.config"}
    assert _imported(typed) == {"ringsched.kv.cache"}
    assert _imported("from ringsched.kernels import native\n") == {"ringsched.kernels.native"}


def _file_map() -> list[str]:
    """The module paths docs/architecture.md's file map lists, in its order (its table rows' first cells)."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    section = text.split("## File map", 1)[1].split("\n## ", 1)[0]
    rows = [row.split("|")[1] for row in section.splitlines() if row.startswith("| `")]
    return [path for cell in rows for path in re.findall(r"`([\w/]+\.py)`", cell)]


def test_the_file_map_names_every_module_in_the_layering_order():
    """docs/architecture.md's file map lists every module of the package by its path under `ringsched/`, unit by
    unit from the bottom of `ORDER` up, so a reader meets a module after the ones it builds on."""
    listed = _file_map()
    paths = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if p.name != "__init__.py"]
    missing = sorted(set(paths) - set(listed))
    assert not missing, f"add these to the file map in docs/architecture.md: {missing}"
    stale = sorted(set(listed) - set(paths))
    assert not stale, f"the file map names modules that do not exist: {stale}"
    rank = {u: i for i, u in enumerate(ORDER)}
    units = [rank[_unit(_module_name(ROOT / p))] for p in listed]
    assert units == sorted(units), "the file map's rows are not in ORDER's order, unit by unit"
