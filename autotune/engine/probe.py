"""The micro-batch probe: for one spec on one device, the exact largest micro-batch whose full
training step fits, without and with gradient checkpointing.

It wires the pure search (`autotune.core.search.micro_batch`) to real trials: each `fits(b)` runs
one complete optimizer step on a `TrialRunner` (`autotune.engine.runner`): in this process, or in a
child process per trial on a probe worker. Out-of-memory arrives as `fits=False`; nothing here
catches it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Protocol

from autotune.core.errors import SpecError
from autotune.core.memory.allocation_trace import AllocationModel
from autotune.core.memory.allocator_config import (
    AllocatorConfig,
    canonical_conf,
    parse_alloc_conf,
)
from autotune.core.schemas import (
    AllocatorOption,
    DeviceInfo,
    ModeProbe,
    ProbeResult,
    Spec,
    StepOutcome,
    TracedFit,
)
from autotune.core.search.micro_batch import (
    PeakModel,
    SearchResult,
    find_max_micro_batch,
    live_budget_bytes,
)
from autotune.engine.devices.device import Device
from autotune.engine.full_collections import with_few_full_collections
from autotune.engine.runner import InProcessRunner, TrialRunner

logger = logging.getLogger(__name__)

AttemptCallback = Callable[[bool, StepOutcome], None]
# A phase of the work starts: what it is, and how many trials it plans when it knows.
PhaseCallback = Callable[[str, int | None], None]
"""Called with (checkpointing, attempt) as soon as a trial finishes, for progress displays."""


class FitTracer(Protocol):
    """Traces a session's step without running it, for the search's first fit
    (`autotune.engine.fit_points`)."""

    def fit_points(self, *, checkpointing: bool) -> Sequence[StepOutcome]:
        """The step at two sizes >= 2 on a model of the session's device, with series (and
        allocations); empty when it cannot be traced."""
        ...


def recommended_micro_batch(
    search: SearchResult,
    *,
    capacity_bytes: int,
    headroom: float,
    allocator_config: AllocatorConfig | None = None,
) -> int:
    """Largest micro-batch <= the raw max whose peak (reserved memory) leaves `headroom` of the
    capacity free, as the best model predicts it
    (docs/design.md#from-the-maximum-to-the-recommendation).

    By the best model the trials agree with: the allocations replayed through the allocator
    model; else the per-op live-bytes model with the budget scaled to live bytes
    (`live_budget_bytes`); else the largest measured size within the budget. Only the replay
    reproducing every trial exactly makes this exact (`replay_is_exact`); `probe_mode` certifies
    any other answer with trials.
    """
    budget_bytes = int(capacity_bytes * (1.0 - headroom))
    if search.max_micro_batch == 0:
        return 0
    replayed = search.allocation_model
    if replayed is not None and _replay_agrees(
        replayed, search, capacity_bytes, allocator_config, tolerance=100
    ):
        # The largest within the budget, not the first size past it: memory is not monotone
        # in b (docs/design.md#memory-that-is-not-monotone).
        largest = replayed.largest_fitting(
            capacity_bytes,
            allocator_config,
            above=0,
            high=search.max_micro_batch + 1,
            budget_bytes=budget_bytes,
        )
        return largest or 0
    model = search.peak_model
    if model is not None and _model_agrees(model, search):
        live_budget = live_budget_bytes(budget_bytes, search.attempts)
        return min(search.max_micro_batch, model.max_micro_batch(live_budget))
    within = [a.micro_batch for a in search.attempts if a.fits and a.peak_bytes <= budget_bytes]
    return max(within, default=0)


def device_allocator_config(info: DeviceInfo) -> AllocatorConfig | None:
    """The caching allocator's settings a device reported (None: torch's defaults)."""
    return parse_alloc_conf(info.allocator_conf) if info.allocator_conf else None


def replay_is_exact(
    search: SearchResult, capacity_bytes: int, allocator_config: AllocatorConfig | None = None
) -> bool:
    """Whether replaying the fitted allocations reproduces every trial at b >= 2 to the byte: then
    the device runs the allocator model itself on what the tracker sees (the emulated GPU), and
    every prediction of it is exact."""
    replayed = search.allocation_model
    return replayed is not None and _replay_agrees(
        replayed, search, capacity_bytes, allocator_config, tolerance=None
    )


def _replay_agrees(
    model: AllocationModel,
    search: SearchResult,
    capacity_bytes: int,
    allocator_config: AllocatorConfig | None,
    *,
    tolerance: int | None,
) -> bool:
    """Trust the replayed allocations only where every trial at b >= 2 (b = 1 runs another op
    sequence) agrees: the same verdict and, for a step that fits, the same reserved peak within
    1 / `tolerance` of it (None: to the byte). On a real card the allocator also serves what the
    dispatcher does not see, and its cache holds what earlier steps left."""
    for attempt in search.attempts:
        if attempt.micro_batch < 2:
            continue
        predicted = model.replay(attempt.micro_batch, capacity_bytes, allocator_config)
        if predicted.fits != attempt.fits:
            return False
        if not attempt.fits:
            continue
        off_bytes = abs(predicted.stats.peak_reserved_bytes - attempt.peak_bytes)
        if off_bytes > (0 if tolerance is None else attempt.peak_bytes // tolerance):
            return False
    return True


def certify_within_budget(
    fits: Callable[[int], StepOutcome],
    search: SearchResult,
    *,
    budget_bytes: int,
    guess: int,
) -> tuple[int, list[StepOutcome]]:
    """The largest micro-batch <= the max whose peak is within `budget_bytes`, certified by trials
    as the max is (it is within, the next size is not), starting from the model's `guess`. Sizes
    the search already ran are not run again. Returns the answer and the new trials."""
    seen = {attempt.micro_batch: attempt for attempt in search.attempts}
    new: list[StepOutcome] = []

    def within(micro_batch: int) -> StepOutcome:
        outcome = seen.get(micro_batch)
        if outcome is None:
            outcome = fits(micro_batch)
            seen[micro_batch] = outcome
            new.append(outcome)
        return outcome.model_copy(
            update={"fits": outcome.fits and outcome.peak_bytes <= budget_bytes}
        )

    answer = find_max_micro_batch(
        within, cap=search.max_micro_batch, capacity_bytes=None, known_fitting=guess
    )
    return answer.max_micro_batch, new


def _model_agrees(model: PeakModel, search: SearchResult) -> bool:
    """Trust the fitted model only where every traced trial agrees with it: for micro-batches
    >= 2, where the op sequence is the fitted one, the same live-bytes peak within 1 % (512-byte
    rounding of small tensors makes the fit approximate on tiny models). The live bytes, not the
    trial's peak: on a GPU that is reserved memory, which the model does not predict (review
    item 1 of issue 9: comparing the two rejected every model on CUDA)."""
    for attempt in search.attempts:
        if attempt.fits and attempt.series and attempt.micro_batch >= 2:
            predicted_bytes = model.peak_bytes(attempt.micro_batch)
            live_bytes = max(attempt.series)
            if abs(predicted_bytes - live_bytes) > live_bytes // 100:
                return False
    return True


def probe_mode(
    session: TrialRunner,
    *,
    checkpointing: bool,
    known_fitting: int = 0,
    on_attempt: AttemptCallback | None = None,
    traced: Sequence[StepOutcome] = (),
) -> ModeProbe:
    """Search one checkpointing mode. `known_fitting` is a hint to verify, not a fact; so are
    the `traced` fit points (`FitTracer`)."""

    def fits(micro_batch: int) -> StepOutcome:
        outcome = session.trial(micro_batch, checkpointing=checkpointing)
        if on_attempt is not None:
            on_attempt(checkpointing, outcome)
        return outcome

    training = session.spec.training
    capacity_bytes = session.device_info.capacity_bytes
    allocator_config = device_allocator_config(session.device_info)
    search = find_max_micro_batch(
        fits,
        cap=training.max_micro_batch,
        capacity_bytes=capacity_bytes,
        known_fitting=known_fitting,
        allocator_config=allocator_config,
        traced=traced,
        check=session.check_stop,
    )
    logger.info(
        "checkpointing=%s: max micro-batch %d after %d trials",
        checkpointing,
        search.max_micro_batch,
        len(search.attempts),
    )
    recommended = recommended_micro_batch(
        search,
        capacity_bytes=capacity_bytes,
        headroom=training.headroom,
        allocator_config=allocator_config,
    )
    attempts = list(search.attempts)
    if search.max_micro_batch > 0 and not replay_is_exact(
        search, capacity_bytes, allocator_config
    ):
        # A model's guess (a real card, or no replay): certified with trials, like the max.
        recommended, certifying = certify_within_budget(
            fits,
            search,
            budget_bytes=int(capacity_bytes * (1.0 - training.headroom)),
            guess=recommended,
        )
        attempts += certifying
        logger.info(
            "checkpointing=%s: recommended micro-batch %d certified with %d more trials",
            checkpointing,
            recommended,
            len(certifying),
        )
    return ModeProbe(
        checkpointing=checkpointing,
        max_micro_batch=search.max_micro_batch,
        recommended_micro_batch=recommended,
        capped=search.capped,
        attempts=[_stored(attempt) for attempt in attempts],
        runs_out_below=list(search.runs_out_below),
        traced=(
            TracedFit(
                predicted_max_micro_batch=search.traced_prediction,
                fit_points=[_stored(point) for point in traced if point.fits],
            )
            if search.traced_prediction is not None
            else None
        ),
    )


def _stored(outcome: StepOutcome) -> StepOutcome:
    """The series served the fit; a result keeps what the wire and the store keep."""
    return outcome.model_copy(update={"series": None, "allocations": None, "start": None})


def probe(spec: Spec, device: Device, *, on_attempt: AttemptCallback | None = None) -> ProbeResult:
    """Find the exact max micro-batch without and with gradient checkpointing.

    A model that does not support checkpointing (a factory without `set_checkpointing`) is
    probed in the plain mode only.

    Raises:
        ModelBuildError: the model cannot be built.
        Any non-OOM error of the training step, unchanged.
    """
    return probe_session(InProcessRunner(spec, device), on_attempt=on_attempt)


@dataclass(frozen=True)
class ExpandableSegments:
    """The same spec on the same device with the allocator's expandable segments, for the probe
    to evaluate (`evaluate_expandable_segments`): a session of its own, since a process's CUDA
    reads the settings once, as it starts; and what traces that session's fit points."""

    session: TrialRunner
    tracer: FitTracer


def with_expandable_segments(info: DeviceInfo) -> str | None:
    """The device's allocator settings with expandable segments, as one `PYTORCH_ALLOC_CONF`
    string; None when it has them already (nothing to evaluate)."""
    config = device_allocator_config(info) or AllocatorConfig()
    if config.expandable_segments:
        return None
    conf = canonical_conf(replace(config, expandable_segments=True))
    assert conf is not None  # differs from the defaults by expandable segments at least
    return conf


def evaluate_expandable_segments(
    session: TrialRunner,
    mode: ModeProbe,
    *,
    traced: Sequence[StepOutcome],
    on_attempt: AttemptCallback | None = None,
) -> AllocatorOption:
    """`mode` again on `session`, whose allocator has expandable segments
    (docs/design.md#expandable-segments-as-a-knob): the traced step's allocations replayed
    under those settings predict the answer and the sizes that run out; only when that is a
    larger answer, or no size up to the answer running out where `mode` has some, does a search
    of real trials verify it (from the traced fit points). Recommended when the trials confirm
    either."""
    info = session.device_info
    conf = info.allocator_conf or ""
    predicted = _traced_answer(traced, info, session.spec.training.max_micro_batch)
    if predicted is None:
        return AllocatorOption(allocator_conf=conf)
    largest, dips = predicted
    if not (largest > mode.max_micro_batch or (mode.runs_out_below and not dips)):
        return AllocatorOption(allocator_conf=conf, traced_max_micro_batch=largest)
    if not session.warm_up(checkpointing=mode.checkpointing).fits:
        return AllocatorOption(allocator_conf=conf, traced_max_micro_batch=largest, trials=1)
    verified = probe_mode(
        session, checkpointing=mode.checkpointing, on_attempt=on_attempt, traced=traced
    )
    better = verified.max_micro_batch > mode.max_micro_batch
    steadier = (
        bool(mode.runs_out_below)
        and not verified.runs_out_below
        and verified.max_micro_batch >= mode.max_micro_batch
    )
    return AllocatorOption(
        allocator_conf=conf,
        traced_max_micro_batch=largest,
        max_micro_batch=verified.max_micro_batch,
        recommended_micro_batch=verified.recommended_micro_batch,
        runs_out_below=verified.runs_out_below,
        trials=len(verified.attempts),
        recommended=better or steadier,
    )


def _traced_answer(
    traced: Sequence[StepOutcome], info: DeviceInfo, cap: int
) -> tuple[int, tuple[int, ...]] | None:
    """The largest size up to `cap` the traced allocations predict to fit on `info`, and the
    sizes below it predicted to run out; None without two traced steps with allocations."""
    points = sorted(
        (p for p in traced if p.fits and p.allocations and p.micro_batch >= 2),
        key=lambda point: point.micro_batch,
    )
    config = device_allocator_config(info)
    capacity_bytes = info.capacity_bytes
    for first, second in pairwise(points):
        assert first.allocations is not None and second.allocations is not None
        if first.micro_batch == second.micro_batch:
            continue
        model = AllocationModel.fit(
            first.micro_batch,
            first.allocations,
            second.micro_batch,
            second.allocations,
            starts=(first.start, second.start),
        )
        if model is None:
            continue
        largest = model.largest_fitting(capacity_bytes, config, above=0, high=cap + 1) or 0
        dips = tuple(
            b for b in range(2, largest) if not model.replay(b, capacity_bytes, config).fits
        )
        return largest, dips
    return None


@with_few_full_collections
def probe_session(
    session: TrialRunner,
    *,
    on_attempt: AttemptCallback | None = None,
    tracer: FitTracer | None = None,
    on_phase: PhaseCallback | None = None,
    expandable: ExpandableSegments | None = None,
) -> ProbeResult:
    """`probe` on an existing session, which stays usable (warm, in steady state) afterwards.
    With a `tracer`, each mode's first fit comes from the traced step: two real trials per
    mode when the trace is right (docs/design.md#cheaper-real-probes). With `expandable`, each
    mode is evaluated under expandable segments too (`ModeProbe.expandable_segments`)."""
    modes_to_probe = [False, True] if session.supports_checkpointing else [False]
    if not session.supports_checkpointing:
        logger.warning("this model cannot toggle gradient checkpointing; probing without only")

    if on_phase is not None:
        on_phase("warm-up: one step at micro-batch 1 (builds the optimizer state)", None)
    failed_warm_ups = _warm_up(session, modes_to_probe)
    # Read after the warm-up: a CUDA device knows its capacity once a step's kernels are loaded.
    device_info = session.device_info
    if len(failed_warm_ups) == len(modes_to_probe):
        # Not even micro-batch 1 fits, in any mode: report how far each got.
        return ProbeResult(
            device=device_info,
            modes=[
                ModeProbe(
                    checkpointing=checkpointing,
                    max_micro_batch=0,
                    recommended_micro_batch=0,
                    capped=False,
                    attempts=[outcome],
                )
                for checkpointing, outcome in failed_warm_ups
            ],
        )

    modes: list[ModeProbe] = []
    known_fitting = 0
    for checkpointing in modes_to_probe:
        if on_phase is not None:
            on_phase(
                f"probe, checkpointing {'on' if checkpointing else 'off'}: the largest "
                "micro-batch that fits",
                None,
            )
        mode = probe_mode(
            session,
            checkpointing=checkpointing,
            known_fitting=known_fitting,
            on_attempt=on_attempt,
            traced=tracer.fit_points(checkpointing=checkpointing) if tracer is not None else (),
        )
        if expandable is not None:
            if on_phase is not None:
                on_phase(
                    f"checkpointing {'on' if checkpointing else 'off'}: the same under "
                    "expandable segments, traced (and verified if they help)",
                    None,
                )
            option = evaluate_expandable_segments(
                expandable.session,
                mode,
                traced=expandable.tracer.fit_points(checkpointing=checkpointing),
                on_attempt=on_attempt,
            )
            mode = mode.model_copy(update={"expandable_segments": option})
        modes.append(mode)
        # Checkpointing only ever removes saved activations, so the plain max is a good first
        # guess for the checkpointed search; the search still verifies it.
        known_fitting = max(known_fitting, mode.max_micro_batch)
    return ProbeResult(device=device_info, modes=modes)


def _warm_up(session: TrialRunner, modes: list[bool]) -> list[tuple[bool, StepOutcome]]:
    """Warm up in the first mode where micro-batch 1 fits; returns the modes that failed first."""
    failed: list[tuple[bool, StepOutcome]] = []
    for checkpointing in modes:
        outcome = session.warm_up(checkpointing=checkpointing)
        if outcome.fits:
            break
        failed.append((checkpointing, outcome))
    return failed


def run_step(spec: Spec, device: Device, *, micro_batch: int, checkpointing: bool) -> StepOutcome:
    """One trial of a full training step at `micro_batch`, after a warm-up at micro-batch 1.

    Raises:
        SpecError: checkpointing was asked for a model that cannot do it.
    """
    session = InProcessRunner(spec, device)
    if checkpointing and not session.supports_checkpointing:
        raise SpecError("--checkpointing: this model cannot toggle gradient checkpointing")
    outcome = session.warm_up(checkpointing=checkpointing)
    if outcome.fits and micro_batch != 1:
        outcome = session.trial(micro_batch, checkpointing=checkpointing)
    return outcome


__all__ = ["FitTracer", "probe", "probe_mode", "probe_session", "run_step"]
