"""`/tokenize` and `/detokenize` over real HTTP (the app over a fake ring): a prompt and a chat round-trip, the chat
as `/v1/chat/completions` renders it, and bad input is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest
from fake_ring import FrontEnd

from ringsched.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def front(smollm2_dir):
    fe = FrontEnd(str(smollm2_dir), grammar_workers=0, max_len=512)
    yield fe
    fe.close()


def test_a_prompt_round_trips(front, smollm2_dir):
    text = "The capital of France is Paris. Ünïcödé, emoji 🚀 and  two spaces."
    r = httpx.post(f"{front.url}/tokenize", json={"prompt": text}, timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == Tokenizer(smollm2_dir).encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    back = httpx.post(f"{front.url}/detokenize", json={"tokens": body["tokens"]}, timeout=10)
    assert back.status_code == 200 and back.json()["prompt"].endswith(text), back.text


def test_messages_render_as_a_chat_request_would(front, smollm2_dir):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    tok = Tokenizer(smollm2_dir)
    r = httpx.post(f"{front.url}/tokenize", json={"model": "m", "messages": messages}, timeout=10)
    assert r.status_code == 200 and r.json()["tokens"] == tok.apply_chat_template(messages), r.text
    r = httpx.post(f"{front.url}/tokenize", json={"messages": messages, "add_generation_prompt": False}, timeout=10)
    assert r.json()["tokens"] == tok.apply_chat_template(messages, add_generation_prompt=False)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "colour": "red"}, "colour"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, "messages[0].role"),
        ("/detokenize", {"tokens": [1, -3]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(front, path, body, param):
    r = httpx.post(f"{front.url}{path}", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_another_model_is_a_404(front):
    r = httpx.post(f"{front.url}/tokenize", json={"model": "gpt-9", "prompt": "a"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_completions_echo_the_prompt_whole_and_streamed(front):
    """`echo`: each choice's text starts with the prompt's (the fake ring answers token 28 every step)."""
    import openai

    client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="x")
    whole = client.completions.create(model="m", prompt="Once upon", max_tokens=3, echo=True, n=2)
    assert all(c.text.startswith("Once upon") and len(c.text) > len("Once upon") for c in whole.choices)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt="Once upon", max_tokens=3, echo=True, stream=True) if c.choices)  # fmt: skip
    assert streamed == whole.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:  # as vLLM: the prompt's log-probabilities come whole
        client.completions.create(model="m", prompt="Once upon", max_tokens=3, stream=True,
                                  extra_body={"prompt_logprobs": 1})  # fmt: skip
    assert e.value.body["param"] == "prompt_logprobs"
