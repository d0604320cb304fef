"""A stage keeps its heap: re-allocating a step's buffers must not fault in fresh pages each time."""

import subprocess
import sys

_GROWING_BUFFERS = """
import resource, sys, torch
from ringsched.heap import keep_heap
if sys.argv[1] == "keep":
    assert keep_heap()
torch.ones(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(48):  # each step a little larger than the last, as a growing batch's activations are
    t = torch.ones((1 << 20) + i * (1 << 16), dtype=torch.uint8)
    del t
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _GROWING_BUFFERS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_kept_heap_faults_each_page_once():
    default, kept = _faults("default"), _faults("keep")
    pages_of_largest = ((1 << 20) + 47 * (1 << 16)) // 4096
    # glibc's default maps each growing buffer afresh (~48 buffers' pages); the kept heap maps about the
    # largest once (plus what torch's first calls touch).
    assert kept < 6 * pages_of_largest, (kept, default)
    assert default > 4 * kept, (kept, default)
