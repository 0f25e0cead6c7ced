"""Where a job's ranks sit and what joins them: nodes of GPUs on one intra-node link (the
catalogue's NVLink or PCIe), nodes joined by a network of `training.inter_node_gbps` per node,
and the refusal of a node no real box is (no torch).

Bandwidths here are per direction, as NCCL's bus bandwidth is: a datasheet's NVLink or PCIe
figure counts both directions and is halved. Links never run at their nominal rate; the
stated efficiencies say how much of it collectives reach (docs/design.md#communication).
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.core.gpus.catalogue import Gpu, Interconnect
from autotune.core.schemas import TrainingSpec

_GIGA = 10**9


@dataclass(frozen=True)
class LinkEfficiency:
    """The share of a link's nominal bandwidth (per direction) NCCL's collectives reach.

    Defaults: NCCL's own cost model caps the bus bandwidth of 8 A100s on NVLink at 235 of their
    300 GB/s per direction (0.78, `ncclTopoTuneModel`); PCIe peer transfers lose more to the
    switch and protocol overhead (0.7); a 400 Gb/s InfiniBand or RoCE NIC gives about 90 % of
    its line rate to a ring (docs/design.md#communication)."""

    nvlink: float = 0.8
    pcie: float = 0.7
    network: float = 0.9

    def __post_init__(self) -> None:
        for name in ("nvlink", "pcie", "network"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} efficiency must be in (0, 1], got {value}")

    def of(self, kind: Interconnect) -> float:
        return self.nvlink if kind == "nvlink" else self.pcie


@dataclass(frozen=True)
class Topology:
    """`nodes` x `gpus_per_node` ranks; `intra_bytes_per_s` is what one GPU sends (and
    receives) to its node's other GPUs, `inter_bytes_per_s` what one node sends (and receives)
    to the others, both per direction and after the efficiencies."""

    nodes: int
    gpus_per_node: int
    intra_kind: Interconnect
    intra_bytes_per_s: float
    inter_bytes_per_s: float

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        network = (
            f", {self.inter_bytes_per_s / _GIGA:,.1f} GB/s per node between nodes"
            if self.nodes > 1
            else ""
        )
        return (
            f"{self.nodes} node(s) x {self.gpus_per_node} GPU(s): "
            f"{self.intra_bytes_per_s / _GIGA:,.1f} GB/s per GPU per direction over "
            f"{self.intra_kind}{network}"
        )


def topology_for(
    training: TrainingSpec, gpu: Gpu, efficiency: LinkEfficiency | None = None
) -> Topology:
    """The spec's ranks on `gpu`'s link, and its network of `inter_node_gbps` per node."""
    efficiency = efficiency or LinkEfficiency()
    link = gpu.link
    return Topology(
        nodes=training.node_count,
        gpus_per_node=training.ranks_per_node,
        intra_kind=link.kind,
        intra_bytes_per_s=link.bandwidth_bytes_per_s / 2 * efficiency.of(link.kind),
        inter_bytes_per_s=training.inter_node_gbps * _GIGA / 8 * efficiency.network,
    )


def box_problem(training: TrainingSpec, gpu: Gpu) -> str | None:
    """Why no real server holds the spec's node of `gpu`s (more than the catalogue's largest
    box of that card), naming the field; None when one does."""
    per_node, largest = training.ranks_per_node, gpu.largest_box
    if per_node <= largest.gpus:
        return None
    field = (
        "training.gpus_per_node" if training.gpus_per_node is not None else "training.world_size"
    )
    alone = "" if training.gpus_per_node is not None else " (world_size alone is one node)"
    return (
        f"{field}: {per_node} {gpu.name} GPUs on one node{alone}, but the largest box holds "
        f"{largest.gpus} ({largest.source}); set nodes and gpus_per_node"
    )


__all__ = ["LinkEfficiency", "Topology", "box_problem", "topology_for"]
