"""`python -m ringsched.server.serve_cli`: the same as `python -m ringsched.launch` (kept for the tests)."""

from __future__ import annotations

import sys

from ringsched.launch import main

if __name__ == "__main__":
    sys.exit(main())
