"""The probe end to end on the emulated GPU: exact answers, only OOM becomes `fits=False`."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from autotune.core.memory.allocation_trace import replay_encoded
from autotune.core.memory.allocator_config import parse_alloc_conf
from autotune.core.presets import PRESETS
from autotune.core.schemas import DeviceInfo, DeviceKind, ModeProbe, Phase, Spec, StepOutcome
from autotune.core.tuning.throughput import Measurement
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.estimate import EstimateRunner
from autotune.engine.probe import ExpandableSegments, probe, probe_session, run_step
from autotune.engine.runner import InProcessRunner

# The smallest preset of each family: within a family the presets differ only in size, which the
# search does not care about (test_zoo.py runs every preset); short sequences keep them quick.
FAMILY_PRESETS = ["cnn", "gpt2-tiny", "llama-tiny", "mlp"]
SEQ_LEN = 32
HUGE_BYTES = 1 << 40


def preset_spec(name: str, **training: object) -> Spec:
    settings: dict[str, object] = {"max_micro_batch": 64, **training}
    if PRESETS[name].kind == "decoder":
        settings.setdefault("seq_len", SEQ_LEN)
    return Spec.model_validate({"model": {"preset": name}, "training": settings})


def capacity_for_about_four(spec: Spec) -> int:
    """A capacity where the plain step fits about four samples: extrapolated from b=2 and 3."""
    session = InProcessRunner(spec, EmulatedDevice(HUGE_BYTES))
    assert session.warm_up().fits
    peak2 = session.trial(2).peak_bytes
    peak3 = session.trial(3).peak_bytes
    return peak3 + (peak3 - peak2) * 3 // 2


def warmed_as_a_probe(spec: Spec, capacity_bytes: int) -> InProcessRunner:
    """A fresh model and optimizer on a fresh device, warmed up as the probe warms up: the
    plain mode first, whose warm-up places the residents for every later trial of both modes
    (docs/design.md#the-caching-allocator-on-the-emulated-gpu), then the checkpointed one."""
    runner = InProcessRunner(spec, EmulatedDevice(capacity_bytes))
    for checkpointing in (False, True):
        assert runner.warm_up(checkpointing=checkpointing).fits
    return runner


def _family(name: str) -> str:
    return getattr(PRESETS[name], "family", PRESETS[name].kind)


def test_the_family_presets_cover_every_family() -> None:
    assert {_family(name) for name in FAMILY_PRESETS} == {_family(name) for name in PRESETS}


@pytest.mark.e2e
@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_probe_result_fits_and_one_more_does_not(name: str) -> None:
    spec = preset_spec(name)
    device = EmulatedDevice(capacity_for_about_four(spec))
    result = probe(spec, device)

    assert [mode.checkpointing for mode in result.modes] == [False, True]
    for mode in result.modes:
        b = mode.max_micro_batch
        assert b >= 1
        # Checked independently: a fresh model and optimizer on a fresh device of that size.
        fresh = warmed_as_a_probe(spec, device.info.capacity_bytes)
        assert fresh.trial(b, checkpointing=mode.checkpointing).fits
        if not mode.capped:
            after = fresh.trial(b + 1, checkpointing=mode.checkpointing)
            assert not after.fits
            assert after.peak_bytes <= device.info.capacity_bytes
        # Every attempt agrees with the answer: it fits up to it, but for the sizes below it
        # the result lists as running out (memory is not monotone in b where the warm-up's
        # placement leaves holes: llama-tiny checkpointed runs out at 10 and fits 18).
        for attempt in mode.attempts:
            expected = attempt.micro_batch <= b and attempt.micro_batch not in mode.runs_out_below
            assert attempt.fits == expected
        assert mode.recommended_micro_batch <= b
    plain, checkpointed = result.modes
    assert checkpointed.max_micro_batch >= plain.max_micro_batch


@pytest.mark.e2e
def test_probe_is_frugal_on_a_preset() -> None:
    spec = preset_spec("gpt2-tiny")
    result = probe(spec, EmulatedDevice(capacity_for_about_four(spec) * 3))
    for mode in result.modes:
        assert len(mode.attempts) <= 4, [a.micro_batch for a in mode.attempts]


@pytest.mark.e2e
def test_a_checkpointed_probe_hinted_at_the_edge_of_a_dip_answers_the_largest_that_fits() -> None:
    # bench/results/estimator.md's llama-tiny row at about 162 MiB (the b=2 peak and one more
    # sample, from the estimate at 2 and 8): the plain answer, 9, is the checkpointed mode's
    # hint, and 10 runs out there. It answered 9 from those two trials; 18 is the largest size
    # that fits, which one more fit point at b=2 lets the allocation model see.
    spec = preset_spec("llama-tiny", precision="bf16")
    estimate = EstimateRunner(spec, capacity_bytes=HUGE_BYTES)
    assert estimate.warm_up().fits
    two, eight = estimate.trial(2).peak_bytes, estimate.trial(8).peak_bytes
    capacity_bytes = two + (eight - two) // 6
    result = probe_session(InProcessRunner(spec, EmulatedDevice(capacity_bytes)))
    plain, checkpointed = result.modes
    tried = [attempt.micro_batch for attempt in checkpointed.attempts]
    assert tried[:3] == [plain.max_micro_batch, plain.max_micro_batch + 1, 2]
    assert checkpointed.max_micro_batch == 18
    fresh = warmed_as_a_probe(spec, capacity_bytes)
    assert not fresh.trial(19, checkpointing=True).fits
    assert fresh.trial(18, checkpointing=True).fits
    assert not fresh.trial(plain.max_micro_batch + 1, checkpointing=True).fits


@pytest.mark.e2e
def test_headroom_lowers_the_recommendation_not_the_max() -> None:
    spec = preset_spec("gpt2-tiny", headroom=0.3)
    device = EmulatedDevice(capacity_for_about_four(spec) * 2)
    plain = probe(spec, device).modes[0]
    assert plain.recommended_micro_batch < plain.max_micro_batch
    budget = int(device.info.capacity_bytes * 0.7)
    rec = run_step(spec, device, micro_batch=plain.recommended_micro_batch, checkpointing=False)
    assert rec.fits and rec.peak_bytes <= budget
    # Within the budget, a step also fits on a card of that size: its allocator made the same
    # decisions without ever asking for more.
    at_budget = run_step(
        spec,
        EmulatedDevice(budget),
        micro_batch=plain.recommended_micro_batch,
        checkpointing=False,
    )
    assert at_budget.fits and at_budget.peak_bytes == rec.peak_bytes
    more = run_step(
        spec, device, micro_batch=plain.recommended_micro_batch + 1, checkpointing=False
    )
    assert more.peak_bytes > budget


def test_nothing_fits_gives_zero_with_the_attempt() -> None:
    spec = preset_spec("gpt2-tiny")
    result = probe(spec, EmulatedDevice(1 << 20))
    assert [mode.max_micro_batch for mode in result.modes] == [0, 0]
    assert all(not mode.attempts[0].fits for mode in result.modes)


def factory_spec(factory: str) -> Spec:
    return Spec.model_validate(
        {
            "model": {"factory": f"tests.autotune_tests.probe_factories:{factory}"},
            "training": {"max_micro_batch": 32},
        }
    )


@pytest.mark.parametrize(
    ("factory", "expected_max"),
    [("real_oom_above_5", 5), ("cpu_allocator_failure_above_4", 4)],
)
@pytest.mark.e2e
def test_out_of_memory_by_type_never_escapes(factory: str, expected_max: int) -> None:
    result = probe(factory_spec(factory), EmulatedDevice(HUGE_BYTES))
    assert [mode.max_micro_batch for mode in result.modes] == [expected_max]


@pytest.mark.parametrize(
    ("factory", "error", "message"),
    [
        ("value_error_above_2", ValueError, "shape mismatch in user model"),
        ("runtime_error_above_2", RuntimeError, "CUDA error: an illegal memory access"),
    ],
)
def test_other_errors_surface_with_their_own_message(
    factory: str, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        probe(factory_spec(factory), EmulatedDevice(HUGE_BYTES))


def test_an_optimizer_that_ran_out_while_building_its_state_steps_again() -> None:
    """AdamW builds its state (exp_avg, exp_avg_sq) lazily in the first step. Out of memory
    half-way left one parameter with exp_avg only, and the next warm-up (the checkpointing mode)
    raised KeyError: 'exp_avg_sq' out of `autotune tune` instead of answering "nothing fits"."""
    spec = preset_spec("mlp")
    params_bytes = sum(
        p.numel() * p.element_size()
        for p in InProcessRunner(spec, EmulatedDevice(HUGE_BYTES)).step.model.parameters()
    )
    # Parameters and gradients fit with the allocator's segments around them (3 copies would not:
    # reserved memory is more than the bytes), the optimizer's two state tensors do not.
    result = probe(spec, EmulatedDevice(params_bytes * 7 // 2))
    assert [mode.max_micro_batch for mode in result.modes] == [0, 0]
    for mode in result.modes:
        assert [(a.fits, a.oom_phase) for a in mode.attempts] == [(False, Phase.OPTIMIZER)]


@pytest.mark.parametrize("model_allocator", [True, False])
def test_an_out_of_memory_says_which_allocation_failed_and_what_memory_held(
    model_allocator: bool,
) -> None:
    spec = preset_spec("mlp", optimizer="adamw")
    capacity_bytes = capacity_for_about_four(spec)
    runner = InProcessRunner(spec, EmulatedDevice(capacity_bytes, model_allocator=model_allocator))
    assert runner.warm_up().fits  # the optimizer's state exists from here on
    parameters = list(runner.step.model.parameters())
    weight_bytes = sum(-(-p.numel() * p.element_size() // 512) * 512 for p in parameters)

    # At 4096 the input batch alone (14 MiB) finds no hole in the warm-up's placement and no
    # room for a segment: it runs out before any activation. At 2048 the first layer's output
    # is made and its ReLU runs out.
    outcome = runner.trial(2048)

    assert not outcome.fits
    oom = outcome.oom
    assert oom is not None
    assert oom.phase is outcome.oom_phase is Phase.FORWARD
    assert oom.op.startswith("aten.") and oom.allocation_bytes > 0
    assert oom.weights_bytes == weight_bytes
    assert oom.gradients_bytes == 0  # set to None after each step; none yet in this forward
    # AdamW: two moments the size of the parameters, and a step count each.
    assert (
        2 * weight_bytes
        <= oom.optimizer_state_bytes
        <= 2 * weight_bytes + 512 * 2 * len(parameters)
    )
    assert oom.activations_bytes > 0
    held_bytes = (
        oom.weights_bytes + oom.optimizer_state_bytes + oom.activations_bytes + oom.cache_bytes
    )
    assert held_bytes <= capacity_bytes < held_bytes + oom.allocation_bytes + 20 * 2**20
    assert (oom.cache_bytes == 0) is (not model_allocator)
    assert f"for {oom.op} in forward did not fit; memory held: weights" in oom.summary()
    # It travels with the attempt (JSON, the server, the run page) and only with an OOM.
    assert StepOutcome.model_validate_json(outcome.model_dump_json()).oom == oom
    assert runner.trial(1).oom is None


# ---------------------------------------------------------------------------------------------
# Expandable segments as a knob: each mode again under them, traced, then verified.

KiB = 2**10
MiB = 2**20
EXPANDABLE = "expandable_segments:True"


def freed_then_growing(micro_batch: int) -> tuple[int, ...]:
    """An encoded allocation trace: a temporary freed at once, then two tensors that grow with
    b; the default allocator's segment rounding runs out at 17 on 40 MiB, expandable segments'
    pages do not."""
    b = micro_batch
    return (512 * KiB * b, -1, 6 * MiB + MiB * b, MiB * b)


class ReplayedSession:
    """A session whose steps replay an allocation trace through the caching-allocator model
    with its device's settings, as the emulated GPU's trials do; records the sizes it ran."""

    def __init__(
        self, trace: Callable[[int], tuple[int, ...]], capacity_bytes: int, conf: str | None
    ) -> None:
        self.trace = trace
        self.config = parse_alloc_conf(conf) if conf else None
        self.spec = preset_spec("mlp")
        self.device_info = DeviceInfo(
            kind=DeviceKind.EMULATED,
            name="replayed",
            total_memory_bytes=capacity_bytes,
            capacity_bytes=capacity_bytes,
            allocator_conf=conf,
        )
        self.supports_checkpointing = False
        self.tokens_per_sample = None
        self.num_blocks = None
        self.calls: list[int] = []

    def outcome(self, micro_batch: int) -> StepOutcome:
        trace = self.trace(micro_batch)
        replayed = replay_encoded(trace, self.device_info.capacity_bytes, self.config)
        return StepOutcome(
            micro_batch=micro_batch,
            fits=replayed.fits,
            peak_bytes=replayed.stats.peak_reserved_bytes,
            series=(replayed.stats.peak_allocated_bytes,) if replayed.fits else None,
            allocations=trace if replayed.fits else None,
        )

    def warm_up(self, *, checkpointing: bool) -> StepOutcome:
        return self.outcome(1)

    def check_stop(self) -> None:
        pass

    def trial(
        self,
        micro_batch: int,
        accumulation_steps: int = 1,
        *,
        checkpointing: bool,
        checkpointed_blocks: int | None = None,
    ) -> StepOutcome:
        self.calls.append(micro_batch)
        return self.outcome(micro_batch)

    def measure(
        self,
        micro_batch: int,
        accumulation_steps: int,
        *,
        checkpointing: bool,
        target_seconds: float,
        checkpointed_blocks: int | None = None,
    ) -> Measurement | None:
        raise AssertionError("a probe measures nothing")

    def fit_points(self, *, checkpointing: bool) -> list[StepOutcome]:
        """Traced: the same steps, never counted as trials."""
        return [self.outcome(2), self.outcome(3)]

    def largest_fitting(self) -> int:
        return max(b for b in range(1, 65) if self.outcome(b).fits)


def _probe_with_expandable(
    trace: Callable[[int], tuple[int, ...]], capacity_bytes: int
) -> tuple[ReplayedSession, ReplayedSession, list[ModeProbe]]:
    default = ReplayedSession(trace, capacity_bytes, None)
    expandable = ReplayedSession(trace, capacity_bytes, EXPANDABLE)
    result = probe_session(default, expandable=ExpandableSegments(expandable, expandable))
    return default, expandable, result.modes


def test_expandable_segments_that_raise_the_answer_are_verified_and_recommended() -> None:
    default, expandable, modes = _probe_with_expandable(freed_then_growing, 40 * MiB)
    (mode,) = modes
    assert mode.max_micro_batch == default.largest_fitting() == 16
    option = mode.expandable_segments
    assert option is not None and option.allocator_conf == EXPANDABLE
    assert option.traced_max_micro_batch == option.max_micro_batch == 17
    assert expandable.largest_fitting() == 17
    # The trace was right: verified from both sides in 2 trials.
    assert expandable.calls == [17, 18] and option.trials == 2
    assert option.recommended


def test_expandable_segments_that_lower_the_answer_are_not_recommended() -> None:
    # Two tensors, the first freed, then a larger one: the default allocator's cache fits 44 past
    # a dip (26-39 run out); expandable segments have no dip, which the trace predicts, but
    # stop at 25: verified by trials, not recommended.
    def split_cache(micro_batch: int) -> tuple[int, ...]:
        b = micro_batch
        return (256 * KiB * b, 256 * KiB * b, -1, MiB + 256 * KiB * b)

    default, expandable, modes = _probe_with_expandable(split_cache, 24 * MiB)
    (mode,) = modes
    assert mode.max_micro_batch == 44 and mode.runs_out_below
    option = mode.expandable_segments
    assert option is not None
    assert option.traced_max_micro_batch == option.max_micro_batch == 25
    assert option.runs_out_below == [] and not option.recommended
    assert expandable.calls == [25, 26]


def test_expandable_segments_that_change_nothing_cost_no_trial() -> None:
    def steady(micro_batch: int) -> tuple[int, ...]:
        return (20 * MiB, 2 * MiB * micro_batch)

    default, expandable, modes = _probe_with_expandable(steady, 64 * MiB)
    option = modes[0].expandable_segments
    assert option is not None and option.traced_max_micro_batch is not None
    assert option.traced_max_micro_batch <= modes[0].max_micro_batch
    assert option.max_micro_batch is None and not option.recommended
    assert expandable.calls == []
