"""Capacity and bubble planning: which TP x PP to run a model with on a cluster, and why.

`python -m ringsched.plan` is the command line; this package is the arithmetic, as pure functions over frozen
dataclasses: `presets` (models and GPUs), `memory` (weights and KV per GPU), `traffic` (bytes per step and the
link they cross), `estimate` (one row per layout), `derivation` (the design document's per-token figures),
`recommend` and `report`.
"""

from ringsched.capacity.cluster import ClusterSpec
from ringsched.capacity.derivation import Derivation, derive
from ringsched.capacity.estimate import (
    LayoutRow,
    bubble_fraction,
    candidate_layouts,
    layout_row,
    one_node_baseline,
    with_baseline,
)
from ringsched.capacity.presets import (
    GPU_PRESETS,
    MODEL_PRESETS,
    CapacityError,
    GpuSpec,
    ModelSpec,
    load_gpu,
    load_model,
)
from ringsched.capacity.recommend import Recommendation, recommend

__all__ = [
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "ClusterSpec",
    "Derivation",
    "GpuSpec",
    "ModelSpec",
    "CapacityError",
    "LayoutRow",
    "Recommendation",
    "bubble_fraction",
    "candidate_layouts",
    "derive",
    "load_gpu",
    "load_model",
    "one_node_baseline",
    "layout_row",
    "recommend",
    "with_baseline",
]
