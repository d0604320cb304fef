"""`process/ports.job_ports`: per-job ports under SLURM, the same on every node of a job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ringsched.process.ports import BASE, BLOCK, DEFAULT_PORTS, JOBS, job_ports


def test_no_job_keeps_the_defaults():
    assert job_ports(None) == job_ports("") == job_ports("abc") == DEFAULT_PORTS


def test_jobs_get_disjoint_blocks_below_the_ephemeral_range():
    seen = set()
    for job in range(1000, 1000 + JOBS):
        dist, http = job_ports(job)
        assert http == dist + 1 and BASE <= dist and http + BLOCK - 2 < 32768
        block = set(range(dist, dist + BLOCK))
        assert not block & seen
        seen |= block
    assert job_ports(1000) == job_ports("1000") == job_ports(1000 + JOBS)  # wraps, as a string too


def test_the_module_prints_the_ports_of_slurm_job_id():
    env = {**os.environ, "SLURM_JOB_ID": "4242", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-m", "ringsched.process.ports"], capture_output=True, text=True,
                         env=env, check=True).stdout  # fmt: skip
    assert tuple(map(int, out.split())) == job_ports(4242)
