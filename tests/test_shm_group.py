"""The shared-memory collectives of a stage's CPU ranks, across real processes: sums and gathers equal the
arithmetic done in one place (the same bits on every rank), tensors larger than a slot go through in chunks,
collectives in a row reuse the two banks safely, inside and outside inference mode alike, and a rank that
never arrives is an error naming it within the deadline, not a hang."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import uuid

import pytest
import torch

from ringsched.comm.shm_group import SHM_DIR, ShmCollectives, shm_usable

pytestmark = pytest.mark.skipif(not shm_usable(torch.device("cpu")), reason="shared-memory collectives: x86-64 CPUs")

SLOT = 4096  # small slots: the 10 000-element tensors below take several chunks


def _inputs(rank: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    n = 10_000 if step % 3 == 0 else 1 + step % 7
    return torch.randn(n, generator=g).to(dtype)


def _rank(path: str, rank: int, size: int, steps: int, q) -> None:
    torch.set_num_threads(1)
    shm = ShmCollectives(path, rank, size, timeout=20.0, slot_bytes=SLOT)
    out = []
    for step in range(steps):
        dtype = torch.bfloat16 if step % 2 else torch.float32
        # Inside and outside inference mode in turn, shapes repeating across both (a stage's forward runs in it,
        # its seam's gather does not).
        with torch.inference_mode() if step % 4 < 2 else contextlib.nullcontext():
            t = _inputs(rank, step, dtype)
            summed = shm.all_reduce(t.clone())
            gathered = shm.all_gather_into(t, t.new_empty(size * t.numel()))
        out.append((summed.float().tolist(), gathered.float().tolist()))  # exact: bfloat16 widens losslessly
    q.put((rank, out))


def _segment(size: int) -> str:
    path = os.path.join(SHM_DIR, f"ringsched-test-{uuid.uuid4().hex[:8]}")
    ShmCollectives.create(path, size, slot_bytes=SLOT)
    return path


@pytest.mark.parametrize("size", [2, 3])
def test_sums_and_gathers_match_one_place_arithmetic_on_every_rank(size):
    path, steps = _segment(size), 60
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(path, r, size, steps, q)) for r in range(size)]
    try:
        for p in procs:
            p.start()
        results = {}
        while len(results) < size:  # a rank that raised exits non-zero: fail on it rather than wait
            try:
                rank, out = q.get(timeout=1)
                results[rank] = out
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not failed, f"a rank exited with {failed}"
    finally:
        for p in procs:
            p.join(10)
        os.unlink(path)
    for step in range(steps):
        dtype = torch.bfloat16 if step % 2 else torch.float32
        parts = [_inputs(r, step, dtype) for r in range(size)]
        want = parts[0] + parts[1]
        for extra in parts[2:]:
            want = want + extra
        for r in range(size):
            summed, gathered = results[r][step]
            assert summed == want.float().tolist(), (step, r)
            assert gathered == torch.cat(parts).float().tolist(), (step, r)


def test_a_rank_that_never_arrives_is_named_within_the_deadline():
    path = _segment(2)
    try:
        shm = ShmCollectives(path, 0, 2, timeout=0.5, slot_bytes=SLOT)
        with pytest.raises(RuntimeError, match=r"rank 1 of the stage's group did not reach collective 1 within 0.5s"):
            shm.all_reduce(torch.ones(4))
        shm.close()
    finally:
        os.unlink(path)
