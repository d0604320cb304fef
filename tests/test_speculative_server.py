"""Speculative decoding with real weights behind real HTTP: the launcher at PP=2 with `--speculative-config` gives
the openai client transformers' greedy tokens on a passage to copy and on a question, keeps drafts on the copy, and
reports the drafts in /metrics. (TP=2 x PP=2 with drafts: tests/test_tp.py; every layout on a tiny model, seeded
rows too: tests/test_loop_in_process.py.)"""

from __future__ import annotations

import re
import time

import pytest
from test_model_reference import hf_greedy

pytestmark = pytest.mark.slow  # a launcher of two stages, real weights, transformers as the reference

PASSAGE = ("The river rose slowly through the night, and by morning the old bridge at the edge of the village stood "
           "in water up to its second arch. The miller's family carried their sacks of flour to the church on the "
           "hill, where the floor was dry and the doors could be barred against the wind.")  # fmt: skip
PROMPTS = [f"Copy this text exactly.\n\n{PASSAGE}\n\nCopy:\n\n{PASSAGE[:40]}", "What is the capital of France?"]
SPEC = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4, '
        '"adaptive": false}')  # drafts on every step, however fast this host's rows are


def test_pp2_server_with_drafts_serves_transformers_tokens_and_counts_them(smollm2_dir, hf_smol):
    import httpx
    import openai

    from ringsched.bench.server_process import ServerProcess

    hf, tok = hf_smol
    want = [hf_greedy(hf, tok(p)["input_ids"], 40) for p in PROMPTS]
    args = ["--pp-size", "2", "--threads-per-stage", "1", "--kv-cache-memory", "64M", "--speculative-config", SPEC]
    with ServerProcess(args) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
        for prompt, expected in zip(PROMPTS, want, strict=True):
            r = client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=40, temperature=0,
                                          logprobs=1, extra_body={"ignore_eos": True})  # fmt: skip
            assert r.usage.completion_tokens == 40
            assert r.choices[0].text == tok.decode(expected, skip_special_tokens=True), prompt
            assert len(r.choices[0].logprobs.tokens) == 40  # one per token, drafted or not
        deadline, counts = time.monotonic() + 10, {}
        while time.monotonic() < deadline and not counts.get("accepted_tokens"):
            time.sleep(0.5)
            text = httpx.get(f"{srv.url}/metrics", timeout=10).text
            counts = {m[1]: float(m[2]) for m in re.finditer(r"^ringsched:spec_decode_num_(\w+)_total (\S+)$", text,
                                                             re.M)}  # fmt: skip
        assert 0 < counts["accepted_tokens"] <= counts["draft_tokens"], text
        rate = float(re.search(r"^ringsched:spec_decode_acceptance_rate (\S+)$", text, re.M)[1])
        assert rate == pytest.approx(counts["accepted_tokens"] / counts["draft_tokens"])
