"""The tuner: for one spec on one device, the (micro-batch, accumulation, checkpointing) that hits
the target global batch exactly at the best measured samples/s.

It probes both checkpointing modes, enumerates the exact candidates under each mode's
headroom-adjusted max, lets an Optuna study pick which to measure, and turns the fastest into a
`Recommendation` with exports. Every measurement runs the same training-step kernel as the probe:
first one tracked step (does it fit, with G micro-batches' gradients alive? its peak), then timed
steps without the tracker, whose per-op cost would distort the timing.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace

from autotune.core.exports import build_exports
from autotune.core.schemas import (
    Infeasible,
    ProbeResult,
    Recommendation,
    Spec,
    StepOutcome,
    Trial,
    TuneResult,
)
from autotune.core.search.micro_batch import fewest_fitting, find_max_micro_batch
from autotune.core.tuning.candidates import Candidate, explain_infeasible, probe_candidates
from autotune.core.tuning.ranking import choose, recommendable
from autotune.core.tuning.result_check import check_result
from autotune.engine.devices.device import Device
from autotune.engine.full_collections import with_few_full_collections
from autotune.engine.probe import (
    AttemptCallback,
    ExpandableSegments,
    FitTracer,
    PhaseCallback,
    device_allocator_config,
    probe_session,
)
from autotune.engine.runner import InProcessRunner, TrialRunner
from autotune.engine.study import run_study

logger = logging.getLogger(__name__)

TrialCallback = Callable[[Trial], None]

# Share of the candidate grid the study may measure (at least MIN_TRIALS): most of the grid is
# dominated (smaller micro-batches, or checkpointing at a micro-batch that fits without it).
TRIAL_SHARE = 0.25
# Two micro-batches are enough to have earlier gradients alive during a later micro-batch.
ACCUMULATION_PROBE_STEPS = 2
MIN_TRIALS = 3


def default_trial_budget(n_candidates: int) -> int:
    return min(n_candidates, max(MIN_TRIALS, math.ceil(n_candidates * TRIAL_SHARE)))


def priority_candidates(candidates: list[Candidate]) -> list[Candidate]:
    """What to measure first, from how GPUs behave: samples/s rises with the micro-batch until
    the kernels saturate, and checkpointing only pays when it allows a larger micro-batch
    (docs/design.md#throughput). So: the largest micro-batch without checkpointing, the largest
    with it (only if larger), then the runner-up without."""
    plain = sorted((c for c in candidates if not c.checkpointing), key=lambda c: -c.micro_batch)
    checkpointed = sorted((c for c in candidates if c.checkpointing), key=lambda c: -c.micro_batch)
    first: list[Candidate] = []
    if plain:
        first.append(plain[0])
    largest_plain = plain[0].micro_batch if plain else 0
    if checkpointed and checkpointed[0].micro_batch > largest_plain:
        first.append(checkpointed[0])
    if len(plain) > 1:
        first.append(plain[1])
    return first


def tune(
    spec: Spec,
    device: Device,
    *,
    storage_url: str,
    study_name: str | None = None,
    n_trials: int | None = None,
    seed: int = 0,
    target_seconds: float = 1.0,
    on_attempt: AttemptCallback | None = None,
    on_trial: TrialCallback | None = None,
) -> TuneResult:
    """Probe, search and recommend.

    Args:
        storage_url: SQLAlchemy URL of the Optuna storage (the project's database).
        n_trials: Measurement budget; default a quarter of the candidates, at least 3.
        target_seconds: Roughly how long each measurement's timed steps take.

    Raises:
        SpecError: the spec has no `training.target_global_batch`.
    """
    spec.training.required_target_global_batch()  # before the model is built
    return tune_session(
        InProcessRunner(spec, device),
        storage_url=storage_url,
        study_name=study_name,
        n_trials=n_trials,
        seed=seed,
        target_seconds=target_seconds,
        on_attempt=on_attempt,
        on_trial=on_trial,
    )


@with_few_full_collections
def tune_session(
    session: TrialRunner,
    *,
    storage_url: str,
    study_name: str | None = None,
    n_trials: int | None = None,
    seed: int = 0,
    target_seconds: float = 1.0,
    on_attempt: AttemptCallback | None = None,
    on_trial: TrialCallback | None = None,
    tracer: FitTracer | None = None,
    on_phase: PhaseCallback | None = None,
    expandable: ExpandableSegments | None = None,
) -> TuneResult:
    """`tune` on any trial runner (in this process, or a child process per trial); the probe's
    first fit points from `tracer` when given, and each mode under expandable segments too with
    `expandable` (`probe_session`).

    Raises:
        AssertionError: the result breaks an invariant of `autotune.core.tuning.result_check` (a
        bug).
    """
    spec = session.spec
    training = spec.training
    if not training.sharding.is_layout:
        raise ValueError("sharding: auto is tuned by autotune.engine.layout_tuning.tune_layouts")
    target_global_batch = training.required_target_global_batch()
    probe_result = probe_session(
        session, on_attempt=on_attempt, tracer=tracer, on_phase=on_phase, expandable=expandable
    )
    device_info = probe_result.device  # as measured: after the probe's warm-up
    # The session each candidate runs on, by the allocator settings it is measured under.
    sessions: dict[str | None, TrialRunner] = {None: session}
    if expandable is not None:
        conf = expandable.session.device_info.allocator_conf
        assert conf is not None  # the device's settings with expandable segments
        sessions[conf] = expandable.session
    world_size = training.world_size
    limits = _largest_recommended(probe_result)
    candidates = probe_candidates(
        target_global_batch, world_size, probe_result.modes, accumulation_probed=False
    )
    infeasible = None
    if any(c.accumulation_steps > 1 for c in candidates):
        if on_phase is not None:
            on_phase("probe: the largest micro-batch while gradients accumulate (G = 2)", None)
        probe_result = _probe_accumulation(session, probe_result, candidates)
        # Under the device's settings first: what they stop short of accumulating at is what
        # expandable segments are tried for.
        candidates = probe_candidates(
            target_global_batch, world_size, probe_result.modes, accumulation_probed=False
        )
        if expandable is not None:
            probe_result = _probe_accumulation(
                expandable.session, probe_result, candidates, expandable_segments=True
            )
        candidates = probe_candidates(target_global_batch, world_size, probe_result.modes)
        if not candidates:
            infeasible = _accumulation_does_not_fit(world_size, limits)
    if not candidates:
        infeasible = (
            infeasible
            or _headroom_leaves_nothing(probe_result, training.headroom)
            or explain_infeasible(target_global_batch, world_size, limits)
        )
        return checked_result(
            TuneResult(
                spec=spec,
                device=device_info,
                probe=probe_result,
                trials=[],
                recommendation=None,
                infeasible=infeasible,
            )
        )

    study_name = study_name or f"autotune-{uuid.uuid4().hex[:12]}"
    budget = n_trials or default_trial_budget(len(candidates))
    if on_phase is not None:
        on_phase(
            f"measure: {min(budget, len(candidates))} of {len(candidates)} configurations, timed",
            min(budget, len(candidates)),
        )
    trials = run_study(
        candidates,
        lambda c: sessions[c.allocator_conf].measure(
            c.micro_batch,
            c.accumulation_steps,
            checkpointing=c.checkpointing,
            target_seconds=target_seconds,
            checkpointed_blocks=c.checkpointed_blocks,
        ),
        storage_url=storage_url,
        study_name=study_name,
        n_trials=budget,
        seed=seed,
        first=priority_candidates(candidates),
        progress=on_trial,
        refine=_partial_checkpointing(sessions, probe_result),
    )
    recommendation = _recommend(
        trials, spec, capacity_bytes=device_info.capacity_bytes, num_blocks=session.num_blocks
    )
    if recommendation is not None:
        recommendation = _with_dips(recommendation, probe_result)
    if recommendation is None:
        # Every measured candidate ran out of memory with its accumulation steps.
        return checked_result(
            TuneResult(
                spec=spec,
                device=device_info,
                probe=probe_result,
                trials=trials,
                recommendation=None,
                infeasible=Infeasible(
                    reason="every measured configuration ran out of memory once gradients were "
                    "accumulated over its micro-batches; lower the headroom-adjusted micro-batch "
                    "or the target"
                ),
                study_name=study_name,
            )
        )
    return checked_result(
        TuneResult(
            spec=spec,
            device=device_info,
            probe=probe_result,
            trials=trials,
            recommendation=recommendation,
            exports=build_exports(
                recommendation,
                token_model=session.tokens_per_sample is not None,
                transformers_version=_installed_transformers_version(),
                training=training,
                device_allocator_conf=device_info.allocator_conf,
            ),
            study_name=study_name,
        )
    )


def checked_result(result: TuneResult) -> TuneResult:
    """`result`, once `autotune.core.tuning.result_check` finds nothing wrong with it: the server
    refuses a result that breaks an invariant, so a violation here is the tuner's bug, named at
    once."""
    violations = check_result(result.spec, result)
    if violations:
        raise AssertionError(
            "tuner bug: its result breaks " + "; ".join(str(v) for v in violations)
        )
    return result


def _headroom_leaves_nothing(probe_result: ProbeResult, headroom: float) -> Infeasible | None:
    """Steps fit, but none leaves the headroom free: say so, rather than that nothing fits."""
    if any(m.recommended_micro_batch > 0 for m in probe_result.modes):
        return None
    largest_fitting = max((m.max_micro_batch for m in probe_result.modes), default=0)
    if largest_fitting < 1:
        return None
    return Infeasible(
        reason=f"micro-batches up to {largest_fitting} fit, but none leaves the {headroom:.0%} "
        "headroom free: their peak reserved memory is above "
        f"{1 - headroom:.0%} of the capacity; lower `headroom` or use a larger device",
        nearest_below=None,
        nearest_above=None,
    )


def _accumulation_does_not_fit(world_size: int, max_micro_batch: dict[bool, int]) -> Infeasible:
    """The target needs accumulation, and not even micro-batch 1 fits with the gradients of an
    earlier micro-batch held (1 divides every target, so any accumulating limit >= 1 would have
    left a candidate): only G = 1 batches, world_size * b for a fitting b, are reachable."""
    largest_fitting = max(max_micro_batch.values(), default=0)
    return Infeasible(
        reason="the target needs gradient accumulation, and with the gradients of an earlier "
        "micro-batch held not even a micro-batch of 1 fits; without accumulation the largest "
        f"fitting micro-batch is {largest_fitting} per rank",
        nearest_below=world_size * largest_fitting,
    )


def _probe_accumulation(
    session: TrialRunner,
    probe_result: ProbeResult,
    candidates: list[Candidate],
    *,
    expandable_segments: bool = False,
) -> ProbeResult:
    """Per mode, the exact largest micro-batch within the headroom when gradients accumulate,
    under the device's allocator settings, or with `expandable_segments` under the mode's
    expandable segments (`session` runs under them), for the candidates measured under them.

    The probe measures G = 1, where gradients appear only during backward. With G >= 2 the
    gradients of the first micro-batch are alive through the next one's forward and backward,
    which adds about the parameter size to the peak; G = 2 and G = 8 peak alike. The same
    frugal search runs over trials at G = 2, starting from the probe's answer.
    """
    capacity_bytes = session.device_info.capacity_bytes
    budget_bytes = int(capacity_bytes * (1.0 - session.spec.training.headroom))
    modes = []
    for mode in probe_result.modes:
        option = mode.expandable_segments if expandable_segments else None
        conf = option.allocator_conf if option is not None else None
        cap = max(
            (
                c.micro_batch
                for c in candidates
                if c.checkpointing is mode.checkpointing
                and c.accumulation_steps > 1
                and c.allocator_conf == conf
            ),
            default=0,
        )
        if cap == 0 or (expandable_segments and option is None):
            modes.append(mode)
            continue
        known = mode.recommended_micro_batch
        if option is not None:
            known = option.recommended_micro_batch or 0
        fits = _accumulating_fits(session, mode.checkpointing, budget_bytes)
        search = find_max_micro_batch(
            fits,
            cap=cap,
            capacity_bytes=budget_bytes,
            known_fitting=min(cap, known),
            allocator_config=device_allocator_config(session.device_info),
            # The candidates need the largest size alone: a dip below it shows in the
            # measured candidate's own trial.
            report_dips=False,
            below_a_failing_hint=True,
        )
        logger.info(
            "checkpointing=%s%s: max accumulating micro-batch %d after %d trials",
            mode.checkpointing,
            f" ({conf})" if conf else "",
            search.max_micro_batch,
            len(search.attempts),
        )
        update: dict[str, object] = {"accumulating_micro_batch": search.max_micro_batch}
        if option is not None:
            update = {"expandable_segments": option.model_copy(update=update)}
        modes.append(mode.model_copy(update=update))
    return probe_result.model_copy(update={"modes": modes})


def _largest_recommended(probe_result: ProbeResult) -> dict[bool, int]:
    """Per mode, the largest micro-batch within the headroom under any allocator settings the
    probe verified (what an explanation of an unreachable target counts as fitting)."""
    limits = {}
    for mode in probe_result.modes:
        option = mode.expandable_segments
        verified = option.recommended_micro_batch if option is not None else None
        limits[mode.checkpointing] = max(mode.recommended_micro_batch, verified or 0)
    return limits


def _accumulating_fits(
    session: TrialRunner, checkpointing: bool, budget_bytes: int
) -> Callable[[int], StepOutcome]:
    """fits(b) for a step of two accumulated micro-batches, within the headroom budget."""

    def fits(micro_batch: int) -> StepOutcome:
        outcome = session.trial(micro_batch, ACCUMULATION_PROBE_STEPS, checkpointing=checkpointing)
        within = outcome.fits and outcome.peak_bytes <= budget_bytes
        # Over the budget counts as not fitting: the search looks for the headroom's limit.
        return outcome.model_copy(
            update={"fits": within, "series": outcome.series if within else None}
        )

    return fits


def _partial_checkpointing(
    sessions: Mapping[str | None, TrialRunner], probe_result: ProbeResult
) -> Callable[[Candidate], Candidate]:
    """What the study measures of a checkpointed candidate whose micro-batch does not fit
    without checkpointing: the fewest blocks checkpointed at which it fits within the headroom,
    found by real trials (docs/design.md#partial-checkpointing), the same micro-batch at a
    fraction of the recompute. More blocks than that only cost time, so the fewest is the
    fastest, and k is a dimension the study need not search; it is looked for only for the
    candidates the study measures, on the session of the allocator settings each is measured
    under (`sessions`, by `Candidate.allocator_conf`)."""
    default = sessions[None]
    num_blocks = default.num_blocks
    plain = next((m for m in probe_result.modes if not m.checkpointing), None)
    budget_bytes = int(default.device_info.capacity_bytes * (1.0 - default.spec.training.headroom))

    def plain_limit(accumulating: bool, allocator_conf: str | None) -> int:
        """The largest plain micro-batch within the headroom under those settings."""
        assert plain is not None
        limit = (
            (plain.accumulating_micro_batch or 0)
            if accumulating
            else plain.recommended_micro_batch
        )
        option = plain.expandable_segments
        if allocator_conf is not None and option is not None:
            verified = (
                option.accumulating_micro_batch if accumulating else option.recommended_micro_batch
            )
            limit = max(limit, verified or 0)
        return limit

    def refine(candidate: Candidate) -> Candidate:
        if not num_blocks or num_blocks < 2 or plain is None or not candidate.checkpointing:
            return candidate
        accumulating = candidate.accumulation_steps > 1
        if candidate.micro_batch <= plain_limit(accumulating, candidate.allocator_conf):
            return candidate  # it fits without checkpointing: the study has that one too
        session = sessions[candidate.allocator_conf]
        steps = ACCUMULATION_PROBE_STEPS if accumulating else 1

        def fits(blocks: int) -> bool:
            outcome = session.trial(
                candidate.micro_batch, steps, checkpointing=True, checkpointed_blocks=blocks
            )
            return outcome.fits and outcome.peak_bytes <= budget_bytes

        blocks = fewest_fitting(fits, failing=0, fitting=num_blocks)
        logger.info(
            "micro-batch %d (G=%d): %d of %d blocks checkpointed fit",
            candidate.micro_batch,
            candidate.accumulation_steps,
            blocks,
            num_blocks,
        )
        return replace(candidate, checkpointed_blocks=blocks) if blocks < num_blocks else candidate

    return refine


def _recommend(
    trials: list[Trial], spec: Spec, *, capacity_bytes: int, num_blocks: int | None
) -> Recommendation | None:
    """The measured configuration `autotune.core.tuning.ranking.choose` picks among those whose
    peak leaves the headroom free (else among all that fit): the fastest, or a simpler one tied
    with it within the measured noise."""
    budget_bytes = int(capacity_bytes * (1.0 - spec.training.headroom))
    pool = recommendable(trials, budget_bytes=budget_bytes)
    if not pool:
        return None
    best = choose(pool)
    assert best is not None and best.samples_per_s is not None and best.peak_bytes is not None
    world_size = spec.training.world_size
    return Recommendation(
        allocator_conf=best.allocator_conf,
        micro_batch=best.micro_batch,
        accumulation_steps=best.accumulation_steps,
        checkpointing=best.checkpointing,
        checkpointed_blocks=best.checkpointed_blocks,
        num_blocks=num_blocks if best.checkpointed_blocks is not None else None,
        world_size=world_size,
        global_batch=best.micro_batch * best.accumulation_steps * world_size,
        samples_per_s=best.samples_per_s,
        tokens_per_s=best.tokens_per_s,
        peak_bytes=best.peak_bytes,
        capacity_bytes=capacity_bytes,
        sharding=spec.training.sharding,
    )


def _with_dips(recommendation: Recommendation, probe_result: ProbeResult) -> Recommendation:
    """The recommendation with the sizes below its micro-batch that run out in its mode, which
    every export then says to keep batches out of (docs/design.md#memory-that-is-not-monotone)."""
    mode = next(
        (m for m in probe_result.modes if m.checkpointing == recommendation.checkpointing), None
    )
    if mode is None:
        return recommendation
    option = mode.expandable_segments
    if recommendation.allocator_conf is not None:
        # Measured under expandable segments: the sizes that run out are theirs.
        assert option is not None and option.allocator_conf == recommendation.allocator_conf
        dips = [b for b in option.runs_out_below if b < recommendation.micro_batch]
        return recommendation.model_copy(update={"runs_out_below": dips})
    below = [b for b in mode.runs_out_below if b < recommendation.micro_batch]
    if (
        below
        and option is not None
        and option.recommended
        and option.max_micro_batch is not None
        and recommendation.micro_batch <= option.max_micro_batch
        and not option.runs_out_below
    ):
        # Under expandable segments every size up to the answer fits, verified by trials: the
        # same step, with no batch size to keep out of. (A larger answer they allow is a
        # candidate measured under them: `probe_candidates`.)
        return recommendation.model_copy(update={"allocator_conf": option.allocator_conf})
    return recommendation.model_copy(update={"runs_out_below": below})


def _installed_transformers_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None
