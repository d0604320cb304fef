"""`launch/slurm/ringsched.sbatch`, unchanged, on a real two-node SLURM cluster brought up on this machine.

One slurmctld and two slurmd daemons (`n0`, `n1`) from Debian's `slurm-wlm`, started and stopped here. Both
"nodes" are this host at 127.0.0.1, so the script's own rule (node R listens on PORT+R) is what keeps them
apart. The job runs the smoke path: serve, ask one question, print the answer, stop. Needs root.

Each node declares two CPUs and the cluster binds tasks with `task/affinity` (sched_setaffinity, no cgroups;
`task/none` leaves every task the whole host). A step without `--cpus-per-task` gets both CPUs; the script's
`RINGSCHED_CPUS_PER_TASK=1` (`srun --cpus-per-task=1`: Slurm 22.05's srun does not take it from sbatch) binds
each node's launcher to one CPU, and its stages size their threads from that.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="slurmctld and slurmd run as root here"),
]

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch" / "slurm" / "ringsched.sbatch"
QUESTION = "What is the capital of France?"
READY = re.compile(r"^(\d): .* ready: .*, (\d+) thread\(s\) on CPUs (\S+) \(pid \d+\)$", re.M)


def free_low_ports(n: int, seed: int, width: int = 1) -> list[int]:
    """`n` ports, each starting `width` consecutive free ports, below the kernel's ephemeral range: a port there
    (what `free_port` hands out) can be taken by any outgoing connection (the rendezvous, gloo, the other xdist
    worker's tests) before the daemon or node that was meant to listen on it binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    out: list[int] = []
    for port in random.Random(seed).sample(range(10000, low - width), 400):
        try:
            socks = [socket.socket() for _ in range(width)]
            try:
                for i, sk in enumerate(socks):
                    sk.bind(("0.0.0.0", port + i))
            finally:
                for sk in socks:
                    sk.close()
        except OSError:
            continue
        if all(abs(port - q) >= width for q in out):
            out.append(port)
        if len(out) == n:
            return out
    raise RuntimeError(f"no {n} free ports below the ephemeral range")


def free_port_pair() -> int:
    """A port P with P and P+1 free below the ephemeral range: node 1 listens on P+1."""
    return free_low_ports(1, os.getpid(), width=2)[0]


SLURM_CONF = """\
ClusterName=ringsched-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
MpiDefault=none
SlurmdParameters=config_overrides
MailProg=/bin/true
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/linear
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
StateSaveLocation={d}/state
SlurmctldPidFile={d}/slurmctld.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdSpoolDir={d}/spool/%n
SlurmdPidFile={d}/slurmd-%n.pid
SlurmdLogFile={d}/slurmd-%n.log
NodeName=n0 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n0_port} CPUs=2 State=UNKNOWN
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={n1_port} CPUs=2 State=UNKNOWN
PartitionName=test Nodes=n0,n1 Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """slurmctld plus slurmd `n0` and `n1` on this host, in `d`; `env` is what client commands need."""

    def __init__(self, d: Path) -> None:
        self.d = d
        self.conf = d / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen] = []

    def __enter__(self) -> SlurmCluster:
        for sub in ("state", "spool/n0", "spool/n1"):
            (self.d / sub).mkdir(parents=True)
        host = socket.gethostname().split(".")[0]  # slurmctld insists on `hostname -s`
        ctld, n0, n1 = free_low_ports(3, os.getpid() + 1)  # slurmd binds late: an ephemeral port may be gone
        ports = {"ctld_port": ctld, "n0_port": n0, "n1_port": n1}
        self.conf.write_text(SLURM_CONF.format(host=host, d=self.d, **ports))
        try:
            self._daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
            for node in ("n0", "n1"):
                self._daemon(["slurmd", "-D", "-N", node, "-f", str(self.conf)], f"slurmd-{node}")
            self._wait_idle(30)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _daemon(self, argv: list[str], name: str) -> None:
        with open(self.d / f"{name}.out", "w") as out:
            self.daemons.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env))

    def cmd(self, *argv: str, check: bool = True) -> str:
        r = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=30)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}\n{self.logs()}")
        return r.stdout

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.daemons:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode}\n{self.logs()}")
            states = self.cmd("sinfo", "-h", "-N", "-o", "%N %t", check=False).split()
            if states.count("idle") == 2:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the nodes were not idle within {timeout:.0f}s\n{self.logs()}")

    def logs(self) -> str:
        files = sorted(self.d.glob("*.log"))
        return "\n".join(f"--- {f.name}:\n{f.read_text(errors='replace')[-2000:]}" for f in files)

    def wait_job(self, job: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.cmd("squeue", "-h", "-j", job, check=False).strip():
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} still in the queue after {timeout:.0f}s")
            time.sleep(0.5)

    def close(self) -> None:
        """Cancel every job, stop the daemons by pid, then kill anything a job left behind."""
        if self.daemons and self.daemons[0].poll() is None:
            self.cmd("scancel", "--full", "--user", "root", check=False)
            deadline = time.monotonic() + 15
            while self.cmd("squeue", "-h", check=False).strip() and time.monotonic() < deadline:
                time.sleep(0.2)
        for p in reversed(self.daemons):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.daemons:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for p in psutil.process_iter():  # job steps carry our SLURM_CONF in their environment
            try:
                if p.pid != os.getpid() and p.environ().get("SLURM_CONF") == str(self.conf):
                    p.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue


@pytest.fixture
def cluster(tmp_path) -> SlurmCluster:
    for tool in ("slurmctld", "slurmd", "sbatch", "curl"):
        assert shutil.which(tool), f"{tool} is missing: apt-get install -y slurm-wlm curl (scripts/test.sh does)"
    with SlurmCluster(tmp_path) as c:
        yield c


@pytest.mark.parametrize(
    ("tp", "cpus"),
    [(2, None), (1, 1)],  # TP=1 (with each task bound to one CPU) and tasks left unbound (at TP=2): one job each
    ids=["tp2", "tp1-one-cpu"],
)
def test_sbatch_script_serves_on_two_nodes(cluster, smollm2_dir, tmp_path, tp, cpus):
    """With `cpus`, each node's task is limited to that many CPUs and the stages' threads are left to the launcher
    (no --threads-per-stage): each stage must report one thread on one CPU, where an unbound task has two."""
    out = tmp_path / "job.out"
    threads = "" if cpus else "--threads-per-stage 1 "
    env = {
        "RINGSCHED_PYTHON": sys.executable,
        "RINGSCHED_PP_SIZE": "2",
        "RINGSCHED_TP_SIZE": str(tp),
        "RINGSCHED_PORT": str(free_port_pair()),
        "RINGSCHED_DIST_PORT": str(free_low_ports(1, os.getpid() + 2)[0]),
        "RINGSCHED_EXTRA_ARGS": threads + "--kv-cache-memory 64M --max-model-len 1024",
        "RINGSCHED_READY_TIMEOUT": "120",
        "RINGSCHED_SMOKE_PROMPT": QUESTION,
    }
    submit = ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", f"--output={out}", f"--chdir={REPO}"]
    if cpus:
        env["RINGSCHED_CPUS_PER_TASK"] = str(cpus)
        submit.append(f"--cpus-per-task={cpus}")
    cluster.env.update(env)
    job = cluster.cmd(*submit, str(SCRIPT)).strip().split(";")[0]
    cluster.wait_job(job, timeout=180)

    log = out.read_text(errors="replace")
    state = cluster.cmd("scontrol", "show", "job", job, check=False)
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, f"{state}\n{log}\n{cluster.logs()}"
    assert "0: " in log and "1: " in log, log  # srun --label: both tasks (nodes) printed
    assert f"ringsched: serving smollm2-135m-instruct (2 stages of {tp} ranks on 2 nodes)" in log, log
    answers = [ln for ln in log.splitlines() if ln.startswith("ringsched: answer:")]
    assert answers and "Paris" in answers[0], log
    if cpus:  # each node's launcher logs its stage's "ready: ..., T thread(s) on CPUs C (pid P)"
        ready = READY.findall(log)
        assert sorted(node for node, _, _ in ready) == ["0", "1"], log
        for node, threads, on in ready:
            assert (threads, on.isdigit()) == ("1", True), f"node {node}: {threads} thread(s) on CPUs {on}\n{log}"
