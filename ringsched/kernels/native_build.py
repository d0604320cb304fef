"""Compile a native CPU kernel (a C file next to this one) on first use and cache the shared library.

The build is keyed by the source, the compiler's version, the flags and the CPU's flags (it is built for this
CPU with `-march=native`, and a cache directory may be shared by the nodes of a cluster), and lands in
`$RINGSCHED_CACHE/native/`. Stages start together: one builds (in its own directory, then an atomic rename)
while the others wait on a lock file, then find the library built.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ringsched.cache_dir import cache_dir

BUILD_STEP_TIMEOUT = 120  # seconds for the compile, and again for the link
LOCK_WAIT = 2 * BUILD_STEP_TIMEOUT + 10  # the longest another process's build may keep this one waiting


def load(
    source: Path, compile_flags: list[str], link_flags: list[str], log: logging.Logger, what: str, fallback: str
) -> ctypes.CDLL | None:
    """The library built from `source` and loaded, or None with a warning (`what`: the kernel's job; `fallback`:
    what runs instead) when there is no compiler or the build fails."""
    try:
        return ctypes.CDLL(str(build(source, compile_flags, link_flags)))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        log.warning("%s: native kernel unavailable (%s); %s", what, e, fallback)
        return None


def build(source: Path, compile_flags: list[str], link_flags: list[str]) -> Path:
    """The shared library built from `source` (raises RuntimeError or OSError when it cannot be built)."""
    lib = target(source, compile_flags, link_flags)
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with open(lib.with_name(f".{lib.stem}.lock"), "w") as lock:  # released on close, or when its holder dies
        _wait_for(lock, lib)
        if not lib.exists():
            _compile(_compiler(), source, compile_flags, link_flags, lib)
    return lib


def target(source: Path, compile_flags: list[str], link_flags: list[str]) -> Path:
    """Where the library built from `source` with these flags by this compiler for this CPU is cached."""
    version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    key = hashlib.sha256()
    for part in (
        source.read_bytes(),
        version.encode(),
        " ".join(compile_flags + link_flags).encode(),
        _cpu_flags().encode(),
        platform.machine().encode(),
    ):
        key.update(part)
    return cache_dir() / "native" / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    return cc


def _wait_for(lock, target: Path) -> None:
    """Hold `lock`, waiting at most LOCK_WAIT seconds for another process's build."""
    deadline = time.monotonic() + LOCK_WAIT
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"another process has been building {target.name} for too long") from None
            time.sleep(0.1)


def _compile(cc: str, source: Path, compile_flags: list[str], link_flags: list[str], target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "k.o", Path(tmp) / "k.so"
        for cmd in ([cc, *compile_flags, str(source), "-o", str(obj)], [cc, str(obj), *link_flags, "-o", str(lib)]):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_STEP_TIMEOUT)
            if done.returncode != 0:
                raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, target)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def switched_on(env: str) -> bool:
    """An on/off environment switch, on unless set to 0, false, no or off."""
    return os.environ.get(env, "1").strip().lower() not in ("0", "false", "no", "off")


class NativeLibrary:
    """One native kernel library of this process, decided once on first use (thread-safe): `get()` is
    `prepare(lib)` of the loaded library (its ctypes signatures declared; by default the library itself), or None
    when the `switch` variable is off, one of `needs` (callables of other libraries' `get`) is None, there is no
    compiler or the build failed (a warning names `what` and the `fallback`)."""

    def __init__(
        self,
        source: Path,
        compile_flags: list[str],
        link_flags: list[str],
        log: logging.Logger,
        what: str,
        fallback: str,
        prepare: Callable[[ctypes.CDLL], Any] = lambda lib: lib,
        switch: str | None = None,
        needs: tuple[Callable[[], Any], ...] = (),
    ) -> None:
        self.source, self.compile_flags, self.link_flags, self.log = source, compile_flags, link_flags, log
        self.what, self.fallback, self.prepare, self.switch, self.needs = what, fallback, prepare, switch, needs
        self._lock = threading.Lock()
        self._decided, self._value = False, None

    def get(self) -> Any:
        with self._lock:
            if not self._decided:
                self._value, self._decided = self._load(), True
            return self._value

    def fresh(self) -> NativeLibrary:
        """The same library, undecided (tests change the environment, then decide again)."""
        return NativeLibrary(
            self.source,
            self.compile_flags,
            self.link_flags,
            self.log,
            self.what,
            self.fallback,
            self.prepare,
            self.switch,
            self.needs,
        )

    def _load(self) -> Any:
        if self.switch is not None and not switched_on(self.switch):
            return None
        if any(need() is None for need in self.needs):
            return None
        lib = load(self.source, self.compile_flags, self.link_flags, self.log, self.what, self.fallback)
        return None if lib is None else self.prepare(lib)
