"""A grammar that applies after a reasoning model's thinking (`SamplingParams.grammar_after`, set by the server with
--reasoning-parser): every token is admitted until the output holds the end tag, the grammar's after it; drafts are
checked across the switch; the server sets it only where the prompt leaves the reasoning open."""

from __future__ import annotations

import pytest

from ringsched.sampling import structured
from ringsched.sampling.params import SamplingParams
from ringsched.server.protocol import parse_chat
from ringsched.server.reasoning import END, grammar_after
from ringsched.server.request_limits import Limits
from ringsched.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return Tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def grammars(smollm2_dir):
    return structured.Grammars(smollm2_dir, 49152, (2,))


def test_every_token_until_the_tag_then_the_grammar(tok, grammars):
    after = tuple(tok.encode(END, add_bos=False))
    c = grammars.build(structured.grammar_for(regex="[0-9]{3}"), after).result()
    one, letter = tok.encode("1", add_bos=False)[0], tok.encode("x", add_bos=False)[0]
    assert c.allowed().all()
    for t in [letter, *after[:-1]]:
        c.advance(t)
        assert c.allowed().all()  # a part of the tag is not the tag
    c.advance(after[-1])
    assert c.allowed()[one] and not c.allowed()[letter]
    with pytest.raises(structured.GrammarError):
        c.advance(letter)


def test_drafts_across_the_tag_are_checked_and_the_state_kept(tok, grammars):
    after = tuple(tok.encode(END, add_bos=False))
    c = grammars.build(structured.grammar_for(regex="[0-9]{3}"), after).result()
    one, two, letter = (tok.encode(s, add_bos=False)[0] for s in ("1", "2", "x"))
    drafts = [letter, *after, one, two, letter]
    assert c.admits(drafts) == len(drafts) - 1
    v, masks = c.masks_along(drafts)
    assert v == len(drafts) - 1 and len(masks) == v + 1
    assert masks[0].all() and not masks[len(after) + 1][letter] and masks[len(after) + 1][one]
    assert c.allowed().all() and not c.active  # as it was
    for t in drafts[:-1]:
        c.advance(t)
    assert c.active and not c.allowed()[letter]


def test_the_tag_is_needed_unless_the_prompt_closed_the_reasoning(tok):
    end = tuple(tok.encode(END, add_bos=False))
    assert grammar_after(tok, tok.encode("<|im_start|>assistant\n<think>\n")) == end  # DeepSeek-R1's: open
    assert grammar_after(tok, tok.encode("<|im_start|>assistant\n")) == end  # Qwen3 thinking: it opens one
    assert grammar_after(tok, tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")) == ()  # closed
    assert grammar_after(tok, tok.encode("<think>a</think> b<|im_start|>assistant\n")) == end  # an earlier turn's


def test_a_chat_grammar_waits_for_the_reasoning_with_a_reasoning_parser(tok):
    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}
    plain = Limits(512, 4096, tok.vocab_size, "m")
    assert parse_chat(body, tok, plain).params.grammar_after == ()
    thinking = Limits(512, 4096, tok.vocab_size, "m", reasoning_parser="deepseek_r1")
    assert parse_chat(body, tok, thinking).params.grammar_after == tuple(tok.encode(END, add_bos=False))
    no_grammar = {"messages": body["messages"]}
    assert parse_chat(no_grammar, tok, thinking).params.grammar_after == ()


def test_the_field_is_checked():
    assert SamplingParams(grammar_after=[5, 6]).grammar_after == (5, 6)
    assert SamplingParams.from_dict(SamplingParams(grammar_after=(7,)).to_dict()).grammar_after == (7,)
    with pytest.raises(ValueError, match="grammar_after"):
        SamplingParams(grammar_after=[-1])
    with pytest.raises(ValueError, match="grammar_after"):
        SamplingParams(grammar_after=list(range(17)))
