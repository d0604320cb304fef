"""Which structured-output constraint a request asks for, in which field.

Contract: `asked_grammar(req)` returns None or `Asked(field, form)`, `form` being the keyword arguments of
`structured.grammar_for` (`{"json_schema": ...}`, `{"regex": ...}`, ...); it raises a 400 naming the field for
a malformed `response_format` or `structured_outputs`, or for more than one constraint. It compiles nothing:
the form is proven later, in a helper process (`grammar_pool.py`), which is where user grammars may crash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringsched.server.errors import APIError, shown

_GUIDED_FORMS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "lark",
}
_STRUCTURED_KEYS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "lark",
    "json_object": "json_object",
}


@dataclass(frozen=True)
class Asked:
    field: str  # the request field it came in: the `param` of its errors
    form: dict[str, Any]


def asked_grammar(req: Any) -> Asked | None:
    asked = _response_format(req.response_format)
    for name, form in _GUIDED_FORMS.items():
        if getattr(req, name) is not None:
            asked.append(Asked(name, {form: getattr(req, name)}))
    if req.structured_outputs is not None:
        given = {
            _STRUCTURED_KEYS[k]: v
            for k, v in req.structured_outputs.items()
            if k in _STRUCTURED_KEYS and v not in (None, False)
        }
        unknown = sorted(set(req.structured_outputs) - set(_STRUCTURED_KEYS))
        if unknown or len(given) != 1:
            raise APIError(
                400, f"structured_outputs takes exactly one of {sorted(_STRUCTURED_KEYS)}", param="structured_outputs"
            )
        asked.append(Asked("structured_outputs", given))
    if len(asked) > 1:
        names = [a.field for a in asked]
        raise APIError(400, f"give one structured-output constraint, got {names}", param=names[1])
    return asked[0] if asked else None


def _response_format(rf: dict[str, Any] | None) -> list[Asked]:
    if rf is None:
        return []
    kind = rf.get("type")
    if kind == "json_object":
        return [Asked("response_format", {"json_object": True})]
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError(
                400, "response_format.json_schema must be an object with a `schema` object", param="response_format"
            )
        return [Asked("response_format", {"json_schema": spec.get("schema", {})})]
    if kind != "text":
        raise APIError(
            400,
            f"response_format.type must be text, json_object or json_schema, got {shown(kind)}",
            param="response_format",
        )
    return []
