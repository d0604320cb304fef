"""A real server in a subprocess, for tests and scripts: `with ServerProcess([...flags]) as srv: srv.url`.

The server runs in its own session (process group), so that however a test ends, `stop()` can reach every
process it started, stages included: SIGTERM first (the graceful path), then SIGKILL to the whole group and to
every descendant it has seen.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from ringsched.stage.worker import process_name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], api_key: str | None = None, startup_timeout: float = 180.0) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.args = ["--host", "127.0.0.1", "--port", str(self.port), *args]
        if api_key:
            self.args += ["--api-key", api_key]
        self.startup_timeout = startup_timeout
        self.log_path = Path(tempfile.mkstemp(prefix="ringsched-server-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self._seen: dict[int, psutil.Process] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        self.stop()
        if exc_type is None:
            self.log_path.unlink(missing_ok=True)
        else:  # pytest shows this with the failure
            print(f"server log {self.log_path}:\n{self.log()[-5000:]}", file=sys.stderr)

    def start(self) -> None:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ringsched.server.serve_cli", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop(grace=0)
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise RuntimeError(f"the server exited with {code} while starting:\n{self.log()[-3000:]}")
            self.descendants()
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready within {self.startup_timeout:.0f}s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def descendants(self) -> list[psutil.Process]:
        """Live descendants of the server; each one seen is remembered, so `stop()` can kill it if orphaned."""
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        for k in kids:
            self._seen.setdefault(k.pid, k)
        return kids

    def stage_pid(self, rank: int) -> int:
        """The pid of stage `rank`: by process name when stages set one, else from the Supervisor's ready log."""
        for k in self.descendants():
            try:
                if k.name() == process_name(rank):
                    return k.pid
            except psutil.NoSuchProcess:
                continue
        m = re.search(rf"stage {rank} ready: .*\(pid (\d+)\)", self.log())
        if not m:
            raise LookupError(f"no pid for stage {rank} in the server log")
        return int(m.group(1))

    def leftovers(self) -> list[psutil.Process]:
        """Processes this server started that are still running (zombies count as gone)."""
        alive = []
        for p in self._seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        return alive

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM, wait up to `grace` seconds, then SIGKILL everything that is left. Returns the exit code."""
        if self.proc is None:
            return None
        self.descendants()
        if self.proc.poll() is None and grace > 0:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the session: stages and helpers included
        except (ProcessLookupError, PermissionError):
            pass
        for p in self.leftovers():
            p.kill()
        self.proc.wait(10)
        return self.proc.returncode
