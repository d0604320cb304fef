"""The figures of one (TP, PP) layout on one cluster: memory, KV capacity, traffic, latency, bubble.

Contract: `layout_row(model, cluster, tp, pp)` validates the layout (raising `CapacityError`) and returns a
`LayoutRow`; `candidate_layouts` lists every TP x PP = N the model allows, with the reason for each one it
rejects; `one_node_baseline` is TP = gpus-per-node, PP = 1 on one node, the configuration the design document
starts from and against which `concurrency_vs_one_node` is measured.

Memory arithmetic, per GPU (the document's): usable = reported memory x --mem-fraction (79.65 x 0.9 =
71.69 GiB on an H100), minus --reserve-gib for activations and graphs, minus this GPU's weights, is KV space.
A stage stores KV only for its own layers, so its KV per token shrinks with PP; with TP it shrinks only until
TP = h_kv.
Every token's KV lives on every stage, so the engine's token capacity is the minimum over stages, and the
per-GPU figures of a row are those of that binding stage.

Context parallelism (`cp` > 1, TP x PP x CP = N): each stage's weights are replicated on its CP ranks, and
each of them stores the KV of 1/CP of every sequence's tokens, so a stage holds CP times the tokens one of
its GPUs does: the layout that lets one sequence's KV exceed one GPU's memory. Its traffic per decode step is
the all-gather of the partial attention outputs, one per layer (`traffic.cp_decode_bytes`); ring attention's
K/V passing in prefill is reported per prompt token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ringsched.capacity import memory
from ringsched.capacity.cluster import ClusterSpec
from ringsched.capacity.presets import GIB, CapacityError, ModelSpec
from ringsched.capacity.step_traffic import step_traffic
from ringsched.layout.partition import PartitionError, head_layers, resolve_partition, uneven_loss


@dataclass(frozen=True)
class StageFigures:
    """One GPU of one stage."""

    layers: int
    weights_gib: float
    kv_bytes_per_token: int
    kv_space_gib: float
    token_capacity: int


@dataclass(frozen=True)
class LayoutRow:
    """What the planner says of one (TP, PP, CP) layout; per-GPU memory figures are the binding stage's."""

    tp: int
    pp: int
    fits: bool
    weights_per_gpu_gib: float
    kv_bytes_per_token_per_gpu: int
    kv_space_per_gpu_gib: float
    token_capacity: int
    concurrent_sequences: int
    allreduce_bytes: float
    tp_bytes_per_rank_per_step: float
    seam_bytes_per_rank_per_step: float
    comm_bytes_per_rank_per_step: float
    comm_bytes_per_rank_per_token: float
    tp_link: str | None
    seam_link: str | None
    comm_ms_per_step: float
    ideal_token_latency_ms: float
    partition: list[int]
    uneven_loss: float
    in_flight: int
    bubble: float
    binding_stage: int
    stages: list[StageFigures] = field(default_factory=list)
    concurrency_vs_one_node: float | None = None
    cp: int = 1
    cp_bytes_per_rank_per_step: float = 0.0  # decode: the partial outputs' all-gather, every layer
    cp_prefill_bytes_per_token: float = 0.0  # prefill: ring attention's K/V, every layer, per prompt token
    cp_link: str | None = None


def bubble_fraction(stages: int, in_flight: int) -> float:
    """GPipe's idle share (S-1)/(S+M-1): 75% at S=4, M=1; 4.5% at M=64."""
    return (stages - 1) / (stages + in_flight - 1)


def check_layout(model: ModelSpec, cluster: ClusterSpec, tp: int, pp: int, cp: int = 1) -> None:
    """Raise `CapacityError` unless TP x PP (x CP) = --gpus and the model can be cut that way."""
    if tp < 1 or pp < 1 or cp < 1:
        raise CapacityError(f"--tp, --pp and --cp must be >= 1, got --tp {tp} --pp {pp} --cp {cp}")
    if cp > 1 and tp * pp * cp != cluster.gpus:
        raise CapacityError(
            f"--tp {tp} x --pp {pp} x --cp {cp} = {tp * pp * cp} GPUs but --gpus is {cluster.gpus}; make TP x PP "
            "x CP equal --gpus"
        )
    if cp == 1 and tp * pp != cluster.gpus:
        shapes = ", ".join(f"{t}x{cluster.gpus // t}" for t in range(1, cluster.gpus + 1) if cluster.gpus % t == 0)
        raise CapacityError(
            f"--tp {tp} x --pp {pp} = {tp * pp} GPUs but --gpus is {cluster.gpus}; make TP x PP equal --gpus "
            f"(TPxPP for {cluster.gpus}: {shapes})"
        )
    if model.num_heads % tp:
        divisors = ", ".join(str(t) for t in range(1, model.num_heads + 1) if model.num_heads % t == 0)
        raise CapacityError(
            f"--tp {tp} does not divide {model.name}'s {model.num_heads} attention heads; choose a TP from {divisors}"
        )
    kv = model.num_kv_heads
    if kv % tp and tp % kv:
        raise CapacityError(
            f"--tp {tp} neither divides nor is a multiple of {model.name}'s {kv} KV heads, so they can be "
            f"neither split nor replicated evenly; choose a TP that divides {kv} or is a multiple of it"
        )
    if pp > model.num_layers:
        raise CapacityError(f"--pp {pp} is more stages than {model.name}'s {model.num_layers} layers")


def layout_row(
    model: ModelSpec,
    cluster: ClusterSpec,
    tp: int,
    pp: int,
    partition: str | list[int] | None = None,
    cp: int = 1,
) -> LayoutRow:
    """All figures of TP x PP (x CP); `partition` overrides the layer split as --pp-layer-partition does."""
    check_layout(model, cluster, tp, pp, cp)
    try:
        counts = resolve_partition(model.num_layers, pp, partition, head_layers(model))
    except PartitionError as err:
        raise CapacityError(str(err)) from None
    stages = [_stage(model, cluster, tp, layers, s == 0, s == pp - 1, cp) for s, layers in enumerate(counts)]
    binding = min(range(pp), key=lambda s: stages[s].token_capacity)
    capacity = stages[binding].token_capacity

    t = step_traffic(model, cluster, tp, counts, cp)

    in_flight = cluster.in_flight if cluster.in_flight is not None else pp
    return LayoutRow(
        tp=tp,
        pp=pp,
        fits=capacity >= cluster.max_model_len,
        weights_per_gpu_gib=stages[binding].weights_gib,
        kv_bytes_per_token_per_gpu=stages[binding].kv_bytes_per_token,
        kv_space_per_gpu_gib=stages[binding].kv_space_gib,
        token_capacity=capacity,
        concurrent_sequences=capacity // cluster.max_model_len,
        allreduce_bytes=t.allreduce_bytes,
        tp_bytes_per_rank_per_step=t.tp_bytes,
        seam_bytes_per_rank_per_step=t.seam_bytes,
        comm_bytes_per_rank_per_step=t.tp_bytes + t.seam_bytes + t.cp_bytes,
        comm_bytes_per_rank_per_token=(t.tp_bytes + t.seam_bytes + t.cp_bytes) / cluster.batch_tokens,
        tp_link=t.tp_link,
        seam_link=t.seam_link,
        comm_ms_per_step=t.ms,
        ideal_token_latency_ms=_ideal_token_latency_ms(model, cluster, tp, counts),
        partition=counts,
        uneven_loss=uneven_loss(counts),
        in_flight=in_flight,
        bubble=bubble_fraction(pp, in_flight),
        binding_stage=binding,
        stages=stages,
        cp=cp,
        cp_bytes_per_rank_per_step=t.cp_bytes,
        cp_prefill_bytes_per_token=t.cp_prefill_per_token,
        cp_link=t.cp_link,
    )


def _ideal_token_latency_ms(model: ModelSpec, cluster: ClusterSpec, tp: int, counts: list[int]) -> float:
    """Ideal latency of one token: the stages run in turn and each GPU reads its weights at HBM speed, so the sum
    is W / (TP x B_HBM) whatever PP is: S cancels, as the document derives."""
    pp = len(counts)
    read = sum(
        memory.stage_read_bytes(model, tp, layers, first=s == 0, last=s == pp - 1) for s, layers in enumerate(counts)
    )
    return read / (cluster.gpu.hbm_tb_per_s * 1e12) * 1e3


def _stage(
    model: ModelSpec, cluster: ClusterSpec, tp: int, layers: int, first: bool, last: bool, cp: int = 1
) -> StageFigures:
    """One GPU of a stage. `kv_bytes_per_token` is the KV of a token it stores; with CP a stage's CP ranks each
    store 1/CP of the tokens, so the stage's token capacity is CP times one GPU's."""
    weights = memory.stage_weight_bytes(model, tp, layers, first=first, last=last) / GIB
    kv_per_token = memory.kv_bytes_per_token(model, tp, layers)
    kv_space = cluster.usable_gib - cluster.reserve_gib - weights
    capacity = cp * max(0, int(kv_space * GIB // kv_per_token))
    return StageFigures(layers, weights, kv_per_token, kv_space, capacity)


def candidate_layouts(
    model: ModelSpec, cluster: ClusterSpec, partition: str | list[int] | None = None, cp: int = 1
) -> tuple[list[LayoutRow], list[tuple[int, int, int, str]]]:
    """Every TP x PP (x CP) = --gpus that the model allows and that fits, and (tp, pp, cp, why) for the rest."""
    rows, skipped = [], []
    if cluster.gpus % cp:
        return rows, [(0, 0, cp, f"--cp {cp} does not divide --gpus {cluster.gpus}")]
    group = cluster.gpus // cp
    for tp in range(1, group + 1):
        if group % tp:
            continue
        pp = group // tp
        try:
            row = layout_row(model, cluster, tp, pp, partition, cp)
        except CapacityError as err:
            skipped.append((tp, pp, cp, str(err)))
            continue
        if row.fits:
            rows.append(row)
        else:
            skipped.append((tp, pp, cp, _why_not(row, cluster)))
    return rows, skipped


def _why_not(row: LayoutRow, cluster: ClusterSpec) -> str:
    room = cluster.usable_gib - cluster.reserve_gib
    if row.kv_space_per_gpu_gib <= 0:
        return f"{row.weights_per_gpu_gib:.2f} GiB of weights per GPU, more than the {room:.2f} GiB available"
    return (
        f"{row.kv_space_per_gpu_gib:.2f} GiB of KV space holds {row.token_capacity} tokens, less than one "
        f"{cluster.max_model_len}-token sequence"
    )


def one_node_baseline(model: ModelSpec, cluster: ClusterSpec) -> LayoutRow | None:
    """TP = --gpus-per-node on one node, when the cluster is bigger than a node and that layout fits."""
    if cluster.gpus <= cluster.gpus_per_node:
        return None
    node = dataclasses.replace(cluster, gpus=cluster.gpus_per_node)
    try:
        row = layout_row(model, node, cluster.gpus_per_node, 1)
    except CapacityError:
        return None
    return row if row.fits else None


def with_baseline(rows: list[LayoutRow], baseline: LayoutRow | None) -> list[LayoutRow]:
    """Fill in `concurrency_vs_one_node`: the gain in whole sequences over the one-node baseline."""
    if baseline is None or baseline.concurrent_sequences == 0:
        return rows
    base = baseline.concurrent_sequences
    return [dataclasses.replace(r, concurrency_vs_one_node=r.concurrent_sequences / base - 1) for r in rows]
