"""Optional features are chosen once, as objects, not asked about where they act: the stage loop and the paged
attention never branch on context parallelism (its attention backend stands in), the planner never asks whether a
speculator is there (`NoDrafts` stands in), and no code outside `weights/` asks which kind of GGUF weight a layer
holds (the weight answers through `Linear`'s methods)."""

from __future__ import annotations

import ast
from pathlib import Path

import ringsched

ROOT = Path(ringsched.__file__).parent


def _tree(rel: str) -> ast.Module:
    return ast.parse((ROOT / rel).read_text())


def _branch_tests(tree: ast.Module) -> list[str]:
    """The condition of every `if`, conditional expression, `while` and boolean operation, as source."""
    tests = [n.test for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp, ast.While))]
    tests += [v for n in ast.walk(tree) if isinstance(n, ast.BoolOp) for v in n.values]
    return [ast.unparse(t) for t in tests]


def _names(source: str) -> set[str]:
    tree = ast.parse(source)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
    }


def test_the_stage_loop_and_paged_attention_do_not_branch_on_context_parallelism():
    for rel in ("stage/loop.py", "attention/paged.py", "models/llama.py", "models/decoder_layer.py"):
        branches = [t for t in _branch_tests(_tree(rel)) if _names(t) & {"cp", "cp_size", "CPGroup", "placement"}]
        assert not branches, f"{rel} branches on CP: {branches}"


def test_the_planner_never_asks_whether_there_is_a_speculator():
    asks = [t for t in _branch_tests(_tree("scheduler/planner.py")) if "speculator" in _names(t)]
    assert not asks, f"the planner asks about its speculator: {asks}"


def test_no_isinstance_on_weight_types_outside_weights():
    kinds = {"GGUFWeights", "GGUFParts"}
    found = []
    for path in ROOT.rglob("*.py"):
        if path.relative_to(ROOT).parts[0] == "weights":
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("isinstance", "issubclass"):
                if _names(ast.unparse(n.args[1])) & kinds:
                    found.append(f"{path.relative_to(ROOT)}:{n.lineno}")
    assert not found, f"isinstance on a weight type outside weights/: {found}"


def test_the_checks_find_what_they_look_for():
    """Each check sees the thing it forbids when it is there."""
    assert _branch_tests(ast.parse("if self.cp is not None:\n    pass\n")) == ["self.cp is not None"]
    assert "cp" in _names("self.cp is not None")
    assert "speculator" in _names(_branch_tests(ast.parse("x = a if self.speculator else b\n"))[0])
    call = ast.parse("isinstance(lin, gguf_kept.GGUFWeights)").body[0].value
    assert _names(ast.unparse(call.args[1])) & {"GGUFWeights"}
