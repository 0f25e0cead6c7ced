"""The throughput search: one Optuna study per tuning run, maximising samples/s over the
candidates, in RDB storage (SQLite file or PostgreSQL) that `optuna-dashboard` can open.

Search space (define-by-run): `checkpointing` (categorical), then the micro-batch among that
mode's candidates, as `micro_batch_ckpt_off` / `micro_batch_ckpt_on` (two names because an
Optuna categorical parameter must keep one set of choices within a study). The accumulation
steps follow from the micro-batch and are stored as a user attribute.

Out-of-memory is a value here, not an exception: `measure` returns None. Such a trial is a
COMPLETE Optuna trial with the constraint 1.0 (infeasible; feasible trials get 0.0) and
objective value 0.0 samples/s. Why 0.0: a configuration that cannot run delivers nothing, and
the value is finite, so every sampler and the dashboard plots accept it; TPE ranks infeasible
trials by their constraint anyway, below every feasible one.

Sampling: BruteForceSampler when there are no more candidates than trials (each candidate once),
else a seeded TPESampler. A candidate is never measured twice: when TPE proposes one already
measured, the trial reuses the stored result (user attribute `reused_from_trial`), costs no
budget and is not returned; after a few such repeats in a row an unmeasured candidate, picked
with the seed, is enqueued so the search keeps moving.

A study that stops on an exception leaves no trial WAITING: the candidates it had enqueued and
never ran are marked FAIL, so that the study's record ends where the search did.
"""

from __future__ import annotations

import logging
import random
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import optuna

from autotune.core.schemas import Trial, TrialState
from autotune.core.tuning.candidates import Candidate
from autotune.core.tuning.throughput import Measurement

logger = logging.getLogger(__name__)

CHECKPOINTING_PARAM = "checkpointing"
# The list-format system attribute of constraints: the one optuna-dashboard shows (it reads
# only this key) and Optuna 5 still reads (`Trial.set_constraint` writes "constraints:NAME",
# which the dashboard does not show).
CONSTRAINTS_SYSTEM_ATTR = "constraints"
OOM_VALUE_SAMPLES_PER_S = 0.0
# Consecutive proposals of already-measured candidates before one is forced.
MAX_REPEATS_IN_A_ROW = 3


def micro_batch_param(checkpointing: bool) -> str:
    """The Optuna parameter holding the micro-batch for one checkpointing mode."""
    return "micro_batch_ckpt_on" if checkpointing else "micro_batch_ckpt_off"


@dataclass
class _Measured:
    number: int
    measurement: Measurement | None  # None: out of memory


class _Tuning:
    """State of one run: the space, the cache of measurements and the budget."""

    def __init__(
        self,
        candidates: list[Candidate],
        measure: Callable[[Candidate], Measurement | None],
        budget: int,
        seed: int,
        progress: Callable[[Trial], None] | None,
        refine: Callable[[Candidate], Candidate] | None = None,
    ) -> None:
        self.refine = refine
        self.by_key = {(c.checkpointing, c.micro_batch): c for c in candidates}
        if len(self.by_key) != len(candidates):
            raise ValueError("duplicate (checkpointing, micro_batch) among the candidates")
        self.micro_batches = {
            mode: sorted(b for ckpt, b in self.by_key if ckpt is mode)
            for mode in sorted({c.checkpointing for c in candidates})
        }
        self.measure = measure
        self.budget = budget
        self.progress = progress
        self.cache: dict[Candidate, _Measured] = {}
        self.trials: list[Trial] = []
        self.repeats_in_a_row = 0
        self.rng = random.Random(seed)

    def objective(self, trial: optuna.Trial) -> float:
        checkpointing = trial.suggest_categorical(CHECKPOINTING_PARAM, list(self.micro_batches))
        assert isinstance(checkpointing, bool)
        micro_batch = trial.suggest_categorical(
            micro_batch_param(checkpointing), self.micro_batches[checkpointing]
        )
        assert isinstance(micro_batch, int)
        candidate = self.by_key[(checkpointing, micro_batch)]
        trial.set_user_attr("micro_batch", candidate.micro_batch)
        trial.set_user_attr("accumulation_steps", candidate.accumulation_steps)

        cached = self.cache.get(candidate)
        if cached is not None:
            trial.set_user_attr("reused_from_trial", cached.number)
            self.repeats_in_a_row += 1
            return _record(trial, cached.measurement)

        self.repeats_in_a_row = 0
        measured = self.refine(candidate) if self.refine is not None else candidate
        if measured.checkpointed_blocks is not None:
            trial.set_user_attr("checkpointed_blocks", measured.checkpointed_blocks)
        if measured.allocator_conf is not None:
            trial.set_user_attr("allocator_conf", measured.allocator_conf)
        measurement = self.measure(measured)
        self.cache[candidate] = _Measured(trial.number, measurement)
        record = _trial_record(trial.number, measured, measurement)
        self.trials.append(record)
        logger.info(
            "trial %d: b=%d G=%d ckpt=%s -> %s",
            trial.number,
            candidate.micro_batch,
            candidate.accumulation_steps,
            candidate.checkpointing,
            "out of memory" if measurement is None else f"{measurement.samples_per_s:.1f} s/s",
        )
        if self.progress is not None:
            self.progress(record)
        return _record(trial, measurement)

    def after_trial(self, study: optuna.Study, _: optuna.trial.FrozenTrial) -> None:
        if len(self.cache) >= min(self.budget, len(self.by_key)):
            study.stop()
        elif self.repeats_in_a_row >= MAX_REPEATS_IN_A_ROW:
            unmeasured = [c for c in self.by_key.values() if c not in self.cache]
            forced = self.rng.choice(unmeasured)
            logger.debug("sampler keeps repeating measured candidates; enqueueing %s", forced)
            study.enqueue_trial(
                {
                    CHECKPOINTING_PARAM: forced.checkpointing,
                    micro_batch_param(forced.checkpointing): forced.micro_batch,
                }
            )
            self.repeats_in_a_row = 0


def _set_infeasibility(trial: optuna.Trial, value: float) -> None:
    """The one constraint (> 0: out of memory), where both Optuna and the dashboard read it."""
    trial.storage.set_trial_system_attr(trial._trial_id, CONSTRAINTS_SYSTEM_ATTR, [value])


def _record(trial: optuna.Trial, measurement: Measurement | None) -> float:
    """Store the measurement on the Optuna trial; return the objective value."""
    if measurement is None:
        _set_infeasibility(trial, 1.0)
        trial.set_user_attr("oom", True)
        return OOM_VALUE_SAMPLES_PER_S
    _set_infeasibility(trial, 0.0)
    fields = asdict(measurement)
    objective = fields.pop("samples_per_s")
    for key, value in fields.items():
        trial.set_user_attr(key, value)
    assert isinstance(objective, float)
    return objective


def _trial_record(number: int, candidate: Candidate, measurement: Measurement | None) -> Trial:
    state = TrialState.OOM if measurement is None else TrialState.COMPLETE
    measured = {} if measurement is None else asdict(measurement)
    return Trial.model_validate(
        {**asdict(candidate), **measured, "number": number, "state": state}
    )


def _fail_waiting(study: optuna.Study) -> None:
    """Marks FAIL the enqueued trials that never ran (a study that stopped on an exception)."""
    waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    for frozen in waiting:
        study._storage.set_trial_state_values(frozen._trial_id, optuna.trial.TrialState.FAIL)


def create_storage(storage_url: str) -> optuna.storages.RDBStorage:
    """Optuna's storage at `storage_url`, its tables made if they are not there yet. Studies
    tuned at once in several processes (`autotune.engine.layout_processes`) need it made once
    before they start: each making the tables at once would race."""
    return optuna.storages.RDBStorage(storage_url)


def run_study(
    candidates: list[Candidate],
    measure: Callable[[Candidate], Measurement | None],
    *,
    storage_url: str,
    study_name: str,
    n_trials: int,
    seed: int = 0,
    first: list[Candidate] | None = None,
    progress: Callable[[Trial], None] | None = None,
    refine: Callable[[Candidate], Candidate] | None = None,
) -> list[Trial]:
    """Measure up to `n_trials` distinct candidates, chosen by Optuna, maximising samples/s.

    Args:
        candidates: The search space; distinct (checkpointing, micro_batch) pairs.
        measure: Runs one candidate; returns None when it ran out of memory. Any exception
            it raises marks the Optuna trial FAIL and propagates.
        storage_url: SQLAlchemy URL of the Optuna storage, e.g. `sqlite:///tune.db` or
            `postgresql+psycopg://127.0.0.1:5432/test`.
        study_name: A new study's name; an existing study of that name is an error.
        n_trials: Budget of measurements.
        seed: Seeds the sampler (and the choice of forced candidates).
        first: Candidates to measure before the sampler proposes any (enqueued in order;
            the tuner's prior of what is likely best). They count against the budget.
        progress: Called with each new measurement as soon as it is recorded.
        refine: Completes a candidate the study is about to measure, and what is measured and
            recorded is the completed one (the tuner's partial checkpointing: the fewest blocks
            at which it fits); it costs nothing for candidates never measured.

    Returns:
        One record per measured candidate, in trial order. `number` is the Optuna trial number
        (there are gaps where a trial reused an earlier measurement).

    Raises:
        ValueError: no candidates, duplicate candidates or a budget below 1.
        optuna.exceptions.DuplicatedStudyError: `study_name` already exists in the storage.
    """
    if not candidates:
        raise ValueError("no candidates to measure")
    if n_trials < 1:
        raise ValueError(f"n_trials must be >= 1, got {n_trials}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    search = _Tuning(candidates, measure, n_trials, seed, progress, refine)
    exhaustive = len(candidates) <= n_trials
    with warnings.catch_warnings():
        # BruteForceSampler still carries Optuna's ExperimentalWarning; it is the right tool.
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler: optuna.samplers.BaseSampler = (
            optuna.samplers.BruteForceSampler(seed=seed)
            if exhaustive
            else optuna.samplers.TPESampler(seed=seed)
        )
        storage = create_storage(storage_url)
        try:
            study = optuna.create_study(
                storage=storage, study_name=study_name, sampler=sampler, direction="maximize"
            )
            study.set_user_attr("n_candidates", len(candidates))
            for candidate in (first or [])[:n_trials]:
                study.enqueue_trial(
                    {
                        CHECKPOINTING_PARAM: candidate.checkpointing,
                        micro_batch_param(candidate.checkpointing): candidate.micro_batch,
                    }
                )
            logger.info(
                "study %s: %d candidates, budget %d, %s sampler",
                study_name,
                len(candidates),
                n_trials,
                type(sampler).__name__,
            )
            # Each round either measures a new candidate or repeats one; every
            # MAX_REPEATS_IN_A_ROW repeats force a new one, which bounds the rounds.
            max_rounds = (MAX_REPEATS_IN_A_ROW + 1) * min(n_trials, len(candidates))
            try:
                study.optimize(
                    search.objective, n_trials=max_rounds, callbacks=[search.after_trial]
                )
            except BaseException:
                _fail_waiting(study)
                raise
        finally:
            storage.engine.dispose()
    return search.trials
