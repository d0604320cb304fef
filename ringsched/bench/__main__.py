"""`python -m ringsched.bench {offline,serve,cores}`: the offline engine, a running server, or the CPUs."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ringsched.bench")
    sub = p.add_subparsers(dest="command", required=True)
    from ringsched.bench.offline import add_offline_args

    add_offline_args(sub.add_parser("offline", help="saturate the offline engine (no HTTP)"))
    from ringsched.bench.cores import add_cores_args

    add_cores_args(sub.add_parser("cores", help="how much parallel compute this machine's CPUs give"))
    serve = sub.add_parser("serve", help="benchmark an OpenAI-compatible server, like `vllm bench serve`")
    try:
        from ringsched.bench.serve import add_serve_args
    except ImportError as e:  # aiohttp/tqdm come with the `bench` and `dev` extras
        print(f"error: {e}", file=sys.stderr)
        return 2
    add_serve_args(serve)
    args = p.parse_args(argv)
    if args.command == "cores":
        from ringsched.bench.cores import run_cores

        run_cores(args)
    elif args.command == "offline":
        from ringsched.bench.offline import run_offline

        run_offline(args)
    else:
        from ringsched.bench.serve import run_serve

        run_serve(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
