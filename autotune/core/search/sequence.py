"""The pure search for the longest sequence that fits at a given micro-batch.

The same search as the micro-batch's (`autotune.core.search.micro_batch.find_max_micro_batch`),
over tokens instead of samples: a trial is an opaque `fits(seq_len_tokens) -> StepOutcome`, and the
search counts in units of `step_tokens` (a multiple of 64 by default: kernels tile sequences in
multiples of it, and people ask for round lengths), so the answer is the exact longest multiple of
the step that fits, certified from both sides like the micro-batch's (it fitted, the next multiple
did not, or it is the cap).

Memory is not affine in the sequence length (eager attention's s x s scores grow with its
square), so the per-op model that predicts micro-batches is not used here: the search gallops
and bisects on the trials alone (`capacity_bytes=None`), ceil(log2(cap / step)) + 2 trials at
most (docs/design.md#the-longest-sequence). No torch here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autotune.core.schemas import StepOutcome
from autotune.core.search.micro_batch import find_max_micro_batch

DEFAULT_STEP_TOKENS = 64


@dataclass(frozen=True)
class SequenceAttempt:
    """One trial of the search: a sequence length, and the step's outcome at it."""

    seq_len: int
    outcome: StepOutcome


@dataclass(frozen=True)
class SequenceSearch:
    """The certified longest sequence (0: not even `step_tokens` fits) and the trials."""

    max_seq_len: int
    attempts: tuple[SequenceAttempt, ...]
    capped: bool  # max_seq_len is the cap's multiple and it fits


def find_max_seq_len(
    fits: Callable[[int], StepOutcome],
    *,
    cap_tokens: int,
    step_tokens: int = DEFAULT_STEP_TOKENS,
    known_fitting_tokens: int = 0,
) -> SequenceSearch:
    """The longest multiple of `step_tokens` <= `cap_tokens` whose step fits.

    Args:
        fits: runs one training step at a sequence length (at the caller's micro-batch) and
            reports what happened; memory must grow with the length.
        cap_tokens: the longest sequence worth trying (the model's positions); never exceeded.
        step_tokens: the answer is a multiple of it.
        known_fitting_tokens: a length expected to fit (the other checkpointing mode's answer),
            tried like any other.

    Raises:
        ValueError: `step_tokens` < 1 or `cap_tokens` < `step_tokens`.

    >>> def step(seq_len: int) -> StepOutcome:
    ...     return StepOutcome(micro_batch=1, fits=seq_len <= 1000, peak_bytes=seq_len)
    >>> result = find_max_seq_len(step, cap_tokens=4096)
    >>> result.max_seq_len, [a.seq_len for a in result.attempts]
    (960, [128, 256, 2112, 1152, 704, 896, 1024, 960])
    """
    if step_tokens < 1:
        raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
    if cap_tokens < step_tokens:
        raise ValueError(f"cap_tokens {cap_tokens} is below one step of {step_tokens} tokens")
    attempts: list[SequenceAttempt] = []

    def fits_steps(steps: int) -> StepOutcome:
        seq_len = steps * step_tokens
        outcome = fits(seq_len)
        attempts.append(SequenceAttempt(seq_len, outcome))
        # The search counts steps where it counts samples; it checks the size it asked for,
        # and the series are not offered: memory is not affine in the length.
        return outcome.model_copy(
            update={"micro_batch": steps, "series": None, "allocations": None, "start": None}
        )

    search = find_max_micro_batch(
        fits_steps,
        cap=cap_tokens // step_tokens,
        capacity_bytes=None,
        known_fitting=known_fitting_tokens // step_tokens,
    )
    return SequenceSearch(
        max_seq_len=search.max_micro_batch * step_tokens,
        attempts=tuple(attempts),
        capped=search.capped,
    )


__all__ = ["DEFAULT_STEP_TOKENS", "SequenceAttempt", "SequenceSearch", "find_max_seq_len"]
