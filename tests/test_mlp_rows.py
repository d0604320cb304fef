"""A long prefill chunk goes through the MLP a slice of rows at a time, with the values of the whole."""

from types import SimpleNamespace

import pytest
import torch

from ringsched.models import llama
from ringsched.models.llama import MLP, mlp_row_chunk


def test_row_chunk_sizes():
    assert mlp_row_chunk(1536, 4) == 1280  # SmolLM2 float32: the default 512-token chunk runs whole
    assert mlp_row_chunk(5632, 4) == 256  # a 1B Llama
    assert mlp_row_chunk(5632, 2) == 640  # bfloat16
    assert mlp_row_chunk(100_000, 4) == 128  # never below 128 rows


@pytest.mark.parametrize("tokens", [129, 300, 512])
def test_sliced_rows_equal_the_whole(monkeypatch, tokens):
    torch.manual_seed(0)
    mlp = MLP(SimpleNamespace(hidden_size=64, intermediate_size=256)).eval()
    x = torch.randn(tokens, 64)
    with torch.no_grad():
        whole = mlp(x)
        monkeypatch.setattr(llama, "MLP_CHUNK_BYTES", 128 * 256 * 4)  # 128 rows at a time
        calls = []
        rows = mlp._rows
        monkeypatch.setattr(mlp, "_rows", lambda t: calls.append(t.shape[0]) or rows(t))
        sliced = mlp(x)
    assert sum(calls) == tokens and len(calls) == -(-tokens // 128)
    assert max(calls) - min(calls) <= 1  # equal slices, no short remainder
    torch.testing.assert_close(sliced, whole, rtol=1e-6, atol=1e-6)
