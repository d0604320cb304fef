"""The engine's command-line flags, shared by `launch`, `generate` and `bench` (argparse lives only here and
in the entry points). Each flag maps to one `EngineConfig` field."""

from __future__ import annotations

import argparse
import sys

from ringsched.config import ConfigError, EngineConfig
from ringsched.models.config import ModelConfig, UnsupportedModelError
from ringsched.models.fetch import DEFAULT_MODEL, FetchError, resolve_model

ENGINE_FLAGS = (
    "model", "pp_size", "pp_async_batch_depth", "max_running_requests", "pp_max_micro_batch_size",
    "chunked_prefill_size", "kv_cache_memory", "max_model_len", "dtype", "device", "threads_per_stage",
    "pp_layer_partition", "pp_flex_layers", "pp_flex_policy", "pp_auto_input_len", "pp_auto_output_len",
    "dist_init_addr", "stage_timeout", "heartbeat_timeout", "seed",
    "nnodes", "node_rank", "host_ip", "dist_timeout",
)  # fmt: skip


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help=f"model directory or known name (default {DEFAULT_MODEL})")
    g.add_argument("--pp-size", type=int, default=1, help="pipeline stages (one process each)")
    g.add_argument("--pp-async-batch-depth", type=int, default=0, help="micro-batches in flight beyond pp-size")
    g.add_argument("--max-running-requests", type=int, default=128)
    g.add_argument("--pp-max-micro-batch-size", type=int, default=None,
                   help="requests per micro-batch (default max-running-requests // pp-size)")
    g.add_argument("--chunked-prefill-size", type=int, default=512, help="prefill tokens per micro-batch")
    g.add_argument("--kv-cache-memory", default="1G", help="KV pool per stage: bytes (2G, 512MiB) or fraction of free")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--threads-per-stage", type=int, default=None, help="CPU threads per stage (default cores/pp)")
    g.add_argument(
        "--pp-layer-partition",
        default=None,
        help="layers per stage, e.g. 16,14, or `auto`: measure the cost of a layer, the embedding and the "
        "lm_head here and pick the split whose slowest stage is fastest",
    )
    g.add_argument("--pp-flex-layers", type=int, default=0,
                   help="PP=2: both stages hold this many layers on each side of the cut, and stage 0 moves the "
                   "cut per micro-batch to balance prefill- and decode-heavy batches (default 0: a fixed cut)")
    g.add_argument("--pp-flex-policy", default="balance", choices=["balance", "ready", "cycle"],
                   help="how the flexible cut is chosen: balance (predicted from the measured stage times), ready "
                   "(stage 0 runs shared layers until stage 1 is ready for the micro-batch; CPU stages), or "
                   "cycle (tests)")
    g.add_argument("--pp-auto-input-len", type=int, default=128,
                   help="typical prompt tokens of the workload `auto` balances for (bench offline: its --input-len)")
    g.add_argument("--pp-auto-output-len", type=int, default=128,
                   help="typical output tokens of the workload `auto` balances for (bench offline: its --output-len)")
    g.add_argument("--dist-init-addr", default=None, help="HOST:PORT for torch.distributed (default a free port)")
    g.add_argument("--stage-timeout", type=float, default=60.0,
                   help="seconds a stage may wait on a neighbour, a node may stay silent, or a stage's loop may make "
                   "no progress while it has work, before the engine stops (default 60)")
    g.add_argument("--heartbeat-timeout", type=float, default=10.0,
                   help="seconds without a heartbeat (sent every 0.5 s) after which a stage counts as hung and the "
                   "engine stops naming it, idle or busy (default 10)")
    g.add_argument("--seed", type=int, default=0)
    n = p.add_argument_group("nodes")
    n.add_argument("--nnodes", type=int, default=1, help="nodes the stages span (the same command on each)")
    n.add_argument("--node-rank", type=int, default=0, help="this node's index; node 0 runs stage 0 and the server")
    n.add_argument("--host-ip", default=None, help="address other nodes reach this one at (default: route to head)")
    n.add_argument("--dist-timeout", type=float, default=300.0, help="seconds to wait for every node to join")


def config_from_args(args: argparse.Namespace, **extra) -> EngineConfig:
    """Build and fully validate the config (model included); on a bad flag print the error and exit 2."""
    try:
        model_dir = str(resolve_model(args.model, quiet=False))
        cfg = EngineConfig(**{k: getattr(args, k) for k in ENGINE_FLAGS if k != "model"}, model=model_dir, **extra)
        mcfg = ModelConfig.from_dir(model_dir)
        cfg.check_partition(mcfg.num_layers)
        cfg.context_len(mcfg.max_position_embeddings)
        return cfg
    except (ConfigError, FetchError, UnsupportedModelError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def engine_kwargs(cfg: EngineConfig) -> dict:
    """`Engine(model=cfg.model, **engine_kwargs(cfg))`: the validated flags, back as keyword arguments."""
    return {k: getattr(cfg, k) for k in ENGINE_FLAGS if k != "model"} | {"log_level": cfg.log_level}
