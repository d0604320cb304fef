"""Keep a stage's freed memory in its heap instead of handing it back to the kernel every step.

Measured on stage 0 of a 2-stage SmolLM2 ring on CPU (strace, /proc/PID/stat): glibc's default malloc gave
the top of the heap back (`brk`) about 100 times a second and grew it again the next micro-batch, so every
step's activations landed on freshly mapped pages: 33 million minor page faults and ~13% of the stage's time
in the kernel zeroing pages, against 1.4 million on stage 1. A stage's working set is the same every step, so
it keeps the heap at its high-water mark (no trimming) and serves every tensor up to the largest mmap
threshold glibc allows (32 MiB) from that heap. Peak memory is unchanged: it is the high-water mark either way.

MKL, torch's BLAS on x86, has its own pool on top of malloc ("fast memory management"): the packing buffers
of each matrix multiply's shape are kept for the life of the process. A stage sees many shapes (every
micro-batch's row count, the head's logit rows), so the pool only grows: measured on stage 1 of a 2-stage
SmolLM2 ring, 53 MiB of its heap and 60 MiB of other mappings were MKL's, and `F.linear` over 92 row counts
of an 8192 x 576 weight kept 66 MiB. Stages run with that pool off (`MKL_DISABLE_FAST_MM=1`); MKL then
takes its buffers from malloc, which the kept heap serves without faults. Same throughput, measured (PP=2
`[17, 13]`, two runs each way, alternating: 215.1, 224.5 tok/s with the pool against 215.2, 239.3 without).

bfloat16 matmuls on CPU go through oneDNN (not MKL), which keeps a primitive per shape in two caches of 1024
entries each (oneDNN's own and ideep's, torch's wrapper), and a stage sees a new row count at every ramp and
tail of its micro-batches: measured, `F.linear` over 128 row counts of SmolLM2's four layer shapes kept 323
MiB, and a bfloat16 PP=2 ring's stages grew by ~90 MiB in the last seconds of a run, as its micro-batches
shrank, to 357-503 MiB above weights + KV. Stages cap both caches at 16 entries: three row counts of a
layer's five weight shapes, so two micro-batches of different sizes keep theirs (at 8 they evict each other
every step: measured, matmuls ~15% slower than at 16 or 32 with two alternating row counts). At 32 a bfloat16
ring's stages were 289-329 MiB above weights + KV (357-526 without a cap), and 307 on an AMX host; at 16 on
that host 285-301, at the same throughput (docs/performance.md). float32 (MKL) does not
use these caches.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2)
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int: its largest value

# Read when first used (MKL's pool; oneDNN's and ideep's caches, the bfloat16 matmuls' path on CPU), so they
# must be in a stage's environment from its start. See the module docstring.
STAGE_ALLOCATOR_ENV = {
    "MKL_DISABLE_FAST_MM": "1",
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16",
    "LRU_CACHE_CAPACITY": "16",
}


@contextmanager
def stage_allocator_env() -> Iterator[None]:
    """Processes started inside inherit `STAGE_ALLOCATOR_ENV` (a value the user set is kept); the caller's
    own environment is restored after."""
    added = {k: v for k, v in STAGE_ALLOCATOR_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def keep_heap(top_pad: int = 64 * 2**20) -> bool:
    """Tune glibc malloc for a steady working set; returns False (and changes nothing) without glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX),
            (_M_TRIM_THRESHOLD, _NEVER_TRIM),
            (_M_TOP_PAD, top_pad),
        )
    )
    if not ok:
        logger.warning("mallopt refused a setting: the stage's heap keeps glibc's defaults")
    return ok
