"""What a node brings to a layer split over nodes that are not alike: its hardware in a few words, the memory it
gives the model, and its own stages' measured costs (`process/node_exchange.py` exchanges and decides).

A node's memory is `--node-memory` as given (bytes, or a fraction of what is available), else what is available
to this process: on CPU the OS's available memory within its cgroup's limit (a container's, or a SLURM job's);
on GPUs their free memory, summed over the node's GPUs. Weights are priced at `--dtype`'s bytes per parameter
(quantized weights take less, so the check errs on the safe side).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import platform
from pathlib import Path

import torch

from ringsched.config import EngineConfig, parse_memory
from ringsched.layout.node_split import NodeSpec, StageBytes
from ringsched.process.partition_auto import BatchShape, StageCosts, measure_stages
from ringsched.spec import ModelSpec
from ringsched.stage.affinity import allowed_cpus, stage_cpus
from ringsched.weights.model_config import layer_weight_params


def available_memory(device: str) -> int:
    """Bytes available to this process now: free GPU memory over the visible GPUs, or the OS's available memory
    within this process's cgroup's limit."""
    if device == "cuda":
        return sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
    import psutil

    free = psutil.virtual_memory().available
    return min(free, _cgroup_room() or free)


def _cgroup_room(root: Path = Path("/sys/fs/cgroup"), group: str | None = None) -> int | None:
    """The bytes this process's cgroup (v2; or `group` under `root`) may still take, or None with no limit or no
    cgroup v2."""
    try:
        if group is None:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
            group = next(ln.split(":", 2)[2] for ln in lines if ln.startswith("0::"))
        where = root / group.strip().lstrip("/")
        limit = (where / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(int(limit) - int((where / "memory.current").read_text()), 0)
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def node_memory(cfg: EngineConfig, probe: bool = True) -> int | None:
    """The bytes this node gives the model's weights and KV (`--node-memory`, or what is available). On a GPU only
    a process that may hold a CUDA context probes (`probe`); otherwise None unless given in bytes."""
    given = parse_memory(cfg.node_memory, "--node-memory") if cfg.node_memory is not None else 1.0
    if isinstance(given, int):
        return given
    if cfg.resolved_device == "cuda" and not probe:
        return None
    return int(given * available_memory(cfg.resolved_device))


def hardware(cfg: EngineConfig) -> dict:
    """What makes nodes differ, in the words nodes compare at the rendezvous (the memory is weighed apart). Read
    without a CUDA context: the launcher must not hold one."""
    device = cfg.resolved_device
    name = _gpu_model() if device == "cuda" else _cpu_model()
    return {
        "device": device,
        "model": name or platform.processor(),
        "cpus": len(allowed_cpus()),
        "threads": cfg.threads,
        "ranks": cfg.ranks_per_node,
        "memory": node_memory(cfg, probe=False),
    }


def _first_line(path: Path, key: str) -> str | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    return next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith(key)), None)


def _cpu_model() -> str | None:
    return _first_line(Path("/proc/cpuinfo"), "model name")


def _gpu_model() -> str | None:
    gpus = sorted(Path("/proc/driver/nvidia/gpus").glob("*/information"))
    return _first_line(gpus[0], "Model") if gpus else None


def stage_bytes(cfg: EngineConfig, spec: ModelSpec) -> StageBytes:
    """What a stage of this model holds over all its ranks (`layout.node_split.StageBytes`)."""
    m, elt = spec.config, torch.empty((), dtype=cfg.torch_dtype).element_size()
    copies = cfg.cp_size  # context-parallel ranks each hold the stage's weights; tensor-parallel ranks a share
    table = m.vocab_size * m.hidden_size * elt
    kv_given = parse_memory(cfg.kv_cache_memory)
    kv_token_layer = m.kv_bytes_per_token_per_layer * elt
    if isinstance(kv_given, int):  # a pool of that size on every rank, whatever its layers
        kv_fixed, kv_layer = kv_given * cfg.ranks_per_stage, 0.0
    else:  # a fraction of what is free: at least one request of the full context
        kv_fixed, kv_layer = 0.0, kv_token_layer * spec.context_len
    return StageBytes(
        layer_weight_params(m) * elt * copies,
        table * copies,
        (table + m.hidden_size * elt) * copies,
        kv_layer,
        kv_fixed,
    )


def local_stages(cfg: EngineConfig) -> tuple[list[torch.device], list[list[int] | None]]:
    """Each of this node's stages' device and cores, as its first rank takes them (a rank takes its local GPU)."""
    c, cuda = cfg, cfg.resolved_device == "cuda"
    firsts = [i * c.ranks_per_stage for i in range(c.stages_per_node)]
    devices = [torch.device("cuda", r) if cuda else torch.device("cpu") for r in firsts]
    return devices, [stage_cpus(c.threads, c.ranks_per_node, r, c.resolved_device) for r in firsts]


def measure_node(cfg: EngineConfig, spec: ModelSpec) -> NodeSpec:
    """This node's stages timed on their own cores or GPUs with their threads and dtype (GPUs in a child process, so
    that the launcher holds no CUDA context), and its memory. One stage: the median of 3 timings (~2.5 s for
    SmolLM2 on one core of this project's Xeon); several: 3 rounds over their cores, so that a slow moment of the
    host is not pinned on one."""
    c, mcfg = cfg, spec.config
    rounds = 1 if c.stages_per_node == 1 else 3
    shape = BatchShape.for_workload(
        c.micro_batch_size, c.chunked_prefill_size, spec.context_len, c.pp_auto_input_len, c.pp_auto_output_len
    )
    devices, cpus = local_stages(c)
    args = (mcfg, c.pp_size, shape, c.torch_dtype, devices, c.threads, cpus, rounds, c.attention_backend)
    if c.resolved_device == "cuda":
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
            costs, memory = pool.submit(_measure, c, args).result()
    else:
        costs, memory = _measure(c, args)
    return NodeSpec(c.node_rank, tuple(costs.layer_ms), costs.embed_ms, costs.head_ms, memory)


def _measure(cfg: EngineConfig, args: tuple) -> tuple[StageCosts, int | None]:
    return measure_stages(*args), node_memory(cfg)
