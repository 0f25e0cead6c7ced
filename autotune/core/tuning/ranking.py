"""Which measured configuration to recommend. The fastest, unless another one's samples/s are
within the measured noise of it (their step-time spreads overlap): then the speeds cannot be
told apart, and the simpler configuration wins: under the device's own allocator settings (a
process-wide change is made only for a gain), without checkpointing (no recompute), with fewer
accumulation steps (fewer optimizer-step boundaries to get wrong). On an emulated
GPU timed by the CPU, a single run's noise would otherwise pick 32 x 2 once and 16 x 4 the next.
"""

from __future__ import annotations

from collections.abc import Sequence

from autotune.core.schemas import Trial, TrialState


def recommendable(trials: Sequence[Trial], *, budget_bytes: int) -> list[Trial]:
    """What a recommendation is chosen from: the complete trials with samples/s whose peak
    leaves the headroom free (at most `budget_bytes`), else every complete one."""
    complete = [t for t in trials if t.state is TrialState.COMPLETE and t.samples_per_s]
    within = [t for t in complete if t.peak_bytes is not None and t.peak_bytes <= budget_bytes]
    return within or complete


def speed_band(trial: Trial) -> tuple[float, float]:
    """The samples/s a trial's timed steps are consistent with: its median, widened by half
    its step-time spread ((max - min) / median) on each side."""
    speed = trial.samples_per_s or 0.0
    half_spread = (trial.step_time_spread or 0.0) / 2
    return speed * (1.0 - half_spread), speed * (1.0 + half_spread)


def ties_with(trial: Trial, fastest: Trial) -> bool:
    """Whether `trial` cannot be told from `fastest` within their measured noise."""
    return speed_band(trial)[1] >= speed_band(fastest)[0]


def choose(pool: Sequence[Trial]) -> Trial | None:
    """The recommended trial of `pool` (complete trials with samples/s): among those tied
    with the fastest, the one under the device's allocator settings, then without
    checkpointing, then with the fewest accumulation steps, then the fastest."""
    if not pool:
        return None
    fastest = max(pool, key=lambda t: t.samples_per_s or 0.0)
    tied = [t for t in pool if t is fastest or ties_with(t, fastest)]
    return min(
        tied,
        key=lambda t: (
            t.allocator_conf is not None,
            t.checkpointing,
            t.accumulation_steps,
            -(t.samples_per_s or 0.0),
        ),
    )
