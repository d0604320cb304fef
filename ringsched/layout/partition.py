"""How the decoder layers are cut into pipeline stages.

Contract: `resolve_partition(num_layers, pp_size, override, head)` returns one layer count per stage (all >= 1,
summing to `num_layers`); `get_pp_indices(num_layers, pp_rank, pp_size)` is the `[start, end)` range of one
stage under the default split without a head weight. Both are pure functions of the model's shape: every stage
and every node computes the same answer on its own.

Default split: the last stage also runs the final norm, the lm_head and sampling, which `head_layers(model)`
prices in decoder layers from the model's shape; the last stage takes the layer count that makes the slowest
stage fastest with its head counted, and the other stages share the rest evenly, the remainder going to the
stages just before the last (so the first, which holds the embedding, is spared when it can be). Ties go to the
more even split, then to the lighter last stage. With a head weight of 0 this is the even split with the
remainder before the last stage; SmolLM2 (head 4 layers) cut in two is [17, 13].
"""

from __future__ import annotations

import logging
import os

ENV_OVERRIDE = "RINGSCHED_PP_LAYER_PARTITION"
DEFAULT_SOURCE = "the default split"

logger = logging.getLogger(__name__)


class PartitionError(ValueError):
    """A layer partition that cannot be used; the message names the flag and the fix."""


# What the head costs against a decoder layer, per token, as a share of their matmul weights' ratio
# (`head_layers`). The lm_head runs only on the rows that sample (every decode, one row per prefill chunk), and its
# one wide matmul runs faster per FLOP than a layer's narrower ones with attention, norms and rotary. Measured on
# this project's 2-core Xeons, float32, SmolLM2 (matmul ratio 8.0), 128 rows at a context of 192: in a micro-batch
# of decodes alone the head took 107 ms against a layer's 18.5, 5.8 layers (0.72 of the ratio); in one with as
# many prefill tokens as decodes, `auto`'s steady state at 128 + 128 tokens a request, 2.6-3.0 layers (0.33-0.37).
# Half the ratio sits between the two: a run of requests arriving together prefills first and then only decodes.
HEAD_SHARE = 1 / 2


def head_layers(model: object) -> float:
    """The head's weight in decoder layers for the default split: `HEAD_SHARE` x the lm_head's matmul weights
    (vocab x hidden) over a layer's (q, k, v, o, gate, up, down; with experts, `moe`, the router and the `top_k`
    experts a token runs through, averaged over the layers). `model` is any object with the config's shape fields
    (`weights.model_config.ModelConfig`, the planner's `capacity.presets.ModelSpec`). SmolLM2-135M: 4.0;
    Llama-3-8B: 1.2; Llama-3-70B: 0.61."""
    hidden = model.hidden_size
    q_out, kv_out = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    mlp = 3 * hidden * model.intermediate_size
    moe = getattr(model, "moe", None)
    if moe is not None:  # as `weights.model_config.layer_matmul_params` prices it (this package sits below `weights`)
        sparse = hidden * (moe.num_experts + 3 * moe.top_k * moe.intermediate)
        mlp += (sparse - mlp) * len(moe.layers) / model.num_layers
    layer = hidden * (2 * q_out + 2 * kv_out) + mlp
    return HEAD_SHARE * model.vocab_size * hidden / layer


def default_partition(num_layers: int, pp_size: int, head: float = 0.0) -> list[int]:
    """The split whose slowest stage is fastest when the last stage's head weighs `head` layers; the stages
    before the last share their layers evenly, the remainder going to those nearest the last."""
    _check_sizes(num_layers, pp_size)
    if head < 0:
        raise PartitionError(f"a head weight must be >= 0 layers, got {head}")
    if pp_size == 1:
        return [num_layers]
    best: tuple[tuple[float, int, int], list[int]] | None = None
    for last in range(1, num_layers - pp_size + 2):  # every stage before the last keeps at least one layer
        counts = [*_even(num_layers - last, pp_size - 1), last]
        slowest = max(max(counts[:-1]), last + head)
        key = (round(slowest, 9), sum(c * c for c in counts), last)
        if best is None or key < best[0]:
            best = (key, counts)
    return best[1]


def _even(num_layers: int, stages: int) -> list[int]:
    """An even split over `stages`, the remainder going to the last ones: stages-1, stages-2, ..."""
    base, remainder = divmod(num_layers, stages)
    return [base + (1 if i >= stages - remainder else 0) for i in range(stages)]


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The `[start, end)` layer range of stage `pp_rank` under the default split."""
    if not 0 <= pp_rank < pp_size:
        raise PartitionError(f"pp_rank {pp_rank} is outside [0, {pp_size})")
    counts = default_partition(num_layers, pp_size)
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


def parse_partition(text: str, source: str = "--pp-layer-partition") -> list[int]:
    """Parse `"16,14"` into `[16, 14]`; errors name `source`."""
    parts = [p.strip() for p in text.split(",")]
    counts = []
    for p in parts:
        try:
            counts.append(int(p))
        except ValueError:
            raise PartitionError(
                f"{source}={text!r}: {p!r} is not an integer; give one layer count per stage, e.g. 16,14"
            ) from None
    return counts


def resolve_partition(
    num_layers: int, pp_size: int, override: str | list[int] | None = None, head: float = 0.0
) -> list[int]:
    """Layer count per stage: the override (flag, else the environment variable) or the default split with the
    head weighing `head` layers (`head_layers(model)`)."""
    _check_sizes(num_layers, pp_size)
    source = "--pp-layer-partition"
    if override is None and os.environ.get(ENV_OVERRIDE):
        override, source = os.environ[ENV_OVERRIDE], ENV_OVERRIDE
    if override is None:
        return default_partition(num_layers, pp_size, head)
    counts = parse_partition(override, source) if isinstance(override, str) else list(override)
    shown = ",".join(str(c) for c in counts)
    if len(counts) != pp_size:
        raise PartitionError(
            f"{source}={shown} has {len(counts)} entries but --pp-size is {pp_size}; give one count per stage"
        )
    if any(c <= 0 for c in counts):
        raise PartitionError(f"{source}={shown} leaves a stage with no layers; every stage needs at least one")
    if sum(counts) != num_layers:
        raise PartitionError(
            f"{source}={shown} sums to {sum(counts)} but the model has {num_layers} layers; make it sum to {num_layers}"
        )
    return counts


def stage_ranges(counts: list[int]) -> list[tuple[int, int]]:
    """Turn per-stage counts into `[start, end)` ranges."""
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


def uneven_loss(counts: list[int]) -> float:
    """Share of throughput lost against a perfect split: the slowest (largest) stage sets the pace."""
    perfect = sum(counts) / len(counts)
    return 1.0 - perfect / max(counts)


def log_partition(counts: list[int], source: str, head: float = 0.0) -> None:
    """Log the split, the last stage's head counted as `head` layers: the default split at INFO with its balance;
    an override (flag, environment, `auto`) at INFO when balanced, else a warning with the throughput its
    slowest stage costs (as vLLM warns). `source` says where it came from (`partition_source`)."""
    stage = [float(c) for c in counts]
    stage[-1] += head
    loss = 1.0 - sum(stage) / len(stage) / max(stage)
    weighed = f"; the last stage's head counted as {head:.1f} layers" if head and len(counts) > 1 else ""
    if source == DEFAULT_SOURCE:
        if len(counts) > 1:
            logger.info(
                "layer partition %s (%s%s): the slowest stage costs %.1f%% of throughput against a perfect split",
                counts,
                source,
                weighed,
                100 * loss,
            )
    elif loss > 0:
        logger.warning(
            "uneven layer partition %s (%s%s): the slowest stage costs %.1f%% of throughput against a perfect split",
            counts,
            source,
            weighed,
            100 * loss,
        )
    else:
        logger.info("layer partition %s (%s)", counts, source)


def partition_source(override: object | None) -> str:
    """Where a partition comes from, as `log_partition` says it."""
    if override is not None:
        return f"--pp-layer-partition {override}"
    if os.environ.get(ENV_OVERRIDE):
        return f"{ENV_OVERRIDE}={os.environ[ENV_OVERRIDE]}"
    return DEFAULT_SOURCE


def _check_sizes(num_layers: int, pp_size: int) -> None:
    if pp_size < 1:
        raise PartitionError(f"--pp-size must be >= 1, got {pp_size}")
    if pp_size > num_layers:
        raise PartitionError(
            f"--pp-size {pp_size} is more stages than the model's {num_layers} layers; use at most {num_layers}"
        )
