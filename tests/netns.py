"""Hosts with their own addresses on one machine, for tests: Linux network namespaces joined by veth links.

    with NetHosts(2, log_dir) as net:               # needs root
        net.hosts[0].ip                             # "10.83.17.1"; host 1 is .2, one /24
        srv = net.spawn(0, [sys.executable, "-m", "http.server"], "web")
        net.run(1, ["curl", f"http://{net.hosts[0].ip}:8000/"])
        net.cut(1)                                  # `ip link set eth0 down` in host 1: the cable is pulled
        net.kill_host(1)                            # SIGKILL every process in host 1: the machine died

Two hosts share one veth pair; more hang off a bridge in a switch namespace. Each namespace has only `lo` and
`eth0`, so a host reaches the others and nothing else (no route to the root namespace or the internet).

Cleanup is guaranteed however the block ends: every process started with `spawn` (its whole tree, by session
and by every descendant seen), then anything else still inside a namespace (`ip netns pids`), then the
namespaces themselves. Names carry the creating pid, so namespaces left by a test process that was SIGKILLed
are swept the next time `NetHosts` is used.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from ringsched.bench.server_process import ProcessTree

PREFIX = "rs"  # namespace names: rs<pid>-<hex>-<host index>
DEV = "eth0"


def netns_unavailable() -> str | None:
    """Why these tests cannot run here (not root, no `ip netns`), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ip(*args: str) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")
    return r.stdout


def netns_pids(ns: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def sweep_stale() -> None:
    """Delete namespaces left by test processes that no longer exist."""
    for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        owner = name[len(PREFIX) :].split("-")[0]
        if name.startswith(PREFIX) and owner.isdigit() and not psutil.pid_exists(int(owner)):
            for pid in netns_pids(name):
                _kill(pid)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


@dataclass(frozen=True)
class Host:
    index: int
    ns: str  # the namespace's name
    ip: str  # eth0's address
    dev: str = DEV


class NsProcess:
    """One command in a namespace, in its own session, with stdout and stderr in `log_path`."""

    def __init__(self, host: Host, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.host, self.argv, self.log_path = host, argv, log_path
        with open(log_path, "w") as log:
            # `ip netns exec` enters the namespace and execs the command: the pid is the command's own.
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", host.ns, *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.tree = ProcessTree(self.proc.pid)
        self.descendants()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def poll(self) -> int | None:
        self.descendants()
        return self.proc.poll()

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if still running after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.poll() is not None:
                return self.proc.returncode
            time.sleep(0.1)
        return self.poll()

    def descendants(self) -> list[psutil.Process]:
        """Live descendants; each one seen is remembered so that `kill()` reaches it even once orphaned."""
        return self.tree.descendants()

    def leftovers(self) -> list[psutil.Process]:
        """Processes of this tree still running (zombies count as gone)."""
        return self.tree.leftovers()

    def tree_gone(self) -> bool:
        return self.poll() is not None and not self.leftovers()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the session and every descendant seen, then reap."""
        self.descendants()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in self.leftovers():
            _kill(p.pid)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM, up to `grace` seconds, then `kill()`. Returns the exit code."""
        self.signal(signal.SIGTERM)
        self.wait(grace)
        self.kill()
        return self.proc.returncode


class NetHosts:
    def __init__(self, n: int, log_dir: Path) -> None:
        if n < 2:
            raise ValueError(f"NetHosts needs at least 2 hosts, got {n}")
        self.n, self.log_dir = n, Path(log_dir)
        tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        net = f"10.{random.randint(64, 250)}.{random.randint(0, 255)}"
        self.hosts = [Host(i, f"{tag}-{i}", f"{net}.{i + 1}") for i in range(n)]
        self.switch = f"{tag}-sw" if n > 2 else None
        self.procs: list[NsProcess] = []
        self._made: list[str] = []

    def __enter__(self) -> NetHosts:
        sweep_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        for name in [h.ns for h in self.hosts] + ([self.switch] if self.switch else []):
            ip("netns", "add", name)
            self._made.append(name)
            ip("-n", name, "link", "set", "lo", "up")
        if self.switch is None:
            a, b = self.hosts
            ip("link", "add", DEV, "netns", a.ns, "type", "veth", "peer", "name", DEV, "netns", b.ns)
        else:
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            for h in self.hosts:
                port = f"h{h.index}"
                ip("link", "add", DEV, "netns", h.ns, "type", "veth", "peer", "name", port, "netns", self.switch)
                ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        for h in self.hosts:
            ip("-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", DEV)
            ip("-n", h.ns, "link", "set", DEV, "up")

    def env(self) -> dict[str, str]:
        """The environment for processes in a namespace: no proxy (nothing outside is reachable), unbuffered."""
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        return {**env, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}

    def spawn(self, i: int, argv: list[str], name: str) -> NsProcess:
        """Start `argv` in host `i`, logging to `<log_dir>/<name>.log`; it is killed when the block ends."""
        p = NsProcess(self.hosts[i], argv, self.log_dir / f"{name}.log", env=self.env())
        self.procs.append(p)
        return p

    def run(self, i: int, argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run a short command in host `i` and return its output (text)."""
        cmd = ["ip", "netns", "exec", self.hosts[i].ns, *argv]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env())

    def cut(self, i: int) -> None:
        """Pull host `i`'s cable: its link goes down, packets to and from it are dropped without a reset."""
        ip("-n", self.hosts[i].ns, "link", "set", DEV, "down")

    def heal(self, i: int) -> None:
        """Plug host `i`'s cable back in (`cut` undone)."""
        ip("-n", self.hosts[i].ns, "link", "set", DEV, "up")

    def pids(self, i: int) -> list[int]:
        return netns_pids(self.hosts[i].ns)

    def kill_host(self, i: int) -> None:
        """SIGKILL every process in host `i`, as if the machine lost power."""
        for pid in self.pids(i):
            _kill(pid)

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        for name in self._made:
            for pid in netns_pids(name):
                _kill(pid)
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()
