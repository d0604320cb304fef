"""`--quantization int4`: group-wise int4 weights (`kernels/quantize.py`) through the native kernel's int4 tile
(`small_linear_int4.h`) for decode rows and a dequantized copy through torch beyond; the lm_head and the embedding
int8 (one tensor where tied)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringsched.attention.paged import ForwardBatch
from ringsched.config import ConfigError, EngineConfig
from ringsched.kernels import small_linear
from ringsched.kernels.quantize import quantize_int4_weight
from ringsched.layout.rank import StageInfo
from ringsched.models.loader import load_stage_model, weights_bytes
from ringsched.models.random_model import random_config, write_random_model

needs_kernel = pytest.mark.skipif(small_linear.library() is None, reason="no native kernel (no C compiler)")


def _weights(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    packed, scales = quantize_int4_weight(w, group)
    return w, packed, scales


@pytest.mark.parametrize("group", [32, 128])
def test_each_group_takes_the_scale_that_rounds_it_best(group):
    """No worse than the scale that keeps the group's extremes (`max|w| / 7`), and within half a step of every weight
    the scale does not clip."""
    w, packed, scales = _weights(13, 256, group)
    assert packed.shape == (13, 128) and packed.dtype == torch.uint8 and scales.shape == (13, 256 // group)
    wg = w.view(13, -1, group)
    err = (small_linear.dequantize_int4(packed, scales).view(13, -1, group) - wg).abs()
    plain = wg.abs().amax(dim=2, keepdim=True) / 7
    plain_err = (torch.round(wg / plain).clamp(-8, 7) * plain - wg).square().sum(dim=2)
    assert (err.square().sum(dim=2) <= plain_err * (1 + 1e-5)).all()
    inside = (wg / scales[:, :, None]).abs() <= 7.5
    assert (err[inside] <= (scales[:, :, None] / 2 * (1 + 1e-5)).expand_as(err)[inside]).all()


def test_the_nibble_order_is_q4_0s():
    """In each block of 32 inputs, value j in byte j's low nibble and value j + 16 in its high one, stored q + 8."""
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 16], w[0, 1] = 7.0, -7.0, 1.0
    packed, scales = quantize_int4_weight(w, 32)
    assert scales.item() == 1.0
    assert packed[0, 0].item() == (15 | (1 << 4)) and packed[0, 1].item() == 9 | (8 << 4)


def test_an_input_size_not_a_multiple_of_the_group_is_refused():
    with pytest.raises(ValueError, match="multiple of the group"):
        quantize_int4_weight(torch.randn(4, 96), 128)


@needs_kernel
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
def test_the_kernel_equals_the_dequantized_weight(group, xdtype, m):
    n, k = 37, 384  # N not a multiple of the 4-output tile
    _, packed, scales = _weights(n, k, group, seed=m)
    x = torch.randn(m, k).to(xdtype)
    bias = torch.randn(n)
    got = small_linear.native_linear(x, packed, bias, scales)
    want = F.linear(x.float(), small_linear.dequantize_int4(packed, scales), bias)
    assert got.dtype == xdtype
    tol = 1e-4 if xdtype == torch.float32 else 2e-2  # bfloat16: the output's rounding
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    torch_path = small_linear.apply(small_linear.TORCH, x, packed, bias.to(xdtype), bias, scales)
    w = small_linear.dequantize_int4(packed, scales).to(xdtype)  # torch's path: the weight in x's dtype
    assert torch.equal(torch_path, F.linear(x, w, bias.to(xdtype)))


@needs_kernel
@pytest.mark.parametrize("group", [32, 128])
def test_a_rows_result_does_not_depend_on_its_batch(group):
    _, packed, scales = _weights(70, 512, group)
    x = torch.randn(9, 512)
    alone = [small_linear.native_linear(x[i : i + 1], packed, None, scales) for i in range(9)]
    for rows in (2, 5, 9):
        batch = small_linear.native_linear(x[:rows], packed, None, scales)
        for i in range(rows):
            assert torch.equal(batch[i : i + 1], alone[i])


def _model(tmp_path):
    cfg = random_config("llama", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512, tie=True)
    return write_random_model(tmp_path / "m", cfg, seed=0)


def _stored_bytes(model) -> int:
    """Parameters (each tensor once) and the quantised layers' scales."""
    held = [m.scales for m in model.modules() if getattr(m, "scales", None) is not None]
    seen = {s.untyped_storage().data_ptr(): s for s in held}  # fused layers' parts share their scales
    return weights_bytes(model) + sum(s.untyped_storage().nbytes() for s in seen.values())


def test_an_int4_model_is_close_to_float32_in_under_a_third_of_its_bytes(tmp_path):
    model_dir = _model(tmp_path)
    stage = StageInfo(0, 1, 0, 2)
    q = load_stage_model(model_dir, stage, quantization="int4")
    ref = load_stage_model(model_dir, stage)
    attn = q.model.layers[0].self_attn
    assert attn.qkv.weight.dtype == torch.uint8 and attn.q_proj.weight.data_ptr() == attn.qkv.weight.data_ptr()
    assert attn.k_proj.scales.data_ptr() == attn.qkv.scales[attn.q_proj.out_features :].data_ptr()
    assert q.model.layers[0].mlp.down_proj.weight.dtype == torch.int8  # down_proj stays int8 (accuracy)
    assert q.lm_head.weight.dtype == torch.int8  # and the embedding's rows are the head's: one tensor
    assert q.model.embed_tokens.weight.data_ptr() == q.lm_head.weight.data_ptr()
    assert _stored_bytes(q) < 0.3 * weights_bytes(ref)
    with torch.no_grad():
        for rows in (1, 5, 100):  # the kernel, then torch's path (dequantized)
            ids = torch.arange(rows) % 512
            want = ref.compute_logits(ref(ForwardBatch.no_cache(rows), input_ids=ids))
            got = q.compute_logits(q(ForwardBatch.no_cache(rows), input_ids=ids))
            assert (got - want).norm() < 0.15 * want.norm()
            assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.7


def test_the_kernel_and_torchs_path_agree_on_the_model(tmp_path):
    """Decode-sized steps (the kernel) and the same rows through torch's path (dequantized weights)."""
    model_dir = _model(tmp_path)
    q = load_stage_model(model_dir, StageInfo(0, 1, 0, 2), quantization="int4")
    ids = torch.arange(4) * 7
    with torch.no_grad():
        native = q.compute_logits(q(ForwardBatch.no_cache(4), input_ids=ids))
        for lin in q.linears():
            lin.paths = small_linear.FixedPaths()
        torch_path = q.compute_logits(q(ForwardBatch.no_cache(4), input_ids=ids))
    torch.testing.assert_close(native, torch_path, rtol=1e-3, atol=1e-3)


def test_int4_is_a_quantization_choice():
    assert EngineConfig(quantization="int4").quantization == "int4"
    with pytest.raises(ConfigError, match="--quantization must be none, int8, int4 or gguf"):
        EngineConfig(quantization="int3")
