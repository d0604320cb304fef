"""`--enable-deterministic-inference`: a request's log-probabilities are the same bit for bit whichever requests
share its micro-batches, because every row count takes the same, row-invariant kernels; so a rerun, or a replay
after a rank is replaced, gives exactly the same text. (Without it, steps of many rows take MKL or oneDNN, whose
rows round differently from the kernel's: a near-tie can flip.)"""

from __future__ import annotations

import pytest
import torch

from ringsched.engine import Engine
from ringsched.kernels.small_linear import Linear
from ringsched.sampling.params import SamplingParams

TARGET = "The lighthouse keeper counted the ships"
CROWD = [f"Story {i}: " + "the sea was calm and the night was long " * (2 + i % 4) for i in range(7)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_invariant_linear_layer_gives_each_row_the_same_bits_at_any_row_count(dtype):
    torch.manual_seed(0)
    lin = Linear(96, 200, bias=True)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        lin.bias.normal_()
    lin = lin.to(dtype)
    lin.prepare()
    if not lin.batch_invariant():
        pytest.skip("the native kernel does not run here")
    x = torch.randn(150, 96).to(dtype)
    with torch.no_grad():
        whole = lin(x)
        for rows in (1, 3, 8, 17, 33, 64, 129):
            assert torch.equal(lin(x[5 : 5 + rows]), whole[5 : 5 + rows]), rows


def test_a_requests_logprobs_do_not_depend_on_the_requests_beside_it(smollm2_dir):
    p = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    kw = {"pp_size": 2, "threads_per_stage": 1, "kv_cache_memory": "16M", "log_level": "warning",
          "enable_prefix_caching": False, "linear_tuning": "off", "enable_deterministic_inference": True}  # fmt: skip
    with Engine("smollm2-135m-instruct", **kw) as llm:
        crowd = llm.generate([*CROWD[:3], TARGET, *CROWD[3:]], p)[3]
        alone = llm.generate([TARGET], p)[0]
    assert crowd.token_ids == alone.token_ids
    assert crowd.logprobs == alone.logprobs  # floats compared exactly
