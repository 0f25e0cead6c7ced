"""What would make a job fit, the pure part (autotune/core/remedies.py): which changes apply to
a spec, the GPU counts the fewest-GPU search walks, the ranking, and the changed spec itself
(`Spec.with_training`)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from autotune.core.remedies import (
    LORA_RANK,
    gpu_counts,
    is_doubling_point,
    paired_changes,
    ranked,
    sharded_change,
    single_gpu_changes,
)
from autotune.core.schemas import Remedy, Spec


def _spec(**training: Any) -> Spec:
    return Spec.model_validate(
        {"model": {"preset": "llama-tiny"}, "training": {"seq_len": 64, **training}}
    )


def test_each_change_applies_only_where_the_spec_lacks_it() -> None:
    labels = [c.label for c in single_gpu_changes(_spec())]
    assert labels == ["bf16 weights", f"LoRA rank {LORA_RANK} on all linear layers", "8-bit AdamW"]
    done = _spec(precision="bf16", weights="bf16", optimizer="adamw8bit", lora={"r": 8})
    assert single_gpu_changes(done) == []
    assert [c.label for c in single_gpu_changes(_spec(optimizer="sgd"))][-1] != "8-bit AdamW"
    mlp = Spec.model_validate({"model": {"preset": "mlp"}})
    assert [c.label for c in single_gpu_changes(mlp)] == ["bf16 weights", "8-bit AdamW"]


def test_every_change_makes_a_valid_spec_that_holds_it() -> None:
    spec = _spec(target_global_tokens=1024)
    changes = single_gpu_changes(spec)
    for change in [*changes, *paired_changes(changes), sharded_change(4, 8)]:
        changed = spec.with_training(change.fields)
        dumped = changed.training.model_dump(mode="json")
        for name, value in change.fields.items():
            held = dumped[name]
            assert held == value if not isinstance(value, dict) else held | value == held
        assert changed.training.target_global_batch == 16  # the rest is kept


def test_pairs_are_every_two_of_the_changes_in_order() -> None:
    changes = single_gpu_changes(_spec())
    pairs = paired_changes(changes)
    assert [p.label for p in pairs] == [
        f"bf16 weights + LoRA rank {LORA_RANK} on all linear layers",
        "bf16 weights + 8-bit AdamW",
        f"LoRA rank {LORA_RANK} on all linear layers + 8-bit AdamW",
    ]
    assert pairs[1].fields == {"precision": "bf16", "weights": "bf16", "optimizer": "adamw8bit"}


def test_more_gpus_than_a_box_holds_are_whole_nodes() -> None:
    assert sharded_change(8, 8).fields == {"world_size": 8, "sharding": "zero3"}
    beyond = sharded_change(24, 8)
    assert beyond.fields == {"nodes": 3, "gpus_per_node": 8, "sharding": "zero3"}
    changed = _spec().with_training(beyond.fields)
    assert (changed.training.world_size, changed.training.node_count) == (24, 3)


def test_the_gpu_counts_fill_a_box_then_add_whole_boxes() -> None:
    counts = gpu_counts(_spec(), 8)
    assert counts[:10] == [2, 3, 4, 5, 6, 7, 8, 16, 24, 32]
    assert counts[-1] == 1024
    assert gpu_counts(_spec(world_size=4), 8)[:2] == [5, 6]  # more than the spec has
    doubling = [c for c in counts if is_doubling_point(c, 8)]
    assert doubling == [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert [c for c in gpu_counts(_spec(), 10) if is_doubling_point(c, 10)][:5] == [
        2, 4, 8, 20, 40
    ]  # fmt: skip


def test_a_new_sequence_drops_the_token_target_and_new_ranks_the_old_topology() -> None:
    spec = _spec(target_global_tokens=1024, nodes=2, gpus_per_node=4)
    shorter = spec.with_training({"seq_len": 32})
    assert shorter.training.target_global_tokens is None
    assert shorter.training.target_global_batch == 16  # the samples the target stood for
    regrown = spec.with_training({"world_size": 2})
    assert (regrown.training.nodes, regrown.training.gpus_per_node) == (None, None)
    with pytest.raises(ValidationError, match="weights"):
        spec.with_training({"weights": "bf16"})  # bf16 weights need bf16 compute


def _remedy(change: str, samples_per_s: float | None, world_size: int, peak: int) -> Remedy:
    return Remedy(
        change=change,
        spec_diff={},
        checkpointing=False,
        micro_batch=1,
        world_size=world_size,
        peak_bytes=peak,
        capacity_bytes=100,
        samples_per_s=samples_per_s,
    )


def test_remedies_rank_by_the_jobs_samples_per_s_then_by_gpus_and_room() -> None:
    fast, slow = _remedy("a", 3.0, 4, 90), _remedy("b", 1.0, 1, 10)
    assert ranked([slow, fast]) == [fast, slow]
    fewer, roomier, tighter = (
        _remedy("c", None, 1, 50),
        _remedy("d", None, 2, 10),
        _remedy("e", None, 1, 80),
    )
    assert ranked([roomier, tighter, fewer]) == [fewer, tighter, roomier]
