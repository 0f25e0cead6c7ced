"""What would make a job fit: the changes worth trying on a spec that fits nowhere, and their
ranking once trials verified them (no torch; the trials are `autotune.engine.remedy_trials`).

A spec fits nowhere when micro-batch 1 runs out in every checkpointing mode. The changes, each
the cheapest of its kind (docs/design.md#what-would-make-it-fit):

* more GPUs with ZeRO-3 (FSDP full shard): the fewest that fit, which shares the weights,
  gradients and optimizer states among the ranks;
* bf16 weights: parameters, gradients and optimizer states in bf16, no fp32 master copy;
* 8-bit AdamW: the optimizer's two states in 8 bits instead of 32;
* LoRA at a stated rank (`LORA_RANK`, all linear layers): only the adapters train;
* a shorter sequence: the longest that fits at micro-batch 1;
* two of the single-GPU changes together, when none fits alone.

CPU offload of the optimizer states (DeepSpeed ZeRO-Offload) is not modelled: its host memory
and its PCIe traffic are not estimated, so it is named as such and never ranked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from autotune.core.schemas import (
    OptimizerName,
    Remedy,
    Sharding,
    Spec,
    WeightsDtype,
)

LORA_RANK = 16
# More GPUs than this are not a change anyone makes to fit one job.
MAX_WORLD_SIZE = 1024

NOT_MODELLED_OFFLOAD = (
    "CPU offload of the optimizer states (DeepSpeed ZeRO-Offload) is not modelled: its host "
    "memory and the PCIe time of moving states and gradients are not estimated"
)


@dataclass(frozen=True)
class Change:
    """A change to the training section: its description and the fields it sets."""

    label: str
    fields: dict[str, Any]

    def plus(self, other: Change) -> Change:
        return Change(f"{self.label} + {other.label}", self.fields | other.fields)


def single_gpu_changes(spec: Spec) -> list[Change]:
    """The changes on the same GPU count that apply to `spec`: bf16 weights (with AdamW, 8 bytes
    per parameter instead of 16), LoRA (the frozen weights only, and the adapters' state), and
    8-bit AdamW (10 instead of 16); each only where the spec does not have it already."""
    training = spec.training
    changes: list[Change] = []
    if training.weights is WeightsDtype.FP32:
        changes.append(Change("bf16 weights", {"precision": "bf16", "weights": "bf16"}))
    if training.lora is None and spec.model.is_token_model is not False:
        changes.append(
            Change(
                f"LoRA rank {LORA_RANK} on all linear layers",
                {"lora": {"r": LORA_RANK, "alpha": 2.0 * LORA_RANK}},
            )
        )
    if training.optimizer is OptimizerName.ADAMW:
        changes.append(Change("8-bit AdamW", {"optimizer": OptimizerName.ADAMW_8BIT.value}))
    return changes


def paired_changes(changes: Sequence[Change]) -> list[Change]:
    """Two of the single-GPU changes together, in the order they were given."""
    return [first.plus(second) for first, second in combinations(changes, 2)]


def sharded_change(world_size: int, gpus_per_box: int) -> Change:
    """`world_size` GPUs, the state fully sharded among them (ZeRO-3, FSDP full shard): on one
    node up to a box of them, else on whole nodes of `gpus_per_box`."""
    sharding = {"sharding": Sharding.ZERO3.value}
    if world_size <= gpus_per_box:
        return Change(
            f"{world_size} GPUs with ZeRO-3 (FSDP full shard)",
            {"world_size": world_size, **sharding},
        )
    nodes = world_size // gpus_per_box
    return Change(
        f"{world_size} GPUs ({nodes} nodes of {gpus_per_box}) with ZeRO-3 (FSDP full shard)",
        {"nodes": nodes, "gpus_per_node": gpus_per_box, **sharding},
    )


def shorter_sequence_change(seq_len: int) -> Change:
    return Change(f"sequence {seq_len} tokens", {"seq_len": seq_len})


def gpu_counts(spec: Spec, gpus_per_box: int) -> list[int]:
    """The GPU counts above the spec's own that the fewest-GPU search may answer, ascending:
    every count that fills part of one box, then whole boxes (nodes), up to `MAX_WORLD_SIZE`."""
    in_box = range(2, min(gpus_per_box, MAX_WORLD_SIZE) + 1)
    boxes = range(2 * gpus_per_box, MAX_WORLD_SIZE + 1, gpus_per_box)
    return [count for count in (*in_box, *boxes) if count > spec.training.world_size]


def is_doubling_point(count: int, gpus_per_box: int) -> bool:
    """Whether the search tries `count` while doubling: a power of two of GPUs within a box,
    of boxes beyond one."""
    units = count if count <= gpus_per_box else count // gpus_per_box
    return units & (units - 1) == 0


def ranked(remedies: Sequence[Remedy]) -> list[Remedy]:
    """Fastest first by the whole job's estimated samples/s; without speeds (no named GPU),
    fewest GPUs first, then the largest share of the capacity left free."""
    return sorted(
        remedies,
        key=lambda r: (
            -(r.samples_per_s or 0.0),
            r.world_size,
            r.peak_bytes / r.capacity_bytes if r.capacity_bytes else 1.0,
        ),
    )


__all__ = [
    "LORA_RANK",
    "NOT_MODELLED_OFFLOAD",
    "Change",
    "gpu_counts",
    "is_doubling_point",
    "paired_changes",
    "ranked",
    "sharded_change",
    "shorter_sequence_change",
    "single_gpu_changes",
]
