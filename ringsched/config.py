"""The engine's configuration: one frozen dataclass, validated where it is built.

Every field mirrors a launcher flag (`pp_async_batch_depth` is `--pp-async-batch-depth`); errors name the flag
and say what to do. The checks are `config_checks.py`'s (mixed in; import `ConfigError` and `parse_memory` from
here); values that depend on the model (layer count, context length) are checked once the model is known.
"""
# size: one field per launcher flag, each with its help; split by concern it would be several tables of one thing

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ringsched.config_checks import (
    ATTENTION_BACKENDS,
    DTYPES,
    LINEAR_TUNING_ENV,
    LINEAR_TUNINGS,
    ConfigChecks,
    ConfigError,
    check_layer_partition,
)
from ringsched.config_checks import parse_memory as parse_memory  # importers take it from here
from ringsched.device import cpu_has_fast_bf16, cpus_here, read_checkpoint_config, resolve_dtype
from ringsched.layout.flex import FLEX_POLICIES, FlexBoundary
from ringsched.layout.partition import ENV_OVERRIDE, PartitionError, resolve_partition
from ringsched.layout.rank import Layout

STATIC_BATCHES_ENV = "RINGSCHED_STATIC_BATCHES"
DEFAULT_MODEL = "smollm2-135m-instruct"  # what `--model` serves when not given (fetched from PyPI)


def _flag(default: Any, help: str, *, type: Callable | None = None, choices: Sequence[str] | None = None,
          group: str = "engine") -> Any:  # fmt: skip
    """A field that is also a command-line flag (`cli_args.add_engine_args` builds the parser from these):
    its default, its help (what it does, when to change it) and its choices live here only."""
    return field(default=default, metadata={"help": help, "type": type, "choices": choices, "group": group})


# Default requests running at once per pipeline stage: PP=N runs N micro-batches of this many, each as full as
# PP=1's one batch, so adding a stage adds throughput without tuning flags (the design brief's admission section).
RUNNING_PER_STAGE = 128


@dataclass(frozen=True)
class EngineConfig(ConfigChecks):
    model: str = _flag(DEFAULT_MODEL, "a model directory, or a known model name (fetched on first use)")
    pp_size: int = _flag(1, "pipeline stages, one process each; more stages hold a bigger model and raise throughput, "
                         "not single-request latency")  # fmt: skip
    tp_size: int = _flag(1, "tensor-parallel ranks per stage, one process each: every layer's matrices are split "
                         "across them at two all-reduces per layer; lowers the time per token where the ranks share a "
                         "fast link (one node)")  # fmt: skip
    cp_size: int = _flag(1, "context-parallel ranks per stage, one process each: a stage's weights are replicated on "
                         "them and every request's tokens and KV are split across them (long prefills by ring "
                         "attention with the zigzag split, decodes over the split KV); lowers a long prompt's time to "
                         "first token and lets one request's KV exceed one rank's pool")  # fmt: skip
    pp_async_batch_depth: int = _flag(0, "micro-batches in flight beyond --pp-size; 1 lets stage 0 plan one ahead, "
                                      "which absorbs a slow micro-batch at some latency per token")  # fmt: skip
    max_running_requests: int | None = _flag(None, "requests running at once (decoding or prefilling; default: "
                                             f"{RUNNING_PER_STAGE} per stage, so each micro-batch holds what one "
                                             "stage's batch would); more raises throughput until the KV pool or "
                                             "compute runs out", type=int)  # fmt: skip
    pp_max_micro_batch_size: int | None = _flag(None, "requests per micro-batch (default: max-running-requests // "
                                                "pp-size, so every slot gets its share)", type=int)  # fmt: skip
    chunked_prefill_size: int = _flag(512, "prefill tokens per micro-batch; smaller chunks keep decodes flowing "
                                      "beside long prompts and shorten the ring's fill")  # fmt: skip
    enable_dynamic_chunking: bool = _flag(False, "size each later chunk of a long prompt to take as long as its first "
                                          "and, beside decoding requests, as long as one of their steps (a start-up "
                                          "probe models both), so their TPOT stays within ~2x while it prefills; "
                                          "alone a long prompt gets no faster")  # fmt: skip
    enable_prefix_caching: bool | None = _flag(None, "reuse the KV of a prompt's longest cached prefix (whole blocks "
                                               "of 16 tokens: system prompts, chat turns, few-shot examples); "
                                               "stage 0's block table holds the cache, idle cached blocks are "
                                               "evicted least recently used (default: on; off with --cp-size > 1, "
                                               "which it does not support)", type=bool)  # fmt: skip
    speculative_config: str | dict | None = _flag(  # JSON text (a dict from Python is kept as its JSON)
        None, 'model-free speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '"suffix"; drafts are verified where they pay at the measured step cost, so outputs that repeat their input '
        "(edits, code) come faster and others pay little (default: none)", type=str)  # fmt: skip
    kv_cache_memory: str | int | float = _flag("1G", "KV pool per stage: bytes (2G, 512MiB) or a fraction of free "
                                               "memory (0.3: of the GPU's, or on CPU of the node's shared by its "
                                               "stages)")  # fmt: skip
    node_memory: str | int | float | None = _flag(None, "this node's memory for weights and KV in a layer split "
                                                  "over nodes: bytes (16G) or a fraction (default: all available)",
                                                  type=str)  # fmt: skip
    max_model_len: int | None = _flag(None, "context length (default: the model's)", type=int)
    dtype: str = _flag("auto", "weights and activations; auto: the checkpoint's torch_dtype on GPU (bfloat16 if it "
                       "names none); on CPU bfloat16 for a bfloat16 checkpoint where the CPU has AVX512-BF16 or AMX, "
                       "else float32; bfloat16 halves memory, float16 is for GPUs",
                       choices=("auto", "float32", "bfloat16", "float16"))  # fmt: skip
    attention_backend: str = _flag("auto", "attention kernels: auto (triton on CUDA; on CPU the native decode kernel "
                                   "where it builds, else torch), torch, native, triton (on CPU it runs under "
                                   "triton's interpreter: for tests only, very slow)",
                                   choices=ATTENTION_BACKENDS)  # fmt: skip
    enforce_eager: bool = _flag(False, "CUDA: run every step eagerly; by default a decode step of up to "
                                "--cuda-graph-max-bs requests replays the stage's CUDA graph for its row bucket, "
                                "which removes most of a step's launch cost")  # fmt: skip
    cuda_graph_max_bs: int = _flag(256, "CUDA: the largest decode step (requests per micro-batch) that replays a "
                                   "CUDA graph; larger steps run eagerly. Each bucket's graph is captured on first "
                                   "use")  # fmt: skip
    quantization: str | None = _flag(
        None, "int8: weight-only int8 projections and lm_head (a float32 scale per output row), a quarter of float32's "
        "weight bytes; a step of a few requests reads every weight, so one request decodes ~2x faster than float32 on "
        "CPU, at a measured cost in accuracy (docs/performance.md); int4: the projections int4 in groups of 32 inputs "
        "with a float32 scale each, the lm_head and embedding int8 (one tensor where tied), about a fifth of float32's "
        "weight bytes; gguf: a GGUF model's tensors in the file's own quantization, as it stores them (Q4_0, Q4_1, "
        "Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; the default model's Q4_1 file too); none: the model's dtype (default: "
        "gguf for --model FILE.gguf, else none)", type=str, choices=("none", "int8", "int4", "gguf"))  # fmt: skip
    linear_tuning: str | None = _flag(
        None, "auto: each stage times its linear layers' paths (native kernel, MKL/oneDNN, bfloat16 widened, int8) "
        "per shape and row count at start-up, cached per CPU, and takes the fastest; off: the fixed thresholds "
        f"(default: ${LINEAR_TUNING_ENV}, else auto)", type=str, choices=LINEAR_TUNINGS)  # fmt: skip
    enable_deterministic_inference: bool = _flag(
        False, "CPU: every row count takes the same kernels (the native linear kernel and layer ops, bit-invariant "
        "across rows), so a request's tokens do not depend on the requests that share its micro-batch: reruns, and "
        "replays after a rank is replaced, give exactly the same text; prefill up to ~1.3x slower")  # fmt: skip
    device: str = _flag("auto", "cuda gives each stage one GPU (NCCL between them); auto picks cuda when present",
                        choices=("auto", "cpu", "cuda"))  # fmt: skip
    threads_per_stage: int | None = _flag(None, "CPU threads per rank (default: cores // ranks on this node; a rank "
                                          "is a stage, or one of its --tp-size ranks)", type=int)  # fmt: skip
    # "auto", "16,14", or [16, 14] from Python
    pp_layer_partition: str | Sequence[int] | None = _flag(
        None, "layers per stage, e.g. 16,14, or auto: measure a layer, the embedding and the lm_head here and pick "
        "the split whose slowest stage is fastest (default: an even split; also RINGSCHED_PP_LAYER_PARTITION)",
        type=str,
    )  # fmt: skip
    # PP=2: layers on each side of the cut that both stages hold, so stage 0 can move the cut per micro-batch
    # (layout/flex.py). "balance" predicts each micro-batch's cut from the measured stage times; "ready" cuts
    # when stage 1 is ready for the micro-batch (CPU stages); "cycle" (tests only, no flag) visits every cut in turn.
    pp_flex_layers: int = _flag(0, "PP=2: both stages hold this many layers on each side of the cut, and stage 0 "
                                "moves the cut per micro-batch to balance prefill- and decode-heavy batches; costs "
                                "2x this many layers of weights and KV")  # fmt: skip
    pp_flex_policy: str = _flag("balance", "how a flexible cut is chosen: balance (predicted from measured stage "
                                "times) or ready (stage 0 cuts when stage 1 is ready; CPU stages)",
                                choices=FLEX_POLICIES)  # fmt: skip
    # The requests `auto` measures for: typical prompt and output lengths (they set the probe's decode context
    # and its share of prefill tokens, so the head's weight against a layer's).
    pp_auto_input_len: int = _flag(128, "the typical prompt tokens --pp-layer-partition auto balances for")
    pp_auto_output_len: int = _flag(128, "the typical output tokens --pp-layer-partition auto balances for")
    dist_init_addr: str | None = _flag(None, "HOST:PORT of the rendezvous store node 0 hosts (default: a free local "
                                       "port; give it with --nnodes > 1)", type=str)  # fmt: skip
    stage_timeout: float = _flag(60.0, "seconds a stage may wait on a neighbour, a node may stay silent, or a "
                                 "stage's loop may sit in one micro-batch, before the engine stops")  # fmt: skip
    heartbeat_timeout: float = _flag(10.0, "seconds without a stage's heartbeat (sent every 0.5 s) before it counts "
                                     "as hung and the engine stops naming it, idle or busy")  # fmt: skip
    max_restarts: int = _flag(3, "ranks replaced within --restart-window after dying or hanging, every open request "
                              "replayed; beyond, or with 0, the engine stops as on any failure")  # fmt: skip
    restart_window: float = _flag(600.0, "seconds over which --max-restarts counts replacements")
    nnodes: int = _flag(1, "nodes the stages span (the same command on each)", group="nodes")
    node_rank: int = _flag(0, "this node's index; node 0 runs stage 0 and the server", group="nodes")
    host_ip: str | None = _flag(None, "the address other nodes reach this one at (default: the route to node 0)",
                                type=str, group="nodes")  # fmt: skip
    dist_timeout: float = _flag(300.0, "seconds to wait for every node to join", group="nodes")
    rejoin_timeout: float = _flag(60.0, "seconds the ring waits, requests held, for a silent node: its launcher "
                                  "started again with the same flags and --node-rank, or a cut link back (with "
                                  "--max-restarts)", group="nodes")  # fmt: skip
    block_size: int = 16
    seed: int = _flag(0, "seeds the requests that sample without a seed of their own (a run replays with the same "
                      "seed and arrival order)")  # fmt: skip
    log_level: str = "info"
    # Filled in by the launcher, not by people:
    ipc_dir: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.max_running_requests is None:  # frozen: the derived default is set once, here
            object.__setattr__(self, "max_running_requests", RUNNING_PER_STAGE * max(self.pp_size, 1))
        check_layer_partition(self)
        if isinstance(self.pp_layer_partition, (list, tuple)):
            # One form from here on (it travels to the stages and prints in logs like the flag's).
            object.__setattr__(self, "pp_layer_partition", ",".join(map(str, self.pp_layer_partition)))
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config", json.dumps(self.speculative_config))
        if self.enable_prefix_caching is None:
            object.__setattr__(self, "enable_prefix_caching", self.cp_size == 1)
        if self.quantization is None:
            gguf = str(self.model or "").lower().endswith(".gguf")
            object.__setattr__(self, "quantization", "gguf" if gguf else "none")
        if self.linear_tuning is None:
            object.__setattr__(self, "linear_tuning", os.environ.get(LINEAR_TUNING_ENV, "auto").strip().lower())
        self.run_checks()  # config_checks.py: one per concern, each naming the flag and the fix

    @property
    def pp_loop_size(self) -> int:
        """Micro-batch slots in flight: one per stage plus the async depth."""
        return self.pp_size + self.pp_async_batch_depth

    @property
    def micro_batch_size(self) -> int:
        if self.pp_max_micro_batch_size is not None:
            return self.pp_max_micro_batch_size
        return max(self.max_running_requests // self.pp_size, 1)

    @property
    def restarts_enabled(self) -> bool:
        """Whether a failed rank is replaced (`process/recovery.py`): --max-restarts above 0."""
        return self.max_restarts > 0

    @property
    def stages_per_node(self) -> int:
        return self.pp_size // self.nnodes

    @property
    def ranks_per_stage(self) -> int:
        return self.tp_size * self.cp_size

    @property
    def world_size(self) -> int:
        return self.pp_size * self.ranks_per_stage

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def layout(self) -> Layout:
        return Layout(pp_size=self.pp_size, tp_size=self.tp_size, cp_size=self.cp_size, nnodes=self.nnodes)

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs (whole stages: each stage's --tp-size ranks are consecutive)."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def describe_rank(self, rank: int) -> str:
        """How messages name a rank: `stage 1` with one rank per stage, else `rank 3 (stage 1, tp 1)` (or `cp 1`);
        with several nodes, the node too."""
        where = []
        if self.ranks_per_stage > 1:
            stage, index = divmod(rank, self.ranks_per_stage)
            cp, tp = divmod(index, self.tp_size)
            text, where = f"rank {rank}", [f"stage {stage}", f"tp {tp}" if self.tp_size > 1 else f"cp {cp}"]
        else:
            text = f"stage {rank}"
        if self.nnodes > 1:
            where.append(f"node {self.node_of(rank)}")
        return f"{text} ({', '.join(where)})" if where else text

    @property
    def torch_dtype(self) -> torch.dtype:
        """`--dtype`, with auto resolved against the checkpoint's config.json (`device.resolve_dtype`)."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        device = self.resolved_device
        checkpoint = read_checkpoint_config(self.model)
        return DTYPES[resolve_dtype("auto", device, checkpoint, device != "cuda" and cpu_has_fast_bf16())]

    @property
    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def backend(self) -> str:
        return "nccl" if self.resolved_device == "cuda" else "gloo"

    @property
    def static_batches(self) -> bool:
        """Whether decode steps may run on per-bucket static buffers (`stage/static_batches.py`): CUDA graphs unless
        --enforce-eager; on CPU only with RINGSCHED_STATIC_BATCHES=1 (the same path without capture, for tests)."""
        if self.resolved_device == "cuda":
            return not self.enforce_eager
        return os.environ.get(STATIC_BATCHES_ENV) == "1" and not self.enforce_eager

    @property
    def threads(self) -> int:
        if self.threads_per_stage is not None:
            return self.threads_per_stage
        return max(cpus_here() // self.ranks_per_node, 1)

    @property
    def auto_partition(self) -> bool:
        """`--pp-layer-partition auto` (or the environment variable): the launcher measures and decides."""
        text = self.pp_layer_partition if self.pp_layer_partition is not None else os.environ.get(ENV_OVERRIDE, "")
        return text.strip().lower() == "auto"

    def check_partition(self, num_layers: int, head: float = 0.0) -> None:
        """Fail early, in the caller's process, on a bad `--pp-layer-partition` or `--pp-flex-layers` (`auto`
        is decided later)."""
        if not self.auto_partition:
            self.flex_boundary(num_layers, self.partition(num_layers, head))

    def flex_boundary(self, num_layers: int, counts: list[int]) -> FlexBoundary | None:
        """The cut range `--pp-flex-layers` gives around the partition's cut, or None for a fixed cut."""
        if not self.pp_flex_layers:
            return None
        try:
            return FlexBoundary(num_layers, counts[0], self.pp_flex_layers)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def partition(self, num_layers: int, head: float = 0.0) -> list[int]:
        """Layers per stage: `--pp-layer-partition`, else the default split with the last stage's head weighing
        `head` layers (`parallel.partition.head_layers(model)`)."""
        if self.auto_partition:  # the launcher replaces "auto" by its measured decision before stages start
            raise ConfigError("--pp-layer-partition auto is decided by the launcher; no split is known yet")
        try:
            return resolve_partition(num_layers, self.pp_size, self.pp_layer_partition, head)
        except PartitionError as e:
            raise ConfigError(str(e)) from None

    def context_len(self, model_max: int) -> int:
        if self.max_model_len is None:
            return model_max
        if self.max_model_len > model_max:
            raise ConfigError(
                f"--max-model-len {self.max_model_len} exceeds the model's {model_max} positions; use <= {model_max}"
            )
        return self.max_model_len
