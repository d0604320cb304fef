"""The vocabulary's two layers: the embedding (first stage) and the lm_head (last stage), whole or
vocabulary-parallel (each rank holds `TPShard.vocab`'s rows). `vocab_embedding` and `lm_head` pick the type once,
when the stage is built; the stage model calls them the same way either way.

Vocabulary-parallel, the rank holding a token's row gives its embedding and the others zeros, which an all-reduce
sums exactly (one nonzero term). The head's greedy path takes each rank's best word and the best of those (the
lowest word on ties, as `argmax`) without gathering a row; its logits path gathers the whole row, so sampling
draws from exactly what one rank would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ringsched.kernels import gguf_linear
from ringsched.kernels.small_linear import NATIVE, Linear
from ringsched.models.parallel_linear import Sharded
from ringsched.models.tp import TPGroup
from ringsched.weights.model_config import ModelConfig

# Vocabulary rows of the lm_head per step of `LMHead.logits` / `LMHead.greedy` on CPU. Measured (one thread, a
# process per setting, AMD EPYC Zen 4): 1024 words against 8192 took SmolLM2's greedy head from 81 to 65 ms at
# 86 rows, 104-109 to 91-98 at 128 and 18 to 14 at 4; a 1B Llama's (32000 x 2048) from 87 to 66 ms at 32 rows;
# and the step's peak memory from 17-21 to 6-9 MiB (likely MKL's copy of the weight chunk it multiplies). 512
# was no faster.
HEAD_VOCAB_CHUNK = 1024


def vocab_embedding(cfg: ModelConfig, group: TPGroup) -> Embedding:
    """The embedding: whole on a stage of one rank, else this rank's rows of it; scaled by `cfg.embed_scale` (Gemma:
    the square root of the hidden size, rounded to the embedding's dtype as transformers rounds it)."""
    if group.size == 1:
        emb = Embedding(cfg.vocab_size, cfg.hidden_size, _weight=_meta_weight(cfg.vocab_size, cfg.hidden_size))
    else:
        emb = VocabParallelEmbedding(cfg, group)
    if cfg.embed_scale != 1.0:
        emb.register_forward_hook(lambda m, args, out: out.mul_(torch.tensor(cfg.embed_scale, dtype=out.dtype)))
    return emb


def _meta_weight(rows: int, hidden: int) -> torch.Tensor | None:
    """On the meta device (the loader's, before the real weights are assigned) an embedding skips its random
    init: `normal_` on a meta tensor imports torch's compiler stack (dynamo, inductor: ~800 modules), which stays
    resident (measured: 69 MiB of a stage 0's anonymous memory, for values that are thrown away)."""
    return torch.empty(rows, hidden) if torch.get_default_device().type == "meta" else None


class Embedding(nn.Embedding):
    """`nn.Embedding`, whose weight may be int8 rows with a float32 scale each (`quantize`, `--quantization
    int4`): a token's row is then its int8 values times its scale, in the model's dtype."""

    scales: torch.Tensor | None = None
    act_dtype: torch.dtype = torch.float32
    qtype = 0  # a GGUF type: `weight` is the file's blocks of each row (`keep_gguf`)

    def quantize(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        """Hold int8 rows `q` [rows, hidden] and `scales` [rows] (`quantize.quantize_int8_weight`; the lm_head's
        own tensors where the two are tied) in place of the float weight."""
        self.act_dtype = self.weight.dtype
        self.weight = nn.Parameter(q, requires_grad=False)
        self.scales = scales

    def keep_gguf(self, raw: torch.Tensor, qtype: int, dtype: torch.dtype) -> None:
        """Hold a GGUF tensor's blocks `raw` [rows, row_bytes] of type `qtype`; looked-up rows come out in `dtype`."""
        self.act_dtype, self.qtype = dtype, qtype
        self.weight = nn.Parameter(raw, requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.qtype:
            rows = self.weight.index_select(0, input_ids.reshape(-1))
            out = gguf_linear.dequantize(rows, self.qtype, self.embedding_dim, self.act_dtype)
            return out.view(*input_ids.shape, self.embedding_dim)
        if self.scales is None:
            return super().forward(input_ids)
        rows = F.embedding(input_ids, self.weight).float() * self.scales[input_ids].unsqueeze(-1)
        return rows.to(self.act_dtype)


class VocabParallelEmbedding(Sharded, Embedding):
    """Rows `group.shard.vocab(cfg)` of the embedding; a token outside them embeds as zeros before the sum."""

    def __init__(self, cfg: ModelConfig, group: TPGroup) -> None:
        start, rows = group.shard.vocab(cfg)
        super().__init__(rows, cfg.hidden_size, _weight=_meta_weight(rows, cfg.hidden_size))
        self.part, self.whole, self.group = (start, rows), cfg.vocab_size, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = input_ids - self.part[0]
        outside = (local < 0) | (local >= rows)
        out = super().forward(local.clamp(0, rows - 1))
        out[outside] = 0
        return self.group.all_reduce(out)


def lm_head(cfg: ModelConfig, group: TPGroup) -> LMHead:
    """The lm_head: whole on a stage of one rank, else this rank's vocabulary rows of it."""
    head = LMHead(cfg.hidden_size, cfg.vocab_size) if group.size == 1 else VocabParallelLMHead(cfg, group)
    head.softcap = cfg.final_softcap
    return head


class LMHead(Linear):
    """The logits of the vocabulary rows it holds, computed a vocabulary chunk at a time on CPU; soft-capped
    (`cap * tanh(logits / cap)`, Gemma 2) where `softcap` is set. The cap keeps the order of the logits, so the
    greedy path skips it."""

    softcap = 0.0
    vocab_chunk = HEAD_VOCAB_CHUNK

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__(hidden, vocab, bias=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[S, vocab]` logits, computed a vocabulary chunk at a time exactly as `greedy` computes them, so a
        greedy request gets the same token whichever of the two paths its batch takes."""
        vocab = self.weight.shape[0]
        out = None
        for start, logits in self._chunks(hidden):
            if start == 0 and logits.shape[-1] == vocab:
                out = logits  # one chunk (GPU): no copy
                break
            if out is None:
                out = hidden.new_empty(hidden.shape[0], vocab)
            out[:, start : start + logits.shape[-1]] = logits
        return out.div_(self.softcap).tanh_().mul_(self.softcap) if self.softcap else out

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[S]` argmax of the logits (the first on ties, as `argmax`) without the `[S, vocab]` logits: on CPU each
        vocabulary chunk's logits are reduced while they are in cache. Measured on SmolLM2 (128 rows, 49152
        words, one thread): the same tokens, ~7% faster than logits then argmax (8192-word chunks then), and
        a chunk's logits instead of the whole `[128, 49152]` (24 MiB)."""
        return self._best(hidden)[1]

    def _best(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(value, row) of each hidden row's highest logit among the rows held, the first on ties."""
        best_val = best_idx = None
        for start, logits in self._chunks(hidden):
            val, idx = logits.max(dim=-1)
            if best_val is None:
                best_val, best_idx = val, idx
                continue
            better = val > best_val  # strictly: an equal value in a later chunk is a later index
            best_val = torch.where(better, val, best_val)
            best_idx = torch.where(better, idx + start, best_idx)
        return best_val, best_idx

    def _chunks(self, hidden: torch.Tensor):
        """(first word, logits `[S, chunk]`) per vocabulary chunk: on a GPU one launch over the whole vocabulary
        is cheapest; on CPU `HEAD_VOCAB_CHUNK` words (0.5 MiB of logits at 128 rows). The path is the head's
        `paths` for the row count; the kernel's takes the whole vocabulary in one pass."""
        path = self.paths.path(hidden.shape[0])
        if path == NATIVE:
            yield 0, self(hidden)
            return
        vocab = self.weight.shape[0]
        chunk = HEAD_VOCAB_CHUNK if hidden.device.type == "cpu" else vocab
        for start in range(0, vocab, chunk):
            yield start, self.run_rows(hidden, slice(start, start + chunk), path)


class VocabParallelLMHead(Sharded, LMHead):
    """Rows `group.shard.vocab(cfg)` of the lm_head; `logits` and `greedy` answer for the whole vocabulary."""

    def __init__(self, cfg: ModelConfig, group: TPGroup) -> None:
        start, rows = group.shard.vocab(cfg)
        super().__init__(cfg.hidden_size, rows)
        self.part, self.whole, self.group = (start, rows), cfg.vocab_size, group
        self.per_rank = group.shard.vocab_per_rank(cfg)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every rank gathers the whole row (sampling then draws from exactly what one rank would)."""
        logits = super().logits(hidden)
        if logits.shape[1] < self.per_rank:  # the last rank's slice is short: pad, gather, cut
            logits = F.pad(logits, (0, self.per_rank - logits.shape[1]), value=float("-inf"))
        return torch.cat(self.group.all_gather(logits).unbind(0), dim=1)[:, : self.whole]

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each rank's best of its vocabulary rows; the best of those, the lowest rank (lowest word) on ties."""
        best_val, best_idx = self._best(hidden)
        mine = torch.stack((best_val.double(), (best_idx + self.part[0]).double()))
        every = self.group.all_gather(mine)  # [ranks, 2, S]
        rank = every[:, 0].argmax(dim=0)  # the first maximum
        return every[rank, 1, torch.arange(rank.numel(), device=rank.device)].long()
