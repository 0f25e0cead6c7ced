"""The Optuna throughput study with a synthetic measure function (pure Python, no torch), on a
SQLite file and on the real PostgreSQL (tests/conftest.py: `sqlite_url`, and `postgres_url`, a
fresh schema dropped afterwards)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections import Counter

import optuna
import pytest

from autotune.core.schemas import Trial, TrialState
from autotune.core.tuning.candidates import Candidate, enumerate_candidates
from autotune.core.tuning.throughput import Measurement
from autotune.engine.study import (
    CHECKPOINTING_PARAM,
    CONSTRAINTS_SYSTEM_ATTR,
    micro_batch_param,
    run_study,
)

# 8 candidates without checkpointing (divisors of 48 up to 16), 10 with (up to 48).
CANDIDATES = enumerate_candidates(48, 1, {False: 16, True: 48})
OOM_WITHOUT_CHECKPOINTING_ABOVE = 8


class SyntheticGpu:
    """Deterministic samples/s: grows with the micro-batch, declines past 12; checkpointing
    costs 10%, a little per accumulation step. Without checkpointing, micro-batches above 8
    run out of memory, so the best is checkpointing at micro-batch 24. Counts how often each
    candidate is measured."""

    def __init__(self) -> None:
        self.calls: Counter[Candidate] = Counter()

    def samples_per_s(self, c: Candidate) -> float:
        b = c.micro_batch
        rate = 100.0 * b / (b + 4.0) - (0.5 * (b - 12) if b > 12 else 0.0)
        return rate * (0.9 if c.checkpointing else 1.0) - 0.1 * c.accumulation_steps

    def measure(self, c: Candidate) -> Measurement | None:
        self.calls[c] += 1
        if not c.checkpointing and c.micro_batch > OOM_WITHOUT_CHECKPOINTING_ABOVE:
            return None
        rate = self.samples_per_s(c)
        samples_per_step = c.micro_batch * c.accumulation_steps
        return Measurement(
            samples_per_s=rate,
            tokens_per_s=rate * 64,
            step_time_s=samples_per_step / rate,
            step_time_spread=0.01,
            timed_steps=5,
            peak_bytes=1000 * c.micro_batch,
        )

    def best(self) -> Candidate:
        feasible = [c for c in CANDIDATES if self.measure(c) is not None]
        return max(feasible, key=self.samples_per_s)


def _unique_name() -> str:
    return f"autotune-test-{uuid.uuid4().hex}"


def _key(trial: Trial) -> tuple[int, int, bool]:
    return trial.micro_batch, trial.accumulation_steps, trial.checkpointing


def _candidate(trial: Trial) -> Candidate:
    return Candidate(trial.micro_batch, trial.accumulation_steps, trial.checkpointing)


def test_small_grid_is_measured_exhaustively_once_each(sqlite_url: str) -> None:
    gpu = SyntheticGpu()
    trials = run_study(
        CANDIDATES, gpu.measure, storage_url=sqlite_url, study_name="exhaustive", n_trials=30
    )
    assert len(CANDIDATES) == 18
    assert sorted(map(_candidate, trials), key=str) == sorted(CANDIDATES, key=str)
    assert set(gpu.calls.values()) == {1}
    assert [t.number for t in trials] == list(range(18))
    complete = [t for t in trials if t.state is TrialState.COMPLETE]
    best = max(complete, key=lambda t: t.samples_per_s or 0.0)
    assert _candidate(best) == gpu.best() == Candidate(24, 2, True)
    # The stored study says the same: one trial per candidate, the same best.
    study = optuna.load_study(study_name="exhaustive", storage=sqlite_url)
    assert len(study.trials) == 18
    assert study.best_trial.user_attrs["micro_batch"] == 24
    assert study.best_trial.params == {CHECKPOINTING_PARAM: True, micro_batch_param(True): 24}


@pytest.mark.e2e
def test_out_of_memory_is_recorded_as_an_infeasible_trial(sqlite_url: str) -> None:
    gpu = SyntheticGpu()
    trials = run_study(
        CANDIDATES, gpu.measure, storage_url=sqlite_url, study_name="oom", n_trials=18
    )
    oom = {_key(t) for t in trials if t.state is TrialState.OOM}
    assert oom == {(12, 4, False), (16, 3, False)}
    for trial in trials:
        if trial.state is TrialState.OOM:
            assert trial.samples_per_s is None
            assert trial.timed_steps == 0
        else:
            assert trial.samples_per_s == pytest.approx(gpu.samples_per_s(_candidate(trial)))
            assert trial.peak_bytes == 1000 * trial.micro_batch
            assert trial.timed_steps == 5
    study = optuna.load_study(study_name="oom", storage=sqlite_url)
    for frozen in study.trials:
        assert frozen.state is optuna.trial.TrialState.COMPLETE
        is_oom = (frozen.user_attrs["micro_batch"], frozen.params[CHECKPOINTING_PARAM]) in {
            (12, False),
            (16, False),
        }
        # Where optuna-dashboard reads constraints (a list under "constraints"), and Optuna too.
        assert frozen.system_attrs[CONSTRAINTS_SYSTEM_ATTR] == [1.0 if is_oom else 0.0]
        assert list(frozen.constraints.values()) == [1.0 if is_oom else 0.0]
        if is_oom:
            assert frozen.value == 0.0
        else:
            candidate = Candidate(
                frozen.user_attrs["micro_batch"],
                frozen.user_attrs["accumulation_steps"],
                frozen.params[CHECKPOINTING_PARAM],
            )
            assert frozen.value == pytest.approx(gpu.samples_per_s(candidate))
    assert list(study.best_trial.constraints.values()) == [0.0]


def test_budget_below_grid_measures_distinct_candidates_within_budget(sqlite_url: str) -> None:
    gpu = SyntheticGpu()
    trials = run_study(
        CANDIDATES, gpu.measure, storage_url=sqlite_url, study_name="budget", n_trials=7
    )
    assert len(trials) == 7
    assert len({_key(t) for t in trials}) == 7
    assert sum(gpu.calls.values()) == 7
    assert set(gpu.calls.values()) == {1}
    assert [t.number for t in trials] == sorted(t.number for t in trials)


def test_repeated_proposals_reuse_the_measurement(sqlite_url: str) -> None:
    """Five candidates, budget four: TPE's random start-up proposes repeats; each reuses the
    stored result instead of measuring again."""
    gpu = SyntheticGpu()
    small = enumerate_candidates(8, 1, {False: 8, True: 1})
    assert len(small) == 5
    trials = run_study(small, gpu.measure, storage_url=sqlite_url, study_name="re", n_trials=4)
    assert len(trials) == 4
    assert set(gpu.calls.values()) == {1}
    study = optuna.load_study(study_name="re", storage=sqlite_url)
    reused = [t for t in study.trials if "reused_from_trial" in t.user_attrs]
    assert reused, "seed 0 makes TPE repeat itself here; the reuse path must be exercised"
    by_number = {t.number: t for t in study.trials}
    for trial in reused:
        original = by_number[trial.user_attrs["reused_from_trial"]]
        assert trial.params == original.params
        assert trial.value == original.value
        assert "reused_from_trial" not in original.user_attrs
    assert {t.number for t in trials}.isdisjoint(t.number for t in reused)


def _sequence(url: str, seed: int, n_trials: int) -> list[tuple[int, int, bool]]:
    trials = run_study(
        CANDIDATES,
        SyntheticGpu().measure,
        storage_url=url,
        study_name=_unique_name(),
        n_trials=n_trials,
        seed=seed,
    )
    return [_key(t) for t in trials]


@pytest.mark.parametrize("n_trials", [8, 30])
@pytest.mark.e2e
def test_same_seed_same_trials(sqlite_url: str, n_trials: int) -> None:
    first = _sequence(sqlite_url, 3, n_trials)
    assert _sequence(sqlite_url, 3, n_trials) == first
    assert _sequence(sqlite_url, 4, n_trials) != first


def test_progress_sees_every_measurement_in_order(sqlite_url: str) -> None:
    seen: list[Trial] = []
    trials = run_study(
        CANDIDATES,
        SyntheticGpu().measure,
        storage_url=sqlite_url,
        study_name="progress",
        n_trials=5,
        progress=seen.append,
    )
    assert seen == trials


def test_stores_accumulation_and_measurement_details(sqlite_url: str) -> None:
    run_study(
        CANDIDATES, SyntheticGpu().measure, storage_url=sqlite_url, study_name="attrs", n_trials=3
    )
    for frozen in optuna.load_study(study_name="attrs", storage=sqlite_url).trials:
        b = frozen.user_attrs["micro_batch"]
        assert frozen.params[micro_batch_param(frozen.params[CHECKPOINTING_PARAM])] == b
        assert frozen.user_attrs["accumulation_steps"] * b == 48
        if not frozen.user_attrs.get("oom"):
            assert frozen.user_attrs["step_time_s"] > 0
            assert frozen.value is not None
            assert frozen.user_attrs["tokens_per_s"] == pytest.approx(frozen.value * 64)


def test_measure_errors_propagate_and_mark_the_trial_failed(sqlite_url: str) -> None:
    def broken(_: Candidate) -> Measurement | None:
        raise RuntimeError("driver fell over")

    with pytest.raises(RuntimeError, match="driver fell over"):
        run_study(CANDIDATES, broken, storage_url=sqlite_url, study_name="broken", n_trials=3)
    study = optuna.load_study(study_name="broken", storage=sqlite_url)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.FAIL]


def test_a_failed_study_leaves_no_waiting_trial(sqlite_url: str) -> None:
    def broken(_: Candidate) -> Measurement | None:
        raise RuntimeError("driver fell over")

    first = CANDIDATES[:3]  # enqueued: the first runs and fails, two never run
    with pytest.raises(RuntimeError, match="driver fell over"):
        run_study(
            CANDIDATES, broken, storage_url=sqlite_url, study_name="b", n_trials=3, first=first
        )
    study = optuna.load_study(study_name="b", storage=sqlite_url)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.FAIL] * 3


def test_refuses_an_existing_study_name_and_bad_arguments(sqlite_url: str) -> None:
    gpu = SyntheticGpu()
    run_study(CANDIDATES, gpu.measure, storage_url=sqlite_url, study_name="once", n_trials=1)
    with pytest.raises(optuna.exceptions.DuplicatedStudyError):
        run_study(CANDIDATES, gpu.measure, storage_url=sqlite_url, study_name="once", n_trials=1)
    with pytest.raises(ValueError, match="no candidates"):
        run_study([], gpu.measure, storage_url=sqlite_url, study_name="x", n_trials=1)
    with pytest.raises(ValueError, match="n_trials"):
        run_study(CANDIDATES, gpu.measure, storage_url=sqlite_url, study_name="y", n_trials=0)
    with pytest.raises(ValueError, match="duplicate"):
        run_study(
            [CANDIDATES[0], CANDIDATES[0]],
            gpu.measure,
            storage_url=sqlite_url,
            study_name="z",
            n_trials=1,
        )


def test_single_mode_single_candidate(sqlite_url: str) -> None:
    trials = run_study(
        [Candidate(4, 2, False)],
        SyntheticGpu().measure,
        storage_url=sqlite_url,
        study_name="one",
        n_trials=5,
    )
    assert [(_key(t), t.state) for t in trials] == [((4, 2, False), TrialState.COMPLETE)]


@pytest.mark.parametrize("n_trials", [6, 30])
@pytest.mark.e2e
def test_postgresql_storage(postgres_url: str, n_trials: int) -> None:
    name = _unique_name()
    gpu = SyntheticGpu()
    try:
        trials = run_study(
            CANDIDATES, gpu.measure, storage_url=postgres_url, study_name=name, n_trials=n_trials
        )
        expected = min(n_trials, len(CANDIDATES))
        assert len(trials) == expected
        assert len({_key(t) for t in trials}) == expected
        assert sum(gpu.calls.values()) == expected
        summaries = optuna.get_all_study_summaries(storage=postgres_url)
        assert name in {s.study_name for s in summaries}
        study = optuna.load_study(study_name=name, storage=postgres_url)
        assert study.direction is optuna.study.StudyDirection.MAXIMIZE
        if n_trials >= len(CANDIDATES):
            assert study.best_trial.user_attrs["micro_batch"] == gpu.best().micro_batch
    finally:
        optuna.delete_study(study_name=name, storage=postgres_url)
    names = {s.study_name for s in optuna.get_all_study_summaries(storage=postgres_url)}
    assert name not in names


def test_study_candidates_and_exports_import_without_torch() -> None:
    code = (
        "import sys, autotune.engine.study, autotune.core.tuning.candidates, "
        "autotune.core.exports, autotune.core.tuning.throughput; sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
