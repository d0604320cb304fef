"""A micro-batch's attention over a KV split across a CP group, across 2 and 3 real gloo processes: each rank builds
its batch from the same plans (stage 0's placement), computes only its rows, and the outputs equal causal
attention over each whole request (split prefill chunks by the ring, short chunks and decodes by travelling
queries, earlier chunks' KV on every rank, rejected drafts' KV dropped); the sampling rows gather in plan order.
Also the partial attention with its LSE against the reference, fully masked rows included."""

import datetime
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ringsched.attention.cp import Visibility, partial_attention
from ringsched.attention.cp_backend import CPBackend
from ringsched.attention.paged import paged_attention
from ringsched.attention.ring import attend_block
from ringsched.comm.cp_group import CPGroup
from ringsched.comm.messages import BatchPlan, PlanEntry
from ringsched.kernels import native
from ringsched.kv.cache import BlockTable
from ringsched.kv.cp_blocks import CPBlocks

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4
SCALE = DIM**-0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def qkv_of(rid: str, n: int, dtype=torch.float32):
    """Each request's queries, keys and values at positions 0..n-1 (the same on every rank)."""
    g = torch.Generator().manual_seed(sum(map(ord, rid)))
    return tuple(torch.randn(n, h, DIM, generator=g).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS))


def reference(rid: str, n: int) -> torch.Tensor:
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in qkv_of(rid, n))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)[0].transpose(0, 1)


# (rid, start, tokens, drafts) per micro-batch: a prompt split over the ranks in two chunks then decoding, a short
# prompt on one rank then decoding, and a third joining later with a chunk just long enough to split; then "a"
# verifies 5 drafts (split over the ranks) of which 1 is kept, and 1 draft (on one rank) that is kept.
SCHEDULE = [
    [("a", 0, 21, 0), ("b", 0, 3, 0)],
    [("a", 21, 14, 0), ("b", 3, 1, 0), ("c", 0, 7, 0)],
    [("a", 35, 1, 0), ("b", 4, 1, 0), ("c", 7, 2, 0)],
    [("a", 36, 1, 0), ("c", 9, 1, 0)],
    [("a", 37, 6, 5)],
    [("a", 39, 2, 1)],
    [("a", 41, 1, 0)],
]
TOTAL = {"a": 43, "b": 5, "c": 10}


def plans(size: int) -> list[BatchPlan]:
    """As stage 0 makes them: a drafted entry placed as one chunk (`CPBlocks.extend`), and what the rejected drafts
    held dropped before the request's next entry (`CPBlocks.rewind`)."""
    alloc = CPBlocks([BlockTable(64, BLOCK) for _ in range(size)])
    out = []
    for seq, chunks in enumerate(SCHEDULE):
        plan = BatchPlan(slot=seq % 2, seq=seq)
        for rid, start, n, drafts in chunks:
            alloc.rewind(rid, start)
            e = PlanEntry(rid, start, list(range(start, start + n - drafts)), True,
                          **alloc.grow(rid, start + n - drafts))  # fmt: skip
            if drafts:
                alloc.extend(e, start + n)
                e.token_ids, e.drafts = list(range(start, start + n)), drafts
            plan.entries.append(e)
        out.append(plan)
    return out


def _rank_main(rank: int, size: int, port: int, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    try:
        for use_kernel in sorted({False, native.usable_for(torch.float32, "cpu")}):
            results[(rank, use_kernel)] = _run_plans(rank, size, use_kernel)
    finally:
        dist.destroy_process_group()


def _run_plans(rank: int, size: int, use_kernel: bool) -> list:
    """This rank's rows, their outputs and the gathered sampling rows of each plan, its caches filled as it goes."""
    group = CPGroup(rank, tuple(range(size)), None)
    table, backend = BlockTable(64, BLOCK, follower=True), CPBackend(group, use_kernel)
    k_cache = torch.zeros(64 * BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    got = []
    for plan in plans(size):
        for e in plan.entries:
            table.assign(e.rid, e.cp_blocks[rank])
        backend.apply(plan)
        batch, ids = backend.forward_batch(plan, table, torch.device("cpu"))
        rows = []  # the request of each of this rank's rows (the plan's token ids are the positions here)
        for e in plan.entries:
            rows += [e.rid] * int(e.cp_counts[rank])
        q, k, v = (torch.stack([qkv_of(rid, TOTAL[rid])[i][p] for rid, p in zip(rows, ids.tolist(), strict=True)])
                   if rows else torch.empty(0, h, DIM)
                   for i, h in enumerate((HEADS, KV_HEADS, KV_HEADS)))  # fmt: skip
        out = paged_attention(q, k, v, batch, k_cache, v_cache, SCALE)  # the layers' call: writes K/V, then attends
        samples = batch.gather_samples(q.reshape(q.shape[0], HEADS * DIM)[batch.logit_rows])
        got.append((rows, ids.tolist(), out, samples))
    return got


@pytest.mark.slow  # spawned processes: ~8 s each
@pytest.mark.parametrize("size", [2, 3])
def test_split_kv_attention_across_gloo_processes_equals_causal_attention(size):
    """Decodes by partial attention and, where a C compiler built it, through the CPU decode kernel (each rank's
    share read in place)."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank_main, args=(size, _free_port(), results), nprocs=size, start_method="spawn",
                           join=True)  # fmt: skip
        got = dict(results)
    kernel = native.usable_for(torch.float32, "cpu")
    assert sorted(got) == sorted((r, k) for r in range(size) for k in {False, kernel})
    want = {rid: reference(rid, n) for rid, n in TOTAL.items()}
    for use_kernel in sorted({False, kernel}):
        for seq, plan in enumerate(plans(size)):
            seen = []
            for rank in range(size):
                rows, positions, out, samples = got[(rank, use_kernel)][seq]
                for i, (rid, pos) in enumerate(zip(rows, positions, strict=True)):
                    assert (out[i] - want[rid][pos]).abs().max() < 1e-5, (use_kernel, seq, rank, rid, pos)
                    seen.append((rid, pos))
                # every rank holds the micro-batch's sampling rows, in plan order: each entry's last query (a
                # drafted entry's last 1 + drafts)
                last = [qkv_of(e.rid, TOTAL[e.rid])[0][p].reshape(-1) for e in plan.entries
                        for p in range(e.start + len(e.token_ids) - 1 - e.drafts, e.start + len(e.token_ids))]
                assert torch.equal(samples, torch.stack(last))
            want_rows = sorted((e.rid, e.start + i) for e in plan.entries for i in range(len(e.token_ids)))
            assert sorted(seen) == want_rows  # each token computed by exactly one rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_attention_with_its_lse(dtype):
    q, k, v = (x.to(dtype) for x in qkv_of("p", 12))
    q_pos, k_pos = torch.arange(20, 32), torch.tensor([3, 25, 26, 40, 41, 27, 28, 21, 22, 30, 31, 33])
    out, lse = partial_attention(q, k, v, q_pos, k_pos, SCALE)
    ref_out, ref_lse = attend_block(q.float(), k.float(), v.float(), q_pos, k_pos, SCALE)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (out.float() - ref_out).abs().max() < tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite] - ref_lse[finite]).abs().max() < tol
    # rows that see no key: output 0 and LSE -inf (the kernel alone gives LSE 0)
    none = partial_attention(q, k, v, torch.arange(12), torch.arange(100, 112), SCALE)
    assert torch.equal(none[0], torch.zeros_like(q)) and torch.isinf(none[1]).all()
    some_dead = partial_attention(q, k, v, torch.arange(12), torch.arange(5, 17), SCALE)
    assert torch.isinf(some_dead[1][:5]).all() and torch.equal(some_dead[0][:5], torch.zeros_like(q[:5]))
    assert Visibility.of(torch.arange(10, 12), torch.arange(0, 10), 3, dtype).mask is None  # all visible: no mask


def test_the_gpu_path_attends_in_key_chunks(monkeypatch):
    """Off the CPU partial attention runs `attend_block` a bounded number of keys at a time, merged by LSE: the
    same output and LSE as over all keys at once (run here on CPU tensors)."""
    from ringsched.attention import cp as cp_attention

    monkeypatch.setattr(cp_attention, "KEY_CHUNK", 5)
    q, k, v = qkv_of("g", 23)
    q_pos, k_pos = torch.arange(10, 23), torch.arange(23)
    out, lse = cp_attention._attend_in_key_chunks(q[10:], k, v, q_pos, k_pos, SCALE)
    want_out, want_lse = attend_block(q[10:], k, v, q_pos, k_pos, SCALE)
    assert (out - want_out).abs().max() < 1e-5 and (lse - want_lse).abs().max() < 1e-5
    assert (out - reference("g", 23)[10:]).abs().max() < 1e-5
