"""`sharding: auto`: which layouts the tuner measures, which one it recommends, and why each of
the others lost (no torch; docs/design.md#choosing-the-layout).

The candidates are every layout valid for the spec's topology: DDP (none), zero1, zero2, zero3
and, on several nodes, hybrid with the node as its shard group. Each is tuned as a spec of its
own (both checkpointing modes, partial checkpointing, accumulation), and the layout whose best
configuration has the highest samples/s wins. All hit the same target global batch on the same
ranks, so each rank's optimizer step holds the same samples in every layout and their step
times compare directly: compute plus the communication compute does not hide. Layouts tied
within the measured noise go to the simpler one, in `LAYOUT_ORDER` (less to configure, fewer
collectives to go wrong).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autotune.core.schemas import (
    LAYOUT_REASON_MAX,
    LayoutOutcome,
    LayoutVerdict,
    Recommendation,
    Sharding,
    TrainingSpec,
    Trial,
    TrialState,
    TuneResult,
)
from autotune.core.tuning.ranking import ties_with

# Simplest first: what a tie goes to.
LAYOUT_ORDER = (Sharding.NONE, Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3, Sharding.HYBRID)

# The collectives behind each layout's communication (autotune.core.parallel.layouts), named
# in the reason a layout lost to its exposed communication.
LAYOUT_COLLECTIVES = {
    Sharding.NONE: "gradient all-reduce (once per optimizer step)",
    Sharding.ZERO1: "gradient all-reduce and parameter broadcast (once per optimizer step)",
    Sharding.ZERO2: "parameter all-gather and gradient reduce-scatter (every micro-step)",
    Sharding.ZERO3: "parameter all-gathers for forward and backward and gradient "
    "reduce-scatter (every micro-step)",
    Sharding.HYBRID: "all-gathers and reduce-scatter within the node and all-reduce of "
    "gradient shards across nodes (every micro-step)",
}

LAYOUT_NAMES = {
    Sharding.NONE: "none (DDP)",
    Sharding.ZERO1: "zero1",
    Sharding.ZERO2: "zero2",
    Sharding.ZERO3: "zero3 (FSDP full shard)",
    Sharding.HYBRID: "hybrid (HSDP, a node per shard group)",
}


def layout_candidates(training: TrainingSpec) -> list[Sharding]:
    """The layouts `sharding: auto` measures on the spec's topology: DDP alone on one rank;
    hybrid only across several nodes (on one node it is zero3)."""
    if training.world_size < 2:
        return [Sharding.NONE]
    layouts = [Sharding.NONE, Sharding.ZERO1, Sharding.ZERO2, Sharding.ZERO3]
    if training.node_count >= 2:
        layouts.append(Sharding.HYBRID)
    return layouts


def format_duration(seconds: float) -> str:
    """A step's part for people: "2.1 s", "35 ms"."""
    if seconds >= 1.0:
        return f"{seconds:,.1f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:,.0f} ms"
    return f"{seconds * 1e6:,.0f} us"


@dataclass(frozen=True)
class LayoutRun:
    """One layout's tuning result, as the tuner produced it for that layout's spec."""

    sharding: Sharding
    result: TuneResult

    @property
    def recommendation(self) -> Recommendation | None:
        return self.result.recommendation

    def trial(self) -> Trial | None:
        """The measured trial its recommendation is."""
        rec = self.recommendation
        if rec is None:
            return None
        return next(
            (
                t
                for t in self.result.trials
                if t.state is TrialState.COMPLETE
                and (t.micro_batch, t.accumulation_steps, t.checkpointing, t.checkpointed_blocks)
                == (
                    rec.micro_batch,
                    rec.accumulation_steps,
                    rec.checkpointing,
                    rec.checkpointed_blocks,
                )
                and t.samples_per_s == rec.samples_per_s
            ),
            None,
        )

    def max_micro_batch(self, checkpointing: bool) -> int | None:
        mode = next((m for m in self.result.probe.modes if m.checkpointing is checkpointing), None)
        return None if mode is None else mode.max_micro_batch

    @property
    def fits(self) -> bool:
        return any(m.max_micro_batch >= 1 for m in self.result.probe.modes)


def choose_layout(runs: Sequence[LayoutRun]) -> LayoutRun | None:
    """The layout to recommend: the fastest best configuration, or the simplest layout tied
    with it within the measured noise (`autotune.core.tuning.ranking.ties_with`); None when no
    layout has a recommendation."""
    ranked = [(run, run.trial()) for run in runs if run.recommendation is not None]
    if not ranked:
        return None
    fastest_run, fastest = max(ranked, key=lambda pair: pair[0].recommendation.samples_per_s)  # type: ignore[union-attr]
    tied = [
        run
        for run, trial in ranked
        if run is fastest_run
        or (trial is not None and fastest is not None and ties_with(trial, fastest))
    ]
    return min(tied, key=lambda run: LAYOUT_ORDER.index(run.sharding))


def _shown_without_choice(runs: Sequence[LayoutRun]) -> LayoutRun:
    """What a result shows when no layout hits the target: the one that fits the largest
    micro-batch, else the most sharded (it came closest to fitting)."""
    return max(
        runs,
        key=lambda run: (
            max((m.max_micro_batch for m in run.result.probe.modes), default=0),
            LAYOUT_ORDER.index(run.sharding),
        ),
    )


def _limits(run: LayoutRun) -> str:
    plain, checkpointed = run.max_micro_batch(False), run.max_micro_batch(True)
    text = f"micro-batch up to {plain or 0}"
    if checkpointed is not None:
        text += f", {checkpointed} checkpointed"
    return text


def _per_gpu_and_job(rec: Recommendation) -> str:
    return (
        f"{rec.samples_per_s:,.2f} samples/s per GPU, {rec.job_samples_per_s:,.1f} for the "
        f"job of {rec.world_size} GPU(s)"
    )


def _slower_reason(run: LayoutRun, chosen: LayoutRun) -> str:
    rec, best = run.recommendation, chosen.recommendation
    assert rec is not None and best is not None
    trial, best_trial = run.trial(), chosen.trial()
    share = 1.0 - rec.samples_per_s / best.samples_per_s
    tied = trial is not None and best_trial is not None and ties_with(trial, best_trial)
    if tied and LAYOUT_ORDER.index(chosen.sharding) < LAYOUT_ORDER.index(run.sharding):
        return (
            f"fits, as fast as {chosen.sharding.value} within the measured noise "
            f"({_per_gpu_and_job(rec)}); {chosen.sharding.value} is simpler"
        )
    # Not tied: the chosen layout is measurably faster, however little (an estimate's step
    # times have no noise), and need not be the simpler one.
    digits = 1 if share < 0.01 else 0
    head = f"fits but {share * 100:.{digits}f} % slower ({_per_gpu_and_job(rec)})"
    parts = (trial, best_trial)
    if any(
        t is None or t.compute_time_s is None or t.exposed_communication_s is None for t in parts
    ):
        return head
    assert trial is not None and best_trial is not None
    compute_s, exposed_s = trial.compute_time_s or 0.0, trial.exposed_communication_s or 0.0
    best_compute_s = best_trial.compute_time_s or 0.0
    best_exposed_s = best_trial.exposed_communication_s or 0.0
    # Both steps hold the same samples per rank (the same target on the same ranks).
    if exposed_s - best_exposed_s >= compute_s - best_compute_s:
        return (
            f"{head}: {format_duration(exposed_s)} of exposed "
            f"{LAYOUT_COLLECTIVES[run.sharding]} per step, against "
            f"{format_duration(best_exposed_s)} exposed in {chosen.sharding.value}"
        )
    return (
        f"{head}: {format_duration(compute_s)} of compute per step against "
        f"{format_duration(best_compute_s)} (micro-batch {rec.micro_batch} x "
        f"{rec.accumulation_steps}, checkpointing {rec.checkpointing_label}: what fits here)"
    )


def _does_not_fit_reason(run: LayoutRun) -> str:
    modes = run.result.probe.modes
    which = "with and without checkpointing" if len(modes) > 1 else "without checkpointing"
    reason = f"does not fit: micro-batch 1 runs out of memory {which}"
    first = next(
        (a for m in modes for a in m.attempts if a.micro_batch == 1 and a.oom is not None), None
    )
    if first is not None and first.oom is not None:
        reason += f" ({first.oom.summary()})"
    return reason


def _chosen_reason(chosen: LayoutRun, runs: Sequence[LayoutRun]) -> str:
    rec = chosen.recommendation
    assert rec is not None
    others = [r for r in runs if r is not chosen and r.recommendation is not None]
    if not others:
        lead = "the only layout that hits the target" if len(runs) > 1 else "the only layout"
    else:
        lead = "the fastest"
    return (
        f"{lead}: {_per_gpu_and_job(rec)} at micro-batch {rec.micro_batch} x "
        f"{rec.accumulation_steps}, checkpointing {rec.checkpointing_label}"
    )


def _outcome(run: LayoutRun, verdict: LayoutVerdict, reason: str) -> LayoutOutcome:
    trial = run.trial()
    training = run.result.spec.training
    return LayoutOutcome(
        sharding=run.sharding,
        shard_group_size=training.shard_group_size,
        verdict=verdict,
        reason=reason[:LAYOUT_REASON_MAX],
        max_micro_batch=run.max_micro_batch(False) or 0,
        max_micro_batch_checkpointed=run.max_micro_batch(True),
        recommendation=run.recommendation,
        compute_time_s=None if trial is None else trial.compute_time_s,
        communication_time_s=None if trial is None else trial.communication_time_s,
        exposed_communication_s=None if trial is None else trial.exposed_communication_s,
        trials=len(run.result.trials),
    )


def compare_layouts(runs: Sequence[LayoutRun]) -> tuple[LayoutRun, list[LayoutOutcome]]:
    """The layout whose result the answer shows (the chosen one, else the one that came
    closest), and every layout's outcome, that one first, then the others by speed, then the
    ones that miss the target, then the ones that do not fit.

    Raises:
        ValueError: no layout was tuned.
    """
    if not runs:
        raise ValueError("no layout was tuned")
    chosen = choose_layout(runs)
    shown = chosen or _shown_without_choice(runs)
    outcomes: list[tuple[tuple[int, float, int], LayoutOutcome]] = []
    for run in runs:
        order = LAYOUT_ORDER.index(run.sharding)
        if run is chosen:
            outcome = _outcome(run, LayoutVerdict.CHOSEN, _chosen_reason(run, runs))
            key = (0, 0.0, order)
        elif run.recommendation is not None:
            assert chosen is not None
            outcome = _outcome(run, LayoutVerdict.SLOWER, _slower_reason(run, chosen))
            key = (1, -run.recommendation.samples_per_s, order)
        elif run.fits:
            why = run.result.infeasible.reason if run.result.infeasible else "no configuration"
            reason = f"fits ({_limits(run)}) but hits no target: {why}"
            outcome = _outcome(run, LayoutVerdict.MISSES_TARGET, reason)
            key = (2, 0.0, order)
        else:
            outcome = _outcome(run, LayoutVerdict.DOES_NOT_FIT, _does_not_fit_reason(run))
            key = (3, 0.0, order)
        if run is shown and chosen is None:
            key = (-1, 0.0, order)
        outcomes.append((key, outcome))
    return shown, [outcome for _, outcome in sorted(outcomes, key=lambda pair: pair[0])]


__all__ = [
    "LAYOUT_COLLECTIVES",
    "LAYOUT_NAMES",
    "LAYOUT_ORDER",
    "LayoutRun",
    "choose_layout",
    "compare_layouts",
    "format_duration",
    "layout_candidates",
]
