"""How the decoder layers are cut into pipeline stages.

Contract: `resolve_partition(num_layers, pp_size, override)` returns one layer count per stage (all >= 1,
summing to `num_layers`); `get_pp_indices(num_layers, pp_rank, pp_size)` is the `[start, end)` range of one
stage under the default split. Both are pure functions: every stage computes the same answer on its own.

Default split: even, with the remainder given to the stages before the last (the last stage also runs the
final norm and the lm_head). When the remainder is at most `pp_size - 2` it therefore lands on middle stages
only, sparing the first stage too (it holds the embedding).
"""

from __future__ import annotations

import logging
import os

ENV_OVERRIDE = "RINGSCHED_PP_LAYER_PARTITION"

logger = logging.getLogger(__name__)


class PartitionError(ValueError):
    """A layer partition that cannot be used; the message names the flag and the fix."""


def default_partition(num_layers: int, pp_size: int) -> list[int]:
    """Even split; the remainder goes to the stages just before the last one."""
    _check_sizes(num_layers, pp_size)
    base, remainder = divmod(num_layers, pp_size)
    counts = [base] * pp_size
    # Stages pp_size-2, pp_size-3, ... each take one extra layer: never the last, and the first only when
    # the remainder is pp_size - 1.
    for i in range(remainder):
        counts[pp_size - 2 - i] += 1
    return counts


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


def resolve_partition(num_layers: int, pp_size: int, override: str | list[int] | None = None) -> list[int]:
    """Layer count per stage: the override (flag, else the environment variable) or the default split."""
    _check_sizes(num_layers, pp_size)
    source = "--pp-layer-partition"
    if override is None and os.environ.get(ENV_OVERRIDE):
        override, source = os.environ[ENV_OVERRIDE], ENV_OVERRIDE
    if override is None:
        return default_partition(num_layers, pp_size)
    counts = parse_partition(override, source) if isinstance(override, str) else list(override)
    shown = ",".join(str(c) for c in counts)
    if len(counts) != pp_size:
        raise PartitionError(
            f"{source}={shown} has {len(counts)} entries but --pp-size is {pp_size}; give one count per stage"
        )
    if any(c <= 0 for c in counts):
        raise PartitionError(
            f"{source}={shown} leaves a stage with no layers; every stage needs at least one"
        )
    if sum(counts) != num_layers:
        raise PartitionError(
            f"{source}={shown} sums to {sum(counts)} but the model has {num_layers} layers; make it sum to "
            f"{num_layers}"
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


def log_partition(counts: list[int], source: str) -> None:
    """Log the split: a warning with its cost when it is uneven (as vLLM warns), else one line at INFO when it
    came from an override. `source` says where it came from: the flag's value, the environment, `auto` or the
    default split."""
    loss = uneven_loss(counts)
    if loss > 0:
        logger.warning(
            "uneven layer partition %s (%s): the slowest stage costs %.1f%% of throughput against a perfect split",
            counts, source, 100 * loss,
        )  # fmt: skip
    elif source != "the default split":
        logger.info("layer partition %s (%s)", counts, source)


def partition_source(override: object | None) -> str:
    """Where a partition comes from, as `log_partition` says it."""
    if override is not None:
        return f"--pp-layer-partition {override}"
    if os.environ.get(ENV_OVERRIDE):
        return f"{ENV_OVERRIDE}={os.environ[ENV_OVERRIDE]}"
    return "the default split"


def _check_sizes(num_layers: int, pp_size: int) -> None:
    if pp_size < 1:
        raise PartitionError(f"--pp-size must be >= 1, got {pp_size}")
    if pp_size > num_layers:
        raise PartitionError(
            f"--pp-size {pp_size} is more stages than the model's {num_layers} layers; "
            f"use at most {num_layers}"
        )
