"""`--pp-layer-partition auto`: measure what a decoder layer, the embedding and the head (final norm, lm_head
and sampling) cost on this hardware, then cut the layers so the slowest stage is as fast as it can be.

Why measure instead of assuming: the head's weight depends on the workload. ringsched runs the lm_head only on
the rows that sample (one per decode, one per prefill chunk), so its cost against a layer's moves with the share
of prefill tokens in a micro-batch, with the vocabulary size and with the CPU's matmul speed at each shape.

The batch shape measured is the micro-batch a saturated engine builds for the workload it is told
(`--pp-auto-input-len`, `--pp-auto-output-len`, default 128 each): `pp_max_micro_batch_size` decodes at the
mean decode context (prompt + half the output), plus the prefill tokens that come with them in the steady
state (a request brings `input_len` prefill tokens per `output_len` samples), capped by
`--chunked-prefill-size`. Measured on this project's 2-core Xeon, a random 1B Llama on requests of 32 + 64
tokens: probing at a context of 256 with as many prefill tokens as decodes made the head look light and
picked [10,10], where [11,9] ran 1.18x faster.

The launcher of node 0 measures once, before the stages start, with one stage's threads; the stages and the
other nodes receive the decision as an explicit partition. On a GPU the launcher measures in a child process
(`choose_partition_apart`), so the launcher itself never creates a CUDA context: one there would hold memory on
GPU 0 for the server's whole life, beside stage 0's.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass

import torch

from ringsched.attention.backend import select_backend
from ringsched.comm.messages import BatchPlan, PlanEntry
from ringsched.kv.cache import BlockTable, KVPool, kv_bytes_per_token
from ringsched.layout.node_split import balance_loss, balanced_split
from ringsched.layout.rank import StageInfo
from ringsched.models.llama import StageModel
from ringsched.stage.affinity import restored_threads_and_cpus
from ringsched.weights.model_config import ModelConfig, layer_weight_params

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchShape:
    decodes: int  # decode rows, one token each
    prefill_tokens: int  # one prefill chunk of this many tokens (0: none)
    context: int  # each decode's context length

    def __post_init__(self) -> None:
        if self.decodes < 0 or self.prefill_tokens < 0 or self.decodes + self.prefill_tokens < 1:
            raise ValueError(f"a batch shape needs at least one token, got {self}")
        if self.context < 1:
            raise ValueError(f"decode context must be >= 1, got {self.context}")

    @property
    def tokens(self) -> int:
        return self.decodes + self.prefill_tokens

    @property
    def sample_rows(self) -> int:
        return self.decodes + (1 if self.prefill_tokens else 0)

    @classmethod
    def for_workload(
        cls, micro_batch_size: int, chunked_prefill_size: int, max_len: int, input_len: int, output_len: int
    ) -> BatchShape:
        """A saturated micro-batch for requests of `input_len` prompt and `output_len` output tokens: every
        decode samples once per step, and each request's prompt (one prefill) comes once per `output_len`
        samples, so prefill tokens per step = decodes * input_len / output_len."""
        prefill = min(round(micro_batch_size * input_len / output_len), chunked_prefill_size)
        return cls(micro_batch_size, prefill, min(input_len + output_len // 2, max_len - 1))


@dataclass(frozen=True)
class StageCosts:
    """Milliseconds per micro-batch of `shape`. `layer_ms[k]` is a layer's cost on stage k's cores: cores of one
    machine need not be equally fast (one may take the host's interrupts)."""

    layer_ms: tuple[float, ...]
    embed_ms: float
    head_ms: float  # final norm + lm_head + sampling
    shape: BatchShape

    @classmethod
    def uniform(cls, layer_ms: float, embed_ms: float, head_ms: float, shape: BatchShape, pp: int) -> StageCosts:
        return cls((layer_ms,) * pp, embed_ms, head_ms, shape)

    def cost(self, k: int, n: int) -> float:
        """Stage k of `len(layer_ms)` holding n layers."""
        first, last = k == 0, k == len(self.layer_ms) - 1
        return n * self.layer_ms[k] + (self.embed_ms if first else 0.0) + (self.head_ms if last else 0.0)

    def stage_ms(self, counts: list[int]) -> list[float]:
        """Predicted compute time of each stage for a partition."""
        return [self.cost(k, n) for k, n in enumerate(counts)]


def best_partition(num_layers: int, pp_size: int, costs: StageCosts, caps: list[int] | None = None) -> list[int]:
    """The partition (every stage >= 1 layer, stage k at most `caps[k]`) whose slowest stage is fastest; ties go
    to the most even split (`layout.node_split.balanced_split`)."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {pp_size} stages")
    if len(costs.layer_ms) != pp_size:
        raise ValueError(f"costs for {len(costs.layer_ms)} stages, asked to cut into {pp_size}")
    return balanced_split(num_layers, costs.cost, caps or [num_layers] * pp_size)


PROBE_BYTES = 384 * 2**20  # weights + KV the probe's layers span: more than a server CPU's last-level cache


def probe_layers(mcfg: ModelConfig, shape: BatchShape, dtype: torch.dtype, stage_layers: int) -> int:
    """How many distinct layers the probe runs through: enough that their weights and KV do not fit in the
    cache (a stage's layers never do, and one layer timed again and again would be served from cache: measured
    on this project's 2-core Xeon with a 300 MiB L3, that made a SmolLM2 layer look 2x cheaper against the
    lm_head than in the ring), at most a stage's share of the layers."""
    per_layer = layer_weight_params(mcfg) * torch.empty((), dtype=dtype).element_size()  # every expert
    per_layer += (shape.decodes * shape.context + shape.prefill_tokens) * kv_bytes_per_token(mcfg, 1, dtype)
    return max(1, min(stage_layers, -(-PROBE_BYTES // per_layer)))


class CostProbe:
    """`layers` randomly initialised layers, the embedding and the head, with a real paged-KV micro-batch of
    `shape` ready to run: `measure()` times them on the cores this process runs on (a one-stage
    `StageCosts`). Each repeat runs all the layers (each with its own KV), then the head, then the embedding,
    so, as in a stage, each finds the others' data in the cache rather than its own."""

    @torch.inference_mode()
    def __init__(
        self,
        mcfg: ModelConfig,
        shape: BatchShape,
        dtype: torch.dtype,
        device: torch.device,
        layers: int = 1,
        attention_backend: str = "auto",
    ) -> None:
        torch.manual_seed(0)
        self.shape, self.device, self.layers = shape, device, layers
        model = StageModel(mcfg, StageInfo(0, 1, 0, layers)).to(device=device, dtype=dtype)
        self.model = model.lay_out_for_cpu().prepare_linears()
        blocks = BlockTable(shape.decodes * -(-shape.context // 16) + -(-shape.prefill_tokens // 16) + 1, 16)
        self.pool = KVPool(mcfg, layers, blocks.num_blocks, 16, dtype, device)
        attention = select_backend(attention_backend, device, dtype)  # time the attention the stages will run
        self.batch, self.ids = attention.forward_batch(_plan(shape, blocks), blocks, device)
        self.hidden = self.model.model.embed_tokens(self.ids)
        self.residual = torch.randn_like(self.hidden)  # a middle layer's input: the residual stream has started

    def _layers(self) -> None:
        for layer, cache in zip(self.model.model.layers[: self.layers], self.pool.caches, strict=True):
            layer(self.hidden.clone(), self.residual.clone(), self.batch, cache)  # a layer writes over its inputs

    def _embed(self) -> None:
        self.model.model.embed_tokens(self.ids)

    def _head(self) -> None:
        rows = self.batch.logit_rows
        out, _ = self.model.model.norm.add_forward(self.hidden[rows], self.residual[rows])
        self.model.greedy_tokens(out)  # the ring's hot path (greedy)

    @torch.inference_mode()
    def measure(self, repeat: int = 7) -> StageCosts:
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        parts = (self._layers, self._head, self._embed)
        for fn in parts:  # warm up: first calls allocate and pick kernels
            fn()
        times: list[list[float]] = [[], [], []]
        for _ in range(repeat):
            for fn, acc in zip(parts, times, strict=True):
                sync()
                start = time.perf_counter()
                fn()
                sync()
                acc.append((time.perf_counter() - start) * 1e3)
        layers_ms, head_ms, embed_ms = (statistics.median(t) for t in times)
        return StageCosts((layers_ms / self.layers,), embed_ms, head_ms, self.shape)


def _plan(shape: BatchShape, blocks: BlockTable) -> BatchPlan:
    entries = []
    for i in range(shape.decodes):
        blocks.ensure(f"d{i}", shape.context)
        entries.append(PlanEntry(f"d{i}", shape.context - 1, [100 + i % 1000], samples=True))
    if shape.prefill_tokens:
        blocks.ensure("p", shape.prefill_tokens)
        entries.append(PlanEntry("p", 0, [100 + i % 1000 for i in range(shape.prefill_tokens)], samples=True))
    return BatchPlan(slot=0, seq=0, entries=entries)


def choose_partition(
    mcfg: ModelConfig,
    pp_size: int,
    shape: BatchShape,
    dtype: torch.dtype,
    device: torch.device | list[torch.device],
    threads: int,
    stage_cpus: list[list[int] | None] | None = None,
    rounds: int = 5,
    attention_backend: str = "auto",
    caps: list[int] | None = None,
) -> tuple[list[int], StageCosts]:
    """Measure with one stage's threads on each stage's cores (`stage_cpus[k]`; None: wherever this process
    runs) and device (one for all, or each stage's), pick the split (stage k at most `caps[k]` layers: what its
    memory holds), log the decision. The first stage's cores time the embedding, the last's the head."""
    if pp_size == 1:
        return [mcfg.num_layers], StageCosts.uniform(0.0, 0.0, 0.0, shape, 1)
    costs = measure_stages(mcfg, pp_size, shape, dtype, device, threads, stage_cpus, rounds, attention_backend)
    counts = best_partition(mcfg.num_layers, pp_size, costs, caps)
    log_choice(counts, costs)
    return counts, costs


def measure_stages(
    mcfg: ModelConfig,
    pp_size: int,
    shape: BatchShape,
    dtype: torch.dtype,
    device: torch.device | list[torch.device],
    threads: int,
    stage_cpus: list[list[int] | None] | None = None,
    rounds: int = 5,
    attention_backend: str = "auto",
) -> StageCosts:
    """A layer's cost on each stage's cores and device (`stage_cpus`, `device`: every stage's of `pp_size`, or a
    node's own stages'; one device for all, or one per stage: a node's GPUs need not be alike), the embedding's on
    the first's and the head's on the last's, each the median over `rounds` rounds."""
    cpu_sets = stage_cpus if stage_cpus is not None else [None] * pp_size
    devices = device if isinstance(device, list) else [device] * len(cpu_sets)
    keys = [(tuple(c) if c else None, str(d)) for c, d in zip(cpu_sets, devices, strict=True)]
    measured: dict[tuple, list[StageCosts]] = {k: [] for k in keys}
    with restored_threads_and_cpus(threads) as allowed:
        layers = probe_layers(mcfg, shape, dtype, -(-mcfg.num_layers // pp_size))
        probes = {str(d): CostProbe(mcfg, shape, dtype, d, layers, attention_backend) for d in dict.fromkeys(devices)}
        # Rounds over the stages' cores, so that a slow moment of the host (or a cold start) is not pinned on
        # one stage; each figure is the median over the rounds.
        for _ in range(rounds):
            for cpus, dev in measured:
                if cpus and allowed:
                    os.sched_setaffinity(0, cpus)
                measured[(cpus, dev)].append(probes[dev].measure(repeat=3))

    def med(key: tuple, field: str) -> float:
        return statistics.median(getattr(c, field) for c in measured[key])

    layer_ms = cores_layer_ms([[c.layer_ms[0] for c in measured[k]] for k in keys])
    return StageCosts(layer_ms, med(keys[0], "embed_ms"), med(keys[-1], "head_ms"), shape)


UNEQUAL_CORES = 0.10  # how much slower one stage's cores must time (median) to be planned as slower


def cores_layer_ms(samples: list[list[float]]) -> tuple[float, ...]:
    """A layer's cost on each stage's cores from each core's timings over the rounds. Cores count as unequal only
    when the timings say so without doubt: one core's fastest round slower than another's slowest, and medians
    `UNEQUAL_CORES` apart; otherwise they share the median of all rounds. Measured one core at a time on a
    shared host, single rounds swing by 25% (65 vs 51 ms for the same layer), which would otherwise move layers
    between equal cores at random; and a probe of a few seconds can catch a neighbour on one core for all its
    rounds. With SmolLM2 a 4% difference between the cores' layer times is enough to move a layer ([18, 12]
    instead of [17, 13]; once here `auto` chose [18, 12] and stage 1 idled 17% of the run, though which of
    its timings caused it was not recorded), so a smaller real difference is better ignored than a passing
    one planned for."""
    medians = [statistics.median(s) for s in samples]
    disjoint = max(min(s) for s in samples) > min(max(s) for s in samples)
    if disjoint and max(medians) > (1 + UNEQUAL_CORES) * min(medians):
        return tuple(medians)
    pooled = statistics.median(t for s in samples for t in s)
    return (pooled,) * len(samples)


def log_choice(counts: list[int], costs: StageCosts) -> None:
    ms = costs.stage_ms(counts)
    s = costs.shape
    logger.info(
        "--pp-layer-partition auto: %s. Measured per micro-batch of %d decodes (context %d) + %d prefill tokens: "
        "layer %s ms (on each stage's cores), embedding %.2f ms, norm+lm_head+sampling %.2f ms (= %.1f layers). "
        "Predicted stage times %s ms; %.1f%% lost against a perfect balance",
        ",".join(map(str, counts)),
        s.decodes,
        s.context,
        s.prefill_tokens,
        [round(t, 2) for t in costs.layer_ms],
        costs.embed_ms,
        costs.head_ms,
        costs.head_ms / max(statistics.fmean(costs.layer_ms), 1e-9),
        [round(t, 2) for t in ms],
        100 * balance_loss(ms),
    )


def choose_partition_apart(*args, **kwargs) -> tuple[list[int], StageCosts]:
    """`choose_partition` in a spawned child process, which takes the CUDA context and frees it as it exits."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(choose_partition, *args, **kwargs).result()
