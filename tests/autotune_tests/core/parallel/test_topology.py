"""Topology in the spec: nodes x gpus_per_node, world_size alone as one node, the refusals named
by field, each catalogue GPU's intra-node link and largest box, and fingerprints kept."""

from __future__ import annotations

from typing import Any

import pytest

from autotune.core.gpus.catalogue import GPUS, find_gpu
from autotune.core.parallel.topology import box_problem, topology_for
from autotune.core.schemas import Spec, TrainingSpec
from autotune.remote.protocol import EstimateTarget, RunCreate, fingerprint

GB = 10**9


def _training(**fields: Any) -> TrainingSpec:
    return TrainingSpec.model_validate(fields)


@pytest.mark.parametrize(
    ("fields", "world", "nodes", "per_node"),
    [
        ({"world_size": 8}, 8, 1, 8),
        ({"nodes": 4, "gpus_per_node": 8}, 32, 4, 8),
        ({"gpus_per_node": 4}, 4, 1, 4),
        ({"nodes": 4, "world_size": 32}, 32, 4, 8),
        ({"nodes": 2, "gpus_per_node": 8, "world_size": 16}, 16, 2, 8),
        # Hybrid specs written before nodes existed: one node per shard group.
        ({"world_size": 16, "sharding": "hybrid", "shard_group_size": 8}, 16, 2, 8),
    ],
)
def test_world_size_is_nodes_times_gpus_per_node(
    fields: dict[str, Any], world: int, nodes: int, per_node: int
) -> None:
    training = _training(**fields)
    assert (training.world_size, training.node_count, training.ranks_per_node) == (
        world,
        nodes,
        per_node,
    )


def test_hybrid_over_nodes_shards_within_each_node_by_default() -> None:
    training = _training(nodes=4, gpus_per_node=8, sharding="hybrid")
    assert training.shard_group_size == 8


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"nodes": 1, "gpus_per_node": 8, "sharding": "hybrid", "shard_group_size": 4},
            "training.sharding: hybrid shards within a node",
        ),
        ({"gpus_per_node": 8, "sharding": "hybrid"}, "training.sharding: hybrid shards within"),
        (
            {"nodes": 2, "gpus_per_node": 8, "sharding": "hybrid", "shard_group_size": 3},
            "training.shard_group_size: 3 must divide world_size 16",
        ),
        (
            {"nodes": 2, "gpus_per_node": 6, "sharding": "hybrid", "shard_group_size": 4},
            "training.shard_group_size: 4 neither divides nor is a multiple of gpus_per_node 6",
        ),
        (
            {"nodes": 4, "gpus_per_node": 8, "world_size": 16},
            "training.world_size: 16, but nodes x gpus_per_node is 4 x 8 = 32",
        ),
        ({"nodes": 4, "world_size": 30}, "training.gpus_per_node: needed with nodes 4"),
        ({"nodes": 2, "gpus_per_node": 8, "inter_node_gbps": 0}, "inter_node_gbps"),
    ],
)
def test_invalid_topologies_are_refused_by_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _training(**fields)


@pytest.mark.parametrize(
    ("gpu", "per_node", "problem"),
    [
        ("H100 80GB", 8, None),
        ("H100 80GB", 16, "16 H100 80GB GPUs on one node"),
        ("A100 80GB", 16, None),
        ("A100 80GB", 32, "HGX A100 with 4, 8 or 16 GPUs"),
        ("L4", 18, None),
        ("RTX 4090", 12, "largest box holds 10"),
    ],
)
def test_a_node_larger_than_any_box_of_that_card_is_refused(
    gpu: str, per_node: int, problem: str | None
) -> None:
    found = box_problem(_training(nodes=2, gpus_per_node=per_node), find_gpu(gpu))
    assert found is None if problem is None else problem in (found or "")
    if problem is not None:
        assert (found or "").startswith("training.gpus_per_node:")
    alone = box_problem(_training(world_size=per_node), find_gpu(gpu))
    assert (alone is None) == (problem is None)
    assert alone is None or alone.startswith("training.world_size:")


def test_every_catalogue_gpu_has_a_sourced_link_and_box() -> None:
    for gpu in GPUS:
        assert gpu.link.source and gpu.largest_box.source
        assert gpu.link.generation.startswith("NVLink" if gpu.interconnect == "nvlink" else "PCIe")
        assert gpu.largest_box.gpus >= 8
    # Cards without NVLink talk over PCIe.
    for name in ("L4", "RTX 4090", "T4", "L40S", "A10G", "RTX 3090"):
        assert find_gpu(name).interconnect == "pcie"
    assert find_gpu("H100 80GB").link.bandwidth_bytes_per_s == 900 * GB


def test_topology_halves_the_datasheet_and_applies_the_efficiencies() -> None:
    topology = topology_for(_training(nodes=4, gpus_per_node=8), find_gpu("H100 80GB"))
    assert (topology.nodes, topology.gpus_per_node) == (4, 8)
    assert topology.intra_bytes_per_s == pytest.approx(450 * GB * 0.8)
    # 400 Gb/s by default: 50 GB/s, 90 % of it.
    assert topology.inter_bytes_per_s == pytest.approx(50 * GB * 0.9)
    slow = topology_for(
        _training(nodes=4, gpus_per_node=8, inter_node_gbps=50), find_gpu("H100 80GB")
    )
    assert slow.inter_bytes_per_s == pytest.approx(50 / 8 * GB * 0.9)


# Computed by the code before topology existed (git archive of 3436b1f, run on these specs):
# stored runs of these specs keep answering.
OLD_FINGERPRINTS = [
    (
        {"seq_len": 64, "world_size": 8, "sharding": "zero3", "target_global_batch": 64},
        "gpt2-tiny",
        "75ffe02ec1580418eee8c226acfc3973fe0c303aa165e59eb558462472137ec9",
    ),
    (
        {"seq_len": 64, "world_size": 16, "sharding": "hybrid", "shard_group_size": 8},
        "llama-tiny",
        "97604a9dae09974c48b5478404da1221a9c36632d48f7cdf57f5e9774c63bfee",
    ),
    ({}, "gpt2-tiny", "fb20205837194ee154928bf0f132b826a844a96d191a206256af95e5917d7b03"),
]


@pytest.mark.parametrize(("training", "preset", "expected"), OLD_FINGERPRINTS)
def test_specs_from_before_topology_keep_their_fingerprints(
    training: dict[str, Any], preset: str, expected: str
) -> None:
    spec = Spec.model_validate({"model": {"preset": preset}, "training": training})
    assert fingerprint(spec, EstimateTarget(gpu="H100 80GB"), "0.1.0") == expected


def test_one_node_written_either_way_is_one_fingerprint_and_the_network_counts_across_nodes() -> (
    None
):
    def fp(training: dict[str, Any]) -> str:
        spec = Spec.model_validate({"model": {"preset": "gpt2-tiny"}, "training": training})
        return fingerprint(spec, EstimateTarget(gpu="H100 80GB"), "1")

    assert fp({"world_size": 8}) == fp({"nodes": 1, "gpus_per_node": 8})
    assert fp({"world_size": 8}) == fp({"world_size": 8, "inter_node_gbps": 50})
    four_nodes = fp({"nodes": 4, "gpus_per_node": 8})
    assert four_nodes != fp({"world_size": 32})
    assert four_nodes != fp({"nodes": 4, "gpus_per_node": 8, "inter_node_gbps": 50})


def test_a_run_on_a_named_gpu_refuses_a_node_no_box_holds() -> None:
    body = {
        "spec": {"model": {"preset": "gpt2-tiny"}, "training": {"world_size": 16}},
        "device": {"kind": "estimate", "gpu": "H100 80GB"},
    }
    with pytest.raises(ValueError, match="spec.training.world_size: 16 H100 80GB GPUs"):
        RunCreate.model_validate(body)
    body["device"] = {"kind": "emulated", "gpu": "A100 80GB"}
    assert RunCreate.model_validate(body).spec.training.world_size == 16
