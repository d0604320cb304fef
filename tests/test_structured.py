"""Structured outputs: grammars from each form, the mask on SmolLM2's vocabulary, JSON-schema answers through the
`openai` client that parse and validate (`check_server`, run on `test_server.py`'s server), and greedy structured
output identical at PP=1 and PP=2."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from ringsched.engine import Engine
from ringsched.sampling import structured
from ringsched.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
KEY = "test-key"  # test_server.py's server
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "country": {"enum": ["France", "Spain", "Italy", "Other"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Madrid", "Rome", "Lyon", "Seville", "Milan", "Nice", "Porto", "Turin", "Bilbao", "Naples",
          "Marseille", "Valencia", "Florence", "Toulouse", "Granada", "Venice", "Bordeaux", "Malaga",
          "Genoa"]  # fmt: skip


def prompts() -> list[str]:
    return [f"Describe the city of {c} as JSON with its city name, country and population." for c in CITIES]


def test_each_form_gives_a_grammar_and_a_mask(smollm2_dir):
    from ringsched.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir)
    grammars = structured.Grammars(smollm2_dir, 49152, (2,))
    for form in ({"json_schema": SCHEMA}, {"json_object": True}, {"regex": "[0-9]{3}"}, {"choice": ["yes", "no"]},
                 {"lark": 'start: "a" "b"+'}):  # fmt: skip
        g = structured.grammar_for(**form)
        assert structured.check(g) == "", form
        c = grammars.constraint(g)
        allowed = c.allowed()
        assert allowed.shape == (49152,) and 0 < int(allowed.sum()) < 49152, form
    c = grammars.constraint(structured.grammar_for(choice=["yes", "no"]))
    for t in tok.encode("yes"):
        assert c.allowed()[t]
        c.advance(t)
    assert c.allowed().nonzero().flatten().tolist() == [2]  # complete: only EOS
    with pytest.raises(structured.GrammarError):
        structured.grammar_for(choice=[])
    assert structured.check(structured.grammar_for(json_schema={"type": "nonsense"}))
    assert structured.check(structured.grammar_for(regex="a("))


def check_server(url: str) -> None:
    """JSON-schema chat answers to 20 prompts, sent at once, parse and validate; a JSON object and a choice too."""
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)

    async def one(prompt: str):
        messages = [{"role": "user", "content": prompt}]
        return await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                                    response_format=rf)  # fmt: skip

    async def every():
        try:
            return await asyncio.gather(*(one(p) for p in prompts()))
        finally:
            await client.close()

    replies = asyncio.run(every())
    sync = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    obj = sync.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=48, temperature=0,
                                  extra_body={"structured_outputs": {"json_object": True}})  # fmt: skip
    choice = sync.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
                                     extra_body={"guided_choice": ["yes", "no"]})  # fmt: skip
    for reply in replies:
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    assert isinstance(json.loads(obj.choices[0].text), dict)
    assert choice.choices[0].text in ("yes", "no")


def test_greedy_structured_output_is_the_same_at_pp1_and_pp2():
    """(PP=2 with speculative drafts: the grammar masks each drafted row and cuts drafts it refuses.) A grammar
    after a tag applies from the token after it, at both."""
    params = SamplingParams(max_tokens=64, temperature=0, grammar=structured.grammar_for(json_schema=SCHEMA))
    late: dict = {}
    texts, spec = {}, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                       "adaptive": False}  # drafts on every step, however fast this host's rows are
    for pp in (1, 2):
        with Engine(MODEL, pp_size=pp, threads_per_stage=1, kv_cache_memory="64M", log_level="warning",
                    speculative_config=spec if pp == 2 else None) as llm:  # fmt: skip
            chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts()[:6]]
            texts[pp] = [o.text for o in llm.generate(chats, params)]
            # A grammar after a tag (a reasoning model's end of thinking): the token the bias forces comes first,
            # unconstrained; once it is out, the grammar takes over (the bias then loses to its mask) and ends it.
            forced = llm.tokenizer.encode(" Sure", add_bos=False)[0]
            after = SamplingParams(max_tokens=12, temperature=0, grammar=structured.grammar_for(regex="[0-9]{3}"),
                                   grammar_after=(forced,), logit_bias={forced: 100})  # fmt: skip
            late[pp] = llm.generate([chats[0]], after)[0]
            accepted = llm.wait_idle().get("spec_accepted_tokens", 0)
    assert texts[1] == texts[2]
    assert accepted > 0
    for t in texts[1]:
        jsonschema.validate(json.loads(t), SCHEMA)
    for out in late.values():
        assert out.token_ids[0] == forced and out.finish_reason == "stop", out
        assert re.fullmatch("[0-9]{3}", llm.tokenizer.decode(out.token_ids[1:])), out.text
    assert late[1].token_ids == late[2].token_ids


def test_a_grammar_cuts_speculative_drafts_at_the_first_it_refuses_and_keeps_its_state(smollm2_dir):
    import torch

    from ringsched.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir)
    c = structured.Grammars(smollm2_dir, 49152, (2,)).constraint(structured.grammar_for(regex="[0-9]{3}"))
    one, two, letter = (tok.encode(s)[0] for s in ("1", "2", "x"))
    before = c.allowed().clone()
    v, masks = c.masks_along([one, two, letter, one])
    assert v == 2 and len(masks) == 3  # "12" is admitted, "x" is not: the masks before 1, before 2, after both
    assert masks[0][one] and masks[1][two] and not masks[2][letter]
    assert torch.equal(c.allowed(), before)  # as it was: the drafts are verified, not yet consumed
    c.advance(one)
