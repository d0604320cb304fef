"""Tensor parallelism's arithmetic: which slice of each weight a rank of a stage holds (`TPShard`), and whether a
model splits `tp` ways at all (`check_tp`). The collectives that join the slices are `models/tp.py`'s."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ringsched.weights.model_config import ModelConfig


class TPLayoutError(ValueError):
    """The model cannot be split `tp` ways; the message says which dimension and what `--tp-size` fits."""


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise `TPLayoutError` unless the model splits `tp` ways (see `TPShard`)."""
    if tp == 1 or _fits(cfg, tp):
        return
    fits = [n for n in range(1, cfg.num_heads + 1) if _fits(cfg, n)]

    def refuse(what: str) -> None:
        raise TPLayoutError(f"--tp-size {tp}: {what}; --tp-size values that fit this model: {fits}")

    if tp > cfg.num_kv_heads and (tp % cfg.num_kv_heads or cfg.num_heads % tp):
        refuse(
            f"past its {cfg.num_kv_heads} KV heads each rank holds one whole KV head and an equal share of the "
            f"{cfg.num_heads // cfg.num_kv_heads} query heads that read it, so --tp-size must be a multiple of "
            f"{cfg.num_kv_heads} dividing the {cfg.num_heads} attention heads"
        )
    if tp > cfg.intermediate_size:
        refuse(f"its MLP width {cfg.intermediate_size} is narrower than {tp} ranks")
    if cfg.moe is not None and tp > cfg.moe.intermediate:
        refuse(f"its experts' width {cfg.moe.intermediate} is narrower than {tp} ranks")
    if cfg.hidden_size % tp:
        refuse(f"its hidden size {cfg.hidden_size} does not split evenly over {tp} ranks (the sharded seam)")


def _fits(cfg: ModelConfig, tp: int) -> bool:
    if tp > cfg.num_kv_heads and (tp % cfg.num_kv_heads or cfg.num_heads % tp):
        return False
    experts = cfg.moe.intermediate if cfg.moe is not None else tp
    return tp <= min(cfg.intermediate_size, experts) and cfg.hidden_size % tp == 0


def _even(n: int, parts: int, i: int) -> tuple[int, int]:
    """(first, count) of part `i` of `n` items cut into `parts` contiguous parts as evenly as possible."""
    lo, hi = i * n // parts, (i + 1) * n // parts
    return lo, hi - lo


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size` tensor-parallel ranks: the slices of a model's weights it holds.

    Attention is split by whole GQA groups (a KV head and the query heads that read it), so every rank's heads
    keep the model's grouping: while `size <= num_kv_heads` the groups are shared out as evenly as they go
    (SmolLM2's 3 KV heads over 2 ranks: 1 and 2); past that each group's query heads are split over
    `size / num_kv_heads` ranks, each of which stores the group's whole KV head. The MLP width and the vocabulary
    are cut as evenly as they go."""

    rank: int = 0
    size: int = 1

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first, count) of the KV heads this rank stores."""
        if self.size <= cfg.num_kv_heads:
            return _even(cfg.num_kv_heads, self.size, self.rank)
        return self.rank // (self.size // cfg.num_kv_heads), 1

    def heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first, count) of this rank's query heads."""
        group = cfg.num_heads // cfg.num_kv_heads
        if self.size <= cfg.num_kv_heads:
            first, n = self.kv_heads(cfg)
            return first * group, n * group
        reps = self.size // cfg.num_kv_heads  # ranks per KV head
        per = group // reps
        return self.kv_heads(cfg)[0] * group + (self.rank % reps) * per, per

    def intermediate(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first, count) of this rank's MLP rows, cut evenly: the all-reduce after attention is a barrier, so the
        MLP half of a layer must balance on its own (giving the rank with fewer heads more MLP rows only moved
        the wait from one all-reduce to the other)."""
        return _even(cfg.intermediate_size, self.size, self.rank)

    def expert_intermediate(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first, count) of this rank's rows of every expert (`cfg.moe.intermediate` wide), cut evenly as the MLP's
        are: each rank holds a slice of every expert, so routing needs no exchange and a layer one all-reduce."""
        assert cfg.moe is not None, "expert_intermediate of a model without experts"
        return _even(cfg.moe.intermediate, self.size, self.rank)

    def vocab(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first, count) of the vocabulary rows: `ceil(vocab / size)` each, the last rank what is left."""
        per = self.vocab_per_rank(cfg)
        start = min(self.rank * per, cfg.vocab_size)
        return start, min(per, cfg.vocab_size - start)

    def vocab_per_rank(self, cfg: ModelConfig) -> int:
        return -(-cfg.vocab_size // self.size)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The model's sizes as this rank holds them: its heads, KV heads, MLP width and vocabulary rows (the
        worker sizes its KV pool by its own KV heads)."""
        if self.size == 1:
            return cfg
        return dataclasses.replace(
            cfg,
            num_heads=self.heads(cfg)[1],
            num_kv_heads=self.kv_heads(cfg)[1],
            intermediate_size=self.intermediate(cfg)[1],
            vocab_size=self.vocab(cfg)[1],
            moe=None
            if cfg.moe is None
            else dataclasses.replace(cfg.moe, intermediate=self.expert_intermediate(cfg)[1]),
        )
