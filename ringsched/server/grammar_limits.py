"""The bounds a structured-output request must keep before any grammar engine sees it.

Contract: `check_form(form, limits)` raises `GrammarError` naming the bound a form (`{"json_schema": ...}`,
`{"regex": ...}`, `{"choice": [...]}`, `{"lark": ...}` or `{"json_object": True}`) passes, and returns
otherwise. It only reads the request's text: linear time, no recursion, so it is safe on hostile input in the
API process itself. llguidance recurses through `$ref` chains and nested rules on the native stack (a chain of
~3,000 `$ref`s or ~5,000 right-recursive Lark rules overflows it: a segfault) and expands a counted repetition
into that many copies; these bounds keep every form far from both, and the helper processes of
`grammar_pool.py` catch whatever gets past them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ringsched.sampling.structured import GrammarError


@dataclass(frozen=True)
class GrammarLimits:
    max_ref_depth: int = 64  # `$ref` followed through `$defs` / `definitions`, one inside the next
    max_schema_bytes: int = 256 * 1024  # the schema as compact JSON
    max_rules: int = 1000  # Lark rules and terminals
    max_nesting: int = 64  # parentheses and brackets, one inside the next (regex and Lark)
    max_grammar_bytes: int = 256 * 1024  # a regex or Lark grammar's text
    max_repetition: int = 10_000  # a regex's counted repetitions multiplied through their nesting
    max_choices: int = 1000  # strings of a choice
    max_choice_bytes: int = 256 * 1024  # all the strings of a choice together


def check_form(form: dict[str, Any], limits: GrammarLimits) -> None:
    if "json_schema" in form:
        _check_schema(form["json_schema"], limits)
    elif "regex" in form:
        _check_text("regex", form["regex"], limits)
        _check_repetition(form["regex"], limits)
    elif "lark" in form:
        _check_text("grammar", form["lark"], limits)
        _check_repetition(form["lark"], limits, "grammar")  # its /regex/ terminals and `item ~ n..m`
        rules = _count_rules(form["lark"])
        if rules > limits.max_rules:
            raise GrammarError(f"the grammar has {rules} rules; at most {limits.max_rules} are accepted")
    elif "choice" in form:
        _check_choice(form["choice"], limits)


def _check_schema(schema: Any, limits: GrammarLimits) -> None:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > limits.max_schema_bytes:
        raise GrammarError(f"the JSON schema is {size} bytes; at most {limits.max_schema_bytes} are accepted")
    if isinstance(schema, dict):
        depth = _ref_depth(schema)
        if depth > limits.max_ref_depth:
            raise GrammarError(
                f"the JSON schema's $ref chain is {depth} deep; at most {limits.max_ref_depth} levels are accepted"
            )


def _refs_in(node: Any) -> list[str]:
    """Every `$ref` string anywhere inside `node` (iteratively: a schema is data from the client)."""
    out, stack = [], [node]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            ref = v.get("$ref")
            if isinstance(ref, str):
                out.append(ref)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return out


def _ref_depth(schema: dict) -> int:
    """The longest chain of local `$ref`s a depth-first walk from the root meets, each definition entered once
    (a recursive schema's cycle ends the chain; it does not make it endless)."""
    defs: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            defs.update({f"#/{key}/{name}": v for name, v in schema[key].items()})
    top = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    deepest, seen, stack = 0, set(), [(top, 0)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        for ref in _refs_in(node):
            if ref in defs and ref not in seen:
                seen.add(ref)
                stack.append((defs[ref], depth + 1))
    return deepest


def _check_text(name: str, text: Any, limits: GrammarLimits) -> None:
    if not isinstance(text, str):
        return  # the compiler refuses a wrong type with its own message
    if len(text.encode()) > limits.max_grammar_bytes:
        raise GrammarError(f"the {name} is {len(text.encode())} bytes; at most {limits.max_grammar_bytes} are accepted")
    depth = deepest = 0
    escaped = quoted = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"' and name == "grammar":  # a Lark literal's brackets are text
            quoted = not quoted
        elif quoted:
            continue
        elif ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}":
            depth = max(depth - 1, 0)
    if deepest > limits.max_nesting:
        raise GrammarError(
            f"the {name} nests brackets {deepest} deep; at most {limits.max_nesting} levels are accepted"
        )


_COUNTED = re.compile(r"\{(\d*)(?:,(\d*))?\}|~\s*(\d+)(?:\s*\.\.\s*(\d+))?")  # x{n,m}; Lark's x ~ n..m


def _check_repetition(regex: Any, limits: GrammarLimits, name: str = "regex") -> None:
    """Counted repetitions (`x{n}`, `x{n,m}`, `x{n,}`) multiply through the groups they repeat: `(a{1000}){1000}`
    is a million copies of `a` to the regex compiler. Brackets and escapes are skipped."""
    if not isinstance(regex, str):
        return
    frames, last, i = [1], 1, 0  # frames: the largest product inside each open group; last: the latest atom's
    while i < len(regex):
        ch = regex[i]
        if ch == "\\":
            i += 2
            if i <= len(regex) and regex[i - 1] in "pPx" and regex[i : i + 1] == "{":  # \p{L}, \x{263a}
                i = regex.find("}", i) + 1 or len(regex)
            last = 1
            continue
        if ch == "[":
            j = i + 1 + (regex[i + 1 : i + 2] == "]")
            while j < len(regex) and regex[j] != "]":
                j += 1 + (regex[j] == "\\")
            i, last = j + 1, 1
            continue
        if ch == "(":
            frames.append(1)
        elif ch == ")" and len(frames) > 1:
            last = frames.pop()
            frames[-1] = max(frames[-1], last)
        elif ch in "{~" and (m := _COUNTED.match(regex, i)):
            bound = max(int(g) for g in m.groups(default="0") if g.isdigit())
            last *= max(bound, 1)
            frames[-1] = max(frames[-1], last)
            if last > limits.max_repetition:
                raise GrammarError(
                    f"the {name} repeats {last} times through nested counted repetitions; at most "
                    f"{limits.max_repetition} are accepted"
                )
            i = m.end()
            continue
        elif not (ch.isspace() and name == "grammar"):  # Lark puts spaces before `~`; a regex's are atoms
            last = 1
        i += 1


def _count_rules(lark: Any) -> int:
    """Lark rule and terminal definitions: a name at the start of a line followed by `:`."""
    if not isinstance(lark, str):
        return 0
    return len(re.findall(r"(?m)^\s*[?!]?[A-Za-z_][\w.]*\s*(?:\{[^}\n]*\})?\s*(?:\.\s*-?\d+\s*)?:", lark))


def _check_choice(choice: Any, limits: GrammarLimits) -> None:
    if not isinstance(choice, list):
        return
    if len(choice) > limits.max_choices:
        raise GrammarError(f"the choice has {len(choice)} strings; at most {limits.max_choices} are accepted")
    size = sum(len(c.encode()) for c in choice if isinstance(c, str))
    if size > limits.max_choice_bytes:
        raise GrammarError(
            f"the choice's strings are {size} bytes together; at most {limits.max_choice_bytes} are accepted"
        )
