"""Malformed requests for the three generation endpoints, each with the status and the `param` it must get back.

`CASES` is a list of `Case(path, body, status, param)`: `body` is a dict (sent as JSON), raw bytes (sent as they
are), or `OVERSIZE` (a valid body one byte past the server's `--max-request-bytes`). `param` is None only where
the body as a whole is refused (not UTF-8, not JSON, not an object, too large). Used against the in-process
front end (fast lane) and against the real server (slow lane).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CMPL, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
OVERSIZE = object()
MSGS = [{"role": "user", "content": "hi"}]
HUGE = 2**64  # past int64 (and uint64): msgpack could not carry it
OUT_OF_VOCAB = 10**6


@dataclass(frozen=True)
class Case:
    path: str
    body: Any
    status: int
    param: str | None

    def payload(self, limit: int) -> bytes:
        if self.body is OVERSIZE:
            return json.dumps({"prompt": "x" * limit}).encode()
        if isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body).encode()

    def __str__(self) -> str:
        shown = "OVERSIZE" if self.body is OVERSIZE else repr(self.body)
        return f"{self.path} {shown[:60]}"


def _nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


# Wrong values per sampling field, shared by the OpenAI endpoints: (field, value).
_BAD_SAMPLING = [
    ("max_tokens", "3"), ("max_tokens", 2.5), ("max_tokens", True), ("max_tokens", [1]), ("max_tokens", 0),
    ("max_tokens", -4), ("max_tokens", HUGE), ("max_tokens", -(2**70)),
    ("temperature", "hot"), ("temperature", True), ("temperature", [0.5]), ("temperature", -0.5),
    ("temperature", {"t": 1}),
    ("top_p", 0), ("top_p", 1.5), ("top_p", "1"), ("top_p", -1),
    ("top_k", -2), ("top_k", 1.5), ("top_k", "5"), ("top_k", HUGE), ("top_k", 10**30),
    ("min_p", -0.1), ("min_p", 1.1), ("min_p", "0"),
    ("seed", "7"), ("seed", 1.5), ("seed", HUGE), ("seed", -(2**64)),
    ("stop", 5), ("stop", [1]), ("stop", [""]), ("stop", [str(i) for i in range(17)]), ("stop", ["x" * 300]),
    ("stop", {"a": 1}), ("stop", [["a"]]),
    ("stop_token_ids", "1"), ("stop_token_ids", [1.5]), ("stop_token_ids", [-1]), ("stop_token_ids", [50000]),
    ("stop_token_ids", [OUT_OF_VOCAB]), ("stop_token_ids", [HUGE]), ("stop_token_ids", list(range(300))),
    ("stop_token_ids", 5), ("stop_token_ids", [True]),
    ("ignore_eos", 1), ("ignore_eos", "true"),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", "1"),
    ("min_tokens", -1), ("min_tokens", 1.5), ("min_tokens", HUGE), ("min_tokens", 10**6),
    ("stream", "yes"), ("stream", 1), ("stream_options", "yes"), ("stream_options", {"include_usage": "yes"}),
    ("n", 0), ("n", 17), ("n", 1.5), ("suffix", "x"), ("model", 5), ("model", []),
    ("logprobs", 21), ("logprobs", -1), ("logprobs", "2"), ("logprobs", [1]),
    ("logit_bias", {"1": 500}), ("logit_bias", {"x": 1}), ("logit_bias", {str(OUT_OF_VOCAB): 1}),
    ("logit_bias", [1, 2]), ("logit_bias", {str(i): 1 for i in range(301)}),
    ("presence_penalty", 3), ("presence_penalty", -2.5), ("frequency_penalty", "1"), ("frequency_penalty", HUGE),
    ("guided_json", {"type": "nonsense"}), ("guided_json", "{not json"), ("guided_regex", "a(b"),
    ("guided_choice", []), ("guided_choice", [""]), ("structured_outputs", {"regex": "a+", "choice": ["a"]}),
    ("structured_outputs", {"xml": "a"}), ("response_format", {"type": "yaml"}),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}),
    # grammars that crash or stall a grammar engine: each is refused by a bound before any compiler sees it
    ("guided_json", None), ("guided_grammar", None), ("guided_regex", "(a{1000}){1000}"),
    ("guided_choice", [f"c{i}" for i in range(20_000)]), ("guided_regex", "(" * 200 + "a" + ")" * 200),
    ("structured_outputs", {"json": None}), ("response_format", None),
    ("n", 16),  # the work budget: 16 x (prompt + 1,000) tokens is past 4 x a 2,048 context (`_WITH`)
]  # fmt: skip


def ref_chain(depth: int) -> dict:
    """A JSON schema whose `$defs` chain `$ref` `depth` levels deep (flat JSON, deep to a schema compiler)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def right_recursive_rules(n: int) -> str:
    """A Lark grammar of `n` right-recursive rules, each one level deeper to the parser."""
    return "start: r0\n" + "\n".join(f'r{i}: "t{i}" r{i + 1} | "u{i}"' for i in range(n)) + f'\nr{n}: "z"'


_HOSTILE = {"guided_json": ref_chain(3000), "guided_grammar": right_recursive_rules(20_000),
            "structured_outputs": {"json": ref_chain(3000)},
            "response_format": {"type": "json_schema", "json_schema": {"schema": ref_chain(3000)}}}  # fmt: skip
_BAD_SAMPLING = [(k, _HOSTILE[k] if v is None else v) for k, v in _BAD_SAMPLING]


def _openai_cases(path: str, base: dict) -> list[Case]:
    out = [Case(path, {**base, k: v, **_WITH.get(k, {})}, 400, k) for k, v in _BAD_SAMPLING]
    out += [
        Case(path, {**base, "model": "gpt-4"}, 404, "model"),
        # JSON the parser takes but we refuse: non-finite numbers, huge literals, deep nesting, lone surrogates.
        Case(path, _raw(base, "temperature", "NaN"), 400, "temperature"),
        Case(path, _raw(base, "top_p", "Infinity"), 400, "top_p"),
        Case(path, _raw(base, "min_p", "-Infinity"), 400, "min_p"),
        Case(path, _raw(base, "temperature", "1e400"), 400, "temperature"),
        Case(path, _raw(base, "max_tokens", "9" * 5000), 400, "max_tokens"),
        Case(path, _raw(base, "seed", "-" + "1" * 50), 400, "seed"),
        Case(path, _raw(base, "stop", _nested(1000, '"a"')), 400, "stop"),
        Case(path, _raw(base, "extra", _nested(30)), 400, "extra"),
        Case(path, _raw(base, "stop", '"\\ud800"'), 400, "stop"),
        Case(path, _raw(base, "stop", '["ok", "\\udfff"]'), 400, "stop"),
        Case(path, _raw(base, "max_tokens", "1.2.3"), 400, "max_tokens"),
    ]
    return out


def _raw(base: dict, key: str, value_json: str) -> bytes:
    """`base` plus one field whose value is written as raw JSON text (what json.dumps would never produce)."""
    head = json.dumps(base)[:-1]
    return f'{head}, "{key}": {value_json}}}'.encode()


# What a case of `_BAD_SAMPLING` is sent with besides its field.
_WITH = {"n": {"max_tokens": 1000}}
_CMPL_BASE = {"prompt": "hi", "max_tokens": 4}
_CHAT_BASE = {"messages": MSGS, "max_tokens": 4}

CASES: list[Case] = [
    # -- the body as a whole ------------------------------------------------------------------------------
    *[Case(p, b"", 400, None) for p in (CMPL, CHAT, GEN)],
    *[Case(p, b'{"prompt": "hi",', 400, None) for p in (CMPL, CHAT, GEN)],
    *[Case(p, b"[1, 2]", 400, None) for p in (CMPL, CHAT, GEN)],
    *[Case(p, b'"just a string"', 400, None) for p in (CMPL, CHAT, GEN)],
    *[Case(p, b'{"prompt": "\xff\xfe bad utf-8"}', 400, None) for p in (CMPL, CHAT, GEN)],
    *[Case(p, OVERSIZE, 413, None) for p in (CMPL, CHAT, GEN)],
    Case(CMPL, b'{"prompt": "hi"} trailing', 400, None),
    Case(CMPL, b'{"prompt": "hi" "max_tokens": 3}', 400, "prompt"),
    Case(CMPL, b'{prompt: "hi"}', 400, None),
    Case(CMPL, _nested(2000).encode(), 400, None),
    # -- /v1/completions ----------------------------------------------------------------------------------
    Case(CMPL, {"model": "m"}, 400, "prompt"),
    Case(CMPL, {"prompt": 5}, 400, "prompt"),
    Case(CMPL, {"prompt": "hi", "echo": "yes"}, 400, "echo"),
    Case(CMPL, {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    Case(CMPL, {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    Case(CMPL, {"prompt": None}, 400, "prompt"),
    Case(CMPL, {"prompt": True}, 400, "prompt"),
    Case(CMPL, {"prompt": {"text": "hi"}}, 400, "prompt"),
    Case(CMPL, {"prompt": []}, 400, "prompt"),
    Case(CMPL, {"prompt": ""}, 400, "prompt"),
    Case(CMPL, {"prompt": [OUT_OF_VOCAB]}, 400, "prompt"),
    Case(CMPL, {"prompt": [-1]}, 400, "prompt"),
    Case(CMPL, {"prompt": [HUGE]}, 400, "prompt"),
    Case(CMPL, {"prompt": [1.5]}, 400, "prompt"),
    Case(CMPL, {"prompt": ["a", "b"]}, 400, "prompt"),
    Case(CMPL, {"prompt": [[1, 2], [3]]}, 400, "prompt"),
    Case(CMPL, {"prompt": [[]]}, 400, "prompt"),
    Case(CMPL, {"prompt": [1] * 2100, "max_tokens": 10}, 400, "prompt"),
    Case(CMPL, {"prompt": "word " * 200_000}, 400, "prompt"),
    Case(CMPL, _raw({"max_tokens": 4}, "prompt", '"\\ud83d lone high surrogate"'), 400, "prompt"),
    Case(CMPL, _raw({"max_tokens": 4}, "prompt", _nested(1200)), 400, "prompt"),
    *_openai_cases(CMPL, _CMPL_BASE),
    # -- /v1/chat/completions -----------------------------------------------------------------------------
    Case(CHAT, {"model": "m"}, 400, "messages"),
    Case(CHAT, {"messages": []}, 400, "messages"),
    Case(CHAT, {"messages": "hi"}, 400, "messages"),
    Case(CHAT, {"messages": [5]}, 400, "messages[0]"),
    Case(CHAT, {"messages": [None]}, 400, "messages[0]"),
    Case(CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    Case(CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    Case(CHAT, {"messages": [{"role": 5, "content": "hi"}]}, 400, "messages[0].role"),
    Case(CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    Case(CHAT, {"messages": [{"role": "user", "content": {"text": "hi"}}]}, 400, "messages[0].content"),
    Case(CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, 400,
         "messages[0].content"),  # fmt: skip
    Case(CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400,
         "messages[0].content"),  # fmt: skip
    Case(CHAT, {"messages": [{"role": "user", "content": "hi", "name": 5}]}, 400, "messages[0].name"),
    Case(CHAT, {"messages": [MSGS[0], {"role": "tyrant", "content": "x"}]}, 400, "messages[1].role"),
    Case(CHAT, {"messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 4}, 400, "messages"),
    Case(CHAT, {"messages": [{"role": "user", "content": "word " * 200_000}]}, 400, "messages"),
    Case(CHAT, _raw({"max_tokens": 4}, "messages", '[{"role": "user", "content": "\\udc00"}]'), 400, "messages"),
    Case(CHAT, _raw({"max_tokens": 4}, "messages", _nested(1500)), 400, "messages"),
    Case(CHAT, {**_CHAT_BASE, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    Case(CHAT, {**_CHAT_BASE, "max_completion_tokens": "9"}, 400, "max_completion_tokens"),
    Case(CHAT, {**_CHAT_BASE, "max_completion_tokens": HUGE}, 400, "max_completion_tokens"),
    *_openai_cases(CHAT, _CHAT_BASE),
    # -- /generate (SGLang) -------------------------------------------------------------------------------
    Case(GEN, {}, 400, "text"),
    Case(GEN, {"text": "hi", "input_ids": [1]}, 400, "text"),
    Case(GEN, {"text": 5}, 400, "text"),
    Case(GEN, {"text": ""}, 400, "text"),
    Case(GEN, {"input_ids": "1 2"}, 400, "input_ids"),
    Case(GEN, {"input_ids": [1.5]}, 400, "input_ids"),
    Case(GEN, {"input_ids": [-1]}, 400, "input_ids"),
    Case(GEN, {"input_ids": [OUT_OF_VOCAB]}, 400, "input_ids"),
    Case(GEN, {"input_ids": [HUGE]}, 400, "input_ids"),
    Case(GEN, {"input_ids": []}, 400, "input_ids"),
    Case(GEN, {"text": "hi", "stream": "yes"}, 400, "stream"),
    Case(GEN, {"text": "hi", "sampling_params": "greedy"}, 400, "sampling_params"),
    Case(GEN, {"text": "hi", "sampling_params": {"beam_width": 2}}, 400, "sampling_params"),
    Case(GEN, {"text": "word " * 200_000}, 400, "text"),
    Case(GEN, _raw({"text": "hi"}, "sampling_params", '{"temperature": NaN}'), 400, "sampling_params"),
    Case(GEN, _raw({"text": "hi"}, "sampling_params", '{"stop": ' + _nested(40, '"a"') + "}"), 400,
         "sampling_params"),  # fmt: skip
    *[
        Case(GEN, {"text": "hi", "sampling_params": {k: v}}, 400, k)
        for k, v in [
            ("max_new_tokens", 0), ("max_new_tokens", "1"), ("max_new_tokens", HUGE), ("max_new_tokens", 1.5),
            ("min_new_tokens", -1), ("min_new_tokens", 10**6), ("temperature", "hot"), ("temperature", -1),
            ("top_p", 2), ("top_k", HUGE), ("top_k", -5), ("min_p", 3), ("sampling_seed", "x"), ("seed", HUGE),
            ("stop", 5), ("stop", [""]), ("stop", ["y" * 300]), ("stop_token_ids", [50000]),
            ("stop_token_ids", [-3]), ("stop_token_ids", "x"), ("ignore_eos", "no"), ("repetition_penalty", 0),
        ]
    ],  # fmt: skip
]
