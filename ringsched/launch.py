"""`python -m ringsched.launch --pp-size N`: start the stages on this node and serve the OpenAI API.

Spawns one process per stage (spawn start method), waits for each to report ready, then serves HTTP on
`--host:--port`. Ctrl-C or SIGTERM stops everything; if a stage dies the server stops with that stage's
error and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ringsched.config import ConfigError
from ringsched.process.cli_args import HelpFormatter, add_engine_args, add_flags, resolve_args
from ringsched.server.options import SERVER_FLAGS, ServerOptions


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ringsched.launch", description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    add_engine_args(p)
    add_flags(p, list(dataclasses.fields(ServerOptions)))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.port is None:
        args.port = 30000 + max(args.node_rank, 0)  # nodes sharing one host must not collide
    try:
        opts = ServerOptions(**{k: getattr(args, k) for k in SERVER_FLAGS})
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg, spec = resolve_args(args, log_level=opts.log_level)
    if cfg.node_rank > 0:
        from ringsched.process.headless import run_headless

        return run_headless(cfg, spec, opts.host, opts.port, opts.log_level)
    from ringsched.process.rendezvous import RendezvousError
    from ringsched.server.serve import PortInUse, run_server  # the HTTP stack only when serving

    try:
        return run_server(cfg, spec, opts)
    except (RendezvousError, PortInUse) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
