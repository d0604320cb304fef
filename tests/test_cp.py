"""Context parallelism's pure parts: the splits and their causal workloads (the design document's figures),
the log-sum-exp merge (fully masked blocks included), and ring attention against
`scaled_dot_product_attention(is_causal=True)`: simulated in one process, and across 2 and 4 real gloo
processes."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from cp_reference import ring_attention, ring_attention_sim, split_kv_decode

from ringsched.attention.ring import attend_block, merge, merge_all
from ringsched.layout.cp_split import causal_pairs, contiguous_split, zigzag_split


def reference(q, k, v, scale):
    """[n, h, D] causal attention by torch (grouped-query when k has fewer heads)."""
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def qkv(n, heads=4, kv_heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, heads, dim, generator=g), torch.randn(n, kv_heads, dim, generator=g),
            torch.randn(n, kv_heads, dim, generator=g))  # fmt: skip


def test_the_documents_workloads():
    assert causal_pairs(contiguous_split(64, 4)) == [136, 392, 648, 904]
    assert causal_pairs(zigzag_split(64, 4)) == [520, 520, 520, 520]
    assert [p.tolist() for p in zigzag_split(8, 2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]


@pytest.mark.parametrize("n,size", [(64, 4), (61, 4), (7, 2), (3, 2), (100, 3)])
def test_splits_cover_every_position_once(n, size):
    for split in (contiguous_split(n, size), zigzag_split(n, size)):
        assert len(split) == size
        assert sorted(torch.cat(split).tolist()) == list(range(n))
    zig = causal_pairs(zigzag_split(n, size))
    if n % (2 * size) == 0:
        assert len(set(zig)) == 1  # exactly balanced when the chunks are equal


def test_merge_of_two_halves_is_attention_over_both():
    q, k, v = qkv(12)
    pos = torch.arange(12)
    scale = 16**-0.5
    whole = attend_block(q, k, v, pos, pos, scale)
    a = attend_block(q, k[:5], v[:5], pos, pos[:5], scale)
    b = attend_block(q, k[5:], v[5:], pos, pos[5:], scale)
    o, lse = merge(*a, *b)
    assert torch.allclose(o, whole[0], atol=1e-6) and torch.allclose(lse, whole[1], atol=1e-6)
    assert torch.allclose(whole[0], reference(q, k, v, scale), atol=1e-6)


def test_fully_masked_blocks_merge_without_nan():
    q, k, v = qkv(4)
    early, late = torch.arange(4), torch.arange(10, 14)
    masked_o, masked_lse = attend_block(q, k, v, early, late, 1.0)  # every key in the queries' future
    assert torch.equal(masked_o, torch.zeros_like(masked_o)) and torch.isneginf(masked_lse).all()
    seen = attend_block(q, k, v, early, early, 1.0)
    for o, lse in (merge(masked_o, masked_lse, *seen), merge(*seen, masked_o, masked_lse)):
        assert torch.equal(o, seen[0]) and torch.equal(lse, seen[1])
    o, lse = merge(masked_o, masked_lse, masked_o, masked_lse)  # nothing visible on either side
    assert not torch.isnan(o).any() and torch.equal(o, masked_o) and torch.isneginf(lse).all()


@pytest.mark.parametrize("split", [contiguous_split, zigzag_split])
@pytest.mark.parametrize("n,size", [(64, 4), (37, 2), (50, 3)])
def test_ring_simulation_equals_causal_attention(split, n, size):
    q, k, v = qkv(n, seed=n)
    scale = 16**-0.5
    got = ring_attention_sim(q, k, v, split(n, size), scale)
    assert (got - reference(q, k, v, scale)).abs().max() < 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_merge_all_is_pairwise_merge():
    q, k, v = qkv(9)
    pos = torch.arange(9)
    parts = [attend_block(q, k[i::3], v[i::3], pos, pos[i::3], 0.25) for i in range(3)]
    pairwise = merge(*merge(*parts[0], *parts[1]), *parts[2])
    together = merge_all([o for o, _ in parts], [lse for _, lse in parts])
    assert torch.allclose(together[0], pairwise[0], atol=1e-6) and torch.allclose(together[1], pairwise[1], atol=1e-6)
    assert torch.allclose(together[0], reference(q, k, v, 0.25), atol=1e-6)


SPLITS = ["zigzag", "contiguous", "decode"]


def _rank_main(rank: int, size: int, port: int, n: int, results) -> None:
    """Every split in turn on one process group: `results[split, rank]` is (positions, output)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=__import__("datetime").timedelta(60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    try:
        q, k, v = qkv(n, seed=3)
        for split_name in SPLITS:
            if split_name == "decode":  # the last token's query over KV spread by 16-token blocks, round robin
                held = torch.arange(n)[(torch.arange(n) // 16) % size == rank]
                last = torch.tensor([n - 1])
                out, _ = split_kv_decode(q[last], last, k[held], v[held], held, 16**-0.5)
                results[split_name, rank] = (last, out)
                continue
            mine = {"zigzag": zigzag_split, "contiguous": contiguous_split}[split_name](n, size)[rank]
            out, _ = ring_attention(q[mine], k[mine], v[mine], mine, mine, 16**-0.5)
            results[split_name, rank] = (mine, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 4])
def test_ring_attention_across_gloo_processes(size):
    """Prefill (zigzag and contiguous splits): each rank's queries over every rank's K/V as it comes round; decode:
    one query over the KV spread across the ranks, merged on every rank. The three run one after another on one
    process group (spawning the ranks is most of the cost)."""
    n = 61  # uneven blocks: each transfer carries its own length
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank_main, args=(size, _free_port(), n, results), nprocs=size,
                           start_method="spawn", join=True)  # fmt: skip
        got = dict(results)
    q, k, v = qkv(n, seed=3)
    want = reference(q, k, v, 16**-0.5)
    assert sorted(got) == sorted((s, r) for s in SPLITS for r in range(size))
    for (split_name, rank), (mine, out) in got.items():
        assert (out - want[mine]).abs().max() < 1e-5, (split_name, rank)
