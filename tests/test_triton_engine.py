"""The whole engine with `--attention-backend triton`: on CPU every attention call runs the Triton kernels under
Triton's interpreter (slow, exact enough), through a real two-stage ring; greedy tokens equal transformers'."""

import pytest
from test_model_reference import hf_greedy

from ringsched import Engine
from ringsched.sampling.params import SamplingParams

pytestmark = pytest.mark.slow
pytest.importorskip("triton")

PROMPTS = ["The quick brown fox jumps over the lazy dog. In Paris,", "1, 2, 3, 5, 8, 13,"]
TOKENS = 3  # the prefill's token, then two decode steps


def test_triton_backend_through_the_ring_matches_transformers(smollm2_dir, hf_smol):
    hf, tok = hf_smol
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    with Engine(model=str(smollm2_dir), pp_size=2, attention_backend="triton", threads_per_stage=1,
                chunked_prefill_size=8) as llm:  # fmt: skip
        # chunks of 8: the second chunk of each prompt attends to a cached prefix (the extend kernel's paged part)
        outs = llm.generate(ids, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, i, TOKENS) for i in ids]
