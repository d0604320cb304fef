"""`python -m ringsched.launch --pp-size N`: start the stages on this node and serve the OpenAI API.

Spawns one process per stage (spawn start method), waits for each to report ready, then serves HTTP on
`--host:--port`. Ctrl-C or SIGTERM stops everything; if a stage dies the server stops with that stage's
error and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import sys

from ringsched.cli_args import add_engine_args, config_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ringsched.launch", description=__doc__.splitlines()[0])
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=None, help="HTTP port (default 30000; health port 30000+node-rank)")
    s.add_argument("--api-key", default=None, help="when set, every endpoint but /health needs this bearer key")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--max-queued-requests", type=int, default=None, help="waiting requests before 503")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds running requests get on SIGTERM")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.port is None:
        args.port = 30000 + max(args.node_rank, 0)  # nodes sharing one host must not collide
    if args.port < 0 or args.port > 65535:
        print(f"error: --port {args.port} is not a port number (0-65535)", file=sys.stderr)
        return 2
    cfg = config_from_args(args, log_level=args.log_level)
    if cfg.node_rank > 0:
        from ringsched.headless import run_headless

        return run_headless(cfg, args.host, args.port, args.log_level)
    from ringsched.rendezvous import RendezvousError
    from ringsched.server.serve import run_server  # the HTTP stack only when serving

    try:
        return run_server(
            cfg,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            served_model_name=args.served_model_name,
            max_queued_requests=args.max_queued_requests,
            shutdown_timeout=args.shutdown_timeout,
            log_level=args.log_level,
        )
    except RendezvousError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
