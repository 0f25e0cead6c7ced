"""What each layout moves and what of it compute hides: DDP's once-per-step all-reduce exposes
less than full shard's gathers every micro-step on NVLink, and hybrid sharding beats full shard
when the network between nodes is slow."""

from __future__ import annotations

from typing import Any

import pytest

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.parallel.collectives import Collective
from autotune.core.parallel.layouts import (
    ModelParameters,
    ParameterShape,
    ShardUnit,
    layout_transfers,
)
from autotune.core.parallel.overlap import StepTimes, step_times
from autotune.core.parallel.topology import topology_for
from autotune.core.schemas import TrainingSpec


def _llama_8b_like(element_size: int = 4) -> ModelParameters:
    """32 blocks of 218M parameters (4096 wide, 14336 MLP) and a 1.05B-parameter root: about
    8B, fp32 master weights by default."""
    width, mlp = 4096, 14336
    block = ShardUnit(
        tuple(
            ParameterShape(rows, rows * cols, element_size, True)
            for rows, cols in [(width, width)] * 2
            + [(1024, width)] * 2
            + [(mlp, width)] * 2
            + [(width, mlp)]
        )
    )
    root = ShardUnit((ParameterShape(128256, 128256 * width, element_size, True),) * 2)
    return ModelParameters(units=(block,) * 32 + (root,))


def _times(model: ModelParameters, accumulation: int = 4, **training: Any) -> StepTimes:
    spec = TrainingSpec.model_validate(training)
    topology = topology_for(spec, find_gpu("H100 80GB"))
    transfers = layout_transfers(spec, model, topology)
    # 8B model, 8 x 4096 tokens per micro-step on an H100 at 50 % of its bf16 peak: ~1.6 s.
    return step_times(
        transfers, topology, compute_s=1.6 * accumulation, accumulation_steps=accumulation
    )


def test_transfers_per_layout_name_their_collectives_and_cadence() -> None:
    model = _llama_8b_like()
    spec = TrainingSpec(world_size=8)
    topology = topology_for(spec, find_gpu("H100 80GB"))
    kinds = {
        sharding: [
            (t.collective, t.cadence)
            for t in layout_transfers(
                TrainingSpec(world_size=8, sharding=sharding), model, topology
            )
        ]
        for sharding in ("none", "zero1", "zero2", "zero3")
    }
    assert kinds["none"] == [(Collective.ALL_REDUCE, "optimizer_step")]
    assert kinds["zero1"] == [
        (Collective.ALL_REDUCE, "optimizer_step"),
        (Collective.BROADCAST, "optimizer_step"),
    ]
    assert kinds["zero2"] == [
        (Collective.ALL_GATHER, "micro_step"),
        (Collective.REDUCE_SCATTER, "micro_step"),
    ]
    assert kinds["zero3"] == [
        (Collective.ALL_GATHER, "micro_step"),
        (Collective.ALL_GATHER, "micro_step"),
        (Collective.REDUCE_SCATTER, "micro_step"),
    ]
    (all_reduce,) = layout_transfers(spec, model, topology)
    assert all_reduce.size_bytes == model.trainable_bytes  # every gradient, once per step


def test_ddp_exposes_less_than_full_shard_at_the_same_batch_on_nvlink() -> None:
    model = _llama_8b_like()
    ddp = _times(model, world_size=8, sharding="none")
    full_shard = _times(model, world_size=8, sharding="zero3")
    assert ddp.exposed_s < full_shard.exposed_s
    assert ddp.communication_s < full_shard.communication_s
    assert ddp.step_time_s < full_shard.step_time_s
    # Full shard gathers every micro-step: its communication grows with the accumulation, DDP's
    # does not.
    assert _times(model, 8, world_size=8, sharding="zero3").communication_s == pytest.approx(
        2 * full_shard.communication_s
    )
    assert _times(model, 8, world_size=8, sharding="none").communication_s == pytest.approx(
        ddp.communication_s
    )


def test_hybrid_beats_full_shard_when_the_network_is_slow() -> None:
    model = _llama_8b_like()
    slow = {"nodes": 4, "gpus_per_node": 8, "inter_node_gbps": 50}
    hybrid = _times(model, sharding="hybrid", **slow)
    full_shard = _times(model, sharding="zero3", **slow)
    assert hybrid.step_time_s < full_shard.step_time_s
    assert hybrid.exposed_s < full_shard.exposed_s
    # The network is what full shard waits on: at 400 Gb/s it waits less.
    fast = _times(model, sharding="zero3", nodes=4, gpus_per_node=8)
    assert fast.exposed_s < full_shard.exposed_s


def test_exposed_is_what_compute_cannot_hide() -> None:
    model = _llama_8b_like()
    times = _times(model, world_size=8, sharding="zero3")
    assert 0 < times.exposed_s <= times.communication_s
    assert times.step_time_s == times.compute_s + times.exposed_s
    # With no compute to hide behind, every collective is exposed.
    spec = TrainingSpec(world_size=8, sharding="zero3")
    topology = topology_for(spec, find_gpu("H100 80GB"))
    bare = step_times(
        layout_transfers(spec, model, topology), topology, compute_s=0.0, accumulation_steps=4
    )
    assert bare.exposed_s == pytest.approx(bare.communication_s)


def test_one_rank_moves_nothing() -> None:
    spec = TrainingSpec()
    topology = topology_for(spec, find_gpu("H100 80GB"))
    assert layout_transfers(spec, _llama_8b_like(), topology) == ()


def test_fsdp_pads_each_parameter_to_the_shard_count() -> None:
    shape = ParameterShape(dim0=9, numel=54, element_size=4, trainable=True)
    assert shape.padded_numel(4) == 12 * 6
    assert shape.padded_numel(3) == 54
    assert ShardUnit((shape,)).gathered_bytes(4) == 12 * 6 * 4


def test_fp32_weights_under_autocast_are_gathered_in_16_bits_and_reduced_in_fp32() -> None:
    model = _llama_8b_like()
    topology = topology_for(TrainingSpec(world_size=8), find_gpu("H100 80GB"))

    def sizes(**training: Any) -> list[tuple[Collective, int]]:
        spec = TrainingSpec(world_size=8, sharding="zero3", **training)
        return [(t.collective, t.size_bytes) for t in layout_transfers(spec, model, topology)]

    fp32 = sizes()
    assert sizes(precision="bf16") == [
        (Collective.ALL_GATHER, fp32[0][1] // 2),
        (Collective.ALL_GATHER, fp32[1][1] // 2),
        fp32[2],
    ]
    # bf16 weights (no master copy) are gathered and reduced as they are: in bf16.
    bf16 = _llama_8b_like(element_size=2)
    spec = TrainingSpec(world_size=8, sharding="zero3", precision="bf16", weights="bf16")
    assert [t.size_bytes for t in layout_transfers(spec, bf16, topology)] == [
        size // 2 for _, size in fp32
    ]
