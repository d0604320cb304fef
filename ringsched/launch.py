"""`python -m ringsched.launch --pp-size N`: start the stages on this node and serve the OpenAI API.

Spawns one process per stage (spawn start method), waits for each to report ready, then serves HTTP on
`--host:--port`. Ctrl-C or SIGTERM stops everything; if a stage dies the server stops with that stage's
error and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import sys

from ringsched.process.cli_args import HelpFormatter, add_engine_args, resolve_args
from ringsched.server.serving import DEFAULT_MAX_REQUEST_BYTES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ringsched.launch", description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)  # fmt: skip
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 serves other machines too")
    s.add_argument("--port", type=int, default=None,
                   help="HTTP port (default: 30000; a node other than 0 serves /health on 30000 + node rank)")
    s.add_argument("--api-key", default=None,
                   help="when set, every endpoint but /health needs this bearer key (default: none, no key)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name requests must use (default: smollm2-135m-instruct for the default model, "
                   "else the model directory's name)")
    s.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests that may wait beyond --max-running-requests; more get 503 with Retry-After "
                   "(default: no limit)")
    s.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted; larger ones get 413; raise it for very long prompts")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM or Ctrl-C")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="warning silences the startup and throughput lines; debug adds the access log")
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.port is None:
        args.port = 30000 + max(args.node_rank, 0)  # nodes sharing one host must not collide
    problem = _server_arg_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    cfg, spec = resolve_args(args, log_level=args.log_level)
    if cfg.node_rank > 0:
        from ringsched.process.headless import run_headless

        return run_headless(cfg, spec, args.host, args.port, args.log_level)
    from ringsched.process.rendezvous import RendezvousError
    from ringsched.server.serve import run_server  # the HTTP stack only when serving

    try:
        return run_server(
            cfg,
            spec,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            served_model_name=args.served_model_name,
            max_queued_requests=args.max_queued_requests,
            shutdown_timeout=args.shutdown_timeout,
            log_level=args.log_level,
            max_request_bytes=args.max_request_bytes,
        )
    except RendezvousError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _server_arg_problem(args: argparse.Namespace) -> str | None:
    if not 0 <= args.port <= 65535:
        return f"--port {args.port} is not a port number (0-65535)"
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        return f"--max-queued-requests must be >= 0 (or left out for no limit), got {args.max_queued_requests}"
    if args.shutdown_timeout < 0:
        return f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}"
    if args.max_request_bytes < 1024:
        return f"--max-request-bytes must be at least 1024 (bytes), got {args.max_request_bytes}"
    return None


if __name__ == "__main__":
    sys.exit(main())
