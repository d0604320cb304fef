"""`python -m ringsched.plan --node ... --node ...`: the layer split over nodes that are not alike, from each node's
description, as the launcher's measured split (`layout/node_split.py`) would choose it, and the launch lines.

A node is `speed=S` (its layer throughput against the others', 1 the reference) or `layer_ms=T` (a layer's
milliseconds, as a node's launcher logs it when it measures itself), with `memory=16G` (what it gives the model's
weights and KV; default: not limited) and `stages=K` (its stages, default 1). The head (final norm, lm_head,
sampling) is priced on the last node at `head_layers(model)` of its layers, the embedding as free; each stage's
KV is at least one request of `--max-model-len` over its layers.
"""

from __future__ import annotations

import shlex

from ringsched.capacity.memory import kv_bytes_per_token_per_layer, layer_params_per_rank
from ringsched.capacity.presets import CapacityError, ModelSpec
from ringsched.config import ConfigError, parse_memory
from ringsched.layout.node_split import NodeSpec, SplitError, StageBytes, describe, split_over_nodes
from ringsched.layout.partition import head_layers

KEYS = ("speed", "layer_ms", "memory", "stages")


def parse_node(text: str, index: int, head: float) -> tuple[NodeSpec, int]:
    """One `--node` description: its `NodeSpec` (the head priced as if it were the last) and its stage count."""
    try:
        fields = dict(kv.split("=", 1) for kv in text.split(",") if kv.strip())
    except ValueError:
        raise CapacityError(f"--node {text!r}: give key=value pairs, e.g. speed=0.5,memory=8G") from None
    unknown = set(fields) - set(KEYS)
    if unknown or ("speed" in fields) == ("layer_ms" in fields):
        raise CapacityError(
            f"--node {text!r}: give speed=S or layer_ms=T (one of them), optionally memory=BYTES "
            f"and stages=K; {sorted(unknown) or 'speed or layer_ms'} is not understood"
        )
    try:
        ms = float(fields["layer_ms"]) if "layer_ms" in fields else 1.0 / float(fields["speed"])
        memory = parse_memory(fields["memory"], "--node memory") if "memory" in fields else None
        stages = int(fields.get("stages", 1))
    except (ValueError, ZeroDivisionError, ConfigError) as e:
        raise CapacityError(f"--node {text!r}: {e}") from None
    if ms <= 0 or stages < 1 or isinstance(memory, float):
        raise CapacityError(f"--node {text!r}: speed and layer_ms must be positive, stages >= 1, memory in bytes")
    return NodeSpec(index, (ms,) * stages, 0.0, head * ms, memory), stages


def stage_bytes(model: ModelSpec, max_model_len: int) -> StageBytes:
    table = model.vocab_size * model.hidden_size * model.dtype_bytes
    return StageBytes(
        layer_params_per_rank(model, 1) * model.dtype_bytes,
        table,
        table + model.hidden_size * model.dtype_bytes,
        kv_bytes_per_token_per_layer(model) * max_model_len,
    )


def plan_nodes(
    model: ModelSpec, model_arg: str, descriptions: list[str], max_model_len: int, head_addr: str
) -> list[str]:
    """The report lines: each node's figures and layers, the predicted balance, then one launch line per node."""
    head = head_layers(model)
    nodes = [parse_node(d, i, head)[0] for i, d in enumerate(descriptions)]
    nodes = [NodeSpec(n.node, n.layer_ms, 0.0, n.head_ms if n is nodes[-1] else 0.0, n.memory) for n in nodes]
    pp = sum(n.stages for n in nodes)
    if len({n.stages for n in nodes}) > 1:
        raise CapacityError("every node runs the same number of stages (the launcher's --pp-size / --nnodes)")
    weights = stage_bytes(model, max_model_len)
    try:
        counts = split_over_nodes(model.num_layers, nodes, weights)
    except (SplitError, ValueError) as e:
        raise CapacityError(str(e)) from None
    lines = [
        f"{model.name}: {model.num_layers} layers over {len(nodes)} nodes, {pp} stages; the head weighs "
        f"{head:.1f} layers on the last",
        describe(counts, nodes, weights),
        "",
    ]
    flags = [
        "--model",
        model_arg,
        "--pp-size",
        str(pp),
        "--pp-layer-partition",
        ",".join(map(str, counts)),
        "--max-model-len",
        str(max_model_len),
    ]
    base = "python -m ringsched.launch " + " ".join(shlex.quote(f) for f in flags)
    for n in nodes:
        lines.append(f"# node {n.node}" + (" and the OpenAI API" if n.node == 0 else ""))
        lines.append(f"{base} --nnodes {len(nodes)} --node-rank {n.node} --dist-init-addr {head_addr}")
    return lines
