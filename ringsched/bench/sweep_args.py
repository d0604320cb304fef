"""`bench sweep`'s flags (`add_sweep_args`); `sweep.py` runs what they ask for."""

from __future__ import annotations

import argparse

from ringsched.config import DEFAULT_MODEL

DEFAULT_OUT_DIR = "bench-sweep"


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--config",
        action="append",
        metavar="KEY=VALUE,...",
        help="one server configuration (repeatable); keys pp, tp (--tp-size), threads (per rank), depth, "
        "partition (16:14 or auto), flex (--pp-flex-layers), policy (--pp-flex-policy), dtype, running, "
        "mbs; e.g. --config pp=2,threads=1 --config tp=2,threads=1",
    )
    add("--model", default=DEFAULT_MODEL, help=f"model directory or known name (default {DEFAULT_MODEL})")
    add(
        "--server-args",
        default="",
        help='more launcher flags for every server, e.g. --server-args="--kv-cache-memory 2G"',
    )
    add("--rates", default=None, help="finite request rates to try in order, e.g. 0.25,0.5,1,2 (else a ladder)")
    add("--min-rate", type=float, default=1.0, help="first rate of the automatic ladder (requests/s)")
    add("--rate-factor", type=float, default=2.0, help="each automatic rung multiplies the rate by this")
    add(
        "--saturation-threshold",
        type=float,
        default=0.05,
        help="stop the finite rungs when output throughput grew by less than this fraction",
    )
    add("--max-rungs", type=int, default=8, help="most finite rungs per configuration (the inf rung is extra)")
    add("--num-prompts", type=int, default=64, help="requests per rung")
    add("--random-input-len", type=int, default=128)
    add("--random-output-len", type=int, default=128)
    add("--random-range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)]")
    add("--random-vocab-size", type=int, default=None, help="prompt ids below this (default min(10000, model's))")
    add("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1.0 is Poisson)")
    add(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the output length (default on, so every rung does the same work)",
    )
    add("--seed", type=int, default=0)
    add("--warmup-prompts", type=int, default=4, help="requests sent to each new server before the first rung")
    add("--startup-timeout", type=float, default=300.0, help="seconds a server gets to become healthy")
    add(
        "--out-dir",
        default=None,
        help=f"where the results go (default {DEFAULT_OUT_DIR}/; with --from-json, the JSON file's folder)",
    )
    add("--from-json", default=None, metavar="FILE", help="only rewrite sweep.md and the plots from a sweep.json")
