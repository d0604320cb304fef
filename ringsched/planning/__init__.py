"""Capacity and bubble planning: which TP x PP to run a model with on a cluster, and why.

`python -m ringsched.plan` is the command line; this package is the arithmetic, as pure functions over frozen
dataclasses: `presets` (models and GPUs), `memory` (weights and KV per GPU), `traffic` (bytes per step and the
link they cross), `capacity` (one row per layout), `derivation` (the design document's per-token figures),
`recommend` and `report`.
"""

from ringsched.planning.capacity import (
    ClusterSpec,
    PlanRow,
    bubble_fraction,
    candidate_layouts,
    one_node_baseline,
    plan_row,
    with_baseline,
)
from ringsched.planning.derivation import Derivation, derive
from ringsched.planning.presets import (
    GPU_PRESETS,
    MODEL_PRESETS,
    GpuSpec,
    ModelSpec,
    PlanError,
    load_gpu,
    load_model,
)
from ringsched.planning.recommend import Recommendation, recommend

__all__ = [
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "ClusterSpec",
    "Derivation",
    "GpuSpec",
    "ModelSpec",
    "PlanError",
    "PlanRow",
    "Recommendation",
    "bubble_fraction",
    "candidate_layouts",
    "derive",
    "load_gpu",
    "load_model",
    "one_node_baseline",
    "plan_row",
    "recommend",
    "with_baseline",
]
