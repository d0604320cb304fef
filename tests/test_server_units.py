"""The server's pure parts without a server: incremental detokenizer, stop strings, request validation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ringsched.detokenizer import IncrementalDetokenizer, StopMatcher, TextStream
from ringsched.server.protocol import APIError, Limits, parse_chat, parse_completion, parse_generate
from ringsched.tokenizer import Tokenizer

LIMITS = Limits(max_len=64, kv_tokens=48, vocab_size=49152, model_name="m")


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> Tokenizer:
    return Tokenizer(smollm2_dir)


def _stream_pieces(tok: Tokenizer, text: str, stop: list[str], prompt: str = "Say:") -> tuple[list[str], TextStream]:
    ts = TextStream(tok, tok.encode(prompt), stop)
    pieces = [ts.add([i]) for i in tok.encode(text)]
    if not ts.stopped:
        pieces.append(ts.finish())
    return pieces, ts


def test_detokenizer_holds_back_partial_utf8(tok):
    text = "héllo 😀 世界, naïve café 🎉!"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, tok.encode("Q:"))
    pieces = [d.add([i]) for i in ids] + [d.flush()]
    assert "".join(pieces) == text == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # an emoji spans several tokens: some steps had nothing complete to show


def test_detokenizer_flushes_an_incomplete_tail(tok):
    ids = tok.encode("ok 😀")[:-1]  # cut inside the emoji
    d = IncrementalDetokenizer(tok)
    assert "".join(d.add([i]) for i in ids) + d.flush() == tok.decode(ids)


@pytest.mark.parametrize(
    "text, stop, expected",
    [
        ("The answer is: 2018-01", ["is: 20"], "The answer "),
        ("The answer is: 2018-01", ["swer", "The"], ""),
        ("abc abd abe", ["abe"], "abc abd "),
        ("no stop here at all", ["zzz"], "no stop here at all"),
        ("ends with a prefix ab", ["abc"], "ends with a prefix ab"),
        ("multi\n\nline", ["\n\n"], "multi"),
    ],
)
def test_stop_strings_across_tokens_never_leak(tok, text, stop, expected):
    pieces, ts = _stream_pieces(tok, text, stop)
    assert "".join(pieces) == ts.text == expected
    assert ts.stopped == (expected != text)
    shown = ""
    for p in pieces:  # at no point was any part of a stop string visible past the final text
        shown += p
        assert expected.startswith(shown)


def test_stop_matcher_holds_only_possible_prefixes():
    m = StopMatcher(["STOP"])
    assert m.feed("abcS") == "abc"
    assert m.feed("T") == ""
    assert m.feed("x") == "STx"  # not a stop string after all: released
    assert m.feed("ST") == ""
    assert m.feed("OP and more") == "" and m.matched == "STOP"
    assert m.flush() == ""


def _err(fn, *args) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    return e.value


def test_parse_completion(tok):
    r = parse_completion({"prompt": "hello", "max_tokens": 4, "stop": "x", "temperature": 0}, tok, LIMITS)
    assert r.prompt_ids == tok.encode("hello") and r.params.max_tokens == 4 and r.params.stop == ("x",)
    assert parse_completion({"prompt": [[5, 6]]}, tok, LIMITS).prompt_ids == [5, 6]
    e = _err(parse_completion, {"prompt": [1] * 60, "max_tokens": 10}, tok, LIMITS)
    assert e.message == (
        "This model's maximum context length is 64 tokens. However, you requested 70 tokens (60 in the prompt, 10 "
        "in the completion). Please reduce the length of the prompt or completion."
    )
    e = _err(parse_completion, {"prompt": [1] * 40, "max_tokens": 10}, tok, LIMITS)
    assert "KV" in e.message and "--kv-cache-memory" in e.message
    assert _err(parse_completion, {"prompt": "a", "top_k": -3}, tok, LIMITS).param == "top_k"
    assert _err(parse_completion, {"prompt": "a", "model": "other"}, tok, LIMITS).status == 404
    echoed = parse_completion({"prompt": "a", "echo": True, "logprobs": 2}, tok, LIMITS)
    assert echoed.params.prompt_logprobs == 2 and not echoed.prompt_logprobs  # for the echo; not returned apart
    assert _err(parse_completion, {"prompt": "a", "prompt_logprobs": 1, "stream": True}, tok, LIMITS).param == (
        "prompt_logprobs"
    )
    assert _err(parse_completion, {"prompt": ["a", "b"]}, tok, LIMITS).param == "prompt"


def test_parse_chat(tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    r = parse_chat({"messages": msgs, "stream": True, "stream_options": {"include_usage": True}}, tok, LIMITS)
    assert r.prompt_ids == tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert r.stream and r.include_usage
    assert r.params.max_tokens == min(LIMITS.max_len, LIMITS.kv_tokens) - len(r.prompt_ids)  # up to the end
    assert (
        parse_chat({"messages": msgs, "max_tokens": 9, "max_completion_tokens": 3}, tok, LIMITS).params.max_tokens == 3
    )
    e = _err(parse_chat, {"messages": [{"role": "user", "content": "x " * 80}], "max_tokens": 1}, tok, LIMITS)
    assert "in the messages" in e.message and e.code == "context_length_exceeded"
    assert _err(parse_chat, {"messages": [{"role": "robot", "content": "x"}]}, tok, LIMITS).param == "messages[0].role"


def test_parse_generate(tok):
    r = parse_generate({"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 5, "top_k": 1}}, tok, LIMITS)
    assert (r.prompt_ids, r.params.max_tokens, r.params.greedy) == ([3, 4], 5, True)
    assert _err(parse_generate, {"sampling_params": {}}, tok, LIMITS).param == "text"


def test_throughput_line_counts_prompt_tokens_as_they_are_prefilled(caplog):
    """A long prompt prefilling over several periods shows as prompt tokens/s in each, not 0."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from ringsched.server.metrics import log_throughput

    client = SimpleNamespace(sched_stats={"running": 1, "prefill_tokens": 0}, counters=SimpleNamespace(
        generation_tokens=0), num_waiting=lambda: 0, stage_stats=lambda: {})  # fmt: skip

    async def main() -> None:
        task = asyncio.create_task(log_throughput(client, period=0.1))
        for _ in range(3):
            await asyncio.sleep(0.1)
            client.sched_stats = {"running": 1, "prefill_tokens": client.sched_stats["prefill_tokens"] + 512}
        await asyncio.sleep(0.05)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="ringsched.server"):
        asyncio.run(main())
    rates = [float(r.getMessage().split("prompt ")[1].split(" tok/s")[0]) for r in caplog.records]
    assert len(rates) >= 2 and all(rate > 1000 for rate in rates[1:]), rates


# Every field OpenAI defines for the endpoint with a value other than its default: honoured (parsed into the
# request) or refused with a 400 naming it.
NON_DEFAULT = {
    "model": "m", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "best_of": 2, "echo": True,
    "frequency_penalty": 0.5, "logit_bias": {"5": 3}, "logprobs": 2, "max_tokens": 3, "n": 2,
    "presence_penalty": -0.5, "seed": 7, "stop": "x", "stream": True, "stream_options": {"include_usage": True},
    "suffix": "x", "temperature": 0.5, "top_p": 0.9, "user": "u", "audio": {"voice": "alloy", "format": "wav"},
    "function_call": "auto", "functions": [{"name": "f"}], "max_completion_tokens": 3, "metadata": {"k": "v"},
    "modalities": ["text", "audio"], "parallel_tool_calls": False, "prediction": {"type": "content", "content": "x"},
    "prompt_cache_key": "k", "reasoning_effort": "low", "response_format": {"type": "json_object"},
    "safety_identifier": "s", "service_tier": "flex", "store": True, "tool_choice": "auto",
    "tools": [{"type": "function", "function": {"name": "f"}}], "top_logprobs": 2, "verbosity": "low",
    "web_search_options": {},
}  # fmt: skip
# What an honoured field shows in the parsed request.
PARSED = {
    "frequency_penalty": lambda r: r.params.frequency_penalty == 0.5,
    "presence_penalty": lambda r: r.params.presence_penalty == -0.5,
    "logit_bias": lambda r: r.params.logit_bias == ((5, 3.0),),
    "max_tokens": lambda r: r.params.max_tokens == 3, "max_completion_tokens": lambda r: r.params.max_tokens == 3,
    "seed": lambda r: r.params.seed == 7, "stop": lambda r: r.params.stop == ("x",),
    "stream": lambda r: r.stream, "stream_options": lambda r: r.include_usage,
    "temperature": lambda r: r.params.temperature == 0.5, "top_p": lambda r: r.params.top_p == 0.9,
    "prompt": lambda r: len(r.prompt_ids) == 1, "messages": lambda r: len(r.prompt_ids) > 3,
    "model": lambda r: True,  # the served name: checked against it (another gets a 404)
    "logprobs": lambda r: r.params.logprobs in (2, 0), "top_logprobs": lambda r: r.params.logprobs == 2,
    "n": lambda r: r.n == 2 and r.best_of == 2 and len(r.sequences("x")) == 2,
    "response_format": lambda r: r.grammar is not None,
    "best_of": lambda r: r.n == 1 and r.best_of == 2 and r.params.logprobs == 0 and not r.logprobs_asked,
    "tools": lambda r: r.tools.tools[0]["function"]["name"] == "f" and r.tools.choice == "auto",
    "tool_choice": lambda r: r.tools.choice == "auto",
    "echo": lambda r: r.echo == "hi",
    "reasoning_effort": lambda r: True,  # a template variable: test_chat_template_sources checks that it arrives
}  # fmt: skip


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_openai_field_is_honoured_or_refused_by_name(tok, endpoint, caplog):
    from ringsched.server.request_bodies import ACCEPTED, OPENAI_FIELDS, UNSUPPORTED

    parse, base = {"completions": (parse_completion, {"prompt": "hi"}),
                   "chat": (parse_chat, {"messages": NON_DEFAULT["messages"]})}[endpoint]  # fmt: skip
    honoured = []
    for field in OPENAI_FIELDS[endpoint]:
        body = {**base, field: NON_DEFAULT[field]}
        if endpoint == "chat" and field in ("logprobs", "top_logprobs"):  # chat's logprobs is a switch
            body["logprobs"] = True
        if field == "tool_choice":  # a choice among tools
            body["tools"] = NON_DEFAULT["tools"]
        if field in UNSUPPORTED:
            e = _err(parse, body, tok, LIMITS)
            assert (e.status, e.param) == (400, field), (field, e)
            assert field in str(e)
            continue
        r = parse(body, tok, replace(LIMITS, tool_parser="hermes"))  # tool_choice auto needs a parser
        assert field in ACCEPTED or PARSED[field](r), field
        honoured.append(field)
    assert {"frequency_penalty", "presence_penalty", "logit_bias", "seed", "stop", "logprobs", "n"} <= set(honoured)
    assert not caplog.records  # OpenAI's own fields are never "ignored"
    with caplog.at_level("WARNING", logger="ringsched.server"):
        parse({**base, "not_a_field": 1, "another": 2}, tok, LIMITS)
    assert "ignored: ['another', 'not_a_field']" in caplog.text
    if endpoint == "chat":
        e = _err(parse, {**base, "top_logprobs": 2}, tok, LIMITS)
        assert e.param == "top_logprobs" and "logprobs" in str(e)
        assert _err(parse, {**base, "logprobs": True, "top_logprobs": 21}, tok, LIMITS).param == "top_logprobs"


def test_the_work_budget_counts_every_sequence_and_names_the_flag(tok):
    from dataclasses import replace

    limits = Limits(max_len=2048, kv_tokens=1 << 20, vocab_size=49152, model_name="m")  # budget 4 x 2048
    ok = parse_completion({"prompt": "hi", "n": 4, "max_tokens": 2000}, tok, limits)
    assert (ok.n, ok.best_of) == (4, 4)
    e = _err(parse_completion, {"prompt": "hi", "n": 5, "max_tokens": 2000}, tok, limits)
    assert (e.status, e.param, e.code) == (400, "n", "request_too_large")
    assert "5 sequence(s) x (1 prompt + 2000 completion tokens) = 10005" in e.message
    assert "at most 8192 (--max-request-tokens)" in e.message
    e = _err(parse_completion, {"prompt": "hi", "n": 1, "best_of": 16, "max_tokens": 1000}, tok, limits)
    assert (e.status, e.param) == (400, "best_of")
    small = replace(limits, max_request_tokens=100)
    e = _err(parse_chat, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}, tok, small)
    assert (e.status, e.param) == (400, "n") and "at most 100" in e.message
    assert parse_generate({"text": "hi", "sampling_params": {"max_new_tokens": 90}}, tok, small)


def test_the_models_sampling_defaults_fill_what_a_request_leaves_out(tok, tmp_path):
    """--generation-config auto (vLLM's default): generation_config.json's temperature, top_p, top_k, min_p and
    repetition_penalty where a request gives none; a request's own value wins."""
    import json

    from ringsched.server.request_limits import model_sampling_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                                 "do_sample": True, "eos_token_id": 2}))  # fmt: skip
    defaults = model_sampling_defaults(str(tmp_path))
    assert defaults == (("temperature", 0.6), ("top_p", 0.95), ("top_k", 20))
    limits = replace(LIMITS, sampling_defaults=defaults)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    silent = parse_chat(body, tok, limits).params
    assert (silent.temperature, silent.top_p, silent.top_k) == (0.6, 0.95, 20)
    given = parse_chat({**body, "temperature": 0.0, "top_k": 5}, tok, limits).params
    assert (given.temperature, given.top_p, given.top_k) == (0.0, 0.95, 5)
    assert parse_completion({"prompt": "hi", "max_tokens": 2}, tok, LIMITS).params.temperature != 0.6  # vllm: none
