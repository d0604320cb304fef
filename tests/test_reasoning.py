"""`--reasoning-parser` (`server/reasoning.py`): the reasoning of a thinking model apart from its answer, the same
whole and streamed, whatever the pieces a stream comes in (every text below split at every character)."""

from __future__ import annotations

import pytest

from ringsched.server.reasoning import ReasoningSplit, split_whole

CASES = {
    # (parser, output): (reasoning, content)
    ("deepseek_r1", "Let me see. 2+2=4.</think>The answer is 4."): ("Let me see. 2+2=4.", "The answer is 4."),
    ("deepseek_r1", "<think>Hmm.</think>\n\nFour."): ("Hmm.", "\n\nFour."),
    ("deepseek_r1", "still thinking when max_tokens hit <th"): ("still thinking when max_tokens hit <th", ""),
    ("deepseek_r1", "a < b and </thin> is not the tag</think>ok"): ("a < b and </thin> is not the tag", "ok"),
    ("qwen3", "<think>\nThe user greets.\n</think>\n\nHello!"): ("\nThe user greets.\n", "\n\nHello!"),
    ("qwen3", "Hello! No thinking here."): (None, "Hello! No thinking here."),
    ("qwen3", "<thinking> is not the tag"): (None, "<thinking> is not the tag"),
    ("qwen3", "<think>cut off"): ("cut off", ""),
    ("qwen3", "<th"): (None, "<th"),
    ("qwen3", ""): (None, ""),
}


@pytest.mark.parametrize("case", list(CASES), ids=[f"{p}:{t[:20]}" for p, t in CASES])
def test_whole_and_streamed_at_every_split_agree(case):
    parser, text = case
    reasoning, content = CASES[case]
    assert split_whole(parser, text) == (reasoning, content)
    for cut in range(len(text) + 1):
        s = ReasoningSplit(parser)
        parts = [s.feed(text[:cut]), s.feed(text[cut:]), s.finish()]
        assert ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts)) == (reasoning, content), cut
    s = ReasoningSplit(parser)
    parts = [s.feed(ch) for ch in text] + [s.finish()]
    assert ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts)) == (reasoning, content)


def test_an_unknown_parser_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--reasoning-parser 'r2d2': use one of deepseek_r1, qwen3"):
        ReasoningSplit("r2d2")


@pytest.fixture(scope="module")
def thinking_front(smollm2_dir):
    """The app over a fake ring whose every request answers `<think>...</think>...` (SmolLM2's tokens for it)."""
    from fake_ring import FrontEnd

    from ringsched.tokenizer import Tokenizer

    fe = FrontEnd(str(smollm2_dir), grammar_workers=0)
    text = "<think>The user says hi; greet back.</think>Hello there!"
    fe.ring.script = Tokenizer(smollm2_dir).encode(text, add_bos=False)
    fe.ctx.reasoning_parser = "qwen3"
    yield fe, len(fe.ring.script)
    fe.close()


def test_the_openai_client_reads_reasoning_content_whole_and_streamed(thinking_front):
    import openai

    fe, n = thinking_front
    client = openai.OpenAI(base_url=f"{fe.url}/v1", api_key="x")
    ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": n}
    message = client.chat.completions.create(**ask).choices[0].message
    assert message.reasoning_content == "The user says hi; greet back." and message.content == "Hello there!"
    reasoning = content = ""
    for chunk in client.chat.completions.create(**ask, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning, content) == ("The user says hi; greet back.", "Hello there!")
