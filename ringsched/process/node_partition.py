"""The layer split this node brings to the rendezvous: `--pp-layer-partition` as given or by default, or with `auto`
node 0's measured choice (`process/partition_auto.py`)."""

from __future__ import annotations

import torch

from ringsched.config import EngineConfig
from ringsched.layout.partition import head_layers
from ringsched.process.partition_auto import BatchShape, choose_partition, choose_partition_apart
from ringsched.spec import ModelSpec
from ringsched.stage.affinity import stage_cpus


def own_partition(cfg: EngineConfig, spec: ModelSpec) -> list[int] | None:
    """This node's partition: the override or default, or for `auto` node 0's measured choice (other nodes
    return None and take node 0's from the rendezvous)."""
    mcfg = spec.config
    if not cfg.auto_partition:
        return cfg.partition(mcfg.num_layers, head_layers(mcfg))
    if cfg.node_rank != 0:
        return None
    c = cfg
    shape = BatchShape.for_workload(
        c.micro_batch_size, c.chunked_prefill_size, c.context_len(mcfg.max_position_embeddings),
        c.pp_auto_input_len, c.pp_auto_output_len,
    )  # fmt: skip
    device = torch.device("cuda", 0) if c.resolved_device == "cuda" else torch.device("cpu")
    # Node 0 knows only its own cores: with several nodes, its first stage's stand in for every stage's.
    here = [stage_cpus(c.threads, c.ranks_per_node, i * c.ranks_per_stage, c.resolved_device)
            for i in range(c.stages_per_node)]  # fmt: skip
    cpus = here if c.nnodes == 1 else [here[0]] * c.pp_size
    choose = choose_partition_apart if device.type == "cuda" else choose_partition  # no CUDA context here
    counts, _ = choose(mcfg, c.pp_size, shape, c.torch_dtype, device, c.threads, cpus,
                       attention_backend=c.attention_backend)
    return counts
