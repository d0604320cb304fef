"""The chat templates real model families ship, for tests: taken from the `llama-cpp-python` source package on PyPI
(llama.cpp keeps the templates of the models it supports, word for word, under `models/templates/`), once, into
the cache. Nothing here downloads from a model hub."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ringsched.cache_dir import cache_dir

SDIST = "llama-cpp-python==0.3.36"
FILES = {
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "llama3.1": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "mistral": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
}


def real_template(family: str) -> Path:
    """The path of `family`'s chat template (a key of `FILES`)."""
    where = cache_dir() / "tests" / f"templates-{SDIST.replace('==', '-')}"
    where.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{where}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one test worker fetches while the others wait
        if not where.exists():
            _fetch(where)
    return where / FILES[family]


def _fetch(where: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "--dest", tmp, SDIST], check=True, timeout=600)  # fmt: skip
        (archive,) = Path(tmp).glob("*.tar.gz")
        partial = Path(f"{where}.partial")
        partial.mkdir(exist_ok=True)
        with tarfile.open(archive) as tar:
            for m in tar.getmembers():
                if m.isfile() and Path(m.name).name in FILES.values() and "/models/templates/" in m.name:
                    (partial / Path(m.name).name).write_bytes(tar.extractfile(m).read())
        missing = set(FILES.values()) - {p.name for p in partial.iterdir()}
        assert not missing, f"{SDIST} has no {sorted(missing)}"
        partial.rename(where)
