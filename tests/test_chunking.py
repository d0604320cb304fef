"""Dynamic chunk sizes: the chunk-time model, its inversion, the floor and the tail rule, and the start-up probe
on a tiny model."""

import pytest
import torch

from ringsched.comm.messages import NewRequest
from ringsched.kv.cache import BlockTable
from ringsched.sampling.params import SamplingParams
from ringsched.scheduler.chunking import ChunkCost, ChunkSizer, DecodeCost
from ringsched.scheduler.planner import Planner
from ringsched.stage.chunk_probe import probe
from ringsched.weights.model_config import ModelConfig

SMOL_LIKE = ChunkCost(per_token=36.4 / 512, per_pair=(102.5 - 36.4) / (512 * 4096))  # ms, as probed on SmolLM2


def test_fit_recovers_the_model():
    cost = ChunkCost(per_token=0.07, per_pair=3e-5)
    n, ctx = 512, 4096
    fitted = ChunkCost.fit(n, cost.time(n, 0), ctx, cost.time(n, ctx))
    assert fitted.per_token == pytest.approx(cost.per_token) and fitted.per_pair == pytest.approx(cost.per_pair)
    assert ChunkCost.fit(n, 10.0, ctx, 9.0).per_pair == 0.0  # a noisy probe never models attention as free time


def test_every_chunk_takes_about_the_first_ones_time():
    sizer = ChunkSizer(SMOL_LIKE, first=512)
    sizes = sizer.plan(6000)
    assert sum(sizes) == 6000 and sizes[0] == 512
    assert all(a >= b for a, b in zip(sizes[:-2], sizes[1:-1], strict=True))  # shrinking as context grows
    done, target = 0, SMOL_LIKE.time(512, 0)
    for n in sizes[:-1]:
        assert SMOL_LIKE.time(n, done) <= target * 1.001
        assert n == sizer.floor or SMOL_LIKE.time(n + 1, done) > target  # the longest that fits
        done += n
    assert min(sizes) >= sizer.floor == 128


def test_floor_and_no_sliver_at_the_end():
    steep = ChunkCost(per_token=1.0, per_pair=1.0)  # attention dominates: the fit falls below the floor at once
    sizer = ChunkSizer(steep, first=100)
    sizes = sizer.plan(1030)
    assert sizes[0] == 100 and all(s >= 25 for s in sizes) and sum(sizes) == 1030
    flat = ChunkSizer(ChunkCost(per_token=1.0, per_pair=0.0), first=100)
    assert flat.plan(1010) == [100] * 9 + [85, 25]  # the 10-token tail folded: the last chunk is the floor
    assert flat.plan(120) == [95, 25]
    assert flat.plan(60) == [60]


@pytest.mark.parametrize("bad", [dict(per_token=0.0, per_pair=1.0), dict(per_token=1.0, per_pair=-1.0)])
def test_nonsense_costs_are_refused(bad):
    with pytest.raises(ValueError):
        ChunkCost(**bad)


def test_probe_on_a_tiny_model(tiny_llama_dir):
    mcfg = ModelConfig.from_dir(tiny_llama_dir)
    cost, decode = probe(mcfg, torch.float32, torch.device("cpu"), first=600, max_len=1024, repeat=1)  # > vocab
    assert cost.per_token > 0
    cost, decode = probe(mcfg, torch.float32, torch.device("cpu"), first=64, max_len=1024, repeat=1)
    assert cost.per_token > 0 and cost.per_pair >= 0 and decode.time(16) > 0
    sizes = ChunkSizer(cost, 64).plan(900)
    assert sum(sizes) == 900 and max(sizes) == 64 and min(sizes) >= 16


def test_beside_decodes_a_chunk_takes_one_decode_step():
    decode = DecodeCost.fit(16, t_one=20.0 / 30, t_rows=35.0 / 30)  # ms per layer
    sizer = ChunkSizer(SMOL_LIKE, first=512, decode=decode)
    alone = sizer.size(0, 6000)
    beside = sizer.size(0, 6000, decoding=16)
    assert alone == 512 and beside < 512
    assert SMOL_LIKE.time(beside, 0) <= decode.time(16) < SMOL_LIKE.time(beside + 1, 0)
    late = sizer.size(5500, 500, decoding=16)
    assert late == sizer.shared_floor == 16  # attention at 5,500 tokens: the floor holds
    assert ChunkSizer(SMOL_LIKE, first=512).size(0, 6000, decoding=16) == 512  # no decode model: as alone


def test_planner_counts_decoding_requests_for_the_sizer():
    decode = DecodeCost(fixed=5.0, per_row=0.5)
    sizer = ChunkSizer(ChunkCost(per_token=1.0, per_pair=0.0), first=64, decode=decode)
    p = Planner(BlockTable(256, 16), 8, 8, 512, eos_ids=(2,), max_len=4096, chunker=sizer)
    for i in range(4):
        p.add(NewRequest(f"s{i}", [10, 11, 12], SamplingParams(max_tokens=50, temperature=0).to_dict()))
    p.plan(0, 0)
    p.on_output(0, [5, 5, 5, 5])  # four streams decoding
    p.add(NewRequest("long", list(range(10, 1010)), SamplingParams(max_tokens=1, temperature=0).to_dict()))
    plan = p.plan(0, 1)
    chunk = [len(e.token_ids) for e in plan.entries if e.rid == "long"]
    assert chunk == [7]  # 5 + 0.5 * 4 = 7 ms of decode step: 7 one-ms tokens
