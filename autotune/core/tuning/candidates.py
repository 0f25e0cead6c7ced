"""The tuner's search space: every (micro-batch, accumulation, checkpointing) that hits the
target global batch exactly, under the allocator settings it fits with, and an explanation
when none does.

Pure and torch-free. The probe supplies, per checkpointing mode, the largest micro-batch that
fits; a candidate is any micro-batch `b` up to that limit with `b * G * world_size == target`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autotune.core.schemas import Infeasible, ModeProbe


@dataclass(frozen=True)
class Candidate:
    """One configuration the tuner may measure: `micro_batch` samples per forward/backward on
    each rank, `accumulation_steps` of them per optimizer step."""

    micro_batch: int
    accumulation_steps: int
    checkpointing: bool
    # With checkpointing, the first this many blocks only (partial checkpointing); None: all.
    checkpointed_blocks: int | None = None
    # PYTORCH_ALLOC_CONF to measure it under when not the device's (`probe_candidates`).
    allocator_conf: str | None = None

    def global_batch(self, world_size: int) -> int:
        """Samples per optimizer step across all ranks."""
        return self.micro_batch * self.accumulation_steps * world_size


def _check_arguments(target_global_batch: int, world_size: int) -> None:
    if target_global_batch < 1:
        raise ValueError(f"target_global_batch must be >= 1, got {target_global_batch}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


def _per_rank_samples(target_global_batch: int, world_size: int) -> int:
    """Samples each rank takes per optimizer step; 0 when the ranks cannot share the target
    evenly (no candidate reaches it)."""
    _check_arguments(target_global_batch, world_size)
    if target_global_batch % world_size:
        return 0
    return target_global_batch // world_size


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
    per_rank_samples = _per_rank_samples(target_global_batch, world_size)
    candidates: list[Candidate] = []
    for checkpointing in sorted(max_micro_batch):
        limit = min(max_micro_batch[checkpointing], per_rank_samples)
        candidates.extend(
            Candidate(b, per_rank_samples // b, checkpointing)
            for b in range(1, limit + 1)
            if per_rank_samples % b == 0
        )
    return candidates


def probe_candidates(
    target_global_batch: int,
    world_size: int,
    modes: Sequence[ModeProbe],
    *,
    accumulation_probed: bool = True,
) -> list[Candidate]:
    """The tuner's candidates from the probe's answers, one per (checkpointing, micro-batch):
    under the device's allocator settings every one within its mode's limit, and where those
    stop short (or the size is one of the mode's `runs_out_below`), under the mode's
    expandable segments when their search verified a limit that holds it
    (docs/design.md#expandable-segments-as-a-knob). A limit is the mode's recommended
    micro-batch, or with accumulation (G >= 2) its accumulating one.

    Args:
        accumulation_probed: False before the tuner's accumulation probes, which these
            candidates size: an unset accumulating limit reads as the recommended one. After
            them an unset one reads as 0 (nothing accumulates).

    Returns:
        As `enumerate_candidates` orders them.
    """
    per_rank_samples = _per_rank_samples(target_global_batch, world_size)

    def limit(recommended: int, accumulating: int | None, steps: int) -> int:
        if steps == 1:
            return recommended
        if accumulating is None:
            return 0 if accumulation_probed else recommended
        return accumulating

    candidates: list[Candidate] = []
    for mode in sorted(modes, key=lambda m: m.checkpointing):
        option = mode.expandable_segments
        if option is not None and (
            option.max_micro_batch is None or option.recommended_micro_batch is None
        ):
            option = None  # traced only: nothing verified to measure under
        largest = max(
            mode.recommended_micro_batch,
            option.recommended_micro_batch or 0 if option is not None else 0,
        )
        for b in range(1, min(largest, per_rank_samples) + 1):
            if per_rank_samples % b:
                continue
            steps = per_rank_samples // b
            default_fits = b <= limit(
                mode.recommended_micro_batch, mode.accumulating_micro_batch, steps
            )
            if option is not None and (not default_fits or b in mode.runs_out_below):
                assert option.recommended_micro_batch is not None
                within = b <= limit(
                    option.recommended_micro_batch, option.accumulating_micro_batch, steps
                )
                if within and b not in option.runs_out_below:
                    candidates.append(
                        Candidate(
                            b, steps, mode.checkpointing, allocator_conf=option.allocator_conf
                        )
                    )
                    continue
            if default_fits:
                candidates.append(Candidate(b, steps, mode.checkpointing))
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
