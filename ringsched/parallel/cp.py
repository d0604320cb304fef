"""Context parallelism's pure parts: how a sequence is split across a CP group, what each rank's causal
attention costs, the log-sum-exp merge of partial attention, and ring attention itself (simulated in one
process, or across a real process group).

A CP group of N ranks splits one sequence by position: each rank computes its own tokens' queries and keeps
their K/V. Under a causal mask a token attends to every earlier one, so a contiguous split leaves the last
rank the most work; the zigzag split cuts the sequence into 2N chunks and gives rank r chunks r and 2N-1-r,
one early and one late, whose work adds up to the same on every rank (`causal_pairs`: 64 tokens on 4 ranks
give [136, 392, 648, 904] contiguous and [520, 520, 520, 520] zigzag).

Decode over a split KV (`split_kv_decode`): each rank attends the same queries over its own share of the KV,
and the partial outputs merge the same way, so each rank reads 1/N of a request's KV.

Ring attention: every rank starts with its own K/V block; at each of N steps it attends its queries to the
block it holds while passing that block on to the next rank and receiving one from the previous, so after N
steps it has seen every block once. The partial results merge by log-sum-exp: a block's output is a softmax
over its keys only, and `merge` reweights two of them by their share of the common denominator. A query row
whose block is entirely in its future has no key at all: its partial output is 0 and its LSE -inf, and the
merge gives it weight 0 without computing `-inf - -inf`.

Shapes: q `[n, heads, D]`, k and v `[m, kv_heads, D]` (grouped-query attention when kv_heads < heads),
positions `[n]` and `[m]` (int64), outputs `[n, heads, D]` and LSE `[n, heads]` (float32 for float32 inputs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
    return [torch.cat([torch.arange(front_at[r], front_at[r] + fronts[r]),
                       torch.arange(back_at[r], back_at[r] + backs[r])]) for r in range(size)]  # fmt: skip


def causal_pairs(split: list[torch.Tensor]) -> list[int]:
    """Each rank's causal attention work: the (query, key) pairs with key <= query its queries attend over."""
    return [int((positions + 1).sum()) for positions in split]


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Causal attention of queries at `q_pos` over one block of keys at `k_pos`: the block's softmax-normalised
    output and each row's LSE. Rows with no visible key give output 0 and LSE -inf."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k.float()) * scale  # [heads, n, m]
    visible = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [n, m]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [heads, n]; -inf where nothing is visible
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(scores.dtype).min))
    out = torch.einsum("hnm,mhd->nhd", probs, v.float())
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Two partial attentions of the same queries over disjoint keys, as one: LSE = log(e^LSE1 + e^LSE2),
    O = O1 e^(LSE1 - LSE) + O2 e^(LSE2 - LSE). A side with LSE -inf weighs 0; both -inf stay 0 and -inf."""
    return merge_all([o1, o2], [lse1, lse2])


def ring_attention_sim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: list[torch.Tensor],
                       scale: float) -> torch.Tensor:  # fmt: skip
    """Causal attention of a whole sequence computed as a CP group of `len(split)` ranks would: each rank's
    queries over the K/V blocks as they come round the ring, merged by LSE; the output in sequence order."""
    size = len(split)
    out = torch.empty_like(q)
    for r, mine in enumerate(split):
        o = lse = None
        for step in range(size):
            held = split[(r - step) % size]  # the block rank r holds at this step
            po, pl = attend_block(q[mine], k[held], v[held], mine, held, scale)
            o, lse = (po, pl) if o is None else merge(o, lse, po, pl)
        out[mine] = o
    return out


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's queries over every rank's K/V in the CP `group`: its own block first, then the others as
    they come round the ring (rank i sends to i+1 and receives from i-1, the next transfer posted before the
    current block is attended, so the two overlap). Blocks may differ in length between ranks (each
    transfer sends its length first). Returns this rank's output and LSE."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt, prev = _global(group, (rank + 1) % size), _global(group, (rank - 1) % size)
    block = (k.contiguous(), v.contiguous(), k_pos.contiguous())
    o = lse = None
    for step in range(size):
        pending = _post_exchange(block, nxt, prev, group) if step < size - 1 else None
        po, pl = attend_block(q, block[0], block[1], q_pos, block[2], scale)
        o, lse = (po, pl) if o is None else merge(o, lse, po, pl)
        if pending is not None:
            block = pending()
    return o, lse


def merge_all(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge` of any number of partial attentions of the same queries over disjoint keys, in one pass:
    weights e^(LSE_i - LSE) with LSE = logsumexp_i LSE_i (rows seen by no part stay 0 and -inf)."""
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = sum(o.float() * torch.exp(part - safe).unsqueeze(-1) for o, part in zip(outs, lses, strict=True))
    return out.to(outs[0].dtype), lse


def split_kv_decode(
    q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor, scale: float,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode over a KV split across the CP `group`: every rank holds the same queries (one per decoding
    request; here one request's) and its own share of the keys; each attends over its share, the partial
    outputs and LSEs are all-gathered and merged, so every rank ends with the full attention (each rank reads
    1/N of the KV). Returns the output and LSE."""
    o, lse = attend_block(q, k, v, q_pos, k_pos, scale)
    size = dist.get_world_size(group)
    outs, lses = [torch.empty_like(o) for _ in range(size)], [torch.empty_like(lse) for _ in range(size)]
    dist.all_gather(outs, o.contiguous(), group=group)
    dist.all_gather(lses, lse.contiguous(), group=group)
    return merge_all(outs, lses)


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _post_exchange(block: tuple[torch.Tensor, ...], nxt: int, prev: int, group):
    """Post the sends of `block` to `nxt` and the receives from `prev`; returns a function that waits and
    gives the received block. Lengths go first (blocks differ in length), then K, V and positions."""
    k, v, pos = block
    n_out = torch.tensor([k.shape[0]], dtype=torch.int64, device=k.device)
    n_in = torch.empty(1, dtype=torch.int64, device=k.device)
    ops = [dist.P2POp(dist.isend, n_out, nxt, group), dist.P2POp(dist.irecv, n_in, prev, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    m = int(n_in)
    k_in, v_in = k.new_empty((m, *k.shape[1:])), v.new_empty((m, *v.shape[1:]))
    pos_in = pos.new_empty(m)
    sends = [(k, k_in), (v, v_in), (pos, pos_in)]
    ops = []
    for t_out, t_in in sends:
        ops += [dist.P2POp(dist.isend, t_out, nxt, group), dist.P2POp(dist.irecv, t_in, prev, group)]
    works = dist.batch_isend_irecv(ops)

    def wait() -> tuple[torch.Tensor, ...]:
        for w in works:
            w.wait()
        return k_in, v_in, pos_in

    return wait
