"""The tuner's search space: every (micro-batch, accumulation, checkpointing) that hits the
target global batch exactly, and an explanation when none does.

Pure and torch-free. The probe supplies, per checkpointing mode, the largest micro-batch that
fits; a candidate is any micro-batch `b` up to that limit with `b * G * world_size == target`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autotune.core.schemas import Infeasible


@dataclass(frozen=True)
class Candidate:
    """One configuration the tuner may measure: `micro_batch` samples per forward/backward on
    each rank, `accumulation_steps` of them per optimizer step."""

    micro_batch: int
    accumulation_steps: int
    checkpointing: bool
    # With checkpointing, the first this many blocks only (partial checkpointing); None: all.
    checkpointed_blocks: int | None = None

    def global_batch(self, world_size: int) -> int:
        """Samples per optimizer step across all ranks."""
        return self.micro_batch * self.accumulation_steps * world_size


def _check_arguments(target_global_batch: int, world_size: int) -> None:
    if target_global_batch < 1:
        raise ValueError(f"target_global_batch must be >= 1, got {target_global_batch}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


def enumerate_candidates(
    target_global_batch: int, world_size: int, max_micro_batch: Mapping[bool, int]
) -> list[Candidate]:
    """Every candidate that reaches `target_global_batch` exactly.

    Args:
        target_global_batch: Samples per optimizer step across all ranks.
        world_size: Data-parallel ranks.
        max_micro_batch: Per checkpointing mode, the largest micro-batch that fits (0 when not
            even 1 fits; a missing mode is not tried).

    Returns:
        Candidates without checkpointing first, then with, each by increasing micro-batch.
    """
    _check_arguments(target_global_batch, world_size)
    if target_global_batch % world_size:
        return []
    per_rank_samples = target_global_batch // world_size
    candidates: list[Candidate] = []
    for checkpointing in sorted(max_micro_batch):
        limit = min(max_micro_batch[checkpointing], per_rank_samples)
        candidates.extend(
            Candidate(b, per_rank_samples // b, checkpointing)
            for b in range(1, limit + 1)
            if per_rank_samples % b == 0
        )
    return candidates


def indivisible_target(target_global_batch: int, world_size: int) -> Infeasible | None:
    """The one reason known before anything runs: a target that is no multiple of the ranks,
    which no micro-batch reaches (the nearest multiples do, once a micro-batch of 1 fits)."""
    _check_arguments(target_global_batch, world_size)
    if target_global_batch % world_size == 0:
        return None
    below = target_global_batch // world_size * world_size
    return Infeasible(
        reason=f"target global batch {target_global_batch} is not divisible by world size "
        f"{world_size}: every rank must take the same number of samples",
        nearest_below=below or None,
        nearest_above=below + world_size,
    )


def explain_infeasible(
    target_global_batch: int, world_size: int, max_micro_batch: Mapping[bool, int]
) -> Infeasible:
    """Why no candidate reaches `target_global_batch`, and the nearest global batches that can
    be reached (some fitting micro-batch on every rank, any number of accumulation steps).

    Raises:
        ValueError: when a candidate does exist.
    """
    _check_arguments(target_global_batch, world_size)
    if enumerate_candidates(target_global_batch, world_size, max_micro_batch):
        raise ValueError(f"global batch {target_global_batch} is achievable; nothing to explain")
    largest_fitting = max(max_micro_batch.values(), default=0)
    if largest_fitting < 1:
        return Infeasible(
            reason="not even a micro-batch of 1 fits on the device, with or without checkpointing",
        )

    # The achievable global batches are world_size * b * G for a fitting b and any G >= 1.
    # Enumerated generically rather than assuming b = 1, so the answer stays right if a caller
    # ever passes a restricted set of micro-batches.
    steps = [world_size * b for b in range(1, largest_fitting + 1)]
    below = [(target_global_batch - 1) // step * step for step in steps]
    above = [(target_global_batch // step + 1) * step for step in steps]
    nearest_below = max(below)
    nearest_above = min(above)

    indivisible = indivisible_target(target_global_batch, world_size)
    if indivisible is not None:
        reason = indivisible.reason
    else:
        per_rank_samples = target_global_batch // world_size
        reason = (
            f"no divisor of {per_rank_samples} samples per rank is a micro-batch that fits "
            f"(largest fitting micro-batch: {largest_fitting})"
        )
    return Infeasible(
        reason=reason,
        nearest_below=nearest_below if nearest_below > 0 else None,
        nearest_above=nearest_above,
    )
