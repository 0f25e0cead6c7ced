"""The pure search for the largest micro-batch that fits: which sizes to try, and in what order.

Owns `find_max_micro_batch` and the per-op memory model (`PeakModel`) that guides it. No torch
here: a trial is an opaque `fits(micro_batch) -> StepOutcome` callback, which on a real GPU costs
seconds to minutes, so the search is tested with fake devices and serves any backend.

Algorithm (the memory model and the proof: docs/design.md#search, docs/design.md#per-op-fit):

0. Traced fit points: when the same step was traced on fake tensors at two sizes (no kernel ran,
   nothing was allocated: `autotune.engine.estimate`), fit on those and verify the prediction as
   in step 2: p fits and p + 1 does not, done in 2 real trials. A missed prediction costs 2 calls
   of budget, like any other, and the search goes on from step 1 inside the bracket it left.
1. Fit points: try b=2, then b=3; with a hint `known_fitting` >= 2, try it and the size after it
   instead. A hint is only a guess and is verified like any other size; if it does not fit, start
   again from 2 and 3 below it. The second point is only tried when the first fits with a
   live-bytes series and the capacity is known, since a model needs two series. If 2 does not
   fit, try 1; if the second point does not fit, the first is the answer. b=1 is never a fit
   point: it runs a different op sequence and its peak sits elsewhere (a 25-49 % error).
2. Predict: live bytes after each op are affine in b, so two traces with the same op sequence
   give every op's line, and the peak at any b is the max over ops (`PeakModel`). What must fit
   is the allocator's reserved memory, which caches and rounds on top of the live bytes: when
   the trials also recorded their allocations, every allocation's size is affine in b too, and
   replaying the predicted allocations through the allocator model says where the step runs out
   (`AllocationModel`); without them the capacity is scaled to live bytes by the largest fitting
   trial's ratio of the two (`live_budget_bytes`). Predict p, the largest b predicted to fit,
   clamped into the bracket already known. Verify p (unless
   already seen fitting) and p + 1 (unless p is the cap). p fits and p + 1 does not: done,
   certified from both sides, in 4 calls.
3. Refit once after an underestimate (p and p + 1 both fit): fit again on the widest pair of
   complete traces with the same op count (a wide span averages allocator rounding, which the
   newest two neighbours would amplify) and verify its prediction the same way. When p + 1 runs
   an op sequence no other trace has (a kernel that changes with b), try p + 2 first: it is the
   nearest candidate and the new sequence's second trace.
4. Fall back when there is no model (no series, unknown capacity, op counts that differ) or the
   predictions missed: gallop (steps 1, 2, 4, ... away from a missed prediction, toward where
   the miss points; doubling from the largest fitting size when there was no prediction), then
   bisect between the tightest known bounds once both sides are seen.

5. Past a dip: a step's reserved memory is not monotone in b (the allocator's cache, split by
   one size's tensors, serves the next size's differently), so the bracket's failing end may be
   a dip with larger sizes that fit above it. Each allocation model the search has (the traced
   one, the one fitted on real trials) replays every size above the bracket, top down
   (`AllocationModel.largest_fitting`); the largest size one predicts to fit is tried, and if it
   fits the bracket opens again from it (its next size first, as step 4). A size that runs out
   there is the model's miss: the next one down is tried, 2 misses at most. The search stops
   when the size above the answer runs out and no model predicts a larger one
   (docs/design.md#memory-that-is-not-monotone). Predictions in steps 0 and 2 take the largest
   size predicted to fit too, not the first predicted to run out. A search that closed with no
   allocation model (a hint that was the answer and whose next size ran out leaves one trace,
   no pair) first takes one more trial at b=2, when the answer's trial recorded allocations: a
   model on b=2 and the answer can see past the dip, where the hint's two trials could not.

Call budget: ceil(log2(cap)) + 2. Every fallback call is clamped into the window where both
outcomes still leave a bisection that ends within the budget, so a search without a model never
exceeds it. A prediction is a bet the budget has no room for (the two fit points already use its
slack): each missed prediction round adds 2 calls to the budget (4 for an overestimate, whose
near misses come from allocator rounding), the extra trace of step 3 and a wrong hint 1 each,
which keeps room to look right next to a near miss first. Worst case: ceil(log2(cap)) + 2 + 7
(+ 1 with a wrong hint, + 4 with a traced prediction that missed); a right prediction finishes
in 4, a right traced one in 2, a right hint in 2 (3 when its next size is a dip's first: the fit
point at b=2 of step 5, and the trials past the dip after it).

Invariants: no size is tried twice or above the cap, and the answer is certified: it fitted and
the next size did not, unless it is the cap, and no model the trials left predicts a larger size
to fit. Sizes below the answer seen running out are reported (`SearchResult.runs_out_below`).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from itertools import pairwise

from autotune.core.memory.allocation_trace import AllocationModel
from autotune.core.memory.allocator_config import AllocatorConfig
from autotune.core.schemas import StepOutcome

logger = logging.getLogger(__name__)

# What `PeakModel.max_micro_batch` returns when no op grows with the micro-batch.
UNBOUNDED_MICRO_BATCH = sys.maxsize

# Predictions after the first one; each miss can cost 2 calls beyond the budget.
_MAX_REFITS = 1
# Sizes above a dip that a model predicted to fit and that ran out, before the search stops.
_MAX_MISSES_PAST_DIPS = 2


@dataclass(frozen=True)
class PeakModel:
    """Per-op affine model fitted on two complete traces at micro-batches b1 < b2, both >= 2
    (identical op sequence): live_t(b) = a_t + b * k_t, peak(b) = max_t live_t(b). Exact
    integer/rational arithmetic (no floats).

    Stored as live_t(b) = base_bytes[t] + (b - b1) * delta_bytes[t] / span_micro_batches, so
    non-integer slopes (b2 - b1 > 1) stay exact.
    """

    base_micro_batch: int
    span_micro_batches: int
    base_bytes: tuple[int, ...]
    delta_bytes: tuple[int, ...]

    @classmethod
    def fit(
        cls, b1: int, series1: Sequence[int], b2: int, series2: Sequence[int]
    ) -> PeakModel | None:
        """Fit on traces at `b1` < `b2`; None if the op sequences differ in length, are empty or
        `b1` < 2 (b=1 runs a different op sequence, so it is no fit point)."""
        if b2 <= b1:
            raise ValueError(f"need b1 < b2, got b1={b1}, b2={b2}")
        if b1 < 2 or len(series1) != len(series2) or not series1:
            return None
        return cls(
            base_micro_batch=b1,
            span_micro_batches=b2 - b1,
            base_bytes=tuple(series1),
            delta_bytes=tuple(s2 - s1 for s1, s2 in zip(series1, series2, strict=True)),
        )

    def peak_bytes(self, micro_batch: int) -> int:
        """Ceil of the predicted peak live bytes at `micro_batch`."""
        if micro_batch < 0:
            raise ValueError(f"micro_batch must be >= 0, got {micro_batch}")
        steps = micro_batch - self.base_micro_batch
        span = self.span_micro_batches
        # Numerators over the common denominator `span`; the max commutes with the division.
        pairs = zip(self.base_bytes, self.delta_bytes, strict=True)
        top = max(base * span + steps * delta for base, delta in pairs)
        return -(-top // span)

    def max_micro_batch(self, budget_bytes: int) -> int:
        """Largest b >= 0 with `peak_bytes(b) <= budget_bytes` (0 if none; no cap applied).

        Solved per op in closed form: since the budget is an integer, ceil(peak) <= budget iff
        every op satisfies (b - b1) * delta_t <= (budget - base_t) * span. Growing ops bound b from
        above, shrinking ones from below; the feasible set is an interval because the peak is a
        max of affine functions (convex). Returns `UNBOUNDED_MICRO_BATCH` when no op grows.
        """
        b1, span = self.base_micro_batch, self.span_micro_batches
        upper = UNBOUNDED_MICRO_BATCH
        lower = 0
        for base, delta in zip(self.base_bytes, self.delta_bytes, strict=True):
            slack = (budget_bytes - base) * span
            if delta > 0:
                upper = min(upper, b1 + slack // delta)
            elif delta < 0:
                lower = max(lower, b1 - (slack // -delta))  # ceil(slack / delta)
            elif slack < 0:
                return 0
        return upper if upper >= lower else 0


def live_budget_bytes(budget_bytes: int, attempts: Sequence[StepOutcome]) -> int:
    """The live-bytes budget (what `PeakModel` predicts) that stands for `budget_bytes` of the
    peak a trial reports, by the ratio of the two at the largest fitting trial with a series.

    On the emulated GPU and on CUDA a trial's peak is the allocator's reserved memory, which is
    above its live tensor bytes by cached blocks, rounding and fragmentation; the ratio at the
    largest trial seen is the one nearest the sizes being predicted. With no such trial, or a
    device whose peak is the live bytes, the budget is unchanged.
    """
    traced = [a for a in attempts if a.fits and a.series]
    if not traced:
        return budget_bytes
    largest = max(traced, key=lambda a: a.micro_batch)
    assert largest.series is not None
    live_bytes = max(largest.series)
    if largest.peak_bytes <= live_bytes:
        return budget_bytes
    return budget_bytes * live_bytes // largest.peak_bytes


@dataclass(frozen=True)
class SearchResult:
    """The certified answer and how it was found."""

    max_micro_batch: int  # 0 when micro-batch 1 does not fit
    attempts: tuple[StepOutcome, ...]  # in the order tried
    peak_model: PeakModel | None  # the last model fitted, if any
    allocation_model: AllocationModel | None  # fitted on the same pair, when both recorded one
    capped: bool  # max_micro_batch == cap and cap fits
    traced_prediction: int | None = None  # what the traced fit points predicted, if given
    # Sizes below the answer that ran out in a trial: memory is not monotone in b there.
    runs_out_below: tuple[int, ...] = ()


class _Gallop(Enum):
    UP = "up"  # step up from the largest fitting size
    DOWN = "down"  # step down from the smallest failing size
    BISECT = "bisect"  # both sides seen: halve the bracket


def _ceil_log2(n: int) -> int:
    """Calls a bisection needs to pin one of `n` candidates (0 for n <= 1)."""
    return (n - 1).bit_length() if n > 1 else 0


class _Search:
    """One search's state: the bracket (lo fits, hi does not), the trials and the budget."""

    def __init__(
        self,
        fits: Callable[[int], StepOutcome],
        cap: int,
        capacity_bytes: int | None,
        allocator_config: AllocatorConfig | None,
    ):
        self._fits = fits
        self.cap = cap
        self.capacity_bytes = capacity_bytes
        self.allocator_config = allocator_config
        self.lo = 0  # largest size seen fitting (0: none yet)
        self.hi = cap + 1  # smallest size seen failing (cap + 1: none yet)
        self.attempts: list[StepOutcome] = []
        self.budget_calls = _ceil_log2(cap) + 2
        self.model: PeakModel | None = None
        self.allocation_model: AllocationModel | None = None
        self.fitted_on: tuple[int, int] | None = None
        self.gallop = _Gallop.UP
        self.step = 0  # 0: double from lo, as there is no prediction to stay close to

    @property
    def done(self) -> bool:
        return self.hi - self.lo == 1

    def trial(self, micro_batch: int) -> StepOutcome:
        """Run one trial strictly inside the bracket, which is why no size is tried twice."""
        if not self.lo < micro_batch < self.hi:
            raise AssertionError(f"search bug: {micro_batch} outside ({self.lo}, {self.hi})")
        observation = self._fits(micro_batch)
        if observation.micro_batch != micro_batch:
            raise AssertionError(
                f"fits({micro_batch}) reported micro-batch {observation.micro_batch}"
            )
        self.attempts.append(observation)
        if observation.fits:
            self.lo = micro_batch
        else:
            self.hi = micro_batch
        logger.debug(
            "micro-batch %d: %s, peak %d bytes",
            micro_batch,
            "fits" if observation.fits else "OOM",
            observation.peak_bytes,
        )
        return observation

    def tried(self, micro_batch: int) -> bool:
        return any(attempt.micro_batch == micro_batch for attempt in self.attempts)

    def try_past_dip(self, micro_batch: int) -> bool:
        """Try a size above the closed bracket's failing end; if it fits, the bracket opens
        again from it, up to the smallest size seen failing above it (else it stays)."""
        if not self.done or not self.hi < micro_batch <= self.cap or self.tried(micro_batch):
            raise AssertionError(f"search bug: {micro_batch} past the dip at {self.hi}")
        lo, hi = self.lo, self.hi
        self.lo, self.hi = micro_batch - 1, micro_batch + 1  # `trial` checks the bracket
        if not self.trial(micro_batch).fits:
            self.lo, self.hi = lo, hi
            return False
        self.hi = min(
            (a.micro_batch for a in self.attempts if not a.fits and a.micro_batch > micro_batch),
            default=self.cap + 1,
        )
        # A new bracket with a budget of its own; its next size first, as after a prediction
        # that fitted.
        self.budget_calls = len(self.attempts) + _ceil_log2(self.hi - self.lo) + 2
        self.gallop, self.step = _Gallop.UP, 1
        return True

    def try_below(self, micro_batch: int) -> StepOutcome:
        """Try a size below the closed bracket's fitting end, for its trace alone: the bracket
        stays (a size that runs out there is a dip, reported with the answer)."""
        if not self.done or not 1 <= micro_batch < self.lo or self.tried(micro_batch):
            raise AssertionError(f"search bug: {micro_batch} below the answer {self.lo}")
        lo, hi = self.lo, self.hi
        self.lo, self.hi = micro_batch - 1, micro_batch + 1  # `trial` checks the bracket
        observation = self.trial(micro_batch)
        self.lo, self.hi = lo, hi
        return observation

    def try_fit_points(self, first: int) -> None:
        """Try `first` and, if it fits with a series and a model is possible, `first + 1`."""
        if self.done or not self.lo < first < self.hi:
            return
        observation = self.trial(first)
        if (
            observation.fits
            and observation.series is not None
            and self.capacity_bytes is not None
            and not self.done
        ):
            self.trial(first + 1)

    def fit_traced(self, traced: Sequence[StepOutcome]) -> PeakModel | None:
        """A model on the two smallest complete traced steps at b >= 2 with the same op count,
        which were never run for real: the bracket stays as the real trials leave it."""
        complete = sorted(
            (
                (obs.micro_batch, series, obs.allocations, obs.start)
                for obs in traced
                if obs.fits and (series := obs.series) and obs.micro_batch >= 2
            ),
            key=lambda point: point[0],
        )
        for (b1, series1, allocations1, start1), (b2, series2, allocations2, start2) in pairwise(
            complete
        ):
            if b1 == b2:
                continue
            model = PeakModel.fit(b1, series1, b2, series2)
            if model is None:
                continue
            self.model = model
            # Not a pair of real trials: a refit on the real ones must not take it for its own.
            self.fitted_on = None
            self.allocation_model = (
                AllocationModel.fit(b1, allocations1, b2, allocations2, starts=(start1, start2))
                if allocations1 and allocations2
                else None
            )
            return model
        return None

    def refit(self) -> PeakModel | None:
        """A model on the widest pair of complete traces (b >= 2) with the newest one's op count,
        or None when there is no such pair or it is the pair already used."""
        traced = {
            obs.micro_batch: obs
            for obs in self.attempts
            if obs.fits and obs.series is not None and obs.micro_batch >= 2
        }
        traces = sorted((b, obs.series) for b, obs in traced.items() if obs.series is not None)
        if not traces:
            return None
        newest_b, newest_series = traces[-1]
        same_ops = [(b, s) for b, s in traces[:-1] if len(s) == len(newest_series)]
        if not same_ops or (same_ops[0][0], newest_b) == self.fitted_on:
            return None
        oldest_b, oldest_series = same_ops[0]
        model = PeakModel.fit(oldest_b, oldest_series, newest_b, newest_series)
        if model is not None:
            self.model, self.fitted_on = model, (oldest_b, newest_b)
            oldest_allocations = traced[oldest_b].allocations
            newest_allocations = traced[newest_b].allocations
            self.allocation_model = (
                AllocationModel.fit(
                    oldest_b,
                    oldest_allocations,
                    newest_b,
                    newest_allocations,
                    starts=(traced[oldest_b].start, traced[newest_b].start),
                )
                if oldest_allocations and newest_allocations
                else None
            )
        return model

    def predict(
        self, model: PeakModel, capacity_bytes: int, evidence: Sequence[StepOutcome]
    ) -> int:
        """The largest b the model predicts to fit (the live-bytes budget scaled by `evidence`,
        the traces the model came from, when there is no allocation model)."""
        if self.allocation_model is not None:
            largest = self.allocation_model.largest_fitting(
                capacity_bytes, self.allocator_config, above=self.lo, high=self.hi
            )
            return self.lo if largest is None else largest
        return model.max_micro_batch(live_budget_bytes(capacity_bytes, evidence))

    def follow_prediction(self, predicted: int) -> None:
        """Verify the predicted p (p fits, p + 1 does not), else aim the gallop at the miss."""
        target = min(max(predicted, self.lo), self.hi - 1)
        logger.debug("model predicts %d, trying %d", predicted, target)
        overestimate = target > self.lo and not self.trial(target).fits
        if overestimate:
            # Overestimate: the answer is most likely just below the failed size.
            self.gallop, self.step = _Gallop.DOWN, 1
        elif not self.done and self.trial(self.lo + 1).fits:
            # Underestimate: the answer is most likely just above.
            self.gallop, self.step = _Gallop.UP, 1
            if not self.done and not self._has_partner(self.lo):
                # The op sequence changed past the fit points, so nothing can be refitted yet.
                # The next size is both the nearest candidate and the new sequence's 2nd trace.
                self.trial(self.lo + 1)
                self.budget_calls += 1
        if not self.done:
            # The bet lost. It is budgeted as the 2 calls a hit takes even when the miss took 1,
            # so the fallback can afford to look right next to the miss first. An overestimate
            # gets 2 more: allocator rounding of small tensors makes the b=2,3 slope slightly
            # off, and extrapolated far (b ~ 700 on the MLP preset) the miss is a few sizes
            # wide, which a short gallop down finds where a clamped bisection would start over.
            self.budget_calls += 4 if overestimate else 2

    def _has_partner(self, micro_batch: int) -> bool:
        """Whether another complete trace (b >= 2) has the same op count as `micro_batch`'s."""
        lengths = {
            obs.micro_batch: len(obs.series)
            for obs in self.attempts
            if obs.fits and obs.series is not None and obs.micro_batch >= 2
        }
        own = lengths.pop(micro_batch, None)
        return own is None or own in lengths.values()

    def guard(self, target: int) -> int:
        """Clamp `target` into the window where both outcomes keep the budget reachable."""
        remaining_calls = self.budget_calls - len(self.attempts)
        half_bracket = 1 << max(remaining_calls - 1, 0)
        low = max(self.lo + 1, self.hi - half_bracket)  # if it fits, hi - it is left
        high = min(self.hi - 1, self.lo + half_bracket)  # if it fails, it - lo is left
        return min(max(target, low), high)

    def gallop_or_bisect(self) -> None:
        """One fallback trial: a gallop step while its direction holds, else a bisection."""
        if self.gallop is _Gallop.UP:
            target = self.lo + (self.step or self.lo or 1)
        elif self.gallop is _Gallop.DOWN:
            target = self.hi - self.step
        else:
            target = (self.lo + self.hi) // 2
        fitted = self.trial(self.guard(target)).fits
        if self.gallop is _Gallop.UP and fitted:
            self.step *= 2
        elif self.gallop is _Gallop.DOWN and not fitted:
            self.step *= 2
        else:
            self.gallop = _Gallop.BISECT


def _fit_point_below(search: _Search) -> None:
    """Step 5's model when the search closed without one (a hint that was the answer, whose
    next size ran out, leaves one trace): one more trial at b=2, fitted with the answer's trace.
    Only when the answer's trial recorded its allocations, as a model past a dip needs."""
    answer = next((a for a in search.attempts if a.micro_batch == search.lo), None)
    if answer is None or not answer.allocations or search.lo <= 2 or search.tried(2):
        return
    logger.info("closed at %d without a model: one more fit point at 2", search.lo)
    if search.try_below(2).fits:
        search.refit()


def _look_past_dips(search: _Search, models: Sequence[AllocationModel]) -> None:
    """Step 5: while a model predicts a size above the closed bracket to fit, try the largest
    such size; close the bracket it opens (its next size first). Stops at the cap, when no
    model predicts a larger size, or after `_MAX_MISSES_PAST_DIPS` predictions ran out."""
    if search.capacity_bytes is None or not models:
        return
    capacity_bytes = search.capacity_bytes
    misses = 0
    # Per model, the sizes below which it is still asked: a miss rules its prediction out.
    highs = [search.cap + 1] * len(models)
    while search.done and search.lo < search.cap and misses < _MAX_MISSES_PAST_DIPS:
        predictions: list[tuple[int, int]] = []
        for index, model in enumerate(models):
            predicted = model.largest_fitting(
                capacity_bytes, search.allocator_config, above=search.hi, high=highs[index]
            )
            while predicted is not None and search.tried(predicted):
                # A size seen running out already (a gallop went past the dip): the next one.
                highs[index] = predicted
                predicted = model.largest_fitting(
                    capacity_bytes, search.allocator_config, above=search.hi, high=predicted
                )
            if predicted is not None:
                predictions.append((predicted, index))
        if not predictions:
            return
        target = max(predictions)[0]
        logger.info("past the dip at %d, a model predicts %d fits", search.hi, target)
        if search.try_past_dip(target):
            while not search.done:
                search.gallop_or_bisect()
        else:
            misses += 1
            for predicted, index in predictions:
                if predicted == target:
                    highs[index] = target


def find_max_micro_batch(
    fits: Callable[[int], StepOutcome],
    *,
    cap: int,
    capacity_bytes: int | None,
    known_fitting: int = 0,
    allocator_config: AllocatorConfig | None = None,
    traced: Sequence[StepOutcome] = (),
    report_dips: bool = True,
    below_a_failing_hint: bool = False,
    check: Callable[[], None] | None = None,
) -> SearchResult:
    """Find the exact largest micro-batch <= `cap` whose training step fits, in few trials.

    Args:
        fits: runs one training step at a micro-batch and reports what happened; memory must be
            monotone in the micro-batch.
        cap: the largest micro-batch worth trying; never exceeded.
        capacity_bytes: the peak a step may reach (the device's measure: reserved memory on
            a GPU); needed to predict from the traces. None: the trials are the only evidence.
        known_fitting: a micro-batch expected to fit (e.g. the other checkpointing mode's max);
            a first guess, tried like any other size.
        allocator_config: the device's caching-allocator settings, for predictions replayed
            through the allocator model (torch's defaults when None).
        traced: the same step traced without running it (fake tensors on a model of the
            device) at two or more sizes >= 2, with series: the first prediction's fit points,
            which cost no trial. Evidence to verify, like the hint: never an answer.
        report_dips: whether to look for the sizes below the answer that run out
            (`SearchResult.runs_out_below`). Without, a search that closed at `cap` tries no
            size for a model of them, and `runs_out_below` holds only the trials that ran out
            below the answer; the answer is the same.
        below_a_failing_hint: when the hint does not fit, try the size below it next, before
            the fit points: for a hint that is most likely just above the answer (the tuner's
            probe of accumulation takes one micro-step's answer as its hint, which the gradients
            held lower by a little). Right, it closes the search at 2 trials; wrong, it costs
            one more.
        check: called before each size the dip scan replays, raising to stop the search (a
            cancel, a shutdown, a time limit): the scan replays every size below the answer
            through the allocator, some 25 s for a 60-layer model whose answer is 1,024 and
            no trial (a torch call, where a stop is otherwise checked) on the way.

    Returns:
        The certified answer, every trial in order and the last `PeakModel` fitted.

    Raises:
        ValueError: `cap` < 1, `known_fitting` < 0 or `capacity_bytes` < 0.

    >>> def device(micro_batch: int) -> StepOutcome:  # a constant op and one growing op
    ...     series = (1_000, 600 + 100 * micro_batch)
    ...     fits = max(series) <= 3_000
    ...     return StepOutcome(
    ...         micro_batch=micro_batch, fits=fits, peak_bytes=max(series),
    ...         series=series if fits else None)
    >>> result = find_max_micro_batch(device, cap=64, capacity_bytes=3_000)
    >>> result.max_micro_batch, [a.micro_batch for a in result.attempts]
    (24, [2, 3, 24, 25])
    """
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    if known_fitting < 0:
        raise ValueError(f"known_fitting must be >= 0, got {known_fitting}")
    if capacity_bytes is not None and capacity_bytes < 0:
        raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
    search = _Search(fits, cap, capacity_bytes, allocator_config)

    traced_prediction: int | None = None
    dip_models: list[AllocationModel] = []
    if capacity_bytes is not None and traced:
        model = search.fit_traced(traced)
        if search.allocation_model is not None:
            # Kept past a miss: it may still know where the step fits above a dip.
            dip_models.append(search.allocation_model)
        if model is not None:
            traced_prediction = min(search.predict(model, capacity_bytes, traced), cap)
            logger.info("the traced step predicts %d", traced_prediction)
            search.follow_prediction(traced_prediction)
            if not search.done:
                # The traced model missed: the real fit points below start over without it.
                search.model, search.allocation_model = None, None
    hint = min(known_fitting, cap)
    if hint >= 2:
        search.try_fit_points(hint)
        if search.hi == hint:
            logger.info("hint %d does not fit; starting again from 2", hint)
            search.budget_calls += 1  # a lost bet, like a wrong prediction
            if below_a_failing_hint and hint - 1 >= 2 and search.lo < hint - 1:
                search.try_fit_points(hint - 1)
                if not search.done:
                    search.budget_calls += 1  # another lost bet
    search.try_fit_points(min(2, cap))

    if capacity_bytes is not None:
        for _ in range(1 + _MAX_REFITS):
            model = None if search.done else search.refit()
            if model is None:
                break
            search.follow_prediction(search.predict(model, capacity_bytes, search.attempts))
    while not search.done:
        search.gallop_or_bisect()
    if (
        capacity_bytes is not None
        and not dip_models
        and search.allocation_model is None
        # With no size left between the failing end and the cap, no size past a dip is left
        # to look for: the model would be the dips' alone.
        and (report_dips or search.hi < cap)
    ):
        _fit_point_below(search)
    if search.allocation_model is not None and search.allocation_model not in dip_models:
        dip_models.append(search.allocation_model)
    _look_past_dips(search, dip_models)

    logger.info("max micro-batch %d after %d trials", search.lo, len(search.attempts))
    return SearchResult(
        max_micro_batch=search.lo,
        attempts=tuple(search.attempts),
        peak_model=search.model,
        allocation_model=search.allocation_model,
        capped=search.lo == cap,
        traced_prediction=traced_prediction,
        runs_out_below=_runs_out_below(search, dip_models if report_dips else (), check),
    )


def _runs_out_below(
    search: _Search, models: Sequence[AllocationModel], check: Callable[[], None] | None
) -> tuple[int, ...]:
    """Sizes below the answer that ran out in a trial, and those the first model agreeing with
    every trial's verdict (at b >= 2, where the op sequence is the fitted one) predicts to run
    out: the dips a person must keep every batch out of. `check` is called before each size
    replayed."""
    answer = search.lo
    runs_out = {a.micro_batch for a in search.attempts if not a.fits and a.micro_batch < answer}
    capacity_bytes = search.capacity_bytes
    if capacity_bytes is None:
        return tuple(sorted(runs_out))
    config = search.allocator_config
    for model in models:
        fits = _replayed_fits(model, capacity_bytes, config, check)
        if all(fits(a.micro_batch) == a.fits for a in search.attempts if a.micro_batch >= 2):
            runs_out.update(b for b in range(2, answer) if not fits(b))
            break
    return tuple(sorted(runs_out))


def _replayed_fits(
    model: AllocationModel,
    capacity_bytes: int,
    config: AllocatorConfig | None,
    check: Callable[[], None] | None,
) -> Callable[[int], bool]:
    """Whether `model`'s replay at a size fits, each size replayed once (`check` called before
    it): a replay of a deep step is some hundred thousand allocator calls, and a size tried is
    also in the range."""

    @functools.cache
    def fits(micro_batch: int) -> bool:
        if check is not None:
            check()
        return model.replay(micro_batch, capacity_bytes, config).fits

    return fits


def fewest_fitting(fits: Callable[[int], bool], *, failing: int, fitting: int) -> int:
    """The smallest k in (failing, fitting] with fits(k), by bisection: `fits` must be monotone
    (false up to some k, true from there), false at `failing` and true at `fitting` (neither
    is asked). Used for partial checkpointing: the fewest checkpointed blocks at which a
    micro-batch fits, more blocks only costing more recompute."""
    if failing >= fitting:
        raise ValueError(f"need failing < fitting, got {failing} and {fitting}")
    while fitting - failing > 1:
        middle = (failing + fitting) // 2
        if fits(middle):
            fitting = middle
        else:
            failing = middle
    return fitting
