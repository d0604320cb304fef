"""The request body as JSON, refused field by field: every problem inside a top-level field names it as `param`.

`load_json(raw)` returns the body as a dict or raises `APIError` (400): not UTF-8, not JSON, not an object (no
`param`), or a field whose JSON is malformed, nested deeper than `MAX_JSON_DEPTH`, holds NaN/Infinity, an
integer literal of over 40 digits, or a lone UTF-16 surrogate (that field as `param`). The top level is walked
here, each field's value parsed by the C decoder, so a failure is always known to belong to one field.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ringsched.server.errors import APIError

MAX_JSON_DEPTH = 16  # the deepest body we accept (messages[i].content[j].text) is 4 levels down
_MAX_INT_DIGITS = 40  # past int64 and uint64 by far; Python refuses to parse > 4300 digits at all
_WS = re.compile(r"[ \t\n\r]*")


class _Refused:
    """A value the JSON parser met but we refuse (NaN, Infinity, a huge integer literal): refused with the name
    of the field it is in, once parsing tells us which."""

    def __init__(self, what: str) -> None:
        self.what = what


def _int_literal(text: str) -> int | _Refused:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        return _Refused(f"an integer literal of {len(text.lstrip('-'))} digits")
    return int(text)


_DECODER = json.JSONDecoder(parse_int=_int_literal, parse_constant=lambda name: _Refused(f"the constant {name}"))


def load_json(raw: bytes) -> dict:
    """The body as a dict. Every problem inside a top-level field is refused with that field as `param`:
    invalid JSON, nesting deeper than MAX_JSON_DEPTH, NaN/Infinity, huge integer literals, lone surrogates."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"The request body is not valid UTF-8: {e}") from None
    i = _WS.match(text).end()
    if text[i : i + 1] != "{":
        kind = "empty" if i == len(text) else "not a JSON object"
        raise APIError(400, f"The request body must be a JSON object; it is {kind}")
    body: dict = {}
    i = _WS.match(text, i + 1).end()
    if text[i : i + 1] == "}":
        return _end_of_body(text, i + 1, body)
    while True:
        if text[i : i + 1] != '"':
            raise _json_error("a field name in double quotes", text, i, None)
        try:
            key, i = json.decoder.scanstring(text, i + 1)
        except json.JSONDecodeError as e:
            raise APIError(400, f"We could not parse the JSON body of your request: {e}") from None
        i = _WS.match(text, i).end()
        if text[i : i + 1] != ":":
            raise _json_error("':'", text, i, key)
        i = _WS.match(text, i + 1).end()
        try:
            value, i = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise APIError(400, f"{key}: we could not parse its JSON value: {e}", param=key) from None
        except RecursionError:
            raise APIError(400, f"{key}: nested deeper than {MAX_JSON_DEPTH} levels", param=key) from None
        _check_value(key, value)
        body[key] = value
        i = _WS.match(text, i).end()
        if text[i : i + 1] == ",":
            i = _WS.match(text, i + 1).end()
            continue
        if text[i : i + 1] == "}":
            return _end_of_body(text, i + 1, body)
        raise _json_error("',' or '}'", text, i, key)


def _end_of_body(text: str, i: int, body: dict) -> dict:
    if _WS.match(text, i).end() != len(text):
        raise APIError(400, f"We could not parse the JSON body of your request: extra data at character {i}")
    return body


def _json_error(expected: str, text: str, i: int, key: str | None) -> APIError:
    where = f" after the field {key!r}" if key is not None else ""
    got = repr(text[i : i + 10]) if i < len(text) else "the end of the body"
    return APIError(
        400,
        f"We could not parse the JSON body of your request: expected {expected}{where} at character {i}, got {got}",
        param=key,
    )


def _check_value(key: str, value: Any) -> None:
    """Depth, refused literals and strings that are not Unicode text (lone surrogates), anywhere in `value`."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"{key}: nested deeper than {MAX_JSON_DEPTH} levels", param=key)
        if isinstance(v, _Refused):
            raise APIError(
                400, f"{key}: {v.what} is not accepted (numbers must be finite and fit in 64 bits)", param=key
            )
        if isinstance(v, str):
            _check_text(key, v)
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
        elif isinstance(v, dict):
            for k, x in v.items():
                _check_text(key, k)
                stack.append((x, depth + 1))


def _check_text(key: str, s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(
            400, f"{key}: a string holds {e.reason} at index {e.start} (a lone UTF-16 surrogate is not text)", param=key
        ) from None
