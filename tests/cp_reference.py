"""Ring attention as the textbook describes it, the reference the CP tests check the engine's against: simulated
in one process (`ring_attention_sim`) or across a real process group (`ring_attention`), and decode over a KV
split across the group (`split_kv_decode`).

Ring attention: every rank starts with its own K/V block; at each of N steps it attends its queries to the
block it holds while passing that block on to the next rank and receiving one from the previous, so after N
steps it has seen every block once; the partial results merge by log-sum-exp (`attention/ring.py`).
Decode over a split KV: each rank attends the same queries over its own share of the KV, and the partial
outputs merge the same way, so each rank reads 1/N of a request's KV.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringsched.attention.ring import attend_block, merge, merge_all


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
