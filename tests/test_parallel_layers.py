"""The tensor-parallel layer types against their whole counterparts: each rank's layer, given the part of the
whole weights its `read_slices` names (what the loader reads), computes the whole layer's output after the
group's collectives. The ranks run as threads over an in-process group (`test_tp_shard.ThreadTP`)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_tp_shard import ThreadTP, _Threads
from torch import nn

from ringsched.layout.rank import StageInfo
from ringsched.models.llama import StageModel
from ringsched.models.parallel_linear import ColumnParallelLinear, RowParallelLinear, read_slices
from ringsched.models.random_model import random_config
from ringsched.models.tp import SoloGroup
from ringsched.models.vocab import (
    Embedding,
    LMHead,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    lm_head,
    vocab_embedding,
)
from ringsched.weights.model_config import ModelConfig
from ringsched.weights.tp_shard import TPShard


def _on_ranks(size: int, fn) -> list:
    """`fn(group)` on each of `size` ranks (threads), in rank order."""
    threads, results = _Threads(size), [None] * size

    def rank(r: int) -> None:
        with torch.inference_mode():
            results[r] = fn(ThreadTP(TPShard(r, size), threads))

    workers = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert all(r is not None for r in results), "a rank failed"
    return results


def _load(module: nn.Module, whole: dict[str, torch.Tensor]) -> nn.Module:
    """`module`'s parameters: its part of each whole tensor, as the loader reads it."""
    parts = module.read_slices() if hasattr(module, "read_slices") else {}
    for name, t in whole.items():
        if name in parts:
            dim, start, stop = parts[name]
            t = t.narrow(dim, start, stop - start)
        setattr(module, name, nn.Parameter(t.clone(), requires_grad=False))
    return module


@pytest.mark.parametrize("size", [2, 3])
def test_column_then_row_parallel_linear_is_the_whole_pair(size):
    torch.manual_seed(0)
    hidden, inter = 12, 10  # 10 rows over 3 ranks: 3, 3, 4
    x = torch.randn(5, hidden)
    up = {"weight": torch.randn(inter, hidden), "bias": torch.randn(inter)}
    down = {"weight": torch.randn(hidden, inter)}
    want_mid = F.linear(x, up["weight"], up["bias"])
    want = F.linear(want_mid, down["weight"])

    def rank(group):
        part = group.shard.intermediate(SimpleNamespace(intermediate_size=inter))
        col = _load(ColumnParallelLinear(hidden, part, inter, bias=True), up)
        row = _load(RowParallelLinear(part, inter, hidden, group), down)
        mid = col(x)
        return mid, row(mid), group.all_reduces

    results = _on_ranks(size, rank)
    torch.testing.assert_close(torch.cat([mid for mid, _, _ in results], dim=1), want_mid)
    for _, out, reduces in results:
        torch.testing.assert_close(out, want)
        assert reduces == 1  # one sum per call of the row-parallel layer


@pytest.mark.parametrize("size", [2, 3])
def test_vocab_parallel_embedding_and_head_are_the_whole_ones(size):
    torch.manual_seed(1)
    cfg = ModelConfig.from_dict(random_config("llama", 1, 16, 2, 1, 32, 301, tie=True))  # 301: uneven parts
    table = torch.randn(cfg.vocab_size, cfg.hidden_size)
    table[250] = table[50]  # a tie between two ranks' words: the lower word wins, as argmax
    ids = torch.tensor([0, 100, 101, 150, 151, 200, 300, 50])
    hidden = torch.cat([torch.randn(4, cfg.hidden_size), table[50:51] * 10])
    want_logits = F.linear(hidden, table)

    def rank(group):
        embed = _load(vocab_embedding(cfg, group), {"weight": table})
        head = _load(lm_head(cfg, group), {"weight": table})
        assert isinstance(embed, VocabParallelEmbedding) and isinstance(head, VocabParallelLMHead)
        return embed(ids), head.logits(hidden), head.greedy(hidden)

    for rows, logits, tokens in _on_ranks(size, rank):
        assert torch.equal(rows, table[ids])  # one nonzero term per row: exact
        torch.testing.assert_close(logits, want_logits)
        assert torch.equal(tokens, want_logits.argmax(dim=-1))
        assert int(tokens[-1]) == 50


def test_a_stage_of_one_rank_builds_whole_layers_that_exchange_nothing():
    cfg = ModelConfig.from_dict(random_config("llama", 1, 16, 2, 1, 32, 301, tie=True))
    solo = SoloGroup()
    assert type(vocab_embedding(cfg, solo)) is Embedding and type(lm_head(cfg, solo)) is LMHead
    torch.manual_seed(2)
    whole = {"weight": torch.randn(16, 32)}
    row = _load(RowParallelLinear((0, 32), 32, 16, solo), whole)
    x = torch.randn(3, 32)
    assert torch.equal(row(x), F.linear(x, whole["weight"]))  # the plain layer's call, nothing added
    assert not row.sums_over_ranks and solo.all_reduces == 0
    with torch.device("meta"):
        assert read_slices(StageModel(cfg, StageInfo(0, 1, 0, 1))) == {}  # every tensor read whole


def test_a_rank_reads_its_heads_rows_and_columns():
    cfg = ModelConfig.from_dict(random_config("llama", 1, 72, 9, 3, 96, 301, tie=True))  # SmolLM2's 9 over 3
    shard = TPShard(1, 2)
    with torch.device("meta"):
        model = StageModel(cfg, StageInfo(0, 1, 0, 1), ThreadTP(shard, _Threads(2)))
    slices, d = read_slices(model), cfg.head_dim
    (q0, h), (k0, kvh), (i0, n), (v0, nv) = (shard.heads(cfg), shard.kv_heads(cfg), shard.intermediate(cfg),
                                             shard.vocab(cfg))  # fmt: skip
    a, m = "model.layers.0.self_attn", "model.layers.0.mlp"
    assert slices == {
        f"{a}.q_proj.weight": (0, q0 * d, (q0 + h) * d), f"{a}.k_proj.weight": (0, k0 * d, (k0 + kvh) * d),
        f"{a}.v_proj.weight": (0, k0 * d, (k0 + kvh) * d), f"{a}.o_proj.weight": (1, q0 * d, (q0 + h) * d),
        f"{m}.gate_proj.weight": (0, i0, i0 + n), f"{m}.up_proj.weight": (0, i0, i0 + n),
        f"{m}.down_proj.weight": (1, i0, i0 + n),
        "model.embed_tokens.weight": (0, v0, v0 + nv), "lm_head.weight": (0, v0, v0 + nv),
    }  # fmt: skip
    assert (q0, h, k0, kvh) == (3, 6, 1, 2)  # the second rank: the last two GQA groups
