"""Ports for a batch job, derived from its id, so two jobs that share a node (or a head) do not collide on the
defaults (29500 for the rendezvous, 30000 for HTTP), and every node of a job derives the same ones.

`python -m ringsched.process.ports` prints `DIST_PORT HTTP_PORT` for `$SLURM_JOB_ID` (the defaults without
one); `launch/slurm/ringsched.sbatch` uses it unless RINGSCHED_DIST_PORT / RINGSCHED_PORT are set.
"""

from __future__ import annotations

import os
import socket
import sys

DEFAULT_PORTS = (29500, 30000)
BASE = 20000  # below every common ephemeral range (Linux starts at 32768), above the well-known services
BLOCK = 20  # ports per job: the rendezvous, then HTTP on node 0 and /health on node R at HTTP + R (R < 19)
JOBS = 600  # job ids wrap after this many: BASE + JOBS x BLOCK = 32000


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS has free now (it may be taken again before it is bound: for one machine's tests and tools)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def job_ports(job_id: str | int | None) -> tuple[int, int]:
    """(rendezvous port, HTTP port of node 0) for a job id; the defaults when there is no job id."""
    if job_id is None or not str(job_id).strip().isdigit():
        return DEFAULT_PORTS
    first = BASE + int(job_id) % JOBS * BLOCK
    return first, first + 1


if __name__ == "__main__":
    dist, http = job_ports(os.environ.get("SLURM_JOB_ID"))
    print(dist, http)
    sys.exit(0)
