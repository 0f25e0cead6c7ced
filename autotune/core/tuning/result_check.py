"""The invariants of a tuning result: what `autotune.engine.tuner` guarantees about every
`TuneResult` it returns, checked on a result that came from anywhere.

Pure and torch-free: the server runs it on every posted result (a worker token must not be able
to store, and serve to every later submitter as cached, a result the tuner could not have
produced), and the tuner runs it on its own output, where a violation is a bug.

Each invariant is written next to the code that guarantees it:

* the spec: the run's own. Without a target nothing is tuned (`probes.worker` answers with the
  probe alone): no trials, no recommendation, no explanation, no exports;
* the device: the probe ran on the result's device (`tuner.tune_session`); a named GPU's
  capacity (emulated, or estimated) is the catalogue's for the spec's world size
  (`autotune.core.gpus.cuda_reserve.budget_for`), a real GPU's at most its total memory;
* the probe, per mode (`probe.probe_session`, `search.find_max_micro_batch`): modes are plain,
  then checkpointed; every attempt is a distinct size in [1, cap]; the max is certified from both
  sides (an attempt at the max fits, one at max + 1 does not unless the max is the cap); a size
  below the max that ran out is listed in `runs_out_below` (memory is not monotone in b); fitting
  attempts stay within capacity; 0 <= recommended <= max; the accumulating max, when set, is at
  most the recommended one (`tuner._probe_accumulation`); a traced fit, when given, predicted
  a size within the cap from two or more distinct fitting steps (`engine.fit_points`);
* expandable segments, per mode (`probe.evaluate_expandable_segments`): the device's settings
  with them; verified figures ordered as a mode's are (recommended <= max, accumulating <=
  recommended, sizes that run out below the max);
* the trials (`study.run_study`, `throughput.measure_throughput`): increasing numbers, distinct
  candidates, each an exact candidate of `candidates.probe_candidates` under the probe's
  limits, under the allocator settings it assigns (expandable segments only where the device's
  settings stop short and theirs were verified); a complete trial has finite positive
  samples/s equal to micro x accumulation / step time and a peak within capacity (an
  estimate's step: its compute plus its exposed communication, exposed at most all of it); an
  out-of-memory trial has no throughput;
* the answer (`tuner._recommend`): a recommendation iff some trial completed, equal to the
  trial `ranking.choose` picks from the pool (the fastest, or a simpler one tied with it within
  the measured noise), for the spec's world size, hitting the target, under the allocator
  settings its trial ran under (or expandable segments where they fit every size up to it),
  with exports that say the same; otherwise an explanation, and no candidate left unmeasured.

`check_attempt` and `check_trial` hold one streamed attempt or trial to the same rules, as far
as they can be judged alone (the server checks each as it arrives, against the largest capacity
the run's target allows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from autotune.core.exports import ZERO_STAGES
from autotune.core.gpus.catalogue import UnknownGpu, find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.memory.allocator_config import (
    AllocatorConfig,
    AllocatorConfigError,
    canonical_conf,
    parse_alloc_conf,
)
from autotune.core.parallel.layout_choice import LAYOUT_ORDER, layout_candidates
from autotune.core.schemas import (
    AllocatorOption,
    DeviceInfo,
    DeviceKind,
    LayoutVerdict,
    ModeProbe,
    Sharding,
    Spec,
    StepOutcome,
    TracedFit,
    Trial,
    TrialState,
    TuneResult,
)
from autotune.core.tuning.candidates import Candidate, probe_candidates
from autotune.core.tuning.ranking import choose, recommendable


@dataclass(frozen=True)
class Violation:
    """One broken invariant: the result's field (a path like `trials[2].micro_batch`) and why."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def check_result(spec: Spec, result: TuneResult) -> list[Violation]:
    """Every invariant `result` violates as an answer to `spec` (empty: a valid result). With
    sharding: auto, the probe, trials, recommendation and exports are held to the layout they
    were measured with (`layout_violations`)."""
    layout = layout_violations(spec, result)
    if layout:
        return layout
    measured = spec if spec.training.sharding.is_layout else _measured_spec(spec, result)
    check = _Check(measured, result, result.device.capacity_bytes)
    if result.spec != spec:
        check.fail("spec", "differs from the spec that was tuned")
    check.spec_and_device()
    if not result.probe.modes:
        check.fail("probe.modes", "the probe searched no mode")
    for index, mode in enumerate(result.probe.modes):
        check.mode(index, mode)
    check.trials()
    check.answer()
    check.fit_advice()
    return check.violations


def _measured_spec(spec: Spec, result: TuneResult) -> Spec:
    return Spec(model=spec.model, training=result.measured_training)


def layout_violations(spec: Spec, result: TuneResult) -> list[Violation]:
    """What `result.layouts` violates (`autotune.engine.layout_tuning.tune_layouts`): set
    exactly for sharding: auto, each candidate layout of the topology once, the chosen one
    first and named by the recommendation (which is its own), or no layout chosen and no
    recommendation; a layout's best configuration hits the target on the spec's ranks."""
    training = spec.training
    layouts = result.layouts
    if training.sharding.is_layout:
        return [Violation("layouts", "set although the spec names its layout")] if layouts else []
    if training.target_global_batch is None:
        return [Violation("spec.training.sharding", "auto needs a target to tune for")]
    violations: list[Violation] = []
    expected = set(layout_candidates(training))
    listed = [layout.sharding for layout in layouts]
    if len(set(listed)) != len(listed) or set(listed) != expected:
        violations.append(
            Violation("layouts", "not each candidate layout of the topology exactly once")
        )
        return violations
    chosen = [i for i, layout in enumerate(layouts) if layout.verdict is LayoutVerdict.CHOSEN]
    rec = result.recommendation
    if rec is None and chosen:
        violations.append(Violation("layouts", "a layout chosen without a recommendation"))
    if rec is not None:
        if chosen != [0]:
            violations.append(
                Violation("layouts", "the chosen layout is not the one listed first")
            )
        elif rec.sharding is not layouts[0].sharding or layouts[0].recommendation != rec:
            violations.append(
                Violation("recommendation.sharding", "not the chosen layout's recommendation")
            )
    for index, layout in enumerate(layouts):
        best = layout.recommendation
        group = training.ranks_per_node if layout.sharding is Sharding.HYBRID else None
        if layout.shard_group_size != group:
            violations.append(
                Violation(f"layouts[{index}].shard_group_size", f"not {group} for this layout")
            )
        if best is None:
            if layout.verdict in (LayoutVerdict.CHOSEN, LayoutVerdict.SLOWER):
                violations.append(
                    Violation(f"layouts[{index}].verdict", "a speed verdict without a speed")
                )
            continue
        if best.sharding is not layout.sharding:
            violations.append(
                Violation(f"layouts[{index}].recommendation.sharding", "not its own")
            )
        if best.global_batch != training.target_global_batch or (
            best.world_size != training.world_size
        ):
            violations.append(
                Violation(f"layouts[{index}].recommendation", "misses the spec's target or ranks")
            )
        # A faster layout loses only a tie, to a simpler one.
        if (
            rec is not None
            and rec.sharding is not None
            and index > 0
            and best.samples_per_s > rec.samples_per_s
            and LAYOUT_ORDER.index(layout.sharding) < LAYOUT_ORDER.index(rec.sharding)
        ):
            violations.append(
                Violation(f"layouts[{index}]", "faster and simpler than the chosen layout")
            )
    return violations


def check_attempt(spec: Spec, attempt: StepOutcome, capacity_bytes: int) -> list[Violation]:
    """What one streamed probe attempt violates on its own, on a device of at most
    `capacity_bytes` (the server checks each as it arrives; the result is checked whole)."""
    check = _Check(spec, None, capacity_bytes)
    check.attempt("attempt", attempt)
    return check.violations


def check_trial(spec: Spec, trial: Trial, capacity_bytes: int) -> list[Violation]:
    """What one streamed trial violates on its own. A FAILED trial may be streamed (the worker
    posts the measurement that crashed), though a result never holds one."""
    check = _Check(spec, None, capacity_bytes)
    check.trial("trial", trial, streamed=True)
    return check.violations


def capacity_violations(spec: Spec, device: DeviceInfo) -> list[Violation]:
    """A device's capacity against what it can be: a named GPU's (an emulated one, or an
    estimate's) is the catalogue's for the spec's world size, to the byte; a real GPU's step
    cannot use more than the card has."""
    violations = []
    if device.gpu is not None:
        try:
            budget = budget_for(find_gpu(device.gpu), spec.training.world_size)
        except UnknownGpu:
            return [Violation("device.gpu", "not a GPU of the catalogue")]
        if device.capacity_bytes != budget.capacity_bytes:
            violations.append(
                Violation(
                    "device.capacity_bytes",
                    f"not the catalogue's {budget.capacity_bytes} for {budget.gpu.name} at "
                    f"world size {spec.training.world_size}",
                )
            )
        if device.total_memory_bytes != budget.gpu.total_memory_bytes:
            violations.append(
                Violation("device.total_memory_bytes", f"not the catalogue's {budget.gpu.name}")
            )
    elif device.kind is DeviceKind.CUDA and device.capacity_bytes > device.total_memory_bytes:
        violations.append(Violation("device.capacity_bytes", "above the GPU's total memory"))
    return violations


def expandable_conf(device: DeviceInfo) -> str:
    """The device's allocator settings with expandable segments, canonical: the settings a
    mode is evaluated under (`autotune.engine.probe.with_expandable_segments`)."""
    config = parse_alloc_conf(device.allocator_conf) if device.allocator_conf else None
    conf = canonical_conf(replace(config or AllocatorConfig(), expandable_segments=True))
    assert conf is not None  # differs from the defaults by expandable segments at least
    return conf


def _finite_positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def _at(data: dict[str, Any], *path: str) -> object:
    value: object = data
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


class _Check:
    """One check's state: the result, what it is checked against, and what failed so far."""

    def __init__(self, spec: Spec, result: TuneResult | None, capacity_bytes: int) -> None:
        self.spec = spec
        self._result = result
        self.capacity_bytes = capacity_bytes
        training = spec.training
        self.budget_bytes = int(self.capacity_bytes * (1.0 - training.headroom))
        modes = result.probe.modes if result is not None else []
        self.modes = {mode.checkpointing: mode for mode in modes}
        self.violations: list[Violation] = []

    @property
    def result(self) -> TuneResult:
        assert self._result is not None, "a streamed event is checked without its result"
        return self._result

    def fail(self, field: str, message: str) -> None:
        self.violations.append(Violation(field, message))

    def spec_and_device(self) -> None:
        if self.result.probe.device != self.result.device:
            self.fail("probe.device", "differs from the result's device")
        for violation in capacity_violations(self.spec, self.result.device):
            self.fail(violation.field, violation.message)

    def mode(self, index: int, mode: ModeProbe) -> None:
        field = f"probe.modes[{index}]"
        cap = self.spec.training.max_micro_batch
        if index > 1 or mode.checkpointing is not (index == 1):
            self.fail(f"{field}.checkpointing", "modes are plain, then checkpointed, once each")
        if not 0 <= mode.max_micro_batch <= cap:
            self.fail(f"{field}.max_micro_batch", f"outside [0, the spec's cap {cap}]")
        if mode.capped != (mode.max_micro_batch == cap):
            self.fail(f"{field}.capped", "true exactly when the max is the spec's cap")
        if not 0 <= mode.recommended_micro_batch <= mode.max_micro_batch:
            self.fail(f"{field}.recommended_micro_batch", "outside [0, max_micro_batch]")
        accumulating = mode.accumulating_micro_batch
        if accumulating is not None and not 0 <= accumulating <= mode.recommended_micro_batch:
            self.fail(f"{field}.accumulating_micro_batch", "outside [0, recommended_micro_batch]")

        verdicts: dict[int, bool] = {}
        for number, attempt in enumerate(mode.attempts):
            at = f"{field}.attempts[{number}]"
            if attempt.micro_batch in verdicts:
                self.fail(f"{at}.micro_batch", "tried twice in one mode")
            verdicts[attempt.micro_batch] = attempt.fits
            self.attempt(at, attempt)
            if attempt.fits and attempt.micro_batch > mode.max_micro_batch:
                self.fail(f"{at}.fits", "a fitting micro-batch above max_micro_batch")
            if not attempt.fits and attempt.micro_batch == mode.max_micro_batch:
                self.fail(f"{at}.fits", "an out-of-memory micro-batch at the max")
            dips = mode.runs_out_below
            if (
                not attempt.fits
                and attempt.micro_batch < mode.max_micro_batch
                and attempt.micro_batch not in dips
            ):
                # Memory is not monotone in b: a size below the max may run out, and is said.
                self.fail(
                    f"{at}.fits",
                    "an out-of-memory micro-batch below the max not listed in runs_out_below",
                )
            if attempt.fits and attempt.micro_batch in dips:
                self.fail(f"{at}.fits", "a fitting micro-batch listed in runs_out_below")
        dips = mode.runs_out_below
        if dips != sorted(set(dips)) or any(not 1 <= b < mode.max_micro_batch for b in dips):
            self.fail(f"{field}.runs_out_below", "not increasing sizes in [1, max_micro_batch)")
        top = mode.max_micro_batch
        if top >= 1 and verdicts.get(top) is not True:
            self.fail(f"{field}.max_micro_batch", "no attempt at the max that fits")
        if not mode.capped and verdicts.get(top + 1) is not False:
            self.fail(f"{field}.max_micro_batch", "no attempt at max + 1 that runs out of memory")
        if mode.traced is not None:
            self._traced(f"{field}.traced", mode.traced, cap)
        if mode.expandable_segments is not None:
            self._expandable(f"{field}.expandable_segments", mode.expandable_segments)

    def _expandable(self, field: str, option: AllocatorOption) -> None:
        """The mode under expandable segments: the device's settings with them, and verified
        figures that relate as a mode's do."""
        if option.allocator_conf != expandable_conf(self.result.device):
            self.fail(
                f"{field}.allocator_conf", "not the device's settings with expandable segments"
            )
        top = option.max_micro_batch
        recommended = option.recommended_micro_batch
        if top is None:
            if recommended is not None or option.accumulating_micro_batch is not None:
                self.fail(field, "verified figures without a verified max_micro_batch")
            if option.recommended:
                self.fail(f"{field}.recommended", "recommended without being verified")
            return
        if recommended is None or not 0 <= recommended <= top:
            self.fail(f"{field}.recommended_micro_batch", "outside [0, max_micro_batch]")
        accumulating = option.accumulating_micro_batch
        if accumulating is not None and not accumulating <= (recommended or 0):
            self.fail(f"{field}.accumulating_micro_batch", "above recommended_micro_batch")
        dips = option.runs_out_below
        if dips != sorted(set(dips)) or any(not 1 <= b < top for b in dips):
            self.fail(f"{field}.runs_out_below", "not increasing sizes in [1, max_micro_batch)")

    def attempt(self, at: str, attempt: StepOutcome) -> None:
        """What an attempt violates on its own."""
        cap = self.spec.training.max_micro_batch
        if attempt.micro_batch > cap:
            self.fail(f"{at}.micro_batch", f"above the spec's cap {cap}")
        if attempt.fits and attempt.peak_bytes > self.capacity_bytes:
            self.fail(f"{at}.peak_bytes", "a fitting step above the device's capacity")
        if attempt.fits and attempt.oom_phase is not None:
            self.fail(f"{at}.oom_phase", "set on a step that fits")
        allocated = attempt.peak_allocated_bytes
        if allocated is not None and allocated > attempt.peak_bytes:
            # Allocated blocks live in reserved segments: torch's own invariant.
            self.fail(f"{at}.peak_allocated_bytes", "above the peak reserved (peak_bytes)")

    def _traced(self, field: str, traced: TracedFit, cap: int) -> None:
        """A trace is evidence the search verified, not an answer: its prediction may miss,
        but it is a size the search could have tried, and its fit points are two distinct
        complete steps (`autotune.engine.fit_points`)."""
        if traced.predicted_max_micro_batch > cap:
            self.fail(f"{field}.predicted_max_micro_batch", f"above the spec's cap {cap}")
        sizes = [point.micro_batch for point in traced.fit_points]
        if len(set(sizes)) < 2 or any(not 2 <= size <= cap for size in sizes):
            self.fail(f"{field}.fit_points", f"not two or more distinct sizes in [2, {cap}]")
        if not all(point.fits for point in traced.fit_points):
            self.fail(f"{field}.fit_points", "a fit point that does not fit fits no model")

    def fit_advice(self) -> None:
        """What would make it fit is said only where micro-batch 1 fits in no mode, and every
        remedy fits its GPU (docs/design.md#what-would-make-it-fit)."""
        advice = self.result.probe.fit_advice
        if advice is None:
            return
        if any(mode.max_micro_batch > 0 for mode in self.result.probe.modes):
            self.fail("probe.fit_advice", "given, but micro-batch 1 fits")
        for index, remedy in enumerate(advice.remedies):
            if remedy.peak_bytes > remedy.capacity_bytes:
                self.fail(f"probe.fit_advice.remedies[{index}].peak_bytes", "above its capacity")

    def _accumulating_limit(self, checkpointing: bool) -> int:
        accumulating = self.modes[checkpointing].accumulating_micro_batch
        return accumulating or 0

    def trials(self) -> None:
        seen: set[tuple[bool, int]] = set()
        previous_number = -1
        for index, trial in enumerate(self.result.trials):
            at = f"trials[{index}]"
            if trial.number <= previous_number:
                self.fail(f"{at}.number", "trial numbers must increase")
            previous_number = trial.number
            key = (trial.checkpointing, trial.micro_batch)
            if key in seen:
                self.fail(f"{at}.micro_batch", "this candidate was already measured")
            seen.add(key)
            self.trial(at, trial, streamed=False)
            mode = self.modes.get(trial.checkpointing)
            if mode is None:
                self.fail(f"{at}.checkpointing", "a mode the probe did not search")
            elif not self._allocator_assigned(at, trial):
                pass  # under settings the tuner would not measure it with: said
            elif trial.allocator_conf is not None:
                pass  # a candidate under expandable segments, within their verified limits
            elif trial.micro_batch > mode.recommended_micro_batch:
                self.fail(
                    f"{at}.micro_batch",
                    f"above the probe's recommended {mode.recommended_micro_batch} for its mode",
                )
            elif trial.accumulation_steps > 1 and trial.micro_batch > self._accumulating_limit(
                trial.checkpointing
            ):
                self.fail(f"{at}.micro_batch", "above the probe's max when accumulating")

    def _candidates(self) -> dict[tuple[bool, int], Candidate]:
        """The tuner's candidates under the probe's answers, by (checkpointing, micro-batch)."""
        target = self.spec.training.target_global_batch
        if target is None:
            return {}
        modes = self.result.probe.modes
        candidates = probe_candidates(target, self.spec.training.world_size, modes)
        return {(c.checkpointing, c.micro_batch): c for c in candidates}

    def _allocator_assigned(self, at: str, trial: Trial) -> bool:
        """Whether `trial` ran under the allocator settings the tuner measures it under: the
        device's where they fit it, its mode's verified expandable segments where only they do
        (`candidates.probe_candidates`); False once said why not."""
        candidate = self._candidates().get((trial.checkpointing, trial.micro_batch))
        if trial.allocator_conf is None:
            if candidate is not None and candidate.allocator_conf is not None:
                self.fail(
                    f"{at}.allocator_conf",
                    "measured under the device's settings where only expandable segments fit it",
                )
                return False
            return True
        if candidate is None or candidate.allocator_conf != trial.allocator_conf:
            self.fail(
                f"{at}.allocator_conf",
                "not a candidate under these settings: its mode's expandable segments were not "
                "verified to fit it within the headroom, or the device's settings fit it",
            )
            return False
        return True

    def trial(self, at: str, trial: Trial, *, streamed: bool) -> None:
        """What a trial violates on its own (`streamed`: a FAILED one may be posted)."""
        training = self.spec.training
        if trial.allocator_conf is not None:
            self._trial_allocator(at, trial.allocator_conf)
        target = training.target_global_batch
        if target is None and streamed:  # a result's are refused by `_probe_only`
            self.fail(at, "a trial although the spec has no target_global_batch to tune for")
        if trial.micro_batch > training.max_micro_batch:
            self.fail(f"{at}.micro_batch", f"above the spec's cap {training.max_micro_batch}")
        if trial.checkpointed_blocks is not None and not trial.checkpointing:
            self.fail(f"{at}.checkpointed_blocks", "set on a trial without checkpointing")
        product = trial.micro_batch * trial.accumulation_steps * training.world_size
        if target is not None and product != target:
            self.fail(
                f"{at}.accumulation_steps",
                f"{trial.micro_batch} x {trial.accumulation_steps} x world size "
                f"{training.world_size} = {product}, not the target {target}",
            )
        self._measurement(at, trial, streamed=streamed)

    def _trial_allocator(self, at: str, conf: str) -> None:
        """A trial's own settings: canonical ones with expandable segments (the only other
        settings the tuner measures under)."""
        try:
            config = parse_alloc_conf(conf)
        except AllocatorConfigError:
            self.fail(f"{at}.allocator_conf", "not settings torch accepts")
            return
        if not config.expandable_segments or canonical_conf(config) != conf:
            self.fail(f"{at}.allocator_conf", "not canonical settings with expandable segments")

    def _measurement(self, at: str, trial: Trial, *, streamed: bool) -> None:
        if trial.state is TrialState.FAILED and not streamed:
            self.fail(f"{at}.state", "a result holds only complete and out-of-memory trials")
        if trial.state is not TrialState.COMPLETE:
            if trial.samples_per_s is not None or trial.tokens_per_s is not None:
                self.fail(f"{at}.samples_per_s", "a throughput on a trial that did not complete")
            return
        if not _finite_positive(trial.samples_per_s):
            self.fail(f"{at}.samples_per_s", "must be a finite number > 0")
        if trial.tokens_per_s is not None and not _finite_positive(trial.tokens_per_s):
            self.fail(f"{at}.tokens_per_s", "must be a finite number > 0")
        if not _finite_positive(trial.step_time_s):
            self.fail(f"{at}.step_time_s", "must be a finite number > 0")
        elif _finite_positive(trial.samples_per_s):
            assert trial.samples_per_s is not None and trial.step_time_s is not None
            measured = trial.micro_batch * trial.accumulation_steps / trial.step_time_s
            if not math.isclose(trial.samples_per_s, measured, rel_tol=1e-6):
                self.fail(f"{at}.samples_per_s", "is not micro x accumulation / step_time_s")
        if trial.peak_bytes is None or not 0 <= trial.peak_bytes <= self.capacity_bytes:
            self.fail(f"{at}.peak_bytes", "a complete trial's peak must be in [0, capacity]")
        self._communication(at, trial)

    def _communication(self, at: str, trial: Trial) -> None:
        """An estimate's split of its step: compute plus exposed communication, exposed no more
        than all of it."""
        parts = (trial.compute_time_s, trial.communication_time_s, trial.exposed_communication_s)
        if all(part is None for part in parts):
            return
        compute_s, communication_s, exposed_s = parts
        if compute_s is None or communication_s is None or exposed_s is None:
            self.fail(f"{at}.compute_time_s", "compute, communication and exposed go together")
            return
        if exposed_s > communication_s * (1 + 1e-9):
            self.fail(f"{at}.exposed_communication_s", "more than the communication_time_s")
        step_s = trial.step_time_s or 0.0
        if not math.isclose(step_s, compute_s + exposed_s, rel_tol=1e-6):
            self.fail(f"{at}.step_time_s", "is not compute_time_s + exposed_communication_s")

    def answer(self) -> None:
        result = self.result
        if self.spec.training.target_global_batch is None:
            self._probe_only()
            return
        rec = result.recommendation
        pool = recommendable(self.result.trials, budget_bytes=self.budget_bytes)
        if rec is None:
            self._no_recommendation(bool(pool))
            return
        if result.infeasible is not None:
            self.fail("infeasible", "set although there is a recommendation")
        training = self.spec.training
        if rec.world_size != training.world_size:
            self.fail("recommendation.world_size", f"not the spec's {training.world_size}")
        product = rec.micro_batch * rec.accumulation_steps * rec.world_size
        if rec.global_batch != product:
            self.fail(
                "recommendation.global_batch", f"not micro x accumulation x world = {product}"
            )
        if rec.global_batch != training.target_global_batch:
            self.fail("recommendation.global_batch", "not the spec's target_global_batch")
        if (rec.checkpointed_blocks is None) != (rec.num_blocks is None) or (
            rec.checkpointed_blocks is not None
            and rec.num_blocks is not None
            and not rec.checkpointed_blocks < rec.num_blocks
        ):
            self.fail("recommendation.checkpointed_blocks", "not fewer than its num_blocks")
        if rec.sharding is not None and rec.sharding is not training.sharding:
            self.fail("recommendation.sharding", f"not the measured layout {training.sharding}")
        if rec.capacity_bytes != self.capacity_bytes:
            self.fail("recommendation.capacity_bytes", "not the device's capacity")
        if not 0 <= rec.peak_bytes <= self.capacity_bytes:
            self.fail("recommendation.peak_bytes", "outside [0, capacity]")
        if not _finite_positive(rec.samples_per_s):
            self.fail("recommendation.samples_per_s", "must be a finite number > 0")
        measured = [
            t
            for t in pool
            if (t.micro_batch, t.accumulation_steps, t.checkpointing, t.checkpointed_blocks)
            == (
                rec.micro_batch,
                rec.accumulation_steps,
                rec.checkpointing,
                rec.checkpointed_blocks,
            )
        ]
        if not measured:
            self.fail("recommendation", "not a measured configuration it could be chosen from")
        else:
            trial = measured[0]
            if (trial.samples_per_s, trial.tokens_per_s, trial.peak_bytes) != (
                rec.samples_per_s,
                rec.tokens_per_s,
                rec.peak_bytes,
            ):
                self.fail("recommendation", "its numbers differ from its trial's")
            self._recommended_allocator(trial)
            chosen = choose(pool)
            if chosen is not None and chosen is not trial:
                self.fail(
                    "recommendation",
                    f"not the fastest nor tied with it within the noise and simpler "
                    f"({chosen.micro_batch} x {chosen.accumulation_steps}, checkpointing "
                    f"{chosen.checkpointing_label}, was measured at {chosen.samples_per_s} "
                    "samples/s)",
                )
        self._exports()

    def _recommended_allocator(self, trial: Trial) -> None:
        """The recommendation holds for the settings its trial ran under, with the sizes that
        run out under them; or, measured under the device's, for expandable segments where
        those fit every size up to it (verified: no size running out, a max at least its
        micro-batch), with no size to keep out of (`tuner._with_dips`)."""
        rec = self.result.recommendation
        assert rec is not None
        mode = self.modes.get(rec.checkpointing)
        if mode is None:
            return  # its trial's mode was never probed: said by `trials`
        option = mode.expandable_segments
        if trial.allocator_conf is not None:
            if rec.allocator_conf != trial.allocator_conf:
                self.fail("recommendation.allocator_conf", "not the settings its trial ran under")
                return
            assert option is not None  # the trial was a candidate under them
            dips = [b for b in option.runs_out_below if b < rec.micro_batch]
        elif rec.allocator_conf is None:
            dips = [b for b in mode.runs_out_below if b < rec.micro_batch]
        else:
            steadier = (
                option is not None
                and option.allocator_conf == rec.allocator_conf
                and option.recommended
                and option.max_micro_batch is not None
                and rec.micro_batch <= option.max_micro_batch
                and not option.runs_out_below
            )
            if not steadier:
                self.fail(
                    "recommendation.allocator_conf",
                    "set, but its trial ran under the device's settings and these were not "
                    "verified to fit every size up to its micro-batch",
                )
                return
            dips = []
        if rec.runs_out_below != dips:
            self.fail(
                "recommendation.runs_out_below",
                f"not {dips}, the sizes below it that run out under its allocator settings",
            )

    def _exports(self) -> None:
        rec = self.result.recommendation
        exports = self.result.exports
        assert rec is not None
        if exports is None:
            self.fail("exports", "missing although there is a recommendation")
            return
        expected: dict[tuple[str, ...], object] = {
            ("hf", "per_device_train_batch_size"): rec.micro_batch,
            ("hf", "gradient_accumulation_steps"): rec.accumulation_steps,
            ("axolotl", "micro_batch_size"): rec.micro_batch,
            ("axolotl", "gradient_accumulation_steps"): rec.accumulation_steps,
            ("axolotl", "gradient_checkpointing"): rec.checkpointing,
            ("deepspeed", "train_batch_size"): rec.global_batch,
            ("deepspeed", "train_micro_batch_size_per_gpu"): rec.micro_batch,
            ("deepspeed", "gradient_accumulation_steps"): rec.accumulation_steps,
            ("lightning", "trainer", "accumulate_grad_batches"): rec.accumulation_steps,
            ("lightning", "datamodule", "batch_size"): rec.micro_batch,
            ("lightning", "module", "gradient_checkpointing"): rec.checkpointing,
        }
        expected[("checkpointed_blocks",)] = rec.checkpointed_blocks if rec.checkpointing else None
        # Every text sets the settings the recommendation holds for (its own, else the
        # device's), and keeps its dips out.
        expected[("allocator_conf",)] = rec.allocator_conf or self.result.device.allocator_conf
        expected[("runs_out_below",)] = rec.runs_out_below
        training = self.spec.training
        if training.target_global_tokens is not None:
            # The samples the token target was turned into are full packed sequences.
            expected[("axolotl", "sequence_len")] = training.seq_len
            expected[("axolotl", "sample_packing")] = True
            expected[("tokens_per_sample",)] = training.seq_len
        elif exports.tokens_per_sample is not None:
            self.fail("exports.tokens_per_sample", "set although the target is not in tokens")
        if training.sharding is not Sharding.NONE:
            stage = ZERO_STAGES[training.sharding]
            expected[("deepspeed", "zero_optimization", "stage")] = stage
        if training.lora is not None:
            expected[("axolotl", "adapter")] = "lora"
            expected[("axolotl", "lora_r")] = training.lora.r
            expected[("lora", "r")] = training.lora.r
        elif exports.lora is not None:
            self.fail("exports.lora", "set although the spec trains no adapters")
        if exports.training != self.result.measured_training:
            # The texts say what each consumer holds beyond this section.
            self.fail("exports.training", "is not the result's spec's training section")
        data = exports.model_dump()
        for path, value in expected.items():
            found = _at(data, *path)
            # bool is an int: compare types too, so that `True` does not pass for 1.
            if type(found) is not type(value) or found != value:
                self.fail(
                    "exports." + ".".join(path), f"is {found!r}, the recommendation says {value!r}"
                )

    def _probe_only(self) -> None:
        # A spec without a target is answered by the probe alone: anything more was not asked
        # for, so it cannot have come from a worker.
        result = self.result
        for field, value in (
            ("trials", result.trials),
            ("recommendation", result.recommendation),
            ("infeasible", result.infeasible),
            ("exports", result.exports),
        ):
            if value:
                self.fail(field, "set although the spec has no target_global_batch to tune for")

    def _no_recommendation(self, some_trial_completed: bool) -> None:
        result = self.result
        if result.infeasible is None:
            self.fail("infeasible", "no recommendation and no explanation why")
        if result.exports is not None:
            self.fail("exports", "set although there is no recommendation")
        if some_trial_completed:
            self.fail("recommendation", "missing although a measured configuration completed")
        if result.trials:
            return
        target = self.spec.training.target_global_batch
        if target is None:
            return
        candidates = self._candidates()
        if candidates:
            self.fail(
                "recommendation",
                f"missing although {len(candidates)} configurations hit the target within the "
                "probe's limits and none was measured",
            )
