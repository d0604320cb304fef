"""`python -m ringsched.server.serve_cli`: the server from the command line, one flag per `EngineConfig` field.

A thin stand-in for `python -m ringsched.launch` (which takes the same flags and calls `run_server`); the
server tests use it so that they do not depend on the launcher.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ringsched.config import ConfigError, EngineConfig
from ringsched.server.serve import run_server

# EngineConfig fields whose annotation is not a plain type argparse can call.
_TYPES = {"kv_cache_memory": str, "pp_max_micro_batch_size": int, "max_model_len": int, "threads_per_stage": int}
_SKIP = {"ipc_dir", "log_level"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ringsched.server.serve_cli", description=__doc__.splitlines()[0])
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP:
            continue
        kind = _TYPES.get(f.name) or type(f.default)
        p.add_argument("--" + f.name.replace("_", "-"), type=kind if kind is not type(None) else str, default=f.default)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="when set, every endpoint but /health needs this bearer key")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-queued-requests", type=int, help="waiting requests before 503 (default: none)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds running requests get on SIGTERM")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    server = {k: args.pop(k) for k in ("host", "port", "api_key", "served_model_name", "max_queued_requests",
                                       "shutdown_timeout", "log_level")}  # fmt: skip
    try:
        cfg = EngineConfig(**args, log_level=server["log_level"])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_server(cfg, **server)


if __name__ == "__main__":
    sys.exit(main())
