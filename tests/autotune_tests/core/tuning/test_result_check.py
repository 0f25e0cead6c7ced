"""Every invariant of `autotune.core.tuning.result_check`, one case each: a valid result broken in
one way is reported, naming the field; the valid result and the real tuner's results pass."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from autotune.core.schemas import AllocatorOption, Spec, TuneResult
from autotune.core.tuning.result_check import check_result, check_trial
from autotune.core.tuning.throughput import Measurement
from autotune.engine.devices.device import EmulatedDevice
from autotune.engine.runner import InProcessRunner
from autotune.engine.tuner import tune, tune_session
from tests.api_tests.factories import (
    attempt,
    cuda_device,
    emulated_device,
    expandable_tune_result,
    tiny_spec,
    trial,
    tune_result,
)
from tests.probes_tests.factories import wide_spec

MIB = 2**20
Data = dict[str, Any]


def _valid() -> TuneResult:
    return tune_result(tiny_spec(), emulated_device())


def _rec(data: Data, **values: object) -> None:
    data["recommendation"].update(values)


def _trial(data: Data, index: int, **values: object) -> None:
    data["trials"][index].update(values)


def _mode(data: Data, index: int, **values: object) -> None:
    data["probe"]["modes"][index].update(values)


def _attempts(data: Data, mode: int) -> list[Data]:
    attempts: list[Data] = data["probe"]["modes"][mode]["attempts"]
    return attempts


def _traced(
    data: Data, mode: int = 0, *, sizes: tuple[int, ...] = (2, 3), **values: object
) -> None:
    """A trace that gave the mode's search its first fit (`autotune.engine.fit_points`)."""
    points = [{"micro_batch": b, "fits": True, "peak_bytes": 1000 * b} for b in sizes]
    traced = {"predicted_max_micro_batch": 4, "fit_points": points, **values}
    data["probe"]["modes"][mode]["traced"] = traced


def _no_recommendation(data: Data) -> None:
    data["recommendation"] = None
    data["exports"] = None


def _no_answer_at_all(data: Data) -> None:
    _no_recommendation(data)
    data["trials"] = []


CAPACITY = emulated_device().capacity_bytes


def _trial_in_a_mode_never_probed(data: Data) -> None:
    data["probe"]["modes"].pop(1)
    _trial(data, 0, checkpointing=True)


def _recommended_over_the_headroom(data: Data) -> None:
    _trial(data, 1, peak_bytes=CAPACITY)
    _rec(data, peak_bytes=CAPACITY)


# (what is broken, how, the field that must be named)
BROKEN: list[tuple[str, Callable[[Data], object], str]] = [
    # The defects of issue 8 (7), as a worker token could post them.
    ("global batch 999", lambda d: _rec(d, global_batch=999), "recommendation.global_batch"),
    (
        "3 x 5 = 15 for target 32",
        lambda d: _rec(d, micro_batch=3, accumulation_steps=5, global_batch=15),
        "recommendation.global_batch",
    ),
    ("world size 7 for a spec of 1", lambda d: _rec(d, world_size=7), "recommendation.world_size"),
    (
        "a micro-batch far above the probe's max",
        lambda d: _trial(d, 1, micro_batch=10**6, accumulation_steps=1),
        "trials[1].micro_batch",
    ),
    (
        "peak above capacity",
        lambda d: _rec(d, peak_bytes=CAPACITY + 1),
        "recommendation.peak_bytes",
    ),
    ("no recommendation although trials completed", _no_recommendation, "recommendation"),
    ("no recommendation and nothing measured", _no_answer_at_all, "recommendation"),
    ("no recommendation and no reason", _no_recommendation, "infeasible"),
    (
        "probe on another device",
        lambda d: d["probe"]["device"].update(name="other"),
        "probe.device",
    ),
    # The spec.
    ("another spec", lambda d: d["spec"]["training"].update(seq_len=65), "spec"),
    # The probe, per mode.
    ("no modes", lambda d: d["probe"].update(modes=[]), "probe.modes"),
    (
        "modes out of order",
        lambda d: d["probe"].update(modes=d["probe"]["modes"][::-1]),
        "probe.modes[0].checkpointing",
    ),
    (
        "max above the cap",
        lambda d: _mode(d, 1, max_micro_batch=2000),
        "probe.modes[1].max_micro_batch",
    ),
    ("capped below the cap", lambda d: _mode(d, 0, capped=True), "probe.modes[0].capped"),
    (
        "recommended above the max",
        lambda d: _mode(d, 0, recommended_micro_batch=9),
        "probe.modes[0].recommended_micro_batch",
    ),
    (
        "accumulating above the recommended",
        lambda d: _mode(d, 0, accumulating_micro_batch=9),
        "probe.modes[0].accumulating_micro_batch",
    ),
    (
        "a size tried twice",
        lambda d: _attempts(d, 0).append(attempt(8, True).model_dump(mode="json")),
        "probe.modes[0].attempts[4].micro_batch",
    ),
    (
        "allocated above reserved",
        lambda d: _attempts(d, 0)[0].update(
            peak_allocated_bytes=_attempts(d, 0)[0]["peak_bytes"] + 1
        ),
        "probe.modes[0].attempts[0].peak_allocated_bytes",
    ),
    (
        "an attempt above the cap",
        lambda d: _attempts(d, 1).append(attempt(2000, False).model_dump(mode="json")),
        "probe.modes[1].attempts[2].micro_batch",
    ),
    (
        "a fitting size above the max",
        lambda d: _attempts(d, 1).append(attempt(24, True).model_dump(mode="json")),
        "probe.modes[1].attempts[2].fits",
    ),
    (
        "an out-of-memory size below the max, not listed as a dip",
        lambda d: _attempts(d, 0)[0].update(fits=False),
        "probe.modes[0].attempts[0].fits",
    ),
    (
        "a fitting size listed as a dip",
        lambda d: d["probe"]["modes"][0].update(
            runs_out_below=[_attempts(d, 0)[0]["micro_batch"]]
        ),
        "probe.modes[0].attempts[0].fits",
    ),
    (
        "a dip at the max",
        lambda d: d["probe"]["modes"][0].update(
            runs_out_below=[d["probe"]["modes"][0]["max_micro_batch"]]
        ),
        "probe.modes[0].runs_out_below",
    ),
    (
        "a fitting attempt above capacity",
        lambda d: _attempts(d, 0)[0].update(peak_bytes=CAPACITY + 1),
        "probe.modes[0].attempts[0].peak_bytes",
    ),
    (
        "an out-of-memory phase on a fitting attempt",
        lambda d: _attempts(d, 0)[0].update(oom_phase="forward"),
        "probe.modes[0].attempts[0].oom_phase",
    ),
    ("max not certified", lambda d: _attempts(d, 0).pop(2), "probe.modes[0].max_micro_batch"),
    ("max + 1 not certified", lambda d: _attempts(d, 0).pop(3), "probe.modes[0].max_micro_batch"),
    # The trials.
    ("trial numbers not increasing", lambda d: _trial(d, 1, number=0), "trials[1].number"),
    (
        "a candidate measured twice",
        lambda d: d["trials"].insert(0, {**d["trials"][1], "number": 0}),
        "trials[2].micro_batch",
    ),
    (
        "a trial off the target",
        lambda d: _trial(d, 0, accumulation_steps=5),
        "trials[0].accumulation_steps",
    ),
    (
        "a trial in a mode never probed",
        _trial_in_a_mode_never_probed,
        "trials[0].checkpointing",
    ),
    (
        "an accumulating trial above the accumulating max",
        lambda d: _mode(d, 0, accumulating_micro_batch=2),
        "trials[0].micro_batch",
    ),
    ("a failed trial", lambda d: _trial(d, 0, state="failed"), "trials[0].state"),
    (
        "throughput without completing",
        lambda d: _trial(d, 0, state="oom"),
        "trials[0].samples_per_s",
    ),
    (
        "samples/s that the step time does not give",
        lambda d: _trial(d, 0, step_time_s=1.0),
        "trials[0].samples_per_s",
    ),
    (
        "a complete trial without peak",
        lambda d: _trial(d, 0, peak_bytes=None),
        "trials[0].peak_bytes",
    ),
    (
        "a trial above capacity",
        lambda d: _trial(d, 0, peak_bytes=CAPACITY + 1),
        "trials[0].peak_bytes",
    ),
    # A traced fit: a prediction the search verified, from two distinct fitting steps.
    (
        "a traced prediction above the cap",
        lambda d: _traced(d, predicted_max_micro_batch=10**6),
        "probe.modes[0].traced.predicted_max_micro_batch",
    ),
    ("one traced fit point", lambda d: _traced(d, sizes=(2,)), "probe.modes[0].traced.fit_points"),
    (
        "a traced fit point at 1",
        lambda d: _traced(d, 1, sizes=(1, 3)),
        "probe.modes[1].traced.fit_points",
    ),
    (
        "a traced fit point that ran out",
        lambda d: _traced(
            d,
            fit_points=[
                {"micro_batch": 2, "fits": True, "peak_bytes": 1},
                {"micro_batch": 3, "fits": False, "peak_bytes": 1},
            ],
        ),
        "probe.modes[0].traced.fit_points",
    ),
    # The answer.
    (
        "not the fastest",
        lambda d: _trial(d, 0, samples_per_s=320.0, step_time_s=0.1, tokens_per_s=None),
        "recommendation",
    ),
    (
        "over the headroom while a trial within it exists",
        _recommended_over_the_headroom,
        "recommendation",
    ),
    ("numbers not its trial's", lambda d: _rec(d, tokens_per_s=1.0), "recommendation"),
    (
        "a configuration never measured",
        lambda d: _rec(d, micro_batch=2, accumulation_steps=16),
        "recommendation",
    ),
    (
        "capacity not the device's",
        lambda d: _rec(d, capacity_bytes=1),
        "recommendation.capacity_bytes",
    ),
    ("infeasible and recommended", lambda d: d.update(infeasible={"reason": "x"}), "infeasible"),
    ("no exports", lambda d: d.update(exports=None), "exports"),
    (
        "exports that say otherwise",
        lambda d: d["exports"]["hf"].update(per_device_train_batch_size=16),
        "exports.hf.per_device_train_batch_size",
    ),
    (
        "exports with a bool for a number",
        lambda d: d["exports"]["deepspeed"].update(gradient_accumulation_steps=True),
        "exports.deepspeed.gradient_accumulation_steps",
    ),
    (
        "exports without a recommendation",
        lambda d: d.update(recommendation=None, infeasible={"reason": "x"}),
        "exports",
    ),
]


def test_a_valid_result_passes() -> None:
    assert check_result(tiny_spec(), _valid()) == []
    data = _valid().model_dump(mode="json")
    _traced(data, 0)
    _traced(data, 1, predicted_max_micro_batch=0)  # a trace may miss: the trials decide
    assert check_result(tiny_spec(), TuneResult.model_validate(data)) == []
    gpu_result = tune_result(tiny_spec(), cuda_device())
    assert check_result(tiny_spec(), gpu_result) == []


@pytest.mark.parametrize(
    ("mutate", "field"), [(m, f) for _, m, f in BROKEN], ids=[name for name, _, _ in BROKEN]
)
def test_each_broken_invariant_is_named(mutate: Callable[[Data], object], field: str) -> None:
    data = _valid().model_dump(mode="json")
    mutate(data)
    result = TuneResult.model_validate(data)

    violations = check_result(tiny_spec() if field != "spec" else _valid().spec, result)

    assert field in [v.field for v in violations], violations


# Refused by the schema itself (`autotune.core.schemas.PositiveRate`, byte counts >= 0): no
# result holding them can even be read.
IMPOSSIBLE_NUMBERS: list[tuple[str, Callable[[Data], object], str]] = [
    ("negative samples/s", lambda d: _rec(d, samples_per_s=-5.0), "recommendation.samples_per_s"),
    ("negative peak", lambda d: _rec(d, peak_bytes=-1), "recommendation.peak_bytes"),
    ("negative trial samples/s", lambda d: _trial(d, 0, samples_per_s=-1.0), "samples_per_s"),
    ("negative tokens/s", lambda d: _trial(d, 0, tokens_per_s=-1.0), "trials.0.tokens_per_s"),
    ("zero step time", lambda d: _trial(d, 0, step_time_s=0.0), "trials.0.step_time_s"),
    ("negative timed steps", lambda d: _trial(d, 0, timed_steps=-99), "trials.0.timed_steps"),
    ("negative spread", lambda d: _trial(d, 0, step_time_spread=-1.0), "step_time_spread"),
    ("negative trial peak", lambda d: _trial(d, 0, peak_bytes=-5), "trials.0.peak_bytes"),
]


@pytest.mark.parametrize(
    ("mutate", "field"),
    [pytest.param(m, f, id=name) for name, m, f in IMPOSSIBLE_NUMBERS],
)
def test_impossible_numbers_are_refused_by_the_schema(
    mutate: Callable[[Data], object], field: str
) -> None:
    data = _valid().model_dump(mode="json")
    mutate(data)
    with pytest.raises(ValidationError, match=re.escape(field)):
        TuneResult.model_validate(data)


def test_a_size_below_the_max_that_runs_out_passes_when_listed_as_a_dip() -> None:
    data = _valid().model_dump(mode="json")
    first = _attempts(data, 0)[0]
    assert first["micro_batch"] < data["probe"]["modes"][0]["max_micro_batch"]
    first.update(fits=False, peak_bytes=CAPACITY + 1)
    data["probe"]["modes"][0]["runs_out_below"] = [first["micro_batch"]]
    result = TuneResult.model_validate(data)
    # The recommendation (plain, above it) lists it, and so do its exports.
    assert [v.field for v in check_result(tiny_spec(), result)] == [
        "recommendation.runs_out_below"
    ]
    _rec(data, runs_out_below=[first["micro_batch"]])
    data["exports"]["runs_out_below"] = [first["micro_batch"]]
    assert check_result(tiny_spec(), TuneResult.model_validate(data)) == []


def test_a_spec_without_target_is_answered_by_the_probe_alone() -> None:
    spec = Spec.model_validate({"model": {"preset": "gpt2-tiny"}, "training": {"seq_len": 64}})
    tuned = tune_result(spec, emulated_device())
    fields = [v.field for v in check_result(spec, tuned)]
    assert {"trials", "recommendation", "exports"} <= set(fields)
    probe_only = tuned.model_copy(
        update={"trials": [], "recommendation": None, "infeasible": None, "exports": None}
    )
    assert check_result(spec, probe_only) == []


def test_a_result_for_a_spec_that_was_not_tuned_is_named() -> None:
    other = tiny_spec(seq_len=128)
    assert [v.field for v in check_result(other, _valid())] == ["spec"]


@settings(
    max_examples=3,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    target=st.integers(min_value=1, max_value=48),
    world_size=st.sampled_from([1, 2]),
    memory_mib=st.sampled_from([3, 4, 6]),
)
def test_the_real_tuners_results_pass(
    tmp_path: Path, target: int, world_size: int, memory_mib: int
) -> None:
    spec = wide_spec(features=16, target_global_batch=target, max_micro_batch=64)
    spec = spec.model_copy(
        update={"training": spec.training.model_copy(update={"world_size": world_size})}
    )
    store = tmp_path / f"tune-{target}-{world_size}-{memory_mib}.db"
    store.unlink(missing_ok=True)

    # tune() itself raises on a violation; checked again here so the test says what it proves.
    result = tune(
        spec,
        EmulatedDevice(memory_mib * MIB),
        storage_url=f"sqlite:///{store}",
        n_trials=2,
        target_seconds=0.01,
    )

    assert check_result(spec, result) == []


class _NegativeClock(InProcessRunner):
    """A runner whose throughput comes out negative, as a broken timer would make it."""

    def measure(
        self,
        micro_batch: int,
        accumulation_steps: int,
        *,
        checkpointing: bool,
        target_seconds: float,
        checkpointed_blocks: int | None = None,
    ) -> Measurement | None:
        measured = super().measure(
            micro_batch,
            accumulation_steps,
            checkpointing=checkpointing,
            target_seconds=target_seconds,
            checkpointed_blocks=checkpointed_blocks,
        )
        if measured is None:
            return None
        return dataclasses.replace(measured, samples_per_s=-measured.samples_per_s)


def test_the_tuner_raises_on_a_result_that_breaks_an_invariant(tmp_path: Path) -> None:
    spec = wide_spec(features=16, target_global_batch=8, max_micro_batch=8)
    session = _NegativeClock(spec, EmulatedDevice(6 * MIB))
    # Refused where the trial is made (a rate must be > 0), else by the tuner's own check.
    with pytest.raises((AssertionError, ValidationError), match=r"samples_per_s"):
        tune_session(
            session,
            storage_url=f"sqlite:///{tmp_path / 'tune.db'}",
            n_trials=1,
            target_seconds=0.01,
        )


# ---------------------------------------------------------------------------------------------
# Trials under expandable segments: where only they fit a micro-batch, within their limits.

EXPANDABLE = "expandable_segments:True"


def _with_expandable_segments() -> TuneResult:
    return expandable_tune_result(tiny_spec(), emulated_device())


def _option(data: Data, **values: object) -> None:
    data["probe"]["modes"][0]["expandable_segments"].update(values)


EXPANDABLE_BROKEN: list[tuple[str, Callable[[Data], object], str]] = [
    (
        "under expandable segments where the default allocator fits",
        lambda d: _trial(d, 1, allocator_conf=EXPANDABLE),
        "trials[1].allocator_conf",
    ),
    (
        "under expandable segments above their accumulating limit",
        lambda d: _option(d, accumulating_micro_batch=8),
        "trials[2].allocator_conf",
    ),
    (
        "under expandable segments that were only traced",
        lambda d: _option(
            d,
            max_micro_batch=None,
            recommended_micro_batch=None,
            accumulating_micro_batch=None,
            recommended=False,
        ),
        "trials[2].allocator_conf",
    ),
    (
        "under the default allocator where only expandable segments fit",
        lambda d: _trial(d, 2, allocator_conf=None),
        "trials[2].allocator_conf",
    ),
    (
        "under settings without expandable segments",
        lambda d: _trial(d, 2, allocator_conf="max_split_size_mb:40"),
        "trials[2].allocator_conf",
    ),
    (
        "a recommendation not under its trial's settings",
        lambda d: _rec(d, allocator_conf=None),
        "recommendation.allocator_conf",
    ),
    (
        "exports that do not set the settings",
        lambda d: d["exports"].update(allocator_conf=None),
        "exports.allocator_conf",
    ),
    (
        "an option not the device's settings with expandable segments",
        lambda d: _option(d, allocator_conf="expandable_segments:True,max_split_size_mb:40"),
        "probe.modes[0].expandable_segments.allocator_conf",
    ),
    (
        "an option recommended above its max",
        lambda d: _option(d, recommended_micro_batch=17),
        "probe.modes[0].expandable_segments.recommended_micro_batch",
    ),
    (
        "dips not the settings' own",
        lambda d: _rec(d, runs_out_below=[3]),
        "recommendation.runs_out_below",
    ),
]


def test_a_trial_under_expandable_segments_only_they_fit_passes() -> None:
    result = _with_expandable_segments()
    assert check_result(tiny_spec(), result) == []
    # The same figures measured under the default allocator, where it does not fit 16.
    assert (
        result.trials[-1].allocator_conf,
        result.exports and result.exports.allocator_conf,
    ) == (
        EXPANDABLE,
        EXPANDABLE,
    )


@pytest.mark.parametrize(
    ("mutate", "field"),
    [(m, f) for _, m, f in EXPANDABLE_BROKEN],
    ids=[name for name, _, _ in EXPANDABLE_BROKEN],
)
def test_each_inconsistent_allocator_setting_is_named(
    mutate: Callable[[Data], object], field: str
) -> None:
    data = _with_expandable_segments().model_dump(mode="json")
    mutate(data)
    violations = check_result(tiny_spec(), TuneResult.model_validate(data))
    assert field in [v.field for v in violations], violations


def test_a_default_allocator_trial_holds_for_expandable_segments_that_fit_every_size() -> None:
    data = _valid().model_dump(mode="json")
    _rec(data, allocator_conf=EXPANDABLE)
    data["exports"]["allocator_conf"] = EXPANDABLE
    fields = [v.field for v in check_result(tiny_spec(), TuneResult.model_validate(data))]
    assert fields == ["recommendation.allocator_conf"]
    # Verified to fit every size up to 16 plain, none running out: the 8 x 4 holds for them.
    data["probe"]["modes"][0]["expandable_segments"] = AllocatorOption(
        allocator_conf=EXPANDABLE, max_micro_batch=16, recommended_micro_batch=8, recommended=True
    ).model_dump(mode="json")
    assert check_result(tiny_spec(), TuneResult.model_validate(data)) == []


def test_a_streamed_trial_under_other_settings_is_refused() -> None:
    under = trial(0).model_copy(update={"allocator_conf": "expandable_segments:False"})
    assert [v.field for v in check_trial(tiny_spec(), under, CAPACITY)] == ["trial.allocator_conf"]
    assert (
        check_trial(tiny_spec(), under.model_copy(update={"allocator_conf": EXPANDABLE}), CAPACITY)
        == []
    )
