"""How much of a layout's communication hides behind compute, as a stated assumption: an
optimizer step's compute time, communication time and the exposed part that adds to the step
(no torch; docs/design.md#communication).

The assumption: a collective runs beside the compute of the phase that issues it, one
collective at a time (NCCL serialises a communicator's work), and hides behind at most
`hidden_share` of that phase's compute (its kernels take SMs and memory bandwidth from the
matmuls). A micro-step's compute is a `backward_share` of backward and the rest forward. DDP's
bucketed all-reduce runs in the last micro-step's backward; FSDP2's all-gathers run a unit
ahead of the forward and backward they feed (prefetch) and its reduce-scatters behind the
backward; ZeroRedundancyOptimizer's broadcasts follow the optimizer step, with nothing left to
hide behind. The first of a phase's `count` collectives cannot hide (nothing runs before the
first unit's gather, nothing after the last bucket's reduction), so at least one of them is
exposed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from autotune.core.parallel.collectives import CollectiveLatency, collective_time
from autotune.core.parallel.layouts import Transfer
from autotune.core.parallel.topology import Topology
from autotune.core.schemas import Phase


@dataclass(frozen=True)
class OverlapAssumptions:
    """Backward is about twice forward (its two matmuls per forward one), so two thirds of a
    micro-step; a collective hides behind at most 80 % of its phase's compute."""

    backward_share: float = 2 / 3
    hidden_share: float = 0.8

    def __post_init__(self) -> None:
        for name in ("backward_share", "hidden_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")

    def describe(self, topology: Topology) -> str:
        return (
            f"communication estimated by NCCL's ring/tree model on {topology.describe()}; "
            f"a collective hides behind at most {self.hidden_share:.0%} of its phase's compute "
            f"(backward {self.backward_share:.0%} of a micro-step), the first of each phase "
            "never; the rest is exposed and adds to the step"
        )


@dataclass(frozen=True)
class StepTimes:
    """One optimizer step: its compute, all its communication, and the part of that which no
    compute hides (the step takes compute + exposed)."""

    compute_s: float
    communication_s: float
    exposed_s: float

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.exposed_s


def _transfer_time_s(
    transfer: Transfer, topology: Topology, latency: CollectiveLatency | None
) -> tuple[float, float]:
    """All `count` collectives of a transfer, and one of them (the part that cannot hide)."""
    if transfer.count == 0 or transfer.size_bytes == 0:
        return 0.0, 0.0
    each = collective_time(
        transfer.collective,
        transfer.size_bytes // transfer.count,
        transfer.group,
        topology,
        latency,
    ).time_s
    return each * transfer.count, each


def _exposed_s(
    communication_s: float, unhideable_s: float, window_s: float, share: float
) -> float:
    return max(communication_s - share * window_s, unhideable_s, 0.0)


def step_times(
    transfers: Iterable[Transfer],
    topology: Topology,
    *,
    compute_s: float,
    accumulation_steps: int,
    assumptions: OverlapAssumptions | None = None,
    latency: CollectiveLatency | None = None,
) -> StepTimes:
    """The step of `accumulation_steps` micro-steps whose compute (the roofline's, optimizer
    step included) takes `compute_s`, with `transfers` (`layout_transfers`) beside it."""
    assumptions = assumptions or OverlapAssumptions()
    steps = accumulation_steps
    micro_s = compute_s / steps
    window = {
        Phase.FORWARD: micro_s * (1 - assumptions.backward_share),
        Phase.BACKWARD: micro_s * assumptions.backward_share,
        Phase.OPTIMIZER: 0.0,
    }
    every: dict[Phase, list[float]] = defaultdict(lambda: [0.0, 0.0])
    last: dict[Phase, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for transfer in transfers:
        total_s, one_s = _transfer_time_s(transfer, topology, latency)
        # The last micro-step carries its own traffic and the optimizer step's.
        targets = [last] if transfer.cadence == "optimizer_step" else [every, last]
        for target in targets:
            target[transfer.phase][0] += total_s
            target[transfer.phase][1] = max(target[transfer.phase][1], one_s)
    share = assumptions.hidden_share
    exposed_each = sum(_exposed_s(c, u, window[p], share) for p, (c, u) in every.items())
    exposed_last = sum(_exposed_s(c, u, window[p], share) for p, (c, u) in last.items())
    communication = (steps - 1) * sum(c for c, _ in every.values()) + sum(
        c for c, _ in last.values()
    )
    return StepTimes(
        compute_s=compute_s,
        communication_s=communication,
        exposed_s=(steps - 1) * exposed_each + exposed_last,
    )


__all__ = ["OverlapAssumptions", "StepTimes", "step_times"]
