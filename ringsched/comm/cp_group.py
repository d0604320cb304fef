"""One rank's context-parallel group inside its stage: the collectives its attention runs (through shared
memory between CPU ranks of a node, else the process group's) and the ring's point-to-point exchange (always
the process group's `isend`/`irecv`, posted before the attention it overlaps)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ringsched.comm.shm_group import ShmCollectives
from ringsched.comm.stage_group import StageGroup


class CPGroup(StageGroup):
    """`rank` of `size` CP ranks of a stage; `ranks` their global ranks in CP order; `group` their process group;
    `shm`, where given, carries the collectives (`StageGroup`); the ring's exchange is this class's own."""

    def __init__(self, rank: int, ranks: tuple[int, ...], group, shm: ShmCollectives | None = None) -> None:
        super().__init__(rank, len(ranks), group, shm, prefix="cp")
        self.ranks = ranks
        self.ring_bytes = 0  # K/V bytes this rank sent round the ring

    def exchange(self, send: list[torch.Tensor], recv_shape: tuple[int, ...]) -> Callable[[], list[torch.Tensor]]:
        """Post the ring step: the tensors `send` to the next rank, as many tensors of `recv_shape` (and dtype) from
        the previous one. Returns a function that waits for all and gives the received tensors (`send` stays
        referenced until then)."""
        nxt, prev = self.ranks[(self.rank + 1) % self.size], self.ranks[(self.rank - 1) % self.size]
        send = [t.contiguous() for t in send]
        recv = [t.new_empty(recv_shape) for t in send]
        # One batch: with NCCL, separate sends queued before the receives would wait on each other between the two
        # ranks of CP=2 (each other's next and previous) once a block outgrows NCCL's buffers.
        ops = [dist.P2POp(dist.isend, t, nxt, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, prev, self.group) for t in recv]
        works = dist.batch_isend_irecv(ops)
        self.ring_bytes += sum(t.numel() * t.element_size() for t in send)

        def wait() -> list[torch.Tensor]:
            for w in works:
                w.wait()
            send.clear()
            return recv

        return wait

    def stats(self) -> dict:
        return {**super().stats(), "cp_ring_bytes": self.ring_bytes}
