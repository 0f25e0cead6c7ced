"""NCCL-style cost of one collective: bus factors, the slowest link on the path, ring or tree."""

from __future__ import annotations

import pytest

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.parallel.collectives import (
    Collective,
    CollectiveLatency,
    Group,
    bus_bytes_per_s,
    bus_factor,
    collective_time,
)
from autotune.core.parallel.topology import topology_for
from autotune.core.schemas import TrainingSpec

GB = 10**9
NO_LATENCY = CollectiveLatency(0, 0, 0, 0, 0, 0)


@pytest.mark.parametrize(
    ("collective", "ranks", "factor"),
    [
        (Collective.ALL_REDUCE, 8, 2 * 7 / 8),
        (Collective.ALL_REDUCE, 2, 1.0),
        (Collective.ALL_GATHER, 8, 7 / 8),
        (Collective.REDUCE_SCATTER, 4, 3 / 4),
        (Collective.BROADCAST, 4, 1.0),
        (Collective.ALL_REDUCE, 1, 0.0),
    ],
)
def test_bus_factor_is_nccls(collective: Collective, ranks: int, factor: float) -> None:
    assert bus_factor(collective, ranks) == pytest.approx(factor)


def _h100(nodes: int, gbps: float = 400) -> TrainingSpec:
    return TrainingSpec(nodes=nodes, gpus_per_node=8, inter_node_gbps=gbps)


def test_a_ring_runs_at_its_slowest_link() -> None:
    topology = topology_for(_h100(4), find_gpu("H100 80GB"))
    within = Group(8, 1)
    across = Group(8, 4)
    assert bus_bytes_per_s(within, topology) == topology.intra_bytes_per_s
    assert bus_bytes_per_s(across, topology) == topology.inter_bytes_per_s  # 45 < 360 GB/s
    # Eight groups through one NIC at once get an eighth of it each.
    shared = Group(1, 4, sharing_network=8)
    assert bus_bytes_per_s(shared, topology) == pytest.approx(topology.inter_bytes_per_s / 8)


def test_time_is_size_times_bus_factor_over_bus_bandwidth() -> None:
    topology = topology_for(_h100(1), find_gpu("H100 80GB"))
    size = 10 * GB
    found = collective_time(Collective.ALL_GATHER, size, Group(8, 1), topology, NO_LATENCY)
    assert found.time_s == pytest.approx(size * 7 / 8 / (450 * GB * 0.8))
    all_reduce = collective_time(Collective.ALL_REDUCE, size, Group(8, 1), topology, NO_LATENCY)
    # A large all-reduce is a ring (twice an all-gather's bytes); the tree carries 2.2x.
    assert all_reduce.algorithm == "ring"
    assert all_reduce.time_s == pytest.approx(2 * found.time_s)


def test_a_small_all_reduce_over_many_nodes_takes_the_tree() -> None:
    topology = topology_for(TrainingSpec(nodes=64, gpus_per_node=1), find_gpu("H100 80GB"))
    small = collective_time(Collective.ALL_REDUCE, 1024, Group(1, 64), topology)
    large = collective_time(Collective.ALL_REDUCE, 10 * GB, Group(1, 64), topology)
    assert (small.algorithm, large.algorithm) == ("tree", "ring")


def test_pcie_is_slower_than_nvlink_and_a_slow_network_slower_still() -> None:
    size = GB
    nvlink = collective_time(
        Collective.ALL_REDUCE, size, Group(8, 1), topology_for(_h100(1), find_gpu("H100 80GB"))
    )
    pcie = collective_time(
        Collective.ALL_REDUCE, size, Group(8, 1), topology_for(_h100(1), find_gpu("L4"))
    )
    fast = topology_for(_h100(4, 400), find_gpu("H100 80GB"))
    slow = topology_for(_h100(4, 50), find_gpu("H100 80GB"))
    across_fast = collective_time(Collective.ALL_REDUCE, size, Group(8, 4), fast)
    across_slow = collective_time(Collective.ALL_REDUCE, size, Group(8, 4), slow)
    assert nvlink.time_s < pcie.time_s
    assert nvlink.time_s < across_fast.time_s < across_slow.time_s
