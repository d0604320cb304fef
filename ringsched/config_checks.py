"""`EngineConfig`'s validation: one named check per concern, each raising `ConfigError` with a message that
names the flag and the fix; a feature refused beside another raises `refusals.REFUSALS`' message.
`EngineConfig.__post_init__` fills in the derived defaults, then runs `CHECKS` in order (`ConfigChecks`, mixed
into it); the checks only read the config."""

from __future__ import annotations

import re

import torch

from ringsched.device import ONE_GPU_ENV, gpu_shortfall, one_gpu
from ringsched.layout.flex import CYCLE, FLEX_POLICIES
from ringsched.refusals import REFUSALS
from ringsched.speculative.config import SpeculativeConfig, SpeculativeConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


class ConfigError(ValueError):
    """A bad flag value; the message names the flag and the fix."""


def parse_memory(value: str | int | float, flag: str = "--kv-cache-memory") -> int | float:
    """`--kv-cache-memory` (or `flag`): bytes (`536870912`, `512M`, `2GiB`) or a fraction of free memory (`0.3`)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        num, unit = float(value), ""
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ConfigError(f"{flag} {value!r}: give bytes (e.g. 2G, 512MiB) or a fraction like 0.3")
        num, unit = float(m.group(1)), (m.group(2) or "").lower().rstrip("b").rstrip("i")
    if 0 < num <= 1 and unit == "":
        return num
    if num < 1:
        raise ConfigError(f"{flag} {value!r} must be positive")
    return int(num * _UNITS[unit])


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _refuse(pair: str, refused: bool, **values: object) -> None:
    """Raise `REFUSALS[pair]`'s error, its message filled from `values`, if `refused`."""
    if refused:
        raise ConfigError(REFUSALS[pair].message(**values))


def check_layer_partition(cfg: ConfigChecks) -> None:
    """`pp_layer_partition` given from Python as a list: layer counts as integers."""
    if isinstance(cfg.pp_layer_partition, (list, tuple)):
        _require(
            all(isinstance(n, int) and not isinstance(n, bool) for n in cfg.pp_layer_partition),
            f"pp_layer_partition {cfg.pp_layer_partition!r}: give layer counts as integers, e.g. [16, 14]",
        )


def check_parallel_sizes(cfg: ConfigChecks) -> None:
    """--pp-size, --tp-size, --cp-size and how they combine."""
    _require(cfg.pp_size >= 1, f"--pp-size must be >= 1, got {cfg.pp_size}")
    _require(cfg.tp_size >= 1, f"--tp-size must be >= 1, got {cfg.tp_size}")
    _require(cfg.cp_size >= 1, f"--cp-size must be >= 1, got {cfg.cp_size}")
    _refuse("cp+tp", cfg.cp_size > 1 and cfg.tp_size > 1, cp=cfg.cp_size, tp=cfg.tp_size)
    _refuse("flex+cp", cfg.pp_flex_layers > 0 and cfg.cp_size > 1, cp=cfg.cp_size)


def check_prefix_caching(cfg: ConfigChecks) -> None:
    _refuse("prefix+cp", bool(cfg.enable_prefix_caching) and cfg.cp_size > 1, cp=cfg.cp_size)


def check_speculative(cfg: ConfigChecks) -> None:
    """--speculative-config: its JSON."""
    if not cfg.speculative_config:
        return
    try:
        SpeculativeConfig.parse(cfg.speculative_config)
    except SpeculativeConfigError as e:
        raise ConfigError(str(e)) from None


def check_pipeline(cfg: ConfigChecks) -> None:
    """--pp-async-batch-depth and the flexible cut (--pp-flex-layers, --pp-flex-policy)."""
    _require(
        cfg.pp_async_batch_depth >= 0,
        f"--pp-async-batch-depth must be >= 0 (0 = exactly pp_size micro-batches), got {cfg.pp_async_batch_depth}",
    )
    _require(cfg.pp_flex_layers >= 0, f"--pp-flex-layers must be >= 0 (0 = a fixed cut), got {cfg.pp_flex_layers}")
    _refuse("flex+pp", cfg.pp_flex_layers > 0 and cfg.pp_size != 2, pp=cfg.pp_size)
    _refuse("flex+tp", cfg.pp_flex_layers > 0 and cfg.tp_size > 1, tp=cfg.tp_size)
    _require(
        cfg.pp_flex_policy in (*FLEX_POLICIES, CYCLE),
        f"--pp-flex-policy {cfg.pp_flex_policy!r}: use one of {', '.join(FLEX_POLICIES)}",
    )


def check_batching(cfg: ConfigChecks) -> None:
    """--quantization, the batch sizes and prefill chunking."""
    _require(
        cfg.quantization in ("none", "int8", "int4", "gguf"),
        f"--quantization must be none, int8, int4 or gguf, got {cfg.quantization!r}",
    )
    _require(
        cfg.max_running_requests >= 1,
        f"--max-running-requests must be >= 1, got {cfg.max_running_requests}",
    )
    if cfg.pp_max_micro_batch_size is not None:
        _require(
            cfg.pp_max_micro_batch_size >= 1,
            f"--pp-max-micro-batch-size must be >= 1, got {cfg.pp_max_micro_batch_size}",
        )
    _require(
        isinstance(cfg.enable_dynamic_chunking, bool),
        f"enable_dynamic_chunking must be True or False, got {cfg.enable_dynamic_chunking!r}",
    )
    _require(
        cfg.chunked_prefill_size >= 1,
        f"--chunked-prefill-size must be >= 1, got {cfg.chunked_prefill_size}",
    )


ATTENTION_BACKENDS = ("auto", "torch", "native", "triton")  # attention/backend.py builds each
LINEAR_TUNINGS = ("auto", "off")  # kernels/linear_tuning.py
LINEAR_TUNING_ENV = "RINGSCHED_LINEAR_TUNING"  # --linear-tuning's default when set (the tests set off)


def check_gpus(cfg: ConfigChecks) -> None:
    """On CUDA: a GPU for each of this node's ranks (all on the first with RINGSCHED_ONE_GPU=1); no flexible cut
    (its transfers are not batched for NCCL)."""
    if not one_gpu():
        shortfall = gpu_shortfall(cfg.pp_size, cfg.nnodes, cfg.tp_size, cfg.cp_size, torch.cuda.device_count())
        _require(shortfall is None, shortfall or "")
    _refuse("flex+cuda", cfg.pp_flex_layers > 0)


def check_device(cfg: ConfigChecks) -> None:
    """--dtype, --device (and whether CUDA is there), --attention-backend, --linear-tuning, --threads-per-stage."""
    _require(
        cfg.dtype == "auto" or cfg.dtype in DTYPES,
        f"--dtype {cfg.dtype!r} is not supported; use auto or one of {', '.join(DTYPES)}",
    )
    _require(cfg.device in ("auto", "cpu", "cuda"), f"--device {cfg.device!r}: use auto, cpu or cuda")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but CUDA is not available; use --device cpu")
    if cfg.resolved_device == "cuda":
        check_gpus(cfg)
    elif one_gpu():
        raise ConfigError(
            f"{ONE_GPU_ENV}=1 puts every rank on the first GPU (a check of the NCCL ring on one GPU) and needs "
            f"--device cuda; unset {ONE_GPU_ENV} to run on {cfg.resolved_device}"
        )
    if cfg.dtype == "float16" and cfg.resolved_device == "cpu":
        raise ConfigError("--dtype float16 is for GPUs; on CPU use float32 or bfloat16")
    _require(
        cfg.attention_backend in ATTENTION_BACKENDS,
        f"--attention-backend {cfg.attention_backend!r} is not a backend; choose one of "
        f"{', '.join(ATTENTION_BACKENDS)}",
    )
    _require(
        cfg.linear_tuning in LINEAR_TUNINGS,
        f"--linear-tuning {cfg.linear_tuning!r} (or {LINEAR_TUNING_ENV}): use auto or off",
    )
    if cfg.threads_per_stage is not None:
        _require(cfg.threads_per_stage >= 1, f"--threads-per-stage must be >= 1, got {cfg.threads_per_stage}")
    _require(
        cfg.cuda_graph_max_bs >= 1,
        f"--cuda-graph-max-bs must be >= 1 (requests), got {cfg.cuda_graph_max_bs}; use --enforce-eager for no graphs",
    )


def check_auto_partition(cfg: ConfigChecks) -> None:
    """The workload `--pp-layer-partition auto` balances for."""
    _require(
        cfg.pp_auto_input_len >= 1 and cfg.pp_auto_output_len >= 1,
        f"--pp-auto-input-len and --pp-auto-output-len must be >= 1 (typical prompt and output tokens), got "
        f"{cfg.pp_auto_input_len} and {cfg.pp_auto_output_len}",
    )


def check_timeouts(cfg: ConfigChecks) -> None:
    _require(cfg.stage_timeout > 0, f"--stage-timeout must be > 0 seconds, got {cfg.stage_timeout}")
    _require(
        cfg.heartbeat_timeout >= 1,
        f"--heartbeat-timeout must be >= 1 second (stages beat every 0.5 s), got {cfg.heartbeat_timeout}",
    )
    _require(cfg.dist_timeout > 0, f"--dist-timeout must be > 0 seconds, got {cfg.dist_timeout}")


def check_nodes(cfg: ConfigChecks) -> None:
    """--nnodes, --node-rank, --dist-init-addr: nodes hold whole stages."""
    _require(cfg.nnodes >= 1, f"--nnodes must be >= 1, got {cfg.nnodes}")
    _require(
        0 <= cfg.node_rank < cfg.nnodes,
        f"--node-rank {cfg.node_rank} must be in [0, {cfg.nnodes}) for --nnodes {cfg.nnodes}",
    )
    _require(
        cfg.pp_size % cfg.nnodes == 0,
        f"--nnodes {cfg.nnodes} must divide --pp-size {cfg.pp_size}: nodes hold whole stages (pp_size/nnodes "
        "each), because a stage's --tp-size ranks all-reduce twice per layer and must share a node's fast links; "
        "raise --pp-size or lower --nnodes",
    )
    if cfg.nnodes > 1:
        _require(
            cfg.dist_init_addr is not None and ":" in cfg.dist_init_addr,
            "--nnodes > 1 needs --dist-init-addr HEAD:PORT (the head node's address), the same on every node",
        )


def check_kv_cache(cfg: ConfigChecks) -> None:
    """The KV pool's block size, --max-model-len, --kv-cache-memory."""
    _require(cfg.block_size >= 1, f"block size must be >= 1, got {cfg.block_size}")
    if cfg.max_model_len is not None:
        _require(cfg.max_model_len >= 2, f"--max-model-len must be >= 2, got {cfg.max_model_len}")
    parse_memory(cfg.kv_cache_memory)
    if cfg.node_memory is not None:
        parse_memory(cfg.node_memory, "--node-memory")


class ConfigChecks:
    """Mixed into `EngineConfig`: its checks, run in the fields' order (of several bad flags, the first field's is
    reported). The checks read the config's fields as `cfg`; this class names their type without importing
    `config.py`, which imports it."""

    def run_checks(self) -> None:
        for check in CHECKS:
            check(self)


CHECKS = (
    check_parallel_sizes,
    check_prefix_caching,
    check_speculative,
    check_pipeline,
    check_batching,
    check_device,
    check_auto_partition,
    check_timeouts,
    check_nodes,
    check_kv_cache,
)
