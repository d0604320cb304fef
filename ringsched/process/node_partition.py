"""The layer split this node brings to the rendezvous: `--pp-layer-partition` as given or by default, or with `auto`
on one node its measured choice within its memory (`process/partition_auto.py`; across nodes,
`process/node_exchange.py` decides at the rendezvous)."""

from __future__ import annotations

from ringsched.comm.store import RendezvousError
from ringsched.config import EngineConfig
from ringsched.layout.node_split import NodeSpec, shortfall, stage_caps
from ringsched.layout.partition import head_layers
from ringsched.process.node_measure import local_stages, node_memory, stage_bytes
from ringsched.process.partition_auto import BatchShape, choose_partition, choose_partition_apart
from ringsched.spec import ModelSpec


def own_partition(cfg: EngineConfig, spec: ModelSpec) -> list[int] | None:
    """This node's partition: the override or default, or for `auto` on one node the measured choice within its
    memory (across nodes None: every node measures itself at the rendezvous, `process/node_exchange.py`)."""
    mcfg = spec.config
    if not cfg.auto_partition:
        return cfg.partition(mcfg.num_layers, head_layers(mcfg))
    if cfg.nnodes > 1:
        return None
    c = cfg
    shape = BatchShape.for_workload(
        c.micro_batch_size,
        c.chunked_prefill_size,
        c.context_len(mcfg.max_position_embeddings),
        c.pp_auto_input_len,
        c.pp_auto_output_len,
    )
    cuda = c.resolved_device == "cuda"
    devices, cpus = local_stages(c)
    caps = _memory_caps(cfg, spec)
    choose = choose_partition_apart if cuda else choose_partition  # no CUDA context here
    counts, _ = choose(
        mcfg,
        c.pp_size,
        shape,
        c.torch_dtype,
        devices,
        c.threads,
        cpus,
        attention_backend=c.attention_backend,
        caps=caps,
    )
    return counts


def _memory_caps(cfg: EngineConfig, spec: ModelSpec) -> list[int] | None:
    """The most layers each stage's share of this node's memory holds (None on a GPU, where the launcher does not
    probe: each stage has its own); refuses a model the node cannot hold, naming the shortfall."""
    memory = node_memory(cfg, probe=False)
    if memory is None:
        return None
    weights, num_layers = stage_bytes(cfg, spec), spec.config.num_layers
    node = NodeSpec(0, (1.0,) * cfg.pp_size, 0.0, 0.0, memory)
    caps = stage_caps([node], weights, num_layers)
    if sum(caps) < num_layers or min(caps) < 1:
        raise RendezvousError(shortfall(num_layers, [node], weights, caps))
    return caps
