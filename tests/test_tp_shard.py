"""Tensor parallelism's arithmetic in one process: which slices each rank holds (`TPShard`), which layouts are
refused and why, and the sharded model itself, its ranks run as threads over an in-process group, against the
unsharded model on tiny random models (`tests/test_tp.py` runs real processes over gloo)."""

from __future__ import annotations

import threading

import pytest
import torch

from ringsched.attention.paged import ForwardBatch
from ringsched.config import ConfigError, EngineConfig
from ringsched.layout.rank import StageInfo, rank_infos
from ringsched.models.loader import load_stage_model, weights_bytes
from ringsched.models.random_model import random_config, write_random_model
from ringsched.models.tp import TPGroup
from ringsched.weights.model_config import ModelConfig
from ringsched.weights.tp_shard import TPLayoutError, TPShard, check_tp


def _cfg(heads: int, kv: int, hidden: int = 64, inter: int = 96, vocab: int = 300, arch: str = "llama"):
    return ModelConfig.from_dict(random_config(arch, 2, hidden, heads, kv, inter, vocab, tie=True))


@pytest.mark.parametrize(("heads", "kv", "tp"), [(9, 3, 2), (9, 3, 3), (9, 3, 9), (4, 1, 2), (8, 4, 4), (8, 2, 4),
                                                 (8, 8, 3), (32, 8, 16)])  # fmt: skip
def test_every_query_head_is_computed_once_beside_the_kv_head_it_reads(heads, kv, tp):
    cfg = _cfg(heads, kv, hidden=heads * 8)
    group = heads // kv
    seen = []
    for r in range(tp):
        s = TPShard(r, tp)
        (q0, nq), (k0, nk) = s.heads(cfg), s.kv_heads(cfg)
        seen += range(q0, q0 + nq)
        assert all(k0 <= q // group < k0 + nk for q in range(q0, q0 + nq))
        assert nq % nk == 0 and nq // nk == min(group, nq)  # the rank's own heads keep one grouping
        local = s.local_config(cfg)
        assert (local.num_heads, local.num_kv_heads) == (nq, nk)
    assert seen == list(range(heads))
    stored = [TPShard(r, tp).kv_heads(cfg)[1] for r in range(tp)]
    assert max(stored) == (-(-kv // tp) if tp <= kv else 1)  # replicated past the KV heads: one each


def test_intermediate_and_vocabulary_cover_every_row_once():
    cfg = _cfg(4, 2, inter=100, vocab=301)
    for tp in (2, 3, 4):
        inter = [TPShard(r, tp).intermediate(cfg) for r in range(tp)]
        vocab = [TPShard(r, tp).vocab(cfg) for r in range(tp)]
        for parts, total in ((inter, 100), (vocab, 301)):
            assert [p[0] for p in parts] == [sum(n for _, n in parts[:i]) for i in range(tp)]
            assert sum(n for _, n in parts) == total


def test_layouts_that_do_not_split_are_refused_with_what_fits():
    smol = _cfg(9, 3, hidden=576, inter=1536, vocab=49152)
    for tp in (1, 2, 3, 9):
        check_tp(smol, tp)
    with pytest.raises(TPLayoutError, match=r"--tp-size 4: .*3 KV heads.*fit this model: \[1, 2, 3, 9\]"):
        check_tp(smol, 4)
    with pytest.raises(TPLayoutError, match="hidden size 70 does not split evenly over 4"):
        check_tp(_cfg(7, 7, hidden=70), 4)


def test_flags_refuse_what_tensor_parallelism_cannot_run():
    with pytest.raises(ConfigError, match="--tp-size must be >= 1"):
        EngineConfig(tp_size=0)
    with pytest.raises(ConfigError, match="--pp-flex-layers runs with --tp-size 1"):
        EngineConfig(pp_size=2, tp_size=2, pp_flex_layers=2)
    with pytest.raises(ConfigError, match="nodes hold whole stages.*tp-size ranks"):
        EngineConfig(pp_size=1, tp_size=2, nnodes=2, dist_init_addr="h:1")
    cfg = EngineConfig(pp_size=2, tp_size=2, nnodes=2, node_rank=1, dist_init_addr="h:1")
    assert (cfg.world_size, cfg.ranks_per_node, list(cfg.local_ranks)) == (4, 2, [2, 3])
    assert cfg.describe_rank(3) == "rank 3 (stage 1, tp 1, node 1)"
    assert [(r.node, r.pp, r.tp) for r in rank_infos(cfg.layout, [1, 1])] == [(0, 0, 0), (0, 0, 1), (1, 1, 0),
                                                                              (1, 1, 1)]  # fmt: skip


class _Threads:
    """The collectives of `size` ranks run as threads: each contributes, all wait, each reads every part."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=30)
        self.parts: list[torch.Tensor | None] = [None] * size

    def exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.parts[rank] = t.clone()
        self.barrier.wait()
        out = [p.clone() for p in self.parts]
        self.barrier.wait()
        return out


class ThreadTP(TPGroup):
    def __init__(self, shard: TPShard, threads: _Threads) -> None:
        super().__init__(shard, None)
        self.threads = threads

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        parts = self.threads.exchange(self.rank, t)
        self.all_reduces += 1
        return t.copy_(torch.stack(parts).sum(0))

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.threads.exchange(self.rank, t))


def _greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """`n` greedy tokens by recomputing the whole sequence each step (no cache), and the first step's logits."""
    ids, first = list(prompt), None
    with torch.inference_mode():
        for _ in range(n):
            batch = ForwardBatch.no_cache(len(ids))
            batch.logit_rows = torch.tensor([len(ids) - 1])
            hidden = model(batch, input_ids=torch.tensor(ids))
            logits = model.compute_logits(hidden)
            token = model.greedy_tokens(hidden)
            assert int(token[0]) == int(logits[0].argmax())  # the sharded argmax is the gathered row's
            first = logits if first is None else first
            ids.append(int(token[0]))
    return ids[len(prompt) :], first


@pytest.mark.parametrize(
    ("arch", "heads", "kv", "tp", "vocab"),
    [("qwen3", 4, 1, 2, 300), ("llama", 8, 4, 4, 300), ("llama", 6, 3, 2, 301), ("qwen2", 4, 2, 2, 302)],
)
def test_sharded_ranks_compute_the_unsharded_model(tmp_path, arch, heads, kv, tp, vocab):
    """Qwen3 with one KV head at TP=2 (replicated), a Llama with 4 KV heads at TP=4, SmolLM2's 3-over-2 split,
    Qwen2's biases; vocabularies that do not divide. The same greedy tokens, logits equal to rounding."""
    config = random_config(arch, 2, heads * 12, heads, kv, 96, vocab, tie=arch != "qwen2")
    model_dir = write_random_model(tmp_path / arch, config, seed=1)
    cfg = ModelConfig.from_dict(config)
    stage = StageInfo(0, 1, 0, cfg.num_layers)
    prompt = [5, 77, 123, 9, 250, 31]
    whole = load_stage_model(model_dir, stage)
    want, want_logits = _greedy(whole, prompt, 8)
    threads, results = _Threads(tp), [None] * tp

    def rank(r: int) -> None:
        model = load_stage_model(model_dir, stage, tp=ThreadTP(TPShard(r, tp), threads))
        results[r] = (*_greedy(model, prompt, 8), weights_bytes(model), model.tp.all_reduces)

    workers = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    for tokens, logits, _, reduces in results:
        assert tokens == want
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        # Per forward: the embedding's, then two per layer.
        assert reduces == 8 * (1 + 2 * cfg.num_layers)
    total = sum(r[2] for r in results)
    assert weights_bytes(whole) <= total  # replicated norms (and KV heads past num_kv_heads) only add
