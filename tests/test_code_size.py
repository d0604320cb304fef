"""Sizes the style guide asks for (`/work/shared/style.md`, docs/architecture.md): no module of `ringsched` over
300 lines and no function over 50, unless it says why. The reason is a comment line `# size: <reason>`: for a
module, among its lines before the first statement after the docstring (or in the docstring region); for a
function, on the line right above its `def` (above its decorators, if it has any)."""

from __future__ import annotations

import ast
from pathlib import Path

import ringsched

ROOT = Path(ringsched.__file__).parent
MAX_FILE_LINES, MAX_FUNCTION_LINES = 300, 50
MARKER = "# size:"


def _modules() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def _has_marker(line: str) -> bool:
    text = line.strip()
    return text.startswith(MARKER) and len(text) > len(MARKER) + 1


def _module_reason(lines: list[str], tree: ast.Module) -> bool:
    body = tree.body
    first = body[1] if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else None
    end = (first.lineno - 1) if first else (body[0].lineno - 1 if body else len(lines))
    return any(_has_marker(line) for line in lines[:end])


def _function_reason(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    top = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return top >= 2 and _has_marker(lines[top - 2])


def _long_modules(paths: list[Path]) -> list[str]:
    out = []
    for path in paths:
        lines = path.read_text().splitlines()
        if len(lines) > MAX_FILE_LINES and not _module_reason(lines, ast.parse("\n".join(lines))):
            out.append(f"{path.relative_to(ROOT.parent)}: {len(lines)} lines")
    return out


def _long_functions(paths: list[Path]) -> list[str]:
    out = []
    for path in paths:
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES and not _function_reason(lines, node):
                    out.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}: {n} lines")
    return out


def test_no_module_over_300_lines_without_a_reason():
    long = _long_modules(_modules())
    assert not long, f"split these by concept, or say why not with a `{MARKER} <reason>` line at the top: {long}"


def test_no_function_over_50_lines_without_a_reason():
    long = _long_functions(_modules())
    assert not long, f"split these, or say why not with a `{MARKER} <reason>` line above the def: {long}"


def test_the_marker_convention():
    module = '"""Doc."""\n\n# size: one table the reader needs whole\nimport os\n'
    assert _module_reason(module.splitlines(), ast.parse(module))
    assert not _module_reason(['"""Doc."""', "import os", "# size: too late"], ast.parse('"""Doc."""\nimport os\n'))
    source = "x = 1\n# size: why\n@staticmethod\ndef f():\n    pass\n\ndef g():\n    pass\n"
    f, g = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]
    lines = source.splitlines()
    assert _function_reason(lines, f) and not _function_reason(lines, g)
    assert not _has_marker("# size:")  # a marker must give a reason


MAX_FMT_SKIPS = 100


def test_the_formatter_lays_out_the_code():
    """`# fmt: skip` stays for tables a reader takes in whole (the flags' fields, the metrics, Triton kernels whose
    loop nest reads best packed), not for calls the formatter would lay out."""
    skips = sum(line.rstrip().endswith("# fmt: skip") for p in _modules() for line in p.read_text().splitlines())
    assert skips < MAX_FMT_SKIPS, f"{skips} `# fmt: skip` lines in ringsched/: let `ruff format` lay the code out"
