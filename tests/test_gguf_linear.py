"""GGUF quantized weights kept as blocks (`kernels/gguf_linear.py`, `gguf_linear.c`): for every type, blocks of
random bits with sane scales dequantize to what the `gguf` package's reference gives, and the kernel multiplies
them as `x @ dequantized.T` does, at decode and prefill row counts, float32 and bfloat16."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from ringsched.kernels import gguf_linear, native_build
from ringsched.kernels.gguf_linear import TYPES, column_bytes, dequantize, gguf_matmul, row_bytes
from ringsched.kernels.small_linear import NATIVE, TORCH, Linear
from ringsched.weights import gguf_kept
from ringsched.weights.gguf_kept import keep

# where each type keeps its float16 fields: (byte offset, low, high)
HALVES = {2: [(0, 0.002, 0.02)], 3: [(0, 0.002, 0.02), (2, -0.1, 0.1)], 6: [(0, 0.002, 0.02)],
          7: [(0, 0.002, 0.02), (2, -0.1, 0.1)], 8: [(0, 0.0005, 0.005)], 12: [(0, 0.0005, 0.005), (2, 0.0, 0.002)],
          13: [(0, 0.0005, 0.005), (2, 0.0, 0.002)], 14: [(208, 0.0001, 0.001)]}  # fmt: skip


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, row_bytes] uint8: random codes, scales and high bits, float16 fields in a sane range."""
    rng = np.random.default_rng(seed)
    _, values, nbytes = TYPES[qtype]
    raw = rng.integers(0, 256, size=(n, k // values, nbytes), dtype=np.uint8)
    for offset, lo, hi in HALVES[qtype]:
        half = rng.uniform(lo, hi, size=(n, k // values)).astype(np.float16)
        raw[:, :, offset : offset + 2] = half.view(np.uint8).reshape(n, k // values, 2)
    return torch.from_numpy(raw.reshape(n, -1).copy())


def reference(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(qtype)).astype(np.float32))


needs_kernel = pytest.mark.skipif(gguf_linear.library() is None, reason="no C compiler: the reference path only")


@pytest.fixture
def exact():
    """The float path for every type (the integer path off), as RINGSCHED_GGUF_INTEGER=0 sets it."""
    lib = gguf_linear.library()
    if lib is not None:
        lib.gguf_set_integer(0)
    yield
    if lib is not None:
        lib.gguf_set_integer(1)


@pytest.mark.parametrize("qtype", sorted(TYPES), ids=[TYPES[t][0] for t in sorted(TYPES)])
def test_dequantize_matches_the_gguf_package(qtype):
    raw = random_blocks(qtype, 6, 512)
    assert raw.shape[1] == row_bytes(qtype, 512)
    torch.testing.assert_close(dequantize(raw, qtype, 512), reference(raw, qtype), rtol=1e-6, atol=1e-7)


@needs_kernel
@pytest.mark.parametrize("qtype", sorted(TYPES), ids=[TYPES[t][0] for t in sorted(TYPES)])
@pytest.mark.parametrize("rows", [1, 3, 6, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_multiplies_as_the_dequantized_weight(qtype, rows, dtype, exact):
    n, k = 37, 768  # outputs not a multiple of the tile
    raw = random_blocks(qtype, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(n)
    want = x.float() @ reference(raw, qtype).T + bias
    got = gguf_matmul(x, raw, qtype, bias)
    assert got.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


INTEGER = 0 if gguf_linear.library() is None else gguf_linear.library().gguf_has_integer()
# where an integer path runs: VNNI (1) the 32-value-block types below 3 rows; AVX2 (2) every type at any rows
INTEGER_CASES = [(t, rows) for t in sorted(TYPES) for rows in (1, 2, 5, 17) if (INTEGER == 2 or
                 (INTEGER == 1 and TYPES[t][1] == 32 and rows < 3))]  # fmt: skip


@pytest.mark.skipif(not INTEGER_CASES, reason="no AVX512-VNNI or AVX2: the float path serves these types")
@pytest.mark.parametrize("qtype, rows", INTEGER_CASES or [(2, 1)], ids=[f"{TYPES[t][0]}-{r}" for t, r in INTEGER_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_integer_path_is_the_float_one_within_the_activations_rounding(qtype, rows, dtype):
    """Activations rounded to int8 per block of 32 (each off by at most its block's max|x| / 254): each output
    within what that rounding can move it (bias added), whatever the rows and outputs (37: not a whole tile)."""
    n, k = 37, 768
    raw = random_blocks(qtype, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2)).to(dtype).float()
    w, bias = reference(raw, qtype), torch.randn(n)
    amax = x.abs().view(rows, k // 32, 32).amax(dim=2).repeat_interleave(32, dim=1)  # each value's block's
    bound = (amax @ w.abs().T) / 254 + 1e-4
    got = gguf_matmul(x.to(dtype), raw, qtype, bias).float()
    slack = 0.0 if dtype == torch.float32 else 1e-2 * (x @ w.T).abs().max().item()  # a bfloat16 output's rounding
    assert ((got - x @ w.T - bias).abs() <= bound + slack).all()
    assert not torch.equal(got, x @ w.T + bias)  # it is the other path


needs_amx = pytest.mark.skipif(gguf_linear.library() is None or not gguf_linear.library().gguf_has_amx(),
                               reason="no AMX (tiles, bfloat16) or no permission for them: the tile path is not taken")
INTEGER_TYPES = pytest.mark.parametrize("qtype", [2, 3, 6, 7, 8], ids=["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])


@needs_amx
@INTEGER_TYPES
@pytest.mark.parametrize(("rows", "n", "k"), [(8, 37, 768), (17, 37, 768), (40, 21, 96), (16, 64, 32), (170, 5, 1536)])
def test_the_tiles_multiply_as_the_dequantized_weight_to_float32s_accuracy(qtype, rows, n, k):
    """From AMX_ROWS (8) rows the tiles (outputs and rows not multiples of 16, an odd number of blocks a row, one
    block, rows in two runs: 160 a run at 1536 inputs): activations split into two bfloat16 halves, within 2e-5 of
    the largest output (int8 ones: ~1e-3)."""
    raw = random_blocks(qtype, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)) * torch.rand(rows, 1) * 4
    bias = torch.randn(n)
    want = x.double() @ reference(raw, qtype).double().T + bias.double()
    got = gguf_matmul(x, raw, qtype, bias)
    assert (got.double() - want).abs().max() <= 2e-5 * want.abs().max()
    lib = gguf_linear.library()
    lib.gguf_set_integer(0)
    try:
        assert not torch.equal(got, gguf_matmul(x, raw, qtype, bias))  # not the float tiles: the tiles ran
    finally:
        lib.gguf_set_integer(1)


@needs_amx
@pytest.mark.parametrize("qtype", [2, 8], ids=["Q4_0", "Q8_0"])
def test_a_rows_result_on_the_tiles_does_not_depend_on_its_batch_its_threads_or_its_columns(qtype):
    k = 256
    raw = random_blocks(qtype, 40, k, seed=6)
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(7))
    want = gguf_matmul(x, raw, qtype, None)[20]
    others = torch.randn(7, k)
    for batch, at in ((x, 20), (x[13:25], 7), (x[20:28], 0), (torch.cat([others, x[20:21]]), 7)):  # 8 rows or more
        assert torch.equal(gguf_matmul(batch, raw, qtype, None)[at], want)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gguf_matmul(x, raw, qtype, None)[20], want)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(gguf_matmul(x, raw[8:24].contiguous(), qtype, None)[20], want[8:24])  # a rank's rows


@needs_amx
def test_the_tiles_write_bfloat16_and_column_slices_as_float32_rounded():
    """bfloat16 activations are exact in float32: the same sums, each rounded to bfloat16 once; parts of different
    types side by side land in their columns exactly as each alone."""
    raw = random_blocks(2, 37, 256, seed=8)
    x = torch.randn(19, 256).to(torch.bfloat16)
    want = gguf_matmul(x.float(), raw, 2, None)
    assert torch.equal(gguf_matmul(x, raw, 2, None), want.to(torch.bfloat16))
    parts = [keep(Linear(256, n, bias=True), random_blocks(t, n, 256, seed=t), t) for t, n in ((3, 20), (8, 17))]
    fused = gguf_kept.fuse_kept(parts)
    got = fused.run(x.float(), NATIVE)
    assert torch.equal(got, torch.cat([gguf_matmul(x.float(), p.weight, p.qtype, p.bias.float()) for p in parts], 1))


@needs_kernel
def test_kept_layers_take_the_kernel_at_every_row_count_where_the_tiles_run():
    lib = gguf_linear.library()
    tiles = bool(lib.gguf_has_amx()) and native_build.switched_on(gguf_linear.INTEGER_SWITCH)
    for qtype, tiled in ((8, tiles), (12, False)):  # Q4_K: the float tiles, which MKL beats past MAX_ROWS
        layer = keep(Linear(256, 8, bias=False), random_blocks(qtype, 8, 256), qtype)
        layer.prepare()
        assert layer.paths.path(gguf_linear.MAX_ROWS) == NATIVE
        assert layer.paths.path(4096) == (NATIVE if tiled else TORCH)


@needs_kernel
@pytest.mark.parametrize("qtype", [8, 12])
def test_a_rows_result_does_not_depend_on_its_batch(qtype, exact):
    """In float32 (what --enable-deterministic-inference takes: `GGUFWeights.batch_invariant`)."""
    k = 512
    raw = random_blocks(qtype, 16, k)
    x = torch.randn(9, k)
    alone = gguf_matmul(x[4:5], raw, qtype, None)
    assert torch.equal(gguf_matmul(x, raw, qtype, None)[4:5], alone)


def test_a_kept_linear_layer_takes_the_kernel_for_few_rows_and_dequantizes_for_many(exact):
    raw = random_blocks(2, 8, 256)
    layer = keep(Linear(256, 8, bias=True), raw, 2)
    layer.bias.data.normal_()
    layer.prepare()
    x = torch.randn(40, 256)
    want = x @ reference(raw, 2).T + layer.bias
    for rows in (1, 40):
        torch.testing.assert_close(layer(x[:rows]), want[:rows], rtol=1e-4, atol=1e-4)
    for path in (NATIVE, TORCH):
        torch.testing.assert_close(layer.run(x, path), want, rtol=1e-4, atol=1e-4)
    assert layer.in_features == 256 and layer.weight.dtype == torch.uint8


def test_a_split_that_cuts_a_block_is_refused_naming_the_sizes_that_fit():
    assert column_bytes(12, 256, 512, 1024, "o_proj") == (144, 288)
    with pytest.raises(ValueError, match=r"--tp-size must divide it in whole blocks: \[1, 3\]"):
        column_bytes(12, 384, 768, 768, "o_proj")  # three Q4_K blocks a row: 2 ranks would cut one


@needs_kernel
def test_deterministic_inference_makes_a_rows_result_independent_of_its_batch():
    layer = keep(Linear(512, 16, bias=False), random_blocks(2, 16, 512), 2)
    layer.prepare()
    try:
        assert layer.batch_invariant()
        x = torch.randn(9, 512)
        assert torch.equal(layer(x)[4:5], layer(x[4:5]))
    finally:
        gguf_linear.library().gguf_set_integer(1)


def test_projections_of_different_types_run_side_by_side_as_one_layer(exact):
    """q/k/v kept in three types (llama.cpp's Q4_K_M gives v more bits): one layer whose outputs are the parts'
    side by side, from their own blocks, at a decode's rows and a prefill's."""
    parts = [keep(Linear(256, n, bias=True), random_blocks(t, n, 256, seed=t), t) for t, n in ((6, 8), (7, 4), (8, 4))]
    fused = gguf_kept.fuse_kept(parts)
    assert isinstance(fused, gguf_kept.GGUFParts) and fused.out_features == 16
    x = torch.randn(40, 256)
    want = torch.cat([x @ reference(p.weight, p.qtype).T + p.bias for p in parts], dim=1)
    for rows, path in ((1, NATIVE), (40, TORCH)):
        torch.testing.assert_close(fused.run(x[:rows], path), want[:rows], rtol=1e-4, atol=1e-4)


@needs_kernel
def test_kept_layers_are_tuned_by_timing_their_own_paths(tmp_path):
    """`--linear-tuning auto` times a kept layer's kernel and its dequantization at every bucket, keyed by its
    GGUF type, and the layer takes what the timings chose."""
    from ringsched.kernels import linear_tuning

    layers = [keep(Linear(256, 64, bias=False), random_blocks(2, 64, 256, seed=s), 2) for s in range(2)]
    for lin in layers:
        lin.prepare()
    tables = linear_tuning.tune(layers, torch.float32, root=tmp_path, cpu=("Test CPU", "avx512f"))
    (shape,) = tables
    assert shape.weight == "gguf-Q4_0" and linear_tuning.candidates(shape) == (NATIVE, TORCH)
    timed = next((tmp_path / "tuning").glob("*gguf-Q4_0*.json")).read_text()
    assert all(f'"{p}"' in timed for p in linear_tuning.candidates(shape))
    x = torch.randn(64, 256)
    for lin in layers:
        assert lin.paths is tables[shape]
        torch.testing.assert_close(lin(x), x @ reference(lin.weight, 2).T, rtol=1e-4, atol=1e-4)
