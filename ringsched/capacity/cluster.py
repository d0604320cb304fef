"""The cluster a capacity plan is made for: its GPUs, their links and the serving parameters (`ClusterSpec`)."""

from __future__ import annotations

from dataclasses import dataclass

from ringsched.capacity.presets import CapacityError, GpuSpec


@dataclass(frozen=True)
class ClusterSpec:
    """The GPUs and the serving parameters a plan is made for."""

    gpu: GpuSpec
    gpus: int
    gpus_per_node: int
    inter_node_gbps: float = 400.0  # Gb/s per GPU per direction; 400 = InfiniBand NDR, one NIC per GPU
    mem_fraction: float = 0.9
    reserve_gib: float = 3.0
    max_model_len: int = 8192
    batch_tokens: int = 64
    in_flight: int | None = None  # micro-batches in flight; None = PP, what vLLM and SGLang keep in flight

    def __post_init__(self) -> None:
        for flag, value in (
            ("--gpus", self.gpus),
            ("--gpus-per-node", self.gpus_per_node),
            ("--max-model-len", self.max_model_len),
            ("--batch-tokens", self.batch_tokens),
        ):
            if not isinstance(value, int) or value < 1:
                raise CapacityError(f"{flag} must be a positive integer, got {value!r}")
        if self.in_flight is not None and self.in_flight < 1:
            raise CapacityError(f"--in-flight must be at least 1 micro-batch, got {self.in_flight}")
        if not 0 < self.mem_fraction <= 1:
            raise CapacityError(f"--mem-fraction must be in (0, 1], got {self.mem_fraction}; vLLM's default is 0.9")
        if self.reserve_gib < 0:
            raise CapacityError(f"--reserve-gib must be >= 0, got {self.reserve_gib}")
        if not self.inter_node_gbps > 0:
            raise CapacityError(f"--inter-node-gbps must be positive, got {self.inter_node_gbps}")

    @property
    def usable_gib(self) -> float:
        """Memory the engine may use per GPU: 79.65 GiB x 0.9 = 71.69 GiB on an H100."""
        return self.gpu.memory_gib * self.mem_fraction

    @property
    def inter_node_gb_per_s(self) -> float:
        """The inter-node link in GB/s (bytes): 400 Gb/s is 50 GB/s per direction."""
        return self.inter_node_gbps / 8
