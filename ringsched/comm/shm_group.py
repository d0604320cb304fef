"""All-reduce and all-gather between the CPU ranks of one stage through shared memory.

Why: a stage's tensor-parallel ranks run two all-reduces per layer, and gloo's take 1.6 ms for SmolLM2's
2.3 KB decode row on this machine (TCP over loopback; 61 of them per token against a 39 ms step). Here each
rank copies its part into its own slot of a shared segment, publishes a sequence number, waits for every other
rank's, and reads the others' slots: a few microseconds of copies plus the wait for the slowest rank.

The segment: one 64-byte line per rank holding the number of the last collective whose data it has written,
then two banks of one `slot_bytes` slot per rank, used alternately. A rank writes collective `k` into bank
`k % 2` only after collective `k - 1` completed on every rank (it waited for their numbers), and every rank
finished reading collective `k - 2` before publishing `k - 1`: two banks suffice. Larger tensors go through in
slot-sized chunks, one collective each. Every rank sums the slots in rank order, so all hold the same bits.

x86-64 only (its stores become visible in program order: the data before the number); elsewhere, and on GPUs,
the process group's collectives are used.
"""

from __future__ import annotations

import mmap
import os
import platform
import time

import numpy as np
import torch

LINE = 64  # bytes per rank's sequence number: its own cache line
SLOT_BYTES = 4 * 2**20
SHM_DIR = "/dev/shm"


def shm_usable(device: torch.device) -> bool:
    return device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


def segment_bytes(size: int, slot_bytes: int = SLOT_BYTES) -> int:
    return size * LINE + 2 * size * slot_bytes


class ShmCollectives:
    """One rank's end of the segment at `path` (created, zeroed, by `create`; the others `attach`)."""

    def __init__(
        self, path: str, rank: int, size: int, timeout: float, slot_bytes: int = SLOT_BYTES, abort=None
    ) -> None:
        """`abort`, if given, is called now and then while waiting for another rank and may raise to stop."""
        self.rank, self.size, self.timeout, self.slot_bytes, self.abort = rank, size, timeout, slot_bytes, abort
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, segment_bytes(size, slot_bytes))
        finally:
            os.close(fd)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self._seq = np.frombuffer(self._map, dtype=np.int64, count=size * LINE // 8)[:: LINE // 8]
        data = raw[size * LINE :]
        self._slots = [
            [data[(b * size + r) * slot_bytes : (b * size + r + 1) * slot_bytes] for r in range(size)] for b in range(2)
        ]
        self.done = int(self._seq[rank])  # collectives completed (all ranks agree)
        self._views: dict[tuple, list[torch.Tensor]] = {}
        self.wait_s = 0.0  # seconds spent waiting for the other ranks (how unevenly the ranks' work is split)

    @staticmethod
    def create(path: str, size: int, slot_bytes: int = SLOT_BYTES) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, segment_bytes(size, slot_bytes))  # a new file reads as zeros
        finally:
            os.close(fd)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` (contiguous) over the ranks, in place."""
        flat = t.view(-1)
        step = self.slot_bytes // t.element_size()
        for start in range(0, flat.numel(), step):
            part = flat[start : start + step]
            views = self._exchange(part)
            torch.add(views[0], views[1], out=part)
            for v in views[2:]:
                part.add_(v)
        return t

    def all_gather_into(self, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (the same shape on all), rank after rank, into the flat `out` (`size * t.numel()`)."""
        flat, dst = t.reshape(-1), out.view(-1)
        n_all = flat.numel()
        step = self.slot_bytes // t.element_size()
        for start in range(0, n_all, step):
            part = flat[start : start + step]
            n = part.numel()
            for r, v in enumerate(self._exchange(part)):
                dst[r * n_all + start : r * n_all + start + n].copy_(v)
        return out

    def _exchange(self, part: torch.Tensor) -> list[torch.Tensor]:
        """Write `part` into this rank's slot of the next collective, publish it, wait for every rank's: the
        slots of that collective as tensors like `part` (read them before the next `_exchange`)."""
        k = self.done + 1
        key = (k % 2, part.dtype, part.numel())
        views = self._views.get(key)
        if views is None:  # decode steps repeat a handful of shapes: their views are made once
            nbytes = part.numel() * part.element_size()
            # Plain tensors, even when first made inside the forward's inference mode: the same views serve
            # collectives outside it (the seam's all-gather), where writing an inference tensor is refused.
            with torch.inference_mode(False):
                views = self._views[key] = [s[:nbytes].view(part.dtype) for s in self._slots[k % 2]]
        views[self.rank].copy_(part)
        self._seq[self.rank] = k
        self._wait(k)
        self.done = k
        return views

    def _wait(self, k: int) -> None:
        seq = self._seq
        if all(seq[r] >= k for r in range(self.size)):
            return
        t0 = time.perf_counter()
        self._spin(k)
        self.wait_s += time.perf_counter() - t0

    def _spin(self, k: int) -> None:
        seq, spins, deadline = self._seq, 0, None
        for r in range(self.size):
            while seq[r] < k:
                spins += 1
                if spins > 64:  # another rank is still computing: give its core back (ranks may share cores)
                    os.sched_yield()
                if spins % 4096 == 0:
                    if self.abort is not None:
                        self.abort()  # raises when the rank is asked to leave its generation of the ring
                    now = time.monotonic()
                    deadline = deadline or now + self.timeout
                    if now > deadline:
                        raise RuntimeError(
                            f"rank {r} of the stage's group did not reach collective {k} within {self.timeout:g}s "
                            "(--stage-timeout)"
                        )

    def close(self) -> None:
        self._slots, self._views = [], {}
        self._seq = None
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with the process
            pass
