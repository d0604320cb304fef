"""The CPU decode-attention kernel (kernels/native.py): same numbers as attending to each request's keys and
values laid out contiguously, on one and two threads, over float32 and bfloat16 caches; SmolLM2 in bfloat16
decoding through it; the torch path where it is off or cannot be built."""

import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ringsched.attention.batch import build_forward_batch
from ringsched.attention.paged import paged_attention
from ringsched.comm.messages import BatchPlan, PlanEntry
from ringsched.kernels import native
from ringsched.kv.cache import BlockTable, KVPool
from ringsched.layout.rank import StageInfo
from ringsched.models.loader import load_stage_model
from ringsched.tokenizer import Tokenizer
from ringsched.weights.model_config import ModelConfig

HAS_CC = bool(shutil.which("cc") or shutil.which("gcc"))


def _scattered(lengths: dict[str, int], bs: int, num_blocks: int) -> BlockTable:
    blocks = BlockTable(num_blocks, bs)
    for step in range(1, max(lengths.values()) + 1):  # grow in turns: each request's blocks are scattered
        for rid, n in lengths.items():
            blocks.ensure(rid, min(step, n))
    return blocks


def _reference(q, k_cache, v_cache, blocks, lengths, scale):
    out = []
    for row, (rid, n) in enumerate(lengths.items()):
        slots = blocks.slots(rid, 0, n)
        kr, vr = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[row].unsqueeze(1), kr, vr, scale=scale, enable_gqa=True)
        out.append(ref.squeeze(1))
    return torch.stack(out)


def test_the_kernel_builds_where_a_compiler_exists():
    # Guards against a silent fallback: the ring tests would pass on the torch path either way.
    assert native.usable_for(torch.float32, "cpu") == (HAS_CC and native.enabled())
    assert native.usable_for(torch.bfloat16, "cpu") == (HAS_CC and native.enabled())
    assert not native.usable_for(torch.float16, "cpu")


@pytest.mark.skipif(not HAS_CC, reason="no C compiler: the torch path is tested in test_attention.py")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "bs"), [(6, 2, 8, 4), (9, 3, 64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_matches_contiguous_attention(threads, heads, kv_heads, dim, bs, dtype):
    torch.manual_seed(0)
    lengths = {"a": 13, "b": 5, "c": 70, "d": 16, "e": 1, "f": 33, "g": 2}
    blocks = _scattered(lengths, bs, 128)
    k_cache, v_cache = (torch.randn(128 * bs, kv_heads, dim, dtype=dtype) for _ in range(2))
    entries = [PlanEntry(rid, n - 1, [7], samples=True) for rid, n in lengths.items()]
    batch, _ = build_forward_batch(BatchPlan(slot=0, seq=0, entries=entries), blocks, torch.device("cpu"), True)
    assert batch.native_decode is not None and batch.decodes == []
    t = len(entries)
    q, k, v = (torch.randn(t, h, dim, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_attention(q, k, v, batch, k_cache, v_cache, scale=dim**-0.5)
    finally:
        torch.set_num_threads(old)
    assert out.dtype == dtype
    # The reference in float32 over the same (bfloat16-valued) inputs: the kernel differs from it only by
    # float32 rounding, and by the final rounding to bfloat16 (8 bits of mantissa: 2**-8 relative).
    f32 = (x.float() for x in (q, k_cache, v_cache))
    ref = _reference(*f32, blocks, lengths, dim**-0.5)  # the new K/V were written above
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_native_decode_gives_each_rows_log_sum_exp():
    """Context parallelism merges a rank's partial attention by its LSE: logsumexp of the row's scaled scores."""
    torch.manual_seed(2)
    heads, kv_heads, dim, bs = 6, 2, 8, 4
    lengths = {"a": 13, "b": 1, "c": 30}
    blocks = _scattered(lengths, bs, 64)
    k_cache, v_cache = (torch.randn(64 * bs, kv_heads, dim) for _ in range(2))
    tables, _ = blocks.padded_blocks(list(lengths), list(lengths.values()))
    nd = native.NativeDecode(torch.arange(3), tables.contiguous(), torch.tensor(list(lengths.values())), bs, 30)
    q = torch.randn(3, heads, dim)
    lse = torch.empty(3, heads)
    out = native.paged_decode(q, k_cache, v_cache, nd, dim**-0.5, lse)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, blocks, lengths, dim**-0.5), rtol=1e-5, atol=1e-5)
    for row, (rid, n) in enumerate(lengths.items()):
        keys = k_cache[blocks.slots(rid, 0, n)].repeat_interleave(heads // kv_heads, dim=1)  # [n, H, D]
        want = torch.logsumexp(torch.einsum("hd,nhd->hn", q[row], keys) * dim**-0.5, dim=-1)
        torch.testing.assert_close(lse[row], want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_mixed_batch_prefill_rows_untouched_by_the_kernel():
    # A prefill chunk and decodes in one batch: the kernel fills the decode rows, SDPA the chunk's.
    torch.manual_seed(1)
    heads, kv_heads, dim, bs = 4, 2, 8, 4
    lengths = {"a": 9, "b": 3}
    blocks = _scattered(lengths, bs, 64)
    blocks.ensure("p", 6)
    entries = [PlanEntry(rid, n - 1, [5], samples=True) for rid, n in lengths.items()]
    entries.append(PlanEntry("p", 0, list(range(6)), samples=True))
    plan = BatchPlan(slot=0, seq=0, entries=entries)
    k_cache, v_cache = torch.randn(64 * bs, kv_heads, dim), torch.randn(64 * bs, kv_heads, dim)
    q, k, v = torch.randn(8, heads, dim), torch.randn(8, kv_heads, dim), torch.randn(8, kv_heads, dim)
    outs = []
    for use_native in (True, False):
        batch, _ = build_forward_batch(plan, blocks, torch.device("cpu"), use_native)
        outs.append(paged_attention(q, k, v, batch, k_cache.clone(), v_cache.clone(), scale=dim**-0.5))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_switched_off_or_unbuildable_means_the_torch_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(native, "LIBRARY", native.LIBRARY.fresh())
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert not native.usable_for(torch.float32, "cpu")

    monkeypatch.setattr(native, "LIBRARY", native.LIBRARY.fresh())
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    monkeypatch.setenv("RINGSCHED_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level("WARNING", logger="ringsched.kernels.native"):
        assert not native.usable_for(torch.float32, "cpu")
    assert "using the torch path" in caplog.text
    assert not list((tmp_path / "native").glob("*.so"))  # nothing half-built left as the cached kernel


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_loading_the_kernel_keeps_denormals(tmp_path):
    # Built with -ffast-math but linked without it: gcc < 13 would otherwise link crtfastmath.o, whose
    # constructor turns on flush-to-zero in the whole process, and torch's float32 results would change.
    code = (
        "import torch; from ringsched.kernels import native\n"
        "assert native.usable_for(torch.float32, 'cpu')\n"
        "x = torch.tensor([1e-38]) / 1000\n"
        "print(x.item() != 0.0)\n"
    )
    env = {"RINGSCHED_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
    assert len(list((tmp_path / "native").glob("paged_decode-*.so"))) == 1


@torch.no_grad()
def _decode_logits(model_dir, dtype, use_native, ids, tokens=None, n=24):
    """The last logits of a prefill of `ids`, then of one decode per token of `tokens` (the engine's path);
    without `tokens`, greedy for `n` steps. Returns the logits and the tokens fed."""
    cfg = ModelConfig.from_dir(model_dir)
    model = load_stage_model(model_dir, StageInfo(0, 1, 0, cfg.num_layers), dtype)
    blocks, pool = BlockTable(64, 16), KVPool(cfg, cfg.num_layers, 64, 16, dtype, "cpu")
    out, fed, start, chunk = [], [], 0, list(ids)
    for i in range(len(tokens) if tokens else n):
        blocks.ensure("r", start + len(chunk))
        plan = BatchPlan(slot=0, seq=0, entries=[PlanEntry("r", start, chunk, True)])
        batch, x = build_forward_batch(plan, blocks, torch.device("cpu"), use_native)
        assert (batch.native_decode is not None) == (use_native and start > 0)
        out.append(model.compute_logits(model(batch, input_ids=x, kv_caches=pool.caches))[-1].float())
        fed.append(tokens[i] if tokens else int(out[-1].argmax()))
        start, chunk = start + len(chunk), [fed[-1]]
    return torch.stack(out), fed


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_bfloat16_decodes_through_the_kernel_err_like_torch(smollm2_dir):
    # SmolLM2 in bfloat16 over a bfloat16 KV cache, decoding the float32 model's own greedy continuation: the
    # kernel's logits are as far from float32's as the torch path's (bfloat16's rounding, ~1 logit at most),
    # and pick float32's token nearly everywhere. A kernel that misread the cache would be many logits off.
    ids = Tokenizer(smollm2_dir).encode("What is the capital of France? The capital of France is")
    f32, tokens = _decode_logits(smollm2_dir, torch.float32, True, ids)
    kernel, _ = _decode_logits(smollm2_dir, torch.bfloat16, True, ids, tokens)
    torch_path, _ = _decode_logits(smollm2_dir, torch.bfloat16, False, ids, tokens)
    err_kernel, err_torch = (kernel - f32).abs().max().item(), (torch_path - f32).abs().max().item()
    assert err_kernel <= 2 * err_torch, (err_kernel, err_torch)
    assert (kernel.argmax(-1) == f32.argmax(-1)).float().mean() >= 0.9
