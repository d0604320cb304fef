"""The collectives of one rank among the ranks of its stage (a tensor- or context-parallel group), counted in
calls and bytes for the benchmarks and `/metrics`. Between CPU ranks of one node they run through shared memory
(`comm/shm_group.py`), else through the torch.distributed group of the stage's ranks. `TPGroup`
(`models/tp.py`) and `CPGroup` (`comm/cp_group.py`) add what only their parallelism needs."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringsched.comm.shm_group import ShmCollectives


class StageGroup:
    """`rank` of `size` ranks; `group` their process group; `shm`, where given, carries the collectives.
    `prefix` names the stats (`tp_all_reduces`, `cp_gather_bytes`, ...)."""

    def __init__(self, rank: int, size: int, group, shm: ShmCollectives | None = None, prefix: str = "") -> None:
        self.rank, self.size, self.group, self.shm, self.prefix = rank, size, group, shm, prefix
        self.all_reduces = 0
        self.all_reduce_bytes = 0
        self.gathers = 0
        self.gather_bytes = 0

    def rebind(self, other: StageGroup) -> None:
        """Carry on over `other`'s process group and shared memory (a new generation of the ring, built alike):
        the layers keep this object."""
        self.group, self.shm = other.group, other.shm

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` (contiguous) over the group, in place."""
        if self.shm:
            self.shm.all_reduce(t)
        else:
            dist.all_reduce(t, group=self.group)
        self.all_reduces += 1
        self.all_reduce_bytes += t.numel() * t.element_size()
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """`[size, *t.shape]`: every rank's `t` (the same shape on all), in rank order."""
        return self.gather_into(t, t.new_empty(self.size, *t.shape))

    def gather_into(self, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` straight into `out` (contiguous, `size` times `t`'s elements, rank `r`'s at the
        `r`-th 1/size of it), with no copy after the collective."""
        t = t.contiguous()
        if self.shm:
            self.shm.all_gather_into(t, out)
        else:
            dist.all_gather(list(out.view(-1).chunk(self.size)), t.view(-1), group=self.group)
        self.gathers += 1
        self.gather_bytes += out.numel() * out.element_size()
        return out

    def stats(self) -> dict:
        p = self.prefix
        return {
            f"{p}_all_reduces": self.all_reduces,
            f"{p}_all_reduce_bytes": self.all_reduce_bytes,
            f"{p}_gathers": self.gathers,
            f"{p}_gather_bytes": self.gather_bytes,
            f"{p}_wait_s": self.shm.wait_s if self.shm else 0.0,
        }
