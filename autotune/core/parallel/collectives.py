"""What one collective costs: NCCL's ring and tree cost models over the slowest link on the
path (no torch).

A collective over n ranks of a buffer of `size_bytes` (the whole tensor: all-reduce's tensor,
all-gather's output, reduce-scatter's input, broadcast's tensor) takes, in NCCL's model
(`ncclTopoTuneModel` and `ncclTopoGetAlgoTime`, docs/design.md#communication),

    time = latency + size_bytes x bus_factor / bus_bandwidth

where the bus bandwidth is what each link carries per direction and the bus factor turns it
into the algorithm bandwidth: 2(n-1)/n for all-reduce (a reduce-scatter then an all-gather),
(n-1)/n for all-gather and reduce-scatter, 1 for broadcast. A ring's bus bandwidth is its
slowest link's: NVLink or PCIe within a node, the node's network share between nodes. NCCL's
tree all-reduce reaches 90 % of the links' bandwidth at half the algorithm bandwidth of a
ring's bus (its `ratio = .5`), and pays latency in log2(nodes) network hops instead of a ring's
2(nodes-1): NCCL picks the faster, and so does `collective_time`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from autotune.core.parallel.topology import Topology

Algorithm = Literal["ring", "tree"]


class Collective(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"


def bus_factor(collective: Collective, ranks: int) -> float:
    """Bytes each link carries per byte of the buffer: bus bandwidth = algorithm bandwidth x
    this (NCCL's nccl-tests convention)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if collective is Collective.ALL_REDUCE:
        return 2 * (ranks - 1) / ranks
    if collective is Collective.BROADCAST:
        return 1.0 if ranks > 1 else 0.0
    return (ranks - 1) / ranks


@dataclass(frozen=True)
class Group:
    """The ranks of one collective and where they sit: `ranks_per_node` of them on each of
    `nodes` nodes, and how many such groups use each node's network at the same time (hybrid
    sharding's all-reduces across nodes run one per shard rank, all through the same NIC)."""

    ranks_per_node: int
    nodes: int
    sharing_network: int = 1

    @property
    def ranks(self) -> int:
        return self.ranks_per_node * self.nodes


@dataclass(frozen=True)
class CollectiveLatency:
    """Seconds per step of a ring or a tree, NCCL's Simple protocol (`baseLat`, `hwLat` of
    its tuning model): the base cost of a launch, then per ring step 3.4 us over NVLink, 5.7 us
    over PCIe, 9.6 us over the network; per tree level 28 us within a node, 50 us across."""

    base_s: float = 8.4e-6
    ring_nvlink_s: float = 3.4e-6
    ring_pcie_s: float = 5.7e-6
    ring_network_s: float = 9.6e-6
    tree_intra_s: float = 28e-6
    tree_network_s: float = 50e-6
    tree_efficiency: float = 0.9  # of the links' bandwidth, NCCL's `busBw * .9` for trees


@dataclass(frozen=True)
class CollectiveTime:
    algorithm: Algorithm
    time_s: float
    bus_bytes_per_s: float


def bus_bytes_per_s(group: Group, topology: Topology) -> float:
    """The slowest link a ring of `group` crosses, per direction: the intra-node link when it
    has several ranks on a node, the node's network (shared by the groups using it at once)
    when it spans nodes."""
    links = []
    if group.ranks_per_node > 1:
        links.append(topology.intra_bytes_per_s)
    if group.nodes > 1:
        links.append(topology.inter_bytes_per_s / group.sharing_network)
    return min(links) if links else math.inf


def _ring_latency_s(
    collective: Collective, group: Group, topology: Topology, latency: CollectiveLatency
) -> float:
    # n - 1 ring steps; an all-reduce is a reduce-scatter then an all-gather, twice as many.
    steps = (2 if collective is Collective.ALL_REDUCE else 1) * (group.ranks - 1)
    network_steps = steps * (group.nodes - 1) // max(group.ranks - 1, 1)
    intra_s = latency.ring_nvlink_s if topology.intra_kind == "nvlink" else latency.ring_pcie_s
    return (
        latency.base_s + (steps - network_steps) * intra_s + network_steps * latency.ring_network_s
    )


def collective_time(
    collective: Collective,
    size_bytes: int,
    group: Group,
    topology: Topology,
    latency: CollectiveLatency | None = None,
) -> CollectiveTime:
    """The time of one collective of a `size_bytes` buffer over `group`: a ring, or for an
    all-reduce NCCL's tree when that is faster."""
    latency = latency or CollectiveLatency()
    if group.ranks == 1 or size_bytes == 0:
        return CollectiveTime("ring", 0.0, math.inf)
    bus = bus_bytes_per_s(group, topology)
    ring = CollectiveTime(
        "ring",
        _ring_latency_s(collective, group, topology, latency)
        + size_bytes * bus_factor(collective, group.ranks) / bus,
        bus,
    )
    if collective is not Collective.ALL_REDUCE:
        return ring
    tree_bus = bus * latency.tree_efficiency
    levels_s = (group.ranks_per_node - 1) * latency.tree_intra_s + math.log2(
        group.nodes
    ) * latency.tree_network_s
    tree = CollectiveTime(
        "tree", latency.base_s + 2 * levels_s + size_bytes / (0.5 * tree_bus), tree_bus
    )
    return tree if tree.time_s < ring.time_s else ring


__all__ = [
    "Collective",
    "CollectiveLatency",
    "CollectiveTime",
    "Group",
    "bus_bytes_per_s",
    "bus_factor",
    "collective_time",
]
