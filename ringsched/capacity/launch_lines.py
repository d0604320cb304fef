"""`python -m ringsched.plan ... --print-launch`: the `ringsched.launch` command for each node of a layout.

Contract: `launch_commands(row, model, gpus_per_node, ...)` returns the lines to print (one comment and one
command per node), or raises `CapacityError` when ringsched cannot run the layout as planned: a stage's
tensor- or context-parallel group wider than a node (its collectives stay inside one), tensor and context
parallelism in one stage, or stages that do not split evenly over the nodes.
"""

from __future__ import annotations

import shlex

from ringsched.capacity.estimate import LayoutRow
from ringsched.capacity.presets import CapacityError
from ringsched.layout.partition import default_partition


def launch_commands(
    row: LayoutRow,
    model: str,
    gpus_per_node: int,
    dtype_bytes: int,
    max_model_len: int,
    head_addr: str = "$HEAD_ADDR:29500",
    head: float = 0.0,
) -> list[str]:
    """`head`: the model's `parallel.partition.head_layers`, so that a row on the launcher's default split
    prints no `--pp-layer-partition`. `model` goes into the commands as given: pass a directory (or a
    placeholder path) the launcher can load. The KV pool is the plan's KV space per GPU, as bytes: the planner
    has already taken the weights and the activation reserve off."""
    if row.cp > 1 and row.tp > 1:
        raise CapacityError(
            f"--print-launch: TP={row.tp} x PP={row.pp} x CP={row.cp} is planned only: the engine runs a stage either "
            "tensor- or context-parallel for now; plan with --tp 1 or --cp 1 for a command to run"
        )
    stage = row.tp * row.cp  # ranks per stage, on one node
    world = stage * row.pp
    nnodes = max(1, -(-world // gpus_per_node))
    if stage > gpus_per_node:
        what = "tensor-parallel" if row.cp == 1 else "context-parallel"
        raise CapacityError(
            f"{'TP' if row.cp == 1 else 'CP'}={stage} is wider than a node's {gpus_per_node} GPUs: ringsched keeps a "
            f"stage's {what} ranks on one node; plan with --{'tp' if row.cp == 1 else 'cp'} at most --gpus-per-node"
        )
    if row.pp % nnodes or world % nnodes:
        raise CapacityError(
            f"PP={row.pp} stages do not split evenly over {nnodes} nodes: each node runs whole stages; pick a PP "
            f"that is a multiple of {nnodes}"
        )
    flags = ["--model", model, "--tp-size", str(row.tp), "--pp-size", str(row.pp)]
    if row.cp > 1:
        flags += ["--cp-size", str(row.cp)]
    flags += ["--dtype", "bfloat16" if dtype_bytes == 2 else "float32"]
    if list(row.partition) != default_partition(sum(row.partition), row.pp, head):
        flags += ["--pp-layer-partition", ",".join(map(str, row.partition))]
    flags += ["--max-model-len", str(max_model_len), "--kv-cache-memory", f"{int(row.kv_space_per_gpu_gib * 1024)}M"]
    base = "python -m ringsched.launch " + " ".join(shlex.quote(f) for f in flags)
    if nnodes == 1:
        return [f"# one node, {world} GPUs", base]
    lines = []
    per = row.pp // nnodes
    for node in range(nnodes):
        stages = f"stages {node * per}-{(node + 1) * per - 1}" if per > 1 else f"stage {node * per}"
        what = f"{stages}, {per * stage} GPUs" + (" and the OpenAI API" if node == 0 else "")
        lines.append(f"# node {node}: {what}")
        lines.append(f"{base} --nnodes {nnodes} --node-rank {node} --dist-init-addr {head_addr}")
    return lines
