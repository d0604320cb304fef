"""The native small-batch linear kernel and the layer's native elementwise steps against torch, on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringsched.kernels import layer_ops, small_linear
from ringsched.kernels.quantize import quantize_int8_weight
from ringsched.models.fused_linear import cpu_layout
from ringsched.models.rmsnorm import RMSNorm
from ringsched.models.rope import Rotary

pytestmark = pytest.mark.skipif(small_linear.library() is None, reason="no C compiler: the torch path runs instead")

# (rows, in, out): every tail, and rows past the fixed thresholds (a tuned stage may give the kernel any row count)
SHAPES = [(1, 64, 48), (3, 70, 37), (4, 576, 960), (9, 33, 130), (33, 96, 64), (257, 70, 40)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_float32_matches_torch(m, k, n, layout):
    torch.manual_seed(m * 1000 + k)
    w = torch.randn(n, k) / k**0.5
    if layout == "kn":
        w = cpu_layout("model.layers.0.self_attn.q_proj.weight", w)
        assert w.stride() == (1, n)
    x, bias = torch.randn(m, k), torch.randn(n)
    torch.testing.assert_close(small_linear.native_linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_bfloat16_matches_torch(m, k, n):
    torch.manual_seed(k)
    w, x = (torch.randn(n, k) / k**0.5).bfloat16(), torch.randn(m, k).bfloat16()
    ref = F.linear(x.float(), w.float())  # exact products, float32 sums: both paths round once at the end
    out = small_linear.native_linear(x, w)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_int8_matches_the_dequantized_weight(m, k, n, xdtype):
    torch.manual_seed(n)
    q, scales = quantize_int8_weight(torch.randn(n, k))
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    x = torch.randn(m, k).to(xdtype)
    ref = F.linear(x.float(), q.float() * scales[:, None])
    tol = 1e-4 if xdtype == torch.float32 else 2e-2
    torch.testing.assert_close(small_linear.native_linear(x, q, None, scales).float(), ref, rtol=tol, atol=tol)


def test_a_rows_result_does_not_depend_on_its_batch():
    """The same row alone, beside 6 others, or through a strided view: the same bits."""
    torch.manual_seed(0)
    for w in (torch.randn(130, 96), torch.randn(130, 96).bfloat16(), quantize_int8_weight(torch.randn(130, 96))[0]):
        scales = torch.rand(130) if w.dtype == torch.int8 else None
        x = torch.randn(7, 96).to(torch.bfloat16 if w.dtype == torch.bfloat16 else torch.float32)
        wide = torch.cat([x, x], dim=1)[:, :96]  # row stride 192
        alone = small_linear.native_linear(x[3:4], w, None, scales)
        assert torch.equal(small_linear.native_linear(x, w, None, scales)[3:4], alone)
        assert torch.equal(small_linear.native_linear(wide, w, None, scales)[3:4], alone)


def test_linear_module_takes_the_kernel_up_to_max_rows_and_torch_beyond():
    lin = small_linear.Linear(64, 32)
    lin.prepare()
    assert lin.paths.max_rows == small_linear.MAX_ROWS[torch.float32] > 0
    x = torch.randn(lin.paths.max_rows + 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(lin(x[:1]), F.linear(x[:1], lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))


def test_bfloat16_steps_of_many_rows_widen_to_float32_where_the_cpu_lacks_amx(monkeypatch):
    lin = small_linear.Linear(96, 40).to(torch.bfloat16)
    monkeypatch.setitem(small_linear._state, "amx", False)
    lin.prepare()
    assert lin.paths.widen_rows == small_linear.WIDEN_ROWS >= lin.paths.max_rows
    x = torch.randn(lin.paths.widen_rows + 3, 96).bfloat16()
    with torch.no_grad():
        out = lin(x)
        expect = (x.float() @ lin.weight.float().T + lin.bias.float()).bfloat16()
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, expect, rtol=0, atol=0)
        # oneDNN's bfloat16 path sums in float32 too: the same values but for the summation order
        torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), rtol=1e-2, atol=1e-2)
        fewer = x[: lin.paths.widen_rows - 1]
        torch.testing.assert_close(lin(fewer), F.linear(fewer, lin.weight, lin.bias), rtol=0, atol=0)
    monkeypatch.setitem(small_linear._state, "amx", True)
    lin.prepare()
    assert lin.paths.widen_rows == 0  # with AMX, oneDNN's bfloat16 kernels are kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_ops_match_the_torch_operators(dtype):
    torch.manual_seed(1)
    rows, hidden, heads, kv_heads, d = 3, 96, 6, 2, 16
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x, res = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden).to(dtype)
    with torch.no_grad():
        want_out, want_res = norm.add_forward(x.clone(), res.clone())
        got_out, got_res = layer_ops.add_rmsnorm(x.clone(), res.clone(), norm.weight, 1e-5)
        assert torch.equal(got_res, want_res)
        torch.testing.assert_close(got_out, want_out, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
        first_out, first_res = layer_ops.add_rmsnorm(x.clone(), None, norm.weight, 1e-5)
        assert torch.equal(first_res, x)
        torch.testing.assert_close(first_out, norm(x), rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)

    rotary = Rotary(d, 10000.0)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d).to(dtype)
    positions, slots = torch.tensor([0, 7, 300]), torch.tensor([5, 1, 9])
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    want_q, want_k = rotary(positions, q.reshape(rows, heads, d), k.reshape(rows, kv_heads, d))
    kc, vc = torch.zeros(12, kv_heads, d, dtype=dtype), torch.zeros(12, kv_heads, d, dtype=dtype)
    got_q = layer_ops.rope_store(qkv, heads, kv_heads, d, positions, rotary.tables(positions), kc, vc, slots)
    assert torch.equal(got_q, want_q)  # the same operations in the same order: the same bits
    assert torch.equal(kc[slots], want_k) and torch.equal(vc[slots], v.reshape(rows, kv_heads, d))
    assert kc[[0, 2, 3]].abs().sum() == 0  # no other slot written

    gate_up = torch.randn(rows, 2 * hidden).to(dtype)
    g, u = gate_up.split(hidden, dim=-1)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(layer_ops.silu_mul(gate_up), F.silu(g) * u, rtol=tol, atol=tol)


def test_an_int8_model_computes_with_its_dequantized_weights(tmp_path):
    """`--quantization int8`: every projection and the lm_head hold int8 rows and scales; a forward (the kernel
    for few rows, torch beyond) equals a float32 model given the dequantized weights."""
    from ringsched.attention.paged import ForwardBatch
    from ringsched.layout.rank import StageInfo
    from ringsched.models.loader import load_stage_model
    from ringsched.models.random_model import random_config, write_random_model

    cfg = random_config("llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512, tie=True)
    model_dir = write_random_model(tmp_path / "m", cfg, seed=0)
    q = load_stage_model(model_dir, StageInfo(0, 1, 0, 2), quantization="int8")
    ref = load_stage_model(model_dir, StageInfo(0, 1, 0, 2))
    attn = q.model.layers[0].self_attn
    assert attn.qkv.weight.dtype == torch.int8 and attn.q_proj.weight.data_ptr() == attn.qkv.weight.data_ptr()
    assert q.lm_head.weight.dtype == torch.int8 and q.model.embed_tokens.weight.dtype == torch.float32
    with torch.no_grad():
        for name, p in q.named_parameters():
            if p.dtype == torch.int8 and name != "lm_head.weight":
                owner = q.get_submodule(name.rsplit(".", 1)[0])
                ref.get_parameter(name).copy_(p.float() * owner.scales[:, None])
        ref.lm_head.weight = torch.nn.Parameter(q.lm_head.weight.float() * q.lm_head.scales[:, None])
        for rows in (1, 40):  # the kernel, then torch's path
            ids = torch.arange(rows) % 512
            want = ref.compute_logits(ref(ForwardBatch.no_cache(rows), input_ids=ids))
            got = q.compute_logits(q(ForwardBatch.no_cache(rows), input_ids=ids))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_switched_off_the_torch_path_runs_every_dtype(monkeypatch):
    """`RINGSCHED_NATIVE_LINEAR=0`: no kernel, and an int8 layer still computes (a float copy of its weight)."""
    monkeypatch.setattr(small_linear, "LIBRARY", small_linear.LIBRARY.fresh())
    monkeypatch.setattr(layer_ops, "LIBRARY", layer_ops.LIBRARY.fresh())
    monkeypatch.setenv(small_linear.ENV_SWITCH, "0")
    assert small_linear.library() is None and not layer_ops.usable(torch.float32, torch.device("cpu"))
    lin = small_linear.Linear(64, 32)
    from ringsched.kernels.quantize import quantize_linear

    quantize_linear(lin)
    lin.prepare()
    assert lin.paths.max_rows == 0
    x = torch.randn(2, 64)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight.float() * lin.scales[:, None], lin.bias))


def test_a_rows_result_does_not_depend_on_its_batch_in_the_kn_layout():
    """float32 weights laid out [K, N]: up to 4 rows stream the halves of K, more rows go through buffered blocks
    of k (64 rows a pass); a row gets the same bits alone, in either form, past a pass and on any thread count."""
    torch.manual_seed(1)
    w = cpu_layout("model.layers.0.mlp.down_proj.weight", torch.randn(200, 600))  # K: several blocks of k
    x, bias = torch.randn(80, 600), torch.randn(200)
    alone = small_linear.native_linear(x[69:70], w, bias)
    for rows in (4, 9, 70):
        assert torch.equal(small_linear.native_linear(x[70 - rows : 70], w, bias)[-1:], alone), rows
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(small_linear.native_linear(x[69:70], w, bias), alone), n
            assert torch.equal(small_linear.native_linear(x[60:70], w, bias)[-1:], alone), n
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(small_linear.native_linear(x, w, bias), F.linear(x, w, bias), rtol=1e-4, atol=1e-4)
