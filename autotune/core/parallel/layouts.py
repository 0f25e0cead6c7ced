"""The bytes each data-parallel layout moves, per micro-step and per optimizer step, and with
which collective: what torch's DDP, ZeroRedundancyOptimizer and FSDP2 issue as the engine runs
them (docs/design.md#communication; no torch).

* none (DDP): the gradients all-reduced once per optimizer step, in buckets during the last
  micro-step's backward (the others run under `no_sync()`); the buffers broadcast before the
  step's first forward.
* zero1 (DDP + ZeroRedundancyOptimizer): DDP's traffic, then after the optimizer step every
  trainable parameter broadcast from the rank that updated it.
* zero2 (FSDP2 without resharding after forward): every micro-step each unit's parameters
  all-gathered for its forward, its gradients reduce-scattered after its backward.
* zero3 (FSDP2 full shard): as zero2, and each unit gathered again for its backward.
* hybrid (HSDP): zero3 within each shard group, then each rank's gradient shard all-reduced
  with the ranks holding the same shard in the other groups, every micro-step.

FSDP2 pads every parameter's first dimension to a multiple of the shard count, so its buffers
are the padded sizes (`ParameterShape.padded_numel`); gradients are reduced for trainable
parameters only, every parameter is gathered. With fp32 master weights under bf16/fp16
autocast, FSDP2 gathers in 16 bits and reduces in fp32 (`gathers_in_16_bits`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from autotune.core.memory.gradient_buckets import BUCKET_CAP_BYTES, FIRST_BUCKET_CAP_BYTES
from autotune.core.parallel.collectives import Collective, Group
from autotune.core.parallel.topology import Topology
from autotune.core.schemas import Phase, Precision, Sharding, TrainingSpec, WeightsDtype

Cadence = Literal["micro_step", "optimizer_step"]


@dataclass(frozen=True)
class ParameterShape:
    """One parameter as the collectives see it: its first dimension, its elements, their
    size, and whether it is trained (has a gradient to reduce)."""

    dim0: int
    numel: int
    element_size: int
    trainable: bool

    def padded_numel(self, shards: int) -> int:
        """Elements of FSDP2's buffer for it over `shards` ranks: dim 0 padded to a multiple."""
        if self.numel == 0:
            return 0
        dim0 = max(self.dim0, 1)
        return -(-dim0 // shards) * shards * (self.numel // dim0)


@dataclass(frozen=True)
class ShardUnit:
    """The parameters one FSDP2 `fully_shard` call owns (a block, or the root: what is in no
    block), gathered and reduced together."""

    parameters: tuple[ParameterShape, ...]

    def gathered_bytes(self, shards: int, element_size: int | None = None) -> int:
        """Bytes of the unit's all-gather: in `element_size` bytes per element when FSDP2
        casts the parameters for it (mixed precision), else in their own."""
        return sum(
            p.padded_numel(shards) * (element_size or p.element_size) for p in self.parameters
        )

    def reduced_bytes(self, shards: int) -> int:
        return sum(p.padded_numel(shards) * p.element_size for p in self.parameters if p.trainable)


@dataclass(frozen=True)
class ModelParameters:
    """What a model gives the collectives: its FSDP2 units (blocks, then the root) and its
    buffers' bytes."""

    units: tuple[ShardUnit, ...]
    buffer_bytes: int = 0

    @property
    def parameters(self) -> tuple[ParameterShape, ...]:
        return tuple(p for unit in self.units for p in unit.parameters)

    @property
    def trainable_bytes(self) -> int:
        return sum(p.numel * p.element_size for p in self.parameters if p.trainable)


@dataclass(frozen=True)
class Transfer:
    """Collectives of one kind at one point of the step: `count` of them moving `size_bytes`
    together (each the whole buffer: all-reduce's tensor, all-gather's output,
    reduce-scatter's input), over `group`, during `phase`, once per `cadence`."""

    what: str
    collective: Collective
    size_bytes: int
    count: int
    group: Group
    phase: Phase
    cadence: Cadence


def _ddp_buckets(size_bytes: int) -> int:
    """How many all-reduces carry the gradients: DDP closes its first bucket at 1 MiB and the
    others at bucket_cap_mb (25 MiB; `autotune.core.memory.gradient_buckets` places them
    tensor by tensor, docs/design.md#data-parallel)."""
    if size_bytes <= FIRST_BUCKET_CAP_BYTES:
        return 1
    return 1 + -(-(size_bytes - FIRST_BUCKET_CAP_BYTES) // BUCKET_CAP_BYTES)


def _ddp(model: ModelParameters, world: Group) -> list[Transfer]:
    gradients = model.trainable_bytes
    transfers = [
        Transfer(
            "gradient all-reduce (DDP buckets)",
            Collective.ALL_REDUCE,
            gradients,
            _ddp_buckets(gradients),
            world,
            Phase.BACKWARD,
            "optimizer_step",
        )
    ]
    if model.buffer_bytes:
        transfers.append(
            Transfer(
                "buffer broadcast (DDP)",
                Collective.BROADCAST,
                model.buffer_bytes,
                1,
                world,
                Phase.FORWARD,
                "optimizer_step",
            )
        )
    return transfers


def gathers_in_16_bits(training: TrainingSpec) -> bool:
    """Whether FSDP2 runs with mixed precision (`MixedPrecisionPolicy(param_dtype=the autocast
    dtype, reduce_dtype=float32)`, as the engine shards): fp32 master weights under bf16/fp16
    autocast. Gathered in 16 bits, each block's weights are freed with it; gathered in fp32,
    autocast's cached 16-bit casts of them would stay until the forward ends
    (docs/design.md#sharded-data-parallel)."""
    return training.precision is not Precision.FP32 and training.weights is WeightsDtype.FP32


def _fsdp(
    model: ModelParameters, shard: Group, *, regather: bool, gathered_element_size: int | None
) -> list[Transfer]:
    shards = shard.ranks
    units = model.units
    transfers = [
        Transfer(
            "parameter all-gather for forward (FSDP2)",
            Collective.ALL_GATHER,
            sum(u.gathered_bytes(shards, gathered_element_size) for u in units),
            len(units),
            shard,
            Phase.FORWARD,
            "micro_step",
        )
    ]
    if regather:
        # Every unit, the root included (`shard_model` reshards it after forward as well).
        transfers.append(
            Transfer(
                "parameter all-gather for backward (FSDP2)",
                Collective.ALL_GATHER,
                sum(u.gathered_bytes(shards, gathered_element_size) for u in units),
                len(units),
                shard,
                Phase.BACKWARD,
                "micro_step",
            )
        )
    reduced = [u for u in units if u.reduced_bytes(shards)]
    transfers.append(
        Transfer(
            "gradient reduce-scatter (FSDP2)",
            Collective.REDUCE_SCATTER,
            sum(u.reduced_bytes(shards) for u in reduced),
            len(reduced),
            shard,
            Phase.BACKWARD,
            "micro_step",
        )
    )
    return transfers


def layout_transfers(
    training: TrainingSpec, model: ModelParameters, topology: Topology
) -> tuple[Transfer, ...]:
    """Every collective the spec's layout issues in one optimizer step, grouped by kind."""
    per_node, nodes = topology.gpus_per_node, topology.nodes
    world = Group(per_node, nodes)
    if training.world_size == 1:
        return ()
    sharding = training.sharding
    if sharding in (Sharding.NONE, Sharding.ZERO1):
        transfers = _ddp(model, world)
        if sharding is Sharding.ZERO1:
            trained = [p for p in model.parameters if p.trainable]
            transfers.append(
                Transfer(
                    "updated parameter broadcast (ZeroRedundancyOptimizer)",
                    Collective.BROADCAST,
                    model.trainable_bytes,
                    len(trained),
                    world,
                    Phase.OPTIMIZER,
                    "optimizer_step",
                )
            )
        return tuple(transfers)
    # FSDP2's mixed precision gathers every parameter in 16 bits.
    gathered = 2 if gathers_in_16_bits(training) else None
    if sharding is not Sharding.HYBRID:
        return tuple(
            _fsdp(
                model, world, regather=sharding is Sharding.ZERO3, gathered_element_size=gathered
            )
        )
    group_size = training.shard_group_size
    assert group_size is not None  # the spec checked it
    # A shard group within a node, or whole nodes (the spec refuses groups straddling nodes).
    shard = (
        Group(group_size, 1) if group_size <= per_node else Group(per_node, group_size // per_node)
    )
    # The ranks holding the same shard, one per group: several on a node when groups are
    # smaller than a node; each node's shard ranks all use its network at once.
    replicas_per_node = max(1, per_node // group_size)
    across = Group(
        replicas_per_node,
        training.world_size // group_size // replicas_per_node,
        sharing_network=min(group_size, per_node),
    )
    transfers = _fsdp(model, shard, regather=True, gathered_element_size=gathered)
    shard_bytes = sum(u.reduced_bytes(group_size) for u in model.units) // group_size
    reduced_units = sum(1 for u in model.units if u.reduced_bytes(group_size))
    transfers.append(
        Transfer(
            "gradient shard all-reduce across replicas (HSDP)",
            Collective.ALL_REDUCE,
            shard_bytes,
            reduced_units,
            across,
            Phase.BACKWARD,
            "micro_step",
        )
    )
    return tuple(transfers)


__all__ = [
    "ModelParameters",
    "ParameterShape",
    "ShardUnit",
    "Transfer",
    "gathers_in_16_bits",
    "layout_transfers",
]
