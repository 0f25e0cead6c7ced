"""The pure micro-batch search, on fake devices: no torch, only traces of live bytes per op.

A fake training step is a list of ops, each leaving `fixed + b * per_sample` bytes live, built
like a real step (resident weights and optimizer state, forward activations, logits, backward,
optimizer temporaries) so that the peak sits in the optimizer step at small b and at the start of
backward at large b, as in docs/design.md#memory-model. A fake device runs it against a
capacity: the step fits iff its peak live bytes stay <= the capacity, and an OOM stops it at the
first op above.
"""

from __future__ import annotations

import itertools
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import pytest

from autotune.core.memory.allocation_trace import AllocationModel, replay_encoded
from autotune.core.memory.allocator_config import AllocatorConfig, parse_alloc_conf
from autotune.core.search.micro_batch import (
    PeakModel,
    SearchResult,
    StepOutcome,
    fewest_fitting,
    find_max_micro_batch,
    live_budget_bytes,
)

KiB = 2**10
MiB = 2**20


def _ceil_log2(n: int) -> int:
    return (n - 1).bit_length()


def _budget_calls(cap: int) -> int:
    """The call budget the search promises: ceil(log2(cap)) + 2."""
    return _ceil_log2(cap) + 2


# ---------------------------------------------------------------------------------------------
# Fake steps and devices.


@dataclass
class FakeStep:
    """Live bytes after each op of a training step: op t leaves fixed_t + b * per_sample_t."""

    ops: list[tuple[int, int]] = field(default_factory=list)
    _fixed_bytes: int = 0
    _per_sample_bytes: int = 0

    def alloc(self, fixed_bytes: int = 0, per_sample_bytes: int = 0) -> None:
        self._fixed_bytes += fixed_bytes
        self._per_sample_bytes += per_sample_bytes
        self.ops.append((self._fixed_bytes, self._per_sample_bytes))

    def free(self, fixed_bytes: int = 0, per_sample_bytes: int = 0) -> None:
        self.alloc(-fixed_bytes, -per_sample_bytes)

    def series(self, micro_batch: int) -> tuple[int, ...]:
        return tuple(fixed + micro_batch * per_sample for fixed, per_sample in self.ops)


def transformer_step(
    *, layers: int = 4, checkpointing: bool = True, logits_bytes_per_sample: int = 2 * MiB
) -> FakeStep:
    """A decoder's training step with AdamW: with checkpointing only each layer's input is kept
    and the layer is recomputed in backward; the optimizer's foreach temporaries are fixed."""
    params_bytes = 20 * MiB
    step = FakeStep()
    step.alloc(fixed_bytes=3 * params_bytes)  # weights and AdamW's two moments
    step.alloc(per_sample_bytes=4 * KiB)  # input ids
    kept_bytes = 1 * MiB if checkpointing else 6 * MiB
    for _ in range(layers):
        step.alloc(per_sample_bytes=2 * MiB)  # attention / MLP temporaries
        step.alloc(per_sample_bytes=kept_bytes)  # saved for backward
        step.free(per_sample_bytes=2 * MiB)
    step.alloc(per_sample_bytes=logits_bytes_per_sample)  # logits
    step.alloc(per_sample_bytes=logits_bytes_per_sample)  # log-softmax, saved
    step.alloc(per_sample_bytes=logits_bytes_per_sample)  # its gradient
    step.free(per_sample_bytes=2 * logits_bytes_per_sample)
    for _ in range(layers):
        if checkpointing:
            step.alloc(per_sample_bytes=6 * MiB)  # recomputed activations
        step.alloc(fixed_bytes=params_bytes // layers)  # weight gradients, kept
        step.alloc(per_sample_bytes=2 * MiB)  # gradient temporaries
        step.free(per_sample_bytes=2 * MiB + (6 * MiB if checkpointing else 0) + kept_bytes)
    step.free(per_sample_bytes=logits_bytes_per_sample)
    step.alloc(fixed_bytes=2 * params_bytes)  # optimizer foreach temporaries
    step.free(fixed_bytes=2 * params_bytes)
    step.free(fixed_bytes=params_bytes)  # zero_grad(set_to_none=True)
    return step


SeriesFn = Callable[[int], tuple[int, ...]]


class FakeDevice:
    """Runs a fake step against a capacity and records every micro-batch tried.

    `overhead_bytes(b)` is memory the device needs beyond the live tensors it can record (the
    caching allocator's fragmentation on a GPU): it counts against the capacity but never
    appears in the series, so a model fitted on series cannot see it. `threshold` makes a device
    that lies: b fits iff b <= threshold, whatever its series say.
    """

    def __init__(
        self,
        series: SeriesFn,
        capacity_bytes: int,
        *,
        record_series: bool = True,
        overhead_bytes: Callable[[int], int] = lambda micro_batch: 0,
        threshold: int | None = None,
    ) -> None:
        self.series = series
        self.capacity_bytes = capacity_bytes
        self.record_series = record_series
        self.overhead_bytes = overhead_bytes
        self.threshold = threshold
        self.calls: list[int] = []

    def _limit_bytes(self, micro_batch: int) -> int:
        return self.capacity_bytes - self.overhead_bytes(micro_batch)

    def step_fits(self, micro_batch: int) -> bool:
        if self.threshold is not None:
            return micro_batch <= self.threshold
        return max(self.series(micro_batch)) <= self._limit_bytes(micro_batch)

    def fits(self, micro_batch: int) -> StepOutcome:
        self.calls.append(micro_batch)
        series = self.series(micro_batch)
        if self.step_fits(micro_batch):
            return StepOutcome(
                micro_batch=micro_batch,
                fits=True,
                peak_bytes=max(series),
                series=series if self.record_series else None,
            )
        # The OOM fires at the first op above the limit: what ran is everything before it.
        limit_bytes = self._limit_bytes(micro_batch)
        ran = itertools.takewhile(lambda live_bytes: live_bytes <= limit_bytes, series)
        return StepOutcome(micro_batch=micro_batch, fits=False, peak_bytes=max(ran, default=0))

    def brute_force_max(self, cap: int) -> int:
        answer = 0
        for micro_batch in range(1, cap + 1):
            if not self.step_fits(micro_batch):
                break
            answer = micro_batch
        return answer


def assert_certified(result: SearchResult, device: FakeDevice, cap: int) -> None:
    """Exact, never repeated, never above the cap, and proven from both sides."""
    tried = [attempt.micro_batch for attempt in result.attempts]
    assert tried == device.calls
    assert len(set(tried)) == len(tried), tried
    assert all(1 <= micro_batch <= cap for micro_batch in tried), tried
    for attempt in result.attempts:
        assert attempt.fits == device.step_fits(attempt.micro_batch)
    seen = {attempt.micro_batch: attempt for attempt in result.attempts}
    answer = result.max_micro_batch
    assert answer == device.brute_force_max(cap), tried
    if answer > 0:
        assert seen[answer].fits, tried
    if answer < cap:
        assert not seen[answer + 1].fits, tried
    assert result.capped == (answer == cap)


def boundary_capacities(step: FakeStep, cap: int) -> list[int]:
    """Every capacity where the answer changes, and one byte either side of it."""
    peaks = sorted({max(step.series(micro_batch)) for micro_batch in range(1, cap + 2)})
    return sorted({peak + delta for peak in peaks for delta in (-1, 0, 1)})


def search(device: FakeDevice, cap: int, *, known_fitting: int = 0) -> SearchResult:
    capacity_bytes = device.capacity_bytes
    return find_max_micro_batch(
        device.fits, cap=cap, capacity_bytes=capacity_bytes, known_fitting=known_fitting
    )


def capacity_for(step: FakeStep, answer: int) -> int:
    """A capacity whose exact answer is `answer`: halfway between its peak and the next one."""
    low = max(step.series(answer))
    high = max(step.series(answer + 1))
    assert high > low
    return (low + high) // 2


CKPT_STEP = transformer_step(checkpointing=True)
PLAIN_STEP = transformer_step(checkpointing=False)


def test_fake_step_peaks_move_with_the_micro_batch() -> None:
    # The fake is only worth testing with if the peak sits elsewhere at small b: at b=1 the
    # optimizer step dominates, at large b the logits at the start of backward.
    def argmax(series: tuple[int, ...]) -> int:
        return series.index(max(series))

    assert argmax(CKPT_STEP.series(1)) > argmax(CKPT_STEP.series(64))
    # An affine fit of the peak alone at b=2 and 3 would be badly wrong: it is nearly flat there.
    peak = [max(CKPT_STEP.series(b)) for b in (2, 3, 64, 65)]
    assert 100 * (peak[1] - peak[0]) < peak[3] - peak[2]


# ---------------------------------------------------------------------------------------------
# PeakModel arithmetic.


def test_peak_model_non_integer_slopes_by_hand() -> None:
    # Ops at b=2 and b=5 (span 3): slopes 2, 7/3 and 15 bytes per sample.
    model = PeakModel.fit(2, [10, 100, 50], 5, [16, 107, 95])
    assert model is not None
    # live(b) = 6 + 2b, 286/3 + 7b/3, 20 + 15b
    assert model.peak_bytes(2) == 100
    assert model.peak_bytes(5) == 107
    assert model.peak_bytes(3) == 103  # 102 + 1/3, rounded up
    assert model.peak_bytes(4) == 105  # 104 + 2/3 beats 80
    assert model.peak_bytes(6) == 110  # 20 + 90 beats 109 + 1/3
    assert model.peak_bytes(0) == 96  # 95 + 1/3
    assert model.max_micro_batch(102) == 2
    assert model.max_micro_batch(103) == 3
    assert model.max_micro_batch(104) == 3
    assert model.max_micro_batch(105) == 4
    assert model.max_micro_batch(109) == 5
    assert model.max_micro_batch(110) == 6
    assert model.max_micro_batch(124) == 6
    assert model.max_micro_batch(125) == 7
    assert model.max_micro_batch(95) == 0  # not even b=0 fits


def test_peak_model_integer_slopes_and_shrinking_ops() -> None:
    # An op that shrinks with b (300 - 20b) bounds b from below; the growing one from above.
    model = PeakModel.fit(2, [260, 30], 3, [240, 40])
    assert model is not None
    assert [model.peak_bytes(b) for b in (0, 2, 5, 10, 20)] == [300, 260, 200, 110, 210]
    assert model.max_micro_batch(110) == 10  # b=10 is the only size with peak <= 110
    assert model.max_micro_batch(200) == 19  # b=5..19
    assert model.max_micro_batch(109) == 0  # nothing fits at all


def test_peak_model_without_growth_is_unbounded() -> None:
    model = PeakModel.fit(2, [100, 50], 4, [100, 40])
    assert model is not None
    assert model.max_micro_batch(100) > 10**9
    assert model.max_micro_batch(99) == 0


@pytest.mark.parametrize(
    ("b1", "series1", "b2", "series2"),
    [
        (1, [10, 20], 2, [12, 24]),  # b=1 runs a different op sequence: no fit point
        (2, [10, 20], 3, [12, 24, 30]),  # op sequences differ
        (2, [], 3, []),
    ],
)
def test_peak_model_refuses_to_fit(
    b1: int, series1: list[int], b2: int, series2: list[int]
) -> None:
    assert PeakModel.fit(b1, series1, b2, series2) is None


def test_peak_model_refuses_a_negative_micro_batch() -> None:
    model = PeakModel.fit(2, [10], 3, [12])
    assert model is not None
    with pytest.raises(ValueError, match="micro_batch must be >= 0, got -1"):
        model.peak_bytes(-1)


def test_peak_model_matches_exact_fractions() -> None:
    rng = random.Random(7)
    for _ in range(300):
        b1 = rng.randint(2, 6)
        b2 = b1 + rng.randint(1, 5)
        ops = [(rng.randint(0, 10_000), rng.randint(-50, 400)) for _ in range(rng.randint(1, 6))]
        # Integer traces whose per-op line has a rational slope (delta / span).
        series1 = [fixed for fixed, _ in ops]
        series2 = [fixed + delta for fixed, delta in ops]
        model = PeakModel.fit(b1, series1, b2, series2)
        assert model is not None
        for b in range(0, 60):
            exact = max(
                Fraction(fixed) + Fraction((b - b1) * delta, b2 - b1) for fixed, delta in ops
            )
            assert model.peak_bytes(b) == -(-exact.numerator // exact.denominator)
        budget_bytes = rng.randint(0, 20_000)
        fitting = [b for b in range(0, 2000) if model.peak_bytes(b) <= budget_bytes]
        expected = max(fitting, default=0)
        if expected < 1999:
            assert model.max_micro_batch(budget_bytes) == expected, (ops, b1, b2, budget_bytes)


def test_peak_model_from_fake_traces_is_exact() -> None:
    model = PeakModel.fit(2, CKPT_STEP.series(2), 3, CKPT_STEP.series(3))
    assert model is not None
    for b in (4, 17, 64, 1000):
        assert model.peak_bytes(b) == max(CKPT_STEP.series(b))


# ---------------------------------------------------------------------------------------------
# Exact sequences of sizes tried.


def test_two_points_then_prediction_then_its_neighbour() -> None:
    device = FakeDevice(CKPT_STEP.series, capacity_for(CKPT_STEP, 17))
    result = search(device, 1024)
    assert device.calls == [2, 3, 17, 18]
    assert result.max_micro_batch == 17
    assert not result.capped
    assert_certified(result, device, 1024)
    assert result.peak_model is not None
    assert result.peak_model.peak_bytes(17) == max(CKPT_STEP.series(17))
    # The model the answer came from: nothing is refitted once the answer is certified.
    assert (result.peak_model.base_micro_batch, result.peak_model.span_micro_batches) == (2, 1)


def test_prediction_equal_to_a_fit_point_checks_only_the_next_size() -> None:
    device = FakeDevice(CKPT_STEP.series, capacity_for(CKPT_STEP, 3))
    result = search(device, 1024)
    assert device.calls == [2, 3, 4]
    assert result.max_micro_batch == 3


def test_second_fit_point_failing_settles_at_two() -> None:
    device = FakeDevice(CKPT_STEP.series, capacity_for(CKPT_STEP, 2))
    result = search(device, 1024)
    assert device.calls == [2, 3]
    assert result.max_micro_batch == 2


def test_only_one_fits() -> None:
    device = FakeDevice(PLAIN_STEP.series, capacity_for(PLAIN_STEP, 1))
    result = search(device, 1024)
    assert device.calls == [2, 1]
    assert result.max_micro_batch == 1
    assert not result.capped


def test_nothing_fits() -> None:
    device = FakeDevice(PLAIN_STEP.series, max(PLAIN_STEP.series(1)) - 1)
    result = search(device, 1024)
    assert device.calls == [2, 1]
    assert result.max_micro_batch == 0
    assert not result.capped
    assert_certified(result, device, 1024)


def test_cap_reached() -> None:
    device = FakeDevice(CKPT_STEP.series, 10**15)
    result = search(device, 40)
    assert device.calls == [2, 3, 40]
    assert result.max_micro_batch == 40
    assert result.capped


@pytest.mark.parametrize(("cap", "calls"), [(1, [1]), (2, [2]), (3, [2, 3])])
def test_tiny_caps(cap: int, calls: list[int]) -> None:
    device = FakeDevice(CKPT_STEP.series, 10**15)
    result = search(device, cap)
    assert device.calls == calls
    assert result.max_micro_batch == cap
    assert result.capped


def test_hint_below_the_answer_replaces_the_fit_points() -> None:
    device = FakeDevice(CKPT_STEP.series, capacity_for(CKPT_STEP, 17))
    result = search(device, 1024, known_fitting=10)
    assert device.calls == [10, 11, 17, 18]
    assert result.max_micro_batch == 17


def test_hint_equal_to_the_answer_takes_two_calls() -> None:
    device = FakeDevice(CKPT_STEP.series, capacity_for(CKPT_STEP, 17))
    result = search(device, 1024, known_fitting=17)
    assert device.calls == [17, 18]
    assert result.max_micro_batch == 17


def test_hint_that_does_not_fit_is_verified_not_assumed() -> None:
    device = FakeDevice(CKPT_STEP.series, capacity_for(CKPT_STEP, 17))
    result = search(device, 1024, known_fitting=20)
    assert device.calls == [20, 2, 3, 17, 18]
    assert result.max_micro_batch == 17
    assert_certified(result, device, 1024)


def test_hint_above_the_cap_is_clamped() -> None:
    device = FakeDevice(CKPT_STEP.series, 10**15)
    result = search(device, 40, known_fitting=100)
    assert device.calls == [40]
    assert result.capped


def test_a_fits_callback_reporting_another_size_is_refused() -> None:
    def fits(micro_batch: int) -> StepOutcome:
        return StepOutcome(micro_batch=micro_batch + 1, fits=True, peak_bytes=0)

    with pytest.raises(AssertionError, match=r"fits\(2\) reported micro-batch 3"):
        find_max_micro_batch(fits, cap=8, capacity_bytes=None)


def test_invalid_arguments() -> None:
    device = FakeDevice(CKPT_STEP.series, 10**15)
    with pytest.raises(ValueError, match="cap must be >= 1, got 0"):
        find_max_micro_batch(device.fits, cap=0, capacity_bytes=None)
    with pytest.raises(ValueError, match="known_fitting must be >= 0, got -1"):
        find_max_micro_batch(device.fits, cap=8, capacity_bytes=None, known_fitting=-1)
    with pytest.raises(ValueError, match="capacity_bytes must be >= 0, got -1"):
        find_max_micro_batch(device.fits, cap=8, capacity_bytes=-1)
    assert device.calls == []


# ---------------------------------------------------------------------------------------------
# Exact answers over many capacities.


@pytest.mark.parametrize("cap", [1, 2, 3, 5, 64, 1024])
@pytest.mark.parametrize("step", [CKPT_STEP, PLAIN_STEP], ids=["ckpt", "plain"])
def test_exact_for_every_capacity(step: FakeStep, cap: int) -> None:
    for capacity_bytes in boundary_capacities(step, min(cap, 300)):
        device = FakeDevice(step.series, capacity_bytes)
        result = search(device, cap)
        assert_certified(result, device, cap)
        assert len(device.calls) <= 4, (capacity_bytes, device.calls)


@pytest.mark.parametrize("record_series", [True, False], ids=["series", "no-series"])
@pytest.mark.parametrize("cap", [7, 64, 100, 1024])
def test_without_a_model_gallop_and_bisect_are_exact_and_bounded(
    record_series: bool, cap: int
) -> None:
    # No series, or no capacity to compare a prediction with: trials are the only evidence.
    calls = []
    for capacity_bytes in boundary_capacities(CKPT_STEP, min(cap, 300)):
        device = FakeDevice(CKPT_STEP.series, capacity_bytes, record_series=record_series)
        if record_series:
            result = find_max_micro_batch(device.fits, cap=cap, capacity_bytes=None)
        else:
            result = search(device, cap)
        assert_certified(result, device, cap)
        assert len(device.calls) <= _budget_calls(cap), (capacity_bytes, device.calls)
        calls.append(len(device.calls))
    print(f"cap {cap}, no model: median {statistics.median(calls)}, max {max(calls)} calls")


@pytest.mark.parametrize("cap", [8, 64, 1000, 1024])
def test_every_threshold_without_a_model_stays_within_the_budget(cap: int) -> None:
    # Any monotone device at all, not only affine ones: a step function at every threshold.
    for threshold in range(0, cap + 1):
        device = FakeDevice(CKPT_STEP.series, 0, record_series=False, threshold=threshold)
        result = search(device, cap)
        assert result.max_micro_batch == threshold
        assert len(set(device.calls)) == len(device.calls)
        assert len(device.calls) <= _budget_calls(cap), (threshold, device.calls)


# ---------------------------------------------------------------------------------------------
# Wrong predictions.


def _fragmentation(threshold: int, extra_bytes: int) -> Callable[[int], int]:
    """Allocator overhead the series cannot show, appearing once b reaches `threshold`."""
    return lambda micro_batch: extra_bytes if micro_batch >= threshold else 0


def _chunked_logits(step_small: FakeStep, step_large: FakeStep, threshold: int) -> SeriesFn:
    """A step whose op sequence changes at `threshold` (e.g. a kernel that starts chunking)."""
    return lambda b: step_small.series(b) if b < threshold else step_large.series(b)


WRONG_PREDICTIONS: dict[str, tuple[SeriesFn, Callable[[int], int]]] = {
    "fragmentation": (CKPT_STEP.series, _fragmentation(8, 24 * MiB)),
    "fragmentation-small": (CKPT_STEP.series, _fragmentation(20, 2 * MiB)),
    # More memory per sample beyond b=8 (an extra workspace op): the first model overestimates.
    "ops-change-up": (
        _chunked_logits(CKPT_STEP, transformer_step(logits_bytes_per_sample=3 * MiB), 8),
        lambda b: 0,
    ),
    # Less memory per sample beyond b=8 (chunked logits): the first model underestimates.
    "ops-change-down": (
        _chunked_logits(
            CKPT_STEP, transformer_step(layers=5, logits_bytes_per_sample=256 * KiB), 8
        ),
        lambda b: 0,
    ),
}


@pytest.mark.parametrize("name", sorted(WRONG_PREDICTIONS))
@pytest.mark.parametrize("cap", [64, 1024])
def test_wrong_predictions_still_give_the_exact_answer(name: str, cap: int) -> None:
    series, overhead_bytes = WRONG_PREDICTIONS[name]
    first_model = PeakModel.fit(2, series(2), 3, series(3))
    assert first_model is not None
    # At the default cap (1024) a miss near the answer leaves room in the budget. In a small
    # range a prediction is a bet the budget has no room for: missing at 45 of [3, 64] leaves
    # 42 candidates, 6 more calls after 3, one over ceil(log2(64)) + 2; the search documents 2
    # extra calls per missed prediction round, and these fakes miss once.
    allowed_calls = _budget_calls(cap) + (0 if cap >= 1024 else 2)
    calls: list[int] = []
    misses = 0
    for capacity_bytes in range(60 * MiB, 60 * MiB + 30 * MiB * 64, 3 * MiB + 12345):
        device = FakeDevice(series, capacity_bytes, overhead_bytes=overhead_bytes)
        result = search(device, cap)
        assert_certified(result, device, cap)
        assert len(device.calls) <= allowed_calls, (capacity_bytes, device.calls)
        calls.append(len(device.calls))
        predicted = min(first_model.max_micro_batch(capacity_bytes), cap)
        misses += predicted != result.max_micro_batch
    # The fakes must actually fool the first model, or this test proves nothing.
    assert misses > len(calls) // 50, misses
    print(
        f"{name}, cap {cap}: {misses}/{len(calls)} first predictions wrong, "
        f"median {statistics.median(calls)}, max {max(calls)} calls"
    )


def test_op_count_change_between_fit_points_falls_back() -> None:
    # b=2 and b=3 run different op sequences: no model can be fitted, trials decide.
    series = _chunked_logits(CKPT_STEP, transformer_step(layers=5), 3)
    for capacity_bytes in range(100 * MiB, 900 * MiB, 7 * MiB):
        device = FakeDevice(series, capacity_bytes)
        result = search(device, 1024)
        assert_certified(result, device, 1024)
        assert len(device.calls) <= _budget_calls(1024)


# ---------------------------------------------------------------------------------------------
# Hints from the other checkpointing mode.


@pytest.mark.parametrize("cap", [64, 1024])
def test_plain_max_as_hint_for_checkpointing(cap: int) -> None:
    calls: list[int] = []
    for capacity_bytes in boundary_capacities(PLAIN_STEP, min(cap, 64))[::3]:
        plain = search(FakeDevice(PLAIN_STEP.series, capacity_bytes), cap)
        device = FakeDevice(CKPT_STEP.series, capacity_bytes)
        result = search(device, cap, known_fitting=plain.max_micro_batch)
        assert_certified(result, device, cap)
        assert len(device.calls) <= 4, (plain.max_micro_batch, device.calls)
        calls.append(len(device.calls))
    print(f"hinted, cap {cap}: median {statistics.median(calls)}, max {max(calls)} calls")


@pytest.mark.parametrize("cap", [64, 1024])
def test_wrong_hint_still_gives_the_exact_answer(cap: int) -> None:
    for capacity_bytes in boundary_capacities(CKPT_STEP, 40)[::2]:
        truth = FakeDevice(CKPT_STEP.series, capacity_bytes).brute_force_max(cap)
        for hint in {truth + 1, truth + 5, 2 * truth + 3, cap}:
            device = FakeDevice(CKPT_STEP.series, capacity_bytes)
            result = search(device, cap, known_fitting=hint)
            assert_certified(result, device, cap)
            assert len(device.calls) <= _budget_calls(cap) + 1, (hint, device.calls)


# ---------------------------------------------------------------------------------------------
# Worst case: series that lie (any monotone device, the model told nothing true).


@pytest.mark.parametrize("cap", [8, 64, 1024])
def test_every_threshold_with_a_misleading_model_is_exact(cap: int) -> None:
    worst = 0
    for threshold in range(0, cap + 1):
        device = FakeDevice(CKPT_STEP.series, capacity_for(CKPT_STEP, 17), threshold=threshold)
        result = search(device, cap)
        assert result.max_micro_batch == threshold
        assert len(set(device.calls)) == len(device.calls)
        assert all(1 <= b <= cap for b in device.calls)
        worst = max(worst, len(device.calls))
    # Two trials spent on a wrong prediction and two on a wrong refit are the most a model can
    # cost beyond the budget.
    assert worst <= _budget_calls(cap) + 4
    print(f"misleading model, cap {cap}: worst {worst} calls")


# ---------------------------------------------------------------------------------------------
# The sweep the targets are stated on.


@pytest.mark.parametrize("cap", [64, 1024])
def test_calls_on_realistic_shapes(cap: int) -> None:
    steps = [
        transformer_step(layers=layers, checkpointing=ckpt, logits_bytes_per_sample=logits)
        for layers in (2, 4, 12)
        for ckpt in (False, True)
        for logits in (1 * MiB, 8 * MiB)
    ]
    calls: list[int] = []
    for step in steps:
        low = max(step.series(1))
        for capacity_bytes in range(low - MiB, low + 4000 * MiB, 37 * MiB + 4321):
            device = FakeDevice(step.series, capacity_bytes)
            result = search(device, cap)
            assert_certified(result, device, cap)
            calls.append(len(device.calls))
    median = statistics.median(calls)
    print(f"realistic, cap {cap}: {len(calls)} searches, median {median}, max {max(calls)} calls")
    assert median <= 4
    assert max(calls) <= _budget_calls(cap)


# ---------------------------------------------------------------------------------------------
# Refits, rounding and the fallback's exact sequences, computed by hand.


def _blocky(fixed_bytes: int, per_sample_bytes: int, block_bytes: int) -> SeriesFn:
    """One op whose per-sample part is rounded up to allocator blocks: a staircase in b."""
    return lambda b: (fixed_bytes + -(-b * per_sample_bytes // block_bytes) * block_bytes,)


def test_underestimate_refits_on_the_widest_pair() -> None:
    # 100 + 20 b rounded up to 50-byte blocks: 150 at b=2 and 200 at b=3 fit a slope of 50, so
    # the model predicts 6 for 350 bytes; 6 and 7 fit (250), and the refit on (2, 7) has the true
    # slope 20 and predicts 12 (350); 13 takes 400.
    device = FakeDevice(_blocky(100, 20, 50), 350)
    result = search(device, 64)
    assert device.calls == [2, 3, 6, 7, 12, 13]
    assert result.max_micro_batch == 12
    assert result.peak_model is not None
    assert (result.peak_model.base_micro_batch, result.peak_model.span_micro_batches) == (2, 5)
    assert_certified(result, device, 64)


def test_without_series_gallop_is_clamped_to_keep_the_budget() -> None:
    # cap 64, budget 8, answer 5 (100 + 20 b <= 210). 2 and 4 fit; doubling to 8 could leave 60
    # candidates for 5 calls, so the guard moves it up to 33; then bisection of (4, 33).
    device = FakeDevice(lambda b: (100 + 20 * b,), 210, record_series=False)
    result = search(device, 64)
    assert device.calls == [2, 4, 33, 18, 11, 7, 5, 6]
    assert result.peak_model is None
    assert_certified(result, device, 64)


def test_overestimate_tries_the_size_below_the_miss_first() -> None:
    # 1 byte of fragmentation from b=17 on: the fit at 2, 3 predicts 17, which fails by a byte.
    device = FakeDevice(
        CKPT_STEP.series, max(CKPT_STEP.series(17)), overhead_bytes=_fragmentation(17, 1)
    )
    result = search(device, 1024)
    assert device.calls == [2, 3, 17, 16]
    assert result.max_micro_batch == 16


@pytest.mark.parametrize(("hint", "calls"), [(0, [2, 3, 7, 8, 9]), (20, [20, 2, 3, 7, 8, 9])])
def test_new_op_sequence_past_an_underestimate_takes_the_next_size(
    hint: int, calls: list[int]
) -> None:
    # From b=8 on the step runs other ops and needs less per sample. With exactly b=8's peak as
    # capacity, the fit at 2, 3 predicts 7; 8 fits with an op count no other trace has, so 9 is
    # tried next, as the nearest candidate and as that sequence's second trace. A hint that
    # does not fit leaves a trial without a trace, which counting op sequences must skip.
    series = _chunked_logits(
        CKPT_STEP, transformer_step(layers=5, logits_bytes_per_sample=256 * KiB), 8
    )
    capacity_bytes = max(series(8))
    model = PeakModel.fit(2, series(2), 3, series(3))
    assert model is not None and model.max_micro_batch(capacity_bytes) == 7
    device = FakeDevice(series, capacity_bytes)
    result = search(device, 1024, known_fitting=hint)
    assert device.calls == calls
    assert result.max_micro_batch == 8
    assert_certified(result, device, 1024)


@pytest.mark.parametrize("cap", [64, 1024])
def test_allocator_blocks_stay_exact_and_cheap(cap: int) -> None:
    # Every op's per-sample part rounded up to 2 MiB, like the CUDA caching allocator's large
    # blocks: the 2-point fit is then only nearly right.
    def rounded(b: int) -> tuple[int, ...]:
        return tuple(
            fixed + -(-b * per_sample // (2 * MiB)) * 2 * MiB
            for fixed, per_sample in CKPT_STEP.ops
        )

    calls = []
    for capacity_bytes in range(60 * MiB, 60 * MiB + 30 * MiB * 64, 3 * MiB + 12345):
        device = FakeDevice(rounded, capacity_bytes)
        result = search(device, cap)
        assert_certified(result, device, cap)
        calls.append(len(device.calls))
    print(f"2 MiB blocks, cap {cap}: median {statistics.median(calls)}, max {max(calls)} calls")
    assert statistics.median(calls) <= 4
    assert max(calls) <= _budget_calls(cap) + 2


def _rounded_mlp_trace(micro_batch: int) -> tuple[int, ...]:
    """An MLP-like step whose per-sample tensors are small and not multiples of the allocator's
    512-byte blocks (a 784-float input row is 3136 bytes), so live bytes are only affine in b up
    to rounding: the b=2,3 slope is a little off, and far out the prediction misses by a few."""

    def block(size_bytes: int) -> int:
        return -(-size_bytes // 512) * 512

    resident = 30_000_000
    ops = [
        resident + block(3136 * micro_batch),
        resident + block(3136 * micro_batch) + block(40 * micro_batch) + block(4 * micro_batch),
        resident + block(3136 * micro_batch) + 2 * block(4096 * micro_batch) + 700_000,
        resident + block(4096 * micro_batch) + block(44 * micro_batch) + 1_500_000,
    ]
    return tuple(ops)


@pytest.mark.parametrize("truth", [300, 691, 1000])
def test_a_far_near_miss_from_allocator_rounding_is_found_by_galloping_down(truth: int) -> None:
    capacity_bytes = max(_rounded_mlp_trace(truth))
    calls: list[int] = []

    def fits(micro_batch: int) -> StepOutcome:
        calls.append(micro_batch)
        series = _rounded_mlp_trace(micro_batch)
        ok = max(series) <= capacity_bytes
        return StepOutcome(
            micro_batch=micro_batch, fits=ok, peak_bytes=max(series), series=series if ok else None
        )

    result = find_max_micro_batch(fits, cap=1024, capacity_bytes=capacity_bytes)
    assert result.max_micro_batch == truth
    assert len(calls) <= 8, calls


# ---------------------------------------------------------------------------------------------
# The budget's arithmetic and the hint's bookkeeping (survivors of bench/mutation.py).


def test_the_budget_grows_at_every_power_of_two_plus_one() -> None:
    # 100 + 20 b <= 210: the answer is 5. With cap 64 the budget is 6 + 2 = 8 and doubling from
    # 4 to 8 could leave 56 candidates for 5 calls, so the guard moves it up; cap 65 buys a 9th
    # call, enough for the plain doubling, which finishes in 5.
    for cap, calls in [(64, [2, 4, 33, 18, 11, 7, 5, 6]), (65, [2, 4, 8, 6, 5])]:
        device = FakeDevice(lambda b: (100 + 20 * b,), 210, record_series=False)
        result = search(device, cap)
        assert device.calls == calls
        assert_certified(result, device, cap)


def test_a_fitting_hint_of_two_without_traces_is_not_tried_again() -> None:
    device = FakeDevice(lambda b: (100 + 20 * b,), 100 + 20 * 40, record_series=False)
    result = search(device, 64, known_fitting=2)
    assert device.calls == [2, 4, 33, 49, 41, 37, 39, 40]
    assert_certified(result, device, 64)


def test_an_underestimate_gallops_up_in_doubling_steps() -> None:
    # The series say 3 is the largest size that fits, the device fits up to 9. 2, 3 predict 3
    # and 4 fits; the refit on (2, 4) predicts 3 again and 5 fits. From 5, gallop up in steps
    # of 1, 2 and 4 (6, 8, 12), then bisect (8, 12).
    device = FakeDevice(CKPT_STEP.series, max(CKPT_STEP.series(3)), threshold=9)
    result = search(device, 16)
    assert device.calls == [2, 3, 4, 5, 6, 8, 12, 10, 9]
    assert result.max_micro_batch == 9


@pytest.mark.parametrize(
    ("threshold", "calls"),
    [
        # Predicted 17, but 17 fails: gallop down 1, 2, 4 sizes, then bisect (10, 14).
        (10, [2, 3, 17, 16, 14, 10, 12, 11]),
        # The same, further down: past 10, the guard takes over from the doubling.
        (9, [2, 3, 17, 16, 14, 10, 4, 7, 8, 9]),
        # Predicted 17, but 18 fits too, and so does the refit's next guess: gallop up from the
        # miss (the guard clamps the doubling to keep the budget), then bisect.
        (60, [2, 3, 17, 18, 19, 20, 513, 266, 143, 81, 50, 65, 57, 61, 59, 60]),
    ],
)
def test_a_missed_prediction_gallops_away_from_the_miss(threshold: int, calls: list[int]) -> None:
    device = FakeDevice(CKPT_STEP.series, capacity_for(CKPT_STEP, 17), threshold=threshold)
    result = search(device, 1024)
    assert device.calls == calls
    assert_certified(result, device, 1024)


@pytest.mark.parametrize(
    ("series", "capacity_bytes", "threshold", "hint", "calls"),
    [
        # cap 32: budget 5 + 2. The fit at 2, 3 predicts 30, which fails (an overestimate: 4
        # more calls, 11). Galloping down 29, 27, 23, 15 fails too; the next step would go
        # below 0, and with 4 calls left the guard keeps the bracket (3, 15) within 8: 7, then
        # bisection finds 9.
        (
            CKPT_STEP.series,
            max(CKPT_STEP.series(30)),
            9,
            0,
            [2, 3, 30, 29, 27, 23, 15, 7, 11, 9, 10],
        ),
        # The op sequence changes at 8 (less per sample beyond): 2, 3 predict 7; 7 and 8 fit
        # (an underestimate: 2 more calls) and 8's sequence is new, so 9 is tried (1 more
        # call); the refit on 8, 9 predicts no more than 9, and 10 fits (2 more: 12 calls).
        # Galloping up, 11 fits; with 5 calls left the guard moves 13 to 17, where a failure
        # still leaves a bracket that bisection closes in time, and bisection finds 13.
        (
            _chunked_logits(
                CKPT_STEP, transformer_step(layers=5, logits_bytes_per_sample=256 * KiB), 8
            ),
            max(CKPT_STEP.series(7)),
            13,
            0,
            [2, 3, 7, 8, 9, 10, 11, 17, 14, 12, 13],
        ),
        # The hint 20 does not fit (1 more call: 8). 2, 3 predict 5; 5, 6 fit (2 more); the
        # refit on 2, 6 predicts 5 again and 7 fits (2 more: 12). Galloping up 8, 10, 14 fits;
        # with 3 calls left the guard keeps the next step within 4 of 14: 18, then 19.
        (
            CKPT_STEP.series,
            max(CKPT_STEP.series(5)),
            19,
            20,
            [20, 2, 3, 5, 6, 7, 8, 10, 14, 18, 19],
        ),
    ],
    ids=["overestimate", "new-op-sequence", "wrong-hint"],
)
def test_each_missed_bet_buys_its_calls_for_the_fallback(
    series: SeriesFn, capacity_bytes: int, threshold: int, hint: int, calls: list[int]
) -> None:
    device = FakeDevice(series, capacity_bytes, threshold=threshold)
    result = search(device, 32, known_fitting=hint)
    assert device.calls == calls
    assert result.max_micro_batch == threshold


# ---------------------------------------------------------------------------------------------
# Reserved memory: a device whose trials run an allocation trace through the allocator model,
# as the emulated GPU does (docs/design.md#predicting-reserved-memory).


def layered_allocations(micro_batch: int, *, layers: int = 6) -> tuple[int, ...]:
    """An encoded allocation trace: weights and moments resident, per layer an activation kept
    for backward and a temporary freed at once (sizes in the 1-10 MiB class at small b, where
    the allocator makes 20 MiB segments), then backward frees the activations."""
    trace: list[int] = []

    def alloc(size_bytes: int) -> int:
        trace.append(size_bytes)
        return len(trace) - 1

    def free(event: int) -> None:
        trace.append(-(event + 1))

    for _ in range(3):
        alloc(24 * MiB)  # weights, two moments
    kept = []
    for _ in range(layers):
        temporary = alloc(micro_batch * 700 * KiB)
        kept.append(alloc(micro_batch * 300 * KiB + 512))
        free(temporary)
    for event in reversed(kept):
        gradient = alloc(micro_batch * 300 * KiB + 512)
        free(event)
        free(gradient)
    return tuple(trace)


def live_series(trace: tuple[int, ...]) -> tuple[int, ...]:
    sizes: dict[int, int] = {}
    live_bytes, series = 0, []
    for position, event in enumerate(trace):
        if event >= 0:
            sizes[position] = event
            live_bytes += event
        else:
            live_bytes -= sizes.pop(-event - 1)
        series.append(live_bytes)
    return tuple(series)


class AllocatorDevice:
    """Trials replayed on the allocator model: they fit when reserved memory fits."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        record_allocations: bool = True,
        config: AllocatorConfig | None = None,
        trace: Callable[[int], tuple[int, ...]] = layered_allocations,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.record_allocations = record_allocations
        self.config = config
        self.trace = trace
        self.calls: list[int] = []

    def outcome(self, micro_batch: int) -> StepOutcome:
        trace = self.trace(micro_batch)
        replayed = replay_encoded(trace, self.capacity_bytes, self.config)
        return StepOutcome(
            micro_batch=micro_batch,
            fits=replayed.fits,
            peak_bytes=replayed.stats.peak_reserved_bytes,
            peak_allocated_bytes=replayed.stats.peak_allocated_bytes,
            series=live_series(trace) if replayed.fits else None,
            allocations=trace if replayed.fits and self.record_allocations else None,
        )

    def fits(self, micro_batch: int) -> StepOutcome:
        self.calls.append(micro_batch)
        return self.outcome(micro_batch)

    def brute_force_max(self, cap: int) -> int:
        return max((b for b in range(1, cap + 1) if self.outcome(b).fits), default=0)


@pytest.mark.parametrize("capacity_mib", [200, 333, 512, 640])
def test_replayed_allocations_predict_where_reserved_memory_runs_out(capacity_mib: int) -> None:
    device = AllocatorDevice(capacity_mib * MiB)
    result = find_max_micro_batch(device.fits, cap=256, capacity_bytes=device.capacity_bytes)
    assert 3 < result.max_micro_batch == device.brute_force_max(256) < 256
    assert result.allocation_model is not None
    assert device.calls == [2, 3, result.max_micro_batch, result.max_micro_batch + 1]


def test_without_allocations_the_live_budget_is_scaled_and_the_answer_still_exact() -> None:
    device = AllocatorDevice(512 * MiB, record_allocations=False)
    result = find_max_micro_batch(device.fits, cap=256, capacity_bytes=device.capacity_bytes)
    assert result.allocation_model is None
    assert result.max_micro_batch == device.brute_force_max(256)
    # Predicting live bytes against the capacity itself would overestimate: reserved memory is
    # above them, and the scaled budget is what keeps the first prediction below the answer.
    model = result.peak_model
    assert model is not None
    assert model.max_micro_batch(device.capacity_bytes) > result.max_micro_batch


def test_live_budget_bytes_scales_by_the_largest_fitting_trace() -> None:
    def outcome(micro_batch: int, peak_bytes: int, live_bytes: int) -> StepOutcome:
        return StepOutcome(
            micro_batch=micro_batch, fits=True, peak_bytes=peak_bytes, series=(1, live_bytes)
        )

    attempts = [outcome(2, 300, 100), outcome(9, 400, 200), outcome(3, 1000, 100)]
    assert live_budget_bytes(1000, attempts) == 500  # b = 9's ratio, not b = 3's
    assert live_budget_bytes(1000, [outcome(2, 100, 100)]) == 1000  # peak is the live bytes
    failed = StepOutcome(micro_batch=4, fits=False, peak_bytes=10)
    assert live_budget_bytes(1000, [failed]) == 1000


def test_peak_model_needs_two_sizes_in_order() -> None:
    with pytest.raises(ValueError, match=r"need b1 < b2, got b1=3, b2=3"):
        PeakModel.fit(3, [10], 3, [10])


def test_peak_model_counts_an_op_that_grows_by_one_byte_per_sample() -> None:
    model = PeakModel.fit(2, (100, 10), 3, (100, 11))
    assert model is not None
    # 10 + (b - 2) <= 15 up to b = 7: a slope of one byte is growth, not a constant.
    assert model.max_micro_batch(15) == 0  # the 100-byte op never fits 15
    assert model.max_micro_batch(100) == 92


def test_the_search_replays_with_the_device_s_allocator_settings() -> None:
    # Expandable segments reserve whole 20 MiB pages: the default policy's replay would predict
    # another maximum, and the search would need more than its 4 calls.
    config = parse_alloc_conf("expandable_segments:True")
    for capacity_mib in (200, 333, 512):
        device = AllocatorDevice(capacity_mib * MiB, config=config)
        result = find_max_micro_batch(
            device.fits, cap=256, capacity_bytes=device.capacity_bytes, allocator_config=config
        )
        assert result.max_micro_batch == device.brute_force_max(256)
        assert device.calls == [2, 3, result.max_micro_batch, result.max_micro_batch + 1]


# ---------------------------------------------------------------------------------------------
# Past a dip: reserved memory that is not monotone in b
# (docs/design.md#memory-that-is-not-monotone).


def split_cache_allocations(micro_batch: int) -> tuple[int, ...]:
    """Two tensors, the first freed, then a larger one: it fits in the first's cached block at
    some sizes and needs a segment of its own at others, so some sizes run out on 24 MiB where
    larger ones fit."""
    b = micro_batch
    return (256 * KiB * b, 256 * KiB * b, -1, MiB + 256 * KiB * b)


def runs_out_below(device: AllocatorDevice, answer: int) -> tuple[int, ...]:
    return tuple(b for b in range(2, answer) if not device.outcome(b).fits)


@pytest.mark.parametrize("traced", [False, True], ids=["fit-run", "fit-traced"])
def test_the_answer_is_the_largest_size_that_fits_past_a_dip(traced: bool) -> None:
    device = AllocatorDevice(24 * MiB, trace=split_cache_allocations)
    largest = device.brute_force_max(64)
    dips = runs_out_below(device, largest)
    assert largest == 44 and dips  # the first size to run out is far below the largest
    points = [device.outcome(2), device.outcome(3)] if traced else []
    result = find_max_micro_batch(
        device.fits, cap=64, capacity_bytes=device.capacity_bytes, traced=points
    )
    assert result.max_micro_batch == largest
    assert result.runs_out_below == dips
    assert device.calls[-2:] == [largest, largest + 1]
    assert len(device.calls) == (2 if traced else 4)


@pytest.mark.parametrize("seed", range(40))
def test_past_dips_the_answer_is_the_largest_size_that_fits_on_random_steps(seed: int) -> None:
    # Random steps of a few tensors on the allocator model, where the replay is exact.
    rng = random.Random(seed)
    events: list[tuple[int, int] | int] = []
    live: list[int] = []
    for position in range(rng.randint(4, 7)):
        if live and rng.random() < 0.35:
            events.append(-(live.pop(rng.randrange(len(live))) + 1))
        else:
            fixed = rng.choice([0, 512 * KiB, MiB, 3 * MiB])
            events.append((fixed, rng.choice([64 * KiB, 256 * KiB, 512 * KiB, MiB, 2 * MiB])))
            live.append(position)

    def trace(b: int) -> tuple[int, ...]:
        return tuple(e if isinstance(e, int) else e[0] + b * e[1] for e in events)

    for capacity_mib in (24, 40):
        device = AllocatorDevice(capacity_mib * MiB, trace=trace)
        if not (device.outcome(2).fits and device.outcome(3).fits):
            continue  # no fit points: no model, nothing predicted past a dip
        result = find_max_micro_batch(device.fits, cap=64, capacity_bytes=device.capacity_bytes)
        assert result.max_micro_batch == device.brute_force_max(64)
        assert result.runs_out_below == runs_out_below(device, result.max_micro_batch)


def _hidden_failures(device: AllocatorDevice, sizes: range) -> None:
    """`sizes` run out for a reason the trace cannot see (on a card: memory the dispatcher never
    sees), so the model's predictions there miss."""
    replayed = device.outcome

    def outcome(micro_batch: int) -> StepOutcome:
        real = replayed(micro_batch)
        if micro_batch in sizes:
            return StepOutcome(micro_batch=micro_batch, fits=False, peak_bytes=real.peak_bytes)
        return real

    device.outcome = outcome  # type: ignore[method-assign]


def test_past_a_dip_a_prediction_that_runs_out_is_a_miss_and_the_next_one_down_is_tried() -> None:
    device = AllocatorDevice(24 * MiB, trace=split_cache_allocations)
    _hidden_failures(device, range(44, 45))
    result = find_max_micro_batch(device.fits, cap=64, capacity_bytes=device.capacity_bytes)
    assert result.max_micro_batch == device.brute_force_max(64) == 43
    assert device.calls == [2, 3, 44, 43]  # 44 ran out: 43 is certified from both sides


@pytest.mark.parametrize(
    ("hidden", "answer", "past_the_dip"),
    [(range(41, 45), 40, [42, 40]), (range(40, 45), 25, [42, 40])],
    ids=["one-miss", "two-misses"],
)
def test_past_a_dip_predictions_that_miss_are_tried_twice_at_most(
    hidden: range, answer: int, past_the_dip: list[int]
) -> None:
    device = AllocatorDevice(24 * MiB, trace=split_cache_allocations)
    _hidden_failures(device, hidden)
    result = find_max_micro_batch(device.fits, cap=64, capacity_bytes=device.capacity_bytes)
    assert result.max_micro_batch == device.brute_force_max(64) == answer
    # The first prediction (44) missed and the fallback closed the bracket at 25 / 26; past
    # that dip the model's largest untried predictions, until one fits or two have missed.
    assert device.calls[:3] == [2, 3, 44] and device.calls[-2:] == past_the_dip
    assert device.calls[-3] == 26 or device.calls[-3] == 25
    assert len(device.calls) == len(set(device.calls))
    # The model disagreed with trials: only sizes seen running out are listed.
    assert result.runs_out_below == tuple(
        b for b in sorted(device.calls) if b < answer and not device.outcome(b).fits
    )


def test_a_hint_at_the_edge_of_a_dip_takes_one_more_fit_point_to_look_past_it() -> None:
    # The plain answer as a hint for checkpointing, at a size whose next one runs out: the
    # hint and its next size close the bracket with one trace, no model. One trial at b=2 fits
    # a model with the hint's trace, which sees the largest size that fits past the dip.
    device = AllocatorDevice(24 * MiB, trace=split_cache_allocations)
    largest = device.brute_force_max(64)
    edges = [b for b in range(3, largest) if device.outcome(b).fits and b + 1 in dips(device)]
    assert edges and largest == 44
    hint = edges[0]
    result = find_max_micro_batch(
        device.fits, cap=64, capacity_bytes=device.capacity_bytes, known_fitting=hint
    )
    assert result.max_micro_batch == largest
    assert device.calls == [hint, hint + 1, 2, largest, largest + 1]
    assert result.runs_out_below == runs_out_below(device, largest)


def test_a_hint_without_allocations_closes_without_a_fit_point_below() -> None:
    # No allocations recorded: no model could look past a dip, so no trial is spent on one.
    device = AllocatorDevice(24 * MiB, trace=split_cache_allocations, record_allocations=False)
    hint = next(b for b in range(3, 44) if device.outcome(b).fits and b + 1 in dips(device))
    result = find_max_micro_batch(
        device.fits, cap=64, capacity_bytes=device.capacity_bytes, known_fitting=hint
    )
    assert device.calls == [hint, hint + 1]
    assert result.max_micro_batch == hint


def test_without_dips_reported_a_hint_at_the_cap_closes_without_a_fit_point_below() -> None:
    # The tuner's probe of accumulation wants the largest size alone: a hint at the cap that
    # fits closes the search, and no trial is spent on a model of the dips below it (none is
    # left to look for above the cap). Reported, the same search spends one at b=2.
    device = AllocatorDevice(24 * MiB, trace=split_cache_allocations)
    cap = device.brute_force_max(64)  # 44, with sizes below it that run out
    for report_dips, calls in ((True, [cap, 2]), (False, [cap])):
        device.calls.clear()
        result = find_max_micro_batch(
            device.fits,
            cap=cap,
            capacity_bytes=device.capacity_bytes,
            known_fitting=cap,
            report_dips=report_dips,
        )
        assert result.max_micro_batch == cap
        assert device.calls == calls
        expected = runs_out_below(device, cap) if report_dips else ()
        assert result.runs_out_below == expected and runs_out_below(device, cap)


def test_without_dips_reported_the_answer_past_a_dip_is_still_the_largest() -> None:
    # Below the cap a model may still see a size past a dip: the search looks for it as ever,
    # and lists only the trials that ran out below its answer.
    device = AllocatorDevice(24 * MiB, trace=split_cache_allocations)
    hint = next(b for b in range(3, 44) if device.outcome(b).fits and b + 1 in dips(device))
    result = find_max_micro_batch(
        device.fits,
        cap=64,
        capacity_bytes=device.capacity_bytes,
        known_fitting=hint,
        report_dips=False,
    )
    assert result.max_micro_batch == device.brute_force_max(64) == 44
    assert device.calls == [hint, hint + 1, 2, 44, 45]
    assert result.runs_out_below == (hint + 1,)


@pytest.mark.parametrize("overshoot", [1, 5])
def test_below_a_failing_hint_the_next_size_down_is_tried_first(overshoot: int) -> None:
    # The tuner's probe of accumulation: its hint (one micro-step's answer, at most its cap) is
    # most likely one above the answer. Right, two trials close the search; wrong, the size
    # below is one trial more before the fit points, and the answer is the same.
    device = AllocatorDevice(512 * MiB)
    largest = device.brute_force_max(256)
    hint = largest + overshoot

    def search(cap: int, *, as_the_tuner: bool) -> int:
        device.calls.clear()
        return find_max_micro_batch(
            device.fits,
            cap=cap,
            capacity_bytes=device.capacity_bytes,
            known_fitting=hint,
            report_dips=not as_the_tuner,
            below_a_failing_hint=as_the_tuner,
        ).max_micro_batch

    assert search(hint, as_the_tuner=True) == largest
    if overshoot == 1:
        assert device.calls == [hint, largest]
        # Below a larger cap a size past a dip may fit: a fit point at 2 for the model that
        # would see it.
        assert search(256, as_the_tuner=True) == largest
        assert device.calls == [hint, largest, 2]
    else:
        assert device.calls == [hint, hint - 1, 2, 3, largest, largest + 1]
    # Without, the fit points come right after the hint.
    assert search(hint, as_the_tuner=False) == largest
    assert device.calls == [hint, 2, 3, largest] + ([largest + 1] if overshoot > 1 else [])


def dips(device: AllocatorDevice) -> set[int]:
    return {b for b in range(2, 65) if not device.outcome(b).fits}


def test_allocation_model_largest_fitting_scans_past_dips() -> None:
    model = AllocationModel.fit(2, split_cache_allocations(2), 3, split_cache_allocations(3))
    assert model is not None
    fits = [b for b in range(2, 65) if replay_encoded(split_cache_allocations(b), 24 * MiB).fits]
    assert model.largest_fitting(24 * MiB, above=1, high=65) == max(fits) == 44
    below = max(b for b in fits if b < 44 and b + 1 not in fits)
    assert model.largest_fitting(24 * MiB, above=1, high=below + 1) == below
    assert model.largest_fitting(24 * MiB, above=44, high=65) is None


# ---------------------------------------------------------------------------------------------
# Traced fit points: the same step traced without running it.


def _traced(device: AllocatorDevice | FakeDevice, *sizes: int) -> list[StepOutcome]:
    """What a trace of the step reports at `sizes`: the device's outcomes, never counted as
    trials (the device's call log is left as it was)."""
    if isinstance(device, AllocatorDevice):
        return [device.outcome(size) for size in sizes]
    calls = list(device.calls)
    traced = [device.fits(size) for size in sizes]
    device.calls = calls
    return traced


@pytest.mark.parametrize("capacity_mib", [200, 333, 512, 640])
def test_a_right_traced_prediction_takes_two_trials(capacity_mib: int) -> None:
    device = AllocatorDevice(capacity_mib * MiB)
    result = find_max_micro_batch(
        device.fits, cap=256, capacity_bytes=device.capacity_bytes, traced=_traced(device, 2, 3)
    )
    answer = device.brute_force_max(256)
    assert device.calls == [answer, answer + 1]
    assert result.max_micro_batch == result.traced_prediction == answer
    # The models are the traced ones, so the recommendation can replay them.
    assert result.allocation_model is not None and result.peak_model is not None


def test_traced_live_bytes_alone_predict_through_the_scaled_budget() -> None:
    # A trace without allocations: the live budget is scaled by the traces' own ratio.
    step = transformer_step(checkpointing=False)
    device = FakeDevice(step.series, capacity_for(step, 40))
    result = find_max_micro_batch(
        device.fits, cap=1024, capacity_bytes=device.capacity_bytes, traced=_traced(device, 2, 3)
    )
    assert_certified(result, device, 1024)
    assert device.calls == [40, 41]
    assert result.allocation_model is None


@pytest.mark.parametrize("capacity_mib", [200, 512])
def test_a_trace_of_another_step_costs_a_few_trials_and_the_answer_is_still_exact(
    capacity_mib: int,
) -> None:
    # The trace models a step that is not the device's (a real card's kernels differ): its
    # prediction misses, and the search goes on from the real fit points, still exact.
    device = AllocatorDevice(capacity_mib * MiB)
    other = FakeDevice(transformer_step(layers=2, checkpointing=True).series, 10**12)
    for traced in (_traced(other, 2, 3), _traced(other, 40, 50)):
        device.calls = []
        result = find_max_micro_batch(
            device.fits, cap=256, capacity_bytes=device.capacity_bytes, traced=traced
        )
        answer = device.brute_force_max(256)
        assert result.max_micro_batch == answer
        assert result.traced_prediction is not None and result.traced_prediction != answer
        assert len(set(device.calls)) == len(device.calls)
        assert answer in device.calls and answer + 1 in device.calls
        # The budget of a missed traced bet: a lost prediction's 4 calls on top of today's.
        assert len(device.calls) <= _budget_calls(256) + 4, device.calls


def test_every_threshold_with_a_misleading_trace_is_exact_and_bounded() -> None:
    # A device that lies about every size: the trace (its series) predicts one answer, the
    # trials say another. Whatever the truth, the answer is certified within the budget.
    step = transformer_step(checkpointing=True)
    cap = 128
    for threshold in range(0, cap + 1):
        device = FakeDevice(step.series, capacity_for(step, 30), threshold=threshold)
        traced = [
            StepOutcome(
                micro_batch=b, fits=True, peak_bytes=max(step.series(b)), series=step.series(b)
            )
            for b in (2, 3)
        ]
        result = find_max_micro_batch(
            device.fits, cap=cap, capacity_bytes=device.capacity_bytes, traced=traced
        )
        assert_certified(result, device, cap)
        assert result.traced_prediction == 30
        assert len(device.calls) <= _budget_calls(cap) + 4 + 2, (threshold, device.calls)


def test_a_trace_without_two_complete_steps_is_no_fit() -> None:
    device = AllocatorDevice(333 * MiB)
    unusable = [
        _traced(device, 2),  # one size only
        [device.outcome(2).model_copy(update={"series": None}), device.outcome(3)],
        _traced(device, 1, 3),  # b = 1 runs another op sequence
        [],
    ]
    for traced in unusable:
        device.calls = []
        result = find_max_micro_batch(
            device.fits, cap=256, capacity_bytes=device.capacity_bytes, traced=traced
        )
        assert result.traced_prediction is None
        assert device.calls[:2] == [2, 3], traced
    # Without a capacity nothing can be predicted from a trace either.
    device.calls = []
    result = find_max_micro_batch(
        device.fits, cap=256, capacity_bytes=None, traced=_traced(device, 2, 3)
    )
    assert result.traced_prediction is None


def test_traced_points_fit_on_the_first_pair_of_distinct_sizes_with_one_op_sequence() -> None:
    device = AllocatorDevice(333 * MiB)
    answer = device.brute_force_max(256)
    two, three, four = (device.outcome(size) for size in (2, 3, 4))
    # b = 2 traced with one more op (a kernel that changes below 3): no model on (2, 3), so
    # the pair (3, 4) is the first one; a size traced twice is one point, not a pair.
    other_ops = two.model_copy(update={"series": (*(two.series or ()), 0)})
    for traced in ([other_ops, three, four], [two, two, three], [three, two, three, two]):
        device.calls = []
        result = find_max_micro_batch(
            device.fits, cap=256, capacity_bytes=device.capacity_bytes, traced=traced
        )
        assert device.calls == [answer, answer + 1], traced
        assert result.traced_prediction == answer


def test_traced_points_are_ordered_by_size_whatever_their_series() -> None:
    # A first op that shrinks as b grows (a buffer sized for the rest of the batch): the series
    # of 3 sort before those of 2, the sizes do not.
    step = transformer_step(checkpointing=False)

    def series(micro_batch: int) -> tuple[int, ...]:
        return (10 * MiB - micro_batch, *step.series(micro_batch))

    device = FakeDevice(series, capacity_for(step, 40))
    traced = _traced(device, 3, 2)
    result = find_max_micro_batch(
        device.fits, cap=1024, capacity_bytes=device.capacity_bytes, traced=traced
    )
    assert device.calls == [40, 41]
    assert result.traced_prediction == 40


@pytest.mark.parametrize("threshold", [1, 2, 5, 9, 16])
def test_fewest_fitting_bisects_to_the_threshold(threshold: int) -> None:
    asked: list[int] = []

    def fits(k: int) -> bool:
        asked.append(k)
        return k >= threshold

    assert fewest_fitting(fits, failing=0, fitting=16) == threshold
    assert all(0 < k < 16 for k in asked)  # the known ends are never asked
    assert len(asked) <= 4  # log2(16)


def test_fewest_fitting_needs_an_interval() -> None:
    with pytest.raises(ValueError, match="failing < fitting"):
        fewest_fitting(lambda k: True, failing=3, fitting=3)
