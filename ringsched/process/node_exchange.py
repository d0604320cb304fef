"""The layer split over nodes that are not alike, decided at the rendezvous.

With `--pp-layer-partition auto` across nodes, or with no partition given when the nodes differ (their hardware
as `node_measure.hardware` describes it, or a node's memory short of its share of the default split), every
node's launcher times its own stages (`node_measure.measure_node`: a layer on each stage's cores, the embedding
and the head, with its own threads and dtype) and publishes them with its memory in the store; node 0 chooses the
split whose slowest stage is fastest within each node's memory (`layout.node_split.split_over_nodes`), logs each
node's figures and the predicted balance, and publishes the counts, or the shortfall per node when the nodes
together cannot hold the model, which every launcher then raises before any stage starts. Identical nodes with no
partition given keep the default split and measure nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

from ringsched.comm.store import RendezvousError
from ringsched.config import EngineConfig
from ringsched.layout.node_split import NodeSpec, SplitError, describe, split_over_nodes
from ringsched.layout.partition import DEFAULT_SOURCE, partition_source
from ringsched.process.node_measure import measure_node, stage_bytes
from ringsched.spec import ModelSpec

logger = logging.getLogger("ringsched.launch")


def split_mode(cfg: EngineConfig) -> str:
    """How this node was told to split the layers: "auto", "given" (the flag or the environment) or "default"."""
    if cfg.auto_partition:
        return "auto"
    return "default" if partition_source(cfg.pp_layer_partition) == DEFAULT_SOURCE else "given"


def why_measure(cfg: EngineConfig, spec: ModelSpec, metas: list[dict], default: list[int]) -> str | None:
    """Why the nodes measure themselves for the split (None: they keep `default`, or the split given), as node 0
    was told (`metas[0]["split"]`): every node decides alike from what all of them published."""
    mode = metas[0]["split"] if metas else "given"
    if cfg.nnodes == 1 or mode == "given":
        return None
    if mode == "auto":
        return "--pp-layer-partition auto"
    plain = [{k: v for k, v in m["hardware"].items() if k != "memory"} for m in metas]
    for m, hw in zip(metas, plain, strict=True):
        if hw != plain[0]:
            return f"node {m['node']} differs from node 0 ({hw} against {plain[0]})"
    weights, spn, pp = stage_bytes(cfg, spec), cfg.stages_per_node, cfg.pp_size
    for m in metas:
        stages = range(m["node"] * spn, (m["node"] + 1) * spn)
        need = sum(weights.need(k, pp, default[k]) for k in stages)
        memory = m["hardware"]["memory"]
        if memory is not None and need > memory:
            return f"node {m['node']} has {memory / 2**30:.2f} GiB, short of the default split's {need / 2**30:.2f}"
    return None


def settle_split(store, cfg: EngineConfig, spec: ModelSpec, reason: str) -> list[int]:
    """Measure this node, publish it, and return the split node 0 decides from every node's figures."""
    t0 = time.monotonic()
    mine = measure_node(cfg, spec)
    store.set(f"measured/{cfg.node_rank}", json.dumps(dataclasses.asdict(mine)))
    logger.info(
        "layer split over nodes (%s): node %d measured itself in %.1fs: layer %s ms, embedding %.2f ms, "
        "head %.2f ms, memory %s",
        reason,
        cfg.node_rank,
        time.monotonic() - t0,
        [round(ms, 2) for ms in mine.layer_ms],
        mine.embed_ms,
        mine.head_ms,
        "not limited" if mine.memory is None else f"{mine.memory / 2**30:.2f} GiB",
    )
    if cfg.node_rank == 0:
        nodes = [
            NodeSpec(**_spec(json.loads(v))) for v in _wait(store, cfg, [f"measured/{n}" for n in range(cfg.nnodes)])
        ]
        weights = stage_bytes(cfg, spec)
        try:
            counts = split_over_nodes(spec.config.num_layers, nodes, weights)
        except SplitError as e:
            store.set("split", json.dumps({"error": str(e)}))
            _acknowledged(store, cfg.nnodes)  # the store goes with this launcher: let every node read why first
            raise RendezvousError(str(e)) from None
        store.set("split", json.dumps({"counts": counts}))
        logger.info("layer split over nodes: %s\n%s", ",".join(map(str, counts)), describe(counts, nodes, weights))
        return counts
    decided = json.loads(_wait(store, cfg, ["split"])[0])
    store.set(f"split-read/{cfg.node_rank}", "1")
    if "error" in decided:
        raise RendezvousError(decided["error"])
    logger.info("layer split over nodes from node 0: %s", ",".join(map(str, decided["counts"])))
    return decided["counts"]


def _spec(d: dict) -> dict:
    return {**d, "layer_ms": tuple(d["layer_ms"])}


def _acknowledged(store, nnodes: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(store.check([f"split-read/{n}"]) for n in range(1, nnodes)):
        time.sleep(0.1)


def _wait(store, cfg: EngineConfig, keys: list[str]) -> list[str]:
    deadline = time.monotonic() + cfg.dist_timeout
    while not all(store.check([k]) for k in keys):
        if time.monotonic() > deadline:
            missing = [k for k in keys if not store.check([k])]
            raise RendezvousError(
                f"the layer split over nodes waited {cfg.dist_timeout:.0f}s for {missing}; a node "
                "stopped while measuring itself (see its log), or raise --dist-timeout"
            )
        time.sleep(0.1)
    return [store.get(k).decode() for k in keys]
