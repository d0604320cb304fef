"""The forward pass's memory savings (in-place norms and rotary, the sliced MLP) give the values of the plain
formulas, bit for bit, so the ring's tokens do not depend on them."""

from types import SimpleNamespace

import pytest
import torch

from ringsched.models import decoder_layer
from ringsched.models.decoder_layer import MLP, mlp_slices
from ringsched.models.rmsnorm import RMSNorm
from ringsched.models.rope import Rotary


def _reference_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm_in_place_is_the_plain_formula(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
        x, residual = torch.randn(37, 96, dtype=dtype), torch.randn(37, 96, dtype=dtype)
        want_residual = x + residual
        want = _reference_norm(norm, want_residual)
        got, got_residual = norm.add_forward(x.clone(), residual.clone())
        assert torch.equal(got_residual, want_residual)
        assert torch.equal(got, want)
        # The first layer starts the residual: its input is the residual, and is left as it was.
        first, start = norm.add_forward(x, None)
        assert start is x and torch.equal(first, _reference_norm(norm, x))


def test_norm_writes_into_the_given_buffer():
    norm = RMSNorm(16, 1e-6)
    x, out = torch.randn(5, 16), torch.empty(5, 16)
    with torch.no_grad():
        got = norm(x, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, _reference_norm(norm, x))


def test_rotary_is_rotate_half_bit_for_bit():
    torch.manual_seed(0)
    rot = Rotary(64, 10000.0)
    q, k = torch.randn(23, 4, 64), torch.randn(23, 2, 64)
    positions = torch.randint(0, 300, (23,))
    cos, sin = rot._cos_sin(positions, q.dtype, None)

    def half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    gq, gk = rot(positions, q, k)
    assert torch.equal(gq, q * cos + half(q) * sin) and torch.equal(gk, k * cos + half(k) * sin)


def test_slice_counts():
    assert mlp_slices(512, 1536, 4) == 1  # SmolLM2 float32: the default 512-token chunk runs whole
    assert mlp_slices(512, 5632, 4) == 2  # a 1B Llama: two halves of 256 rows
    assert mlp_slices(300, 5632, 4) == 1  # 6.6 MiB: whole
    assert mlp_slices(512, 5632, 2) == 1  # bfloat16 halves the buffer
    assert mlp_slices(200, 100_000, 4) == 1  # never a slice under 128 rows
    assert mlp_slices(2048, 5632, 4) == 6  # six equal slices of 7.5 MiB


@pytest.mark.parametrize("tokens", [129, 300, 512])
def test_sliced_mlp_equals_the_whole(monkeypatch, tokens):
    torch.manual_seed(0)
    mlp = MLP(SimpleNamespace(hidden_size=64, intermediate_size=256, mlp_bias=False)).eval()
    x = torch.randn(tokens, 64)
    with torch.no_grad():
        whole = mlp(x)
        monkeypatch.setattr(decoder_layer, "MLP_SLICE_BYTES", 128 * 256 * 4)  # slices of about 128 rows
        calls = []
        rows = mlp._rows
        monkeypatch.setattr(mlp, "_rows", lambda t: calls.append(t.shape[0]) or rows(t))
        sliced = mlp(x)
    assert sum(calls) == tokens and len(calls) == max(tokens // 128, 1)
    assert max(calls) - min(calls) <= 1  # equal slices, no short remainder
    assert torch.equal(sliced, whole)
