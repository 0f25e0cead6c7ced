"""How long one op takes on a named GPU by the roofline, and the assumptions that says so (no
torch).

An op is bound by its arithmetic (FLOPs over the card's dense peak for the op's dtype) or by
its memory traffic (bytes read and written over the card's bandwidth), whichever takes longer,
plus the launch cost of one kernel. Datasheet peaks are never reached: a stated fraction of each
is assumed, the same for every op (docs/design.md#estimates-without-a-gpu). The result is an
estimate to rank configurations and to compare GPUs, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from autotune.core.gpus.catalogue import Gpu

MathDtype = Literal["fp32", "tf32", "bf16", "fp16"]


@dataclass(frozen=True)
class RooflineAssumptions:
    """The fractions of the datasheet a training step reaches, and the cost of one launch.

    Defaults: large-model training reaches 40-60 % of the dense peak in its matmuls (model
    FLOPs utilisation reported for GPT-3- and Llama-scale runs) and elementwise kernels 60-80 %
    of the bandwidth; a launch costs about 5 us of GPU time when the CPU keeps ahead.
    """

    compute_efficiency: float = 0.5
    memory_efficiency: float = 0.7
    launch_s: float = 5e-6

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "memory_efficiency"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if self.launch_s < 0:
            raise ValueError(f"launch_s must be >= 0, got {self.launch_s}")

    def describe(self, gpu: Gpu) -> str:
        return (
            f"speed estimated by roofline on {gpu.name}: "
            f"{self.compute_efficiency:.0%} of the dense peak per dtype, "
            f"{self.memory_efficiency:.0%} of {gpu.memory_bandwidth_bytes_per_s / 1e9:,.0f} GB/s, "
            f"{self.launch_s * 1e6:g} us per kernel; no kernel was run"
        )


def peak_flops_per_s(gpu: Gpu, dtype: MathDtype) -> float:
    """The card's dense peak for `dtype`; fp32 where the card has no faster path for it."""
    peak = gpu.peak
    fast = {
        "fp32": None,
        "tf32": peak.tf32_per_s,
        "bf16": peak.bf16_per_s,
        "fp16": peak.fp16_per_s,
    }
    return fast[dtype] or peak.fp32_per_s


def op_time_s(
    gpu: Gpu,
    assumptions: RooflineAssumptions,
    *,
    flops: int,
    bytes_moved: int,
    dtype: MathDtype,
) -> float:
    """One kernel: the longer of its arithmetic and its memory traffic, plus its launch."""
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"flops and bytes_moved must be >= 0, got {flops} and {bytes_moved}")
    compute_s = flops / (peak_flops_per_s(gpu, dtype) * assumptions.compute_efficiency)
    memory_s = bytes_moved / (gpu.memory_bandwidth_bytes_per_s * assumptions.memory_efficiency)
    return max(compute_s, memory_s) + assumptions.launch_s


__all__ = ["MathDtype", "RooflineAssumptions", "op_time_s", "peak_flops_per_s"]
