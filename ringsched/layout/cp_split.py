"""How a sequence is split by position across a context-parallel group of N ranks.

Under a causal mask a token attends to every earlier one, so a contiguous split leaves the last rank the most
work; the zigzag split cuts the sequence into 2N chunks and gives rank r chunks r and 2N-1-r, one early and one
late, whose work adds up to the same on every rank (`causal_pairs`: 64 tokens on 4 ranks give
[136, 392, 648, 904] contiguous and [520, 520, 520, 520] zigzag).
"""

from __future__ import annotations

import torch


def contiguous_split(n: int, size: int) -> list[torch.Tensor]:
    """Positions of each of `size` ranks: consecutive ranges, as even as they go (earlier ranks one longer)."""
    if size < 1 or n < 0:
        raise ValueError(f"cannot split {n} tokens over {size} ranks")
    return list(torch.arange(n).tensor_split(size))


def zigzag_split(n: int, size: int) -> list[torch.Tensor]:
    """Positions of each of `size` ranks: the sequence cut into 2*size chunks as even as they go, rank r
    holding chunks r and 2*size-1-r (in that order)."""
    if size < 1 or n < 0:
        raise ValueError(f"cannot split {n} tokens over {size} ranks")
    chunks = torch.arange(n).tensor_split(2 * size)
    return [torch.cat([chunks[r], chunks[2 * size - 1 - r]]) for r in range(size)]


def zigzag_pieces(shares: list[int]) -> list[torch.Tensor]:
    """Offsets (within a chunk of `sum(shares)` tokens) of each rank's tokens when rank r holds exactly
    `shares[r]` of them, zigzag: the chunk is laid out as every rank's front piece in rank order, then every
    rank's back piece in reverse order, rank r's front piece being `shares[r] // 2` tokens and its back piece
    the rest. With equal even shares this is `zigzag_split`; unequal shares let the placement keep every rank's
    total within a token of the others'. A rank with a share of 0 holds nothing."""
    fronts = [s // 2 for s in shares]
    backs = [s - f for s, f in zip(shares, fronts, strict=True)]
    n, size = sum(shares), len(shares)
    front_at = [sum(fronts[:r]) for r in range(size)]
    back_at = [n - sum(backs[: r + 1]) for r in range(size)]
    return [
        torch.cat([torch.arange(front_at[r], front_at[r] + fronts[r]), torch.arange(back_at[r], back_at[r] + backs[r])])
        for r in range(size)
    ]


def causal_pairs(split: list[torch.Tensor]) -> list[int]:
    """Each rank's causal attention work: the (query, key) pairs with key <= query its queries attend over."""
    return [int((positions + 1).sum()) for positions in split]
