"""`python -m ringsched.plan`: which TP x PP to serve a model with on a cluster, and why.

    python -m ringsched.plan --model llama-3-70b --gpu h100-sxm-80gb --gpus 16 --gpus-per-node 8

prints, for every TP x PP = --gpus that fits, the weights, KV capacity, traffic, latency, partition and
bubble of that layout, then a one-line recommendation; `--json` prints the rows as a list of objects instead.
With `--node speed=1,memory=16G --node speed=0.5,memory=8G` (nodes not alike) it prints the layer split over those
nodes and each node's launch line instead (`capacity/nodes.py`).
MODEL is a preset or a model directory with a HF config.json; every preset figure can be overridden by a flag.
The arithmetic lives in `ringsched.capacity`; this module only parses arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from ringsched.capacity import GPU_PRESETS, MODEL_PRESETS, CapacityError, ClusterSpec, load_gpu, load_model
from ringsched.capacity.launch_lines import launch_commands
from ringsched.capacity.nodes import plan_nodes
from ringsched.capacity.report import json_rows, text_report
from ringsched.capacity.sweep import make_layouts
from ringsched.layout.partition import head_layers

# flag dest -> ModelSpec / GpuSpec field it overrides
_MODEL_FLAGS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_heads": "num_heads",
    "num_kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "tie_embeddings": "tie_embeddings",
    "dtype_bytes": "dtype_bytes",
}
_GPU_FLAGS = {
    "gpu_memory_gib": "memory_gib",
    "hbm_tb_per_s": "hbm_tb_per_s",
    "intra_node_gb_per_s": "intra_node_gb_per_s",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ringsched.plan",
        description="Capacity and bubble planner: weights, KV, traffic and latency of every TP x PP layout.",
    )
    p.add_argument("--model", required=True, help=f"a preset ({', '.join(MODEL_PRESETS)}) or a model dir")
    p.add_argument("--gpu", help=f"a preset: {', '.join(GPU_PRESETS)} (required without --node)")
    p.add_argument("--gpus", type=int, help="GPUs in all (N = TP x PP; required without --node)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs in one node, one NVLink domain (required without --node)")
    p.add_argument(
        "--node",
        action="append",
        metavar="speed=S|layer_ms=T[,memory=16G][,stages=K]",
        help="nodes that are not alike, one --node each in node order: the layer split their speeds and "
        "memory call for (as --pp-layer-partition auto measures it) and each node's launch line, "
        "instead of the GPU layouts",
    )
    _add_cluster_args(p)
    p.add_argument("--tp", type=int, nargs="+", help="plan only these TP sizes (paired with --pp if given)")
    p.add_argument("--pp", type=int, nargs="+", help="plan only these PP sizes (paired with --tp if given)")
    p.add_argument(
        "--cp",
        type=int,
        nargs="+",
        help="context-parallel sizes to plan as well (TP x PP x CP = --gpus; default 1): each stage's "
        "ranks replicate its weights and split every sequence's KV",
    )
    p.add_argument("--pp-layer-partition", help="layers per stage, e.g. 48,32 (as the server's flag)")
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    p.add_argument(
        "--print-launch",
        action="store_true",
        help="also print the ringsched.launch command for each node of the recommended layout",
    )
    p.add_argument(
        "--dist-init-addr",
        default="$HEAD_ADDR:29500",
        help="HOST:PORT the printed commands rendezvous at (node 0's address)",
    )

    _add_overrides(p)
    return p


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    """The cluster's links and the serving parameters (`ClusterSpec`'s fields beyond its GPUs)."""
    p.add_argument(
        "--inter-node-gbps",
        type=float,
        default=400.0,
        help="inter-node link per GPU per direction, Gb/s (default 400: InfiniBand NDR)",
    )
    p.add_argument("--mem-fraction", type=float, default=0.9, help="share of GPU memory the engine uses")
    p.add_argument("--reserve-gib", type=float, default=3.0, help="GiB per GPU kept for activations, graphs")
    p.add_argument("--max-model-len", type=int, default=8192, help="tokens per sequence, for concurrency")
    p.add_argument("--batch-tokens", type=int, default=64, help="T: tokens per decode step")
    p.add_argument("--in-flight", type=int, default=None, help="M micro-batches in flight (default: PP)")


def _add_overrides(p: argparse.ArgumentParser) -> None:
    """The flags that override a preset's model or GPU figures."""
    m = p.add_argument_group("model overrides")
    for flag in (
        "num-layers",
        "hidden-size",
        "num-heads",
        "num-kv-heads",
        "head-dim",
        "intermediate-size",
        "vocab-size",
    ):
        m.add_argument(f"--{flag}", type=int)
    m.add_argument(
        "--tie-embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether lm_head shares the embedding matrix",
    )
    m.add_argument("--dtype-bytes", type=int, help="bytes per weight and KV element (2 for bf16)")

    g = p.add_argument_group("GPU overrides")
    g.add_argument("--gpu-memory-gib", type=float, help="memory as the device reports it, GiB")
    g.add_argument("--hbm-tb-per-s", type=float, help="HBM bandwidth, TB/s")
    g.add_argument("--intra-node-gb-per-s", type=float, help="GPU-to-GPU link in a node, GB/s per direction")


def _overrides(args: argparse.Namespace, mapping: dict[str, str]) -> dict:
    return {field: getattr(args, dest) for dest, field in mapping.items() if getattr(args, dest) is not None}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.node:
        return _plan_nodes(args)
    missing = [f for f in ("gpu", "gpus", "gpus_per_node") if getattr(args, f) is None]
    if missing:
        parser.error(f"give {', '.join('--' + f.replace('_', '-') for f in missing)} (or describe nodes with --node)")
    try:
        model = dataclasses.replace(load_model(args.model), **_overrides(args, _MODEL_FLAGS))
        gpu = dataclasses.replace(load_gpu(args.gpu), **_overrides(args, _GPU_FLAGS))
        cluster = ClusterSpec(gpu, args.gpus, args.gpus_per_node, **{f: getattr(args, f) for f in _CLUSTER_FLAGS})
        plan = make_layouts(model, cluster, args.tp, args.pp, args.pp_layer_partition, args.cp)
        launch = _launch_lines(args, model, plan) if args.print_launch else []
    except CapacityError as err:
        print(f"ringsched.plan: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(json_rows(plan.rows), indent=2))
    else:
        print(text_report(model, cluster, plan.derivation, plan.rows, plan.skipped, plan.baseline, plan.recommendation))
    if launch:
        print("\n" + "\n".join(launch), file=sys.stderr if args.json else sys.stdout)
    return 0


_CLUSTER_FLAGS = ("inter_node_gbps", "mem_fraction", "reserve_gib", "max_model_len", "batch_tokens", "in_flight")


def _launch_lines(args: argparse.Namespace, model, plan) -> list[str]:
    """`--print-launch`: the recommended layout's command per node. A preset's name is not a model the launcher can
    load: the commands then name a path to fill in, and say so."""
    if plan.recommendation.row is None:
        return []
    preset = not os.path.isdir(args.model)
    lines = launch_commands(
        plan.recommendation.row,
        f"/path/to/{args.model}" if preset else args.model,
        args.gpus_per_node,
        model.dtype_bytes,
        args.max_model_len,
        args.dist_init_addr,
        head_layers(model),
    )
    note = f"# --model: replace /path/to/{args.model} by the model's directory on each node "
    note += f"({args.model} is a planning preset)"
    return [note, *lines] if preset and lines else lines


def _plan_nodes(args: argparse.Namespace) -> int:
    try:
        model = dataclasses.replace(load_model(args.model), **_overrides(args, _MODEL_FLAGS))
        lines = plan_nodes(
            model,
            args.model if os.path.isdir(args.model) else f"/path/to/{args.model}",
            args.node,
            args.max_model_len,
            args.dist_init_addr,
        )
    except CapacityError as err:
        print(f"ringsched.plan: error: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
