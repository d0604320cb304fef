"""A real server in a subprocess: `with ServerProcess([...flags]) as srv: srv.url`. `bench sweep` starts one per
configuration with it; the server tests and scripts/ use it too, which is why it ships in the package.

The server runs in its own session (process group), so that however a test ends, `stop()` can reach every
process it started, stages included: SIGTERM first (the graceful path), then SIGKILL to the whole group and to
every descendant it has seen.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from ringsched.process.ports import free_port
from ringsched.stage.worker import process_name


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
        self.tree: ProcessTree | None = None

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
                [sys.executable, "-m", "ringsched.launch", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.tree = ProcessTree(self.proc.pid)
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
        return self.tree.descendants() if self.tree else []

    def stage_pid(self, rank: int, tp: int | None = None) -> int:
        """The pid of stage `rank` (of its tensor-parallel rank `tp`, with --tp-size > 1): by process name when
        ranks set one, else from the Supervisor's ready log."""
        for k in self.descendants():
            try:
                if k.name() == process_name(rank, tp):
                    return k.pid
            except psutil.NoSuchProcess:
                continue
        where = rf"stage {rank}" if tp is None else rf"stage {rank}, tp {tp}\)"
        m = re.search(rf"{where} ready: .*\(pid (\d+)\)", self.log())
        if not m:
            raise LookupError(f"no pid for {where} in the server log")
        return int(m.group(1))

    def leftovers(self) -> list[psutil.Process]:
        """Processes this server started that are still running (zombies count as gone)."""
        return self.tree.leftovers() if self.tree else []

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
        self.tree.kill()
        self.proc.wait(10)
        return self.proc.returncode


class ProcessTree:
    """The processes under `pid`, remembered as they are seen, so that ones orphaned later can still be found
    and killed: the tests' one process-tree cleanup."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: dict[int, psutil.Process] = {}

    def descendants(self) -> list[psutil.Process]:
        """Live descendants now; each one is remembered."""
        try:
            kids = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        for k in kids:
            self.seen.setdefault(k.pid, k)
        return kids

    def leftovers(self) -> list[psutil.Process]:
        """Processes ever seen that still run (zombies count as gone)."""
        alive = []
        for p in list(self.seen.values()):
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        return alive

    def kill(self) -> None:
        for p in self.leftovers():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
