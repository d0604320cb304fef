"""Where ringsched keeps what it makes or fetches once: models, built kernels, linear-layer timings."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$RINGSCHED_CACHE`, or `~/.cache/ringsched`."""
    return Path(os.environ.get("RINGSCHED_CACHE") or Path.home() / ".cache" / "ringsched")
