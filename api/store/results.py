"""What workers store under a lease: streamed attempts and trials, and the final result.

Every function first checks the lease (`api.store.leases.held_run`); under a stale lease nothing is
written. Streamed attempts and trials are checked as a result is
(`autotune.core.tuning.result_check`). The final result is authoritative: it replaces what was
streamed under its lease; its exports are rebuilt here from its recommendation and spec.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from api.errors import InvalidResult, ResultRejected
from api.store.leases import held_run, renew
from api.store.rowmodels import attempt_row, mode_row, target_of, trial_row
from api.store.runstore import create_run
from api.store.tables import AttemptRow, ModeRow, RecommendationRow, RunRow, TrialRow
from autotune.core.exports import build_exports
from autotune.core.schemas import Spec, TuneResult
from autotune.core.tuning.result_check import Violation, check_attempt, check_trial
from autotune.remote.protocol import (
    AttemptEvent,
    EventAck,
    ResultSubmission,
    RunCreate,
    RunStatus,
    TrialEvent,
)


def _check_event(row: RunRow, check: Callable[[Spec, int], list[Violation]]) -> None:
    """Refuse (422 `invalid_result`) an event that breaks what a result would: streamed
    attempts and trials are shown on the run's page before any result arrives, and stay on a
    run that then fails."""
    spec = Spec.model_validate(row.spec)
    capacity_bytes = target_of(row).max_capacity_bytes(spec.training.world_size)
    violations = check(spec, capacity_bytes)
    if violations:
        raise InvalidResult(violations)


def record_attempt(
    session: Session, *, run_id: int, event: AttemptEvent, now: datetime, lease_s: float
) -> EventAck:
    """Store a streamed probe attempt once per (run, lease, sequence); renews the lease.

    Raises:
        RunNotFound, StaleLease, RunCancelled, InvalidResult.
    """
    row = held_run(session, run_id=run_id, lease_id=event.lease_id, now=now)
    _check_event(row, lambda spec, capacity: check_attempt(spec, event.attempt, capacity))
    seen = session.execute(
        select(AttemptRow.id).where(
            AttemptRow.run_id == run_id,
            AttemptRow.lease_id == event.lease_id,
            AttemptRow.sequence == event.sequence,
        )
    ).first()
    if seen is None:
        session.add(
            attempt_row(
                row,
                sequence=event.sequence,
                checkpointing=event.checkpointing,
                attempt=event.attempt,
                now=now,
            )
        )
    return EventAck(stored=seen is None, lease_expires_at=renew(session, row, now, lease_s))


def record_trial(
    session: Session, *, run_id: int, event: TrialEvent, now: datetime, lease_s: float
) -> EventAck:
    """Store a streamed trial once per (run, lease, trial number); renews the lease.

    Raises:
        RunNotFound, StaleLease, RunCancelled, InvalidResult.
    """
    row = held_run(session, run_id=run_id, lease_id=event.lease_id, now=now)
    _check_event(row, lambda spec, capacity: check_trial(spec, event.trial, capacity))
    seen = session.execute(
        select(TrialRow.id).where(
            TrialRow.run_id == run_id,
            TrialRow.lease_id == event.lease_id,
            TrialRow.number == event.trial.number,
        )
    ).first()
    if seen is None:
        session.add(trial_row(row, trial=event.trial, now=now))
    return EventAck(stored=seen is None, lease_expires_at=renew(session, row, now, lease_s))


def _torch_major_minor(version: str | None) -> str | None:
    if not version:
        return None
    return ".".join(version.split("+")[0].split(".")[:2])


def _check_result(row: RunRow, result: TuneResult) -> None:
    if result.spec.model_dump(mode="json") != row.spec:
        raise ResultRejected(f"result.spec: differs from the spec of run {row.id}")
    target = target_of(row)
    if not target.matches(result.device):
        raise ResultRejected(
            f"result.device: {result.device.name} does not match the run's target {target.label}"
        )


def _exports(result: TuneResult) -> dict[str, Any] | None:
    """The exports of `result`'s recommendation, built here from it and the spec: a worker's
    own text (code users paste and run) is never stored; it says only which transformers
    version to write for and whether the loss is per token."""
    sent = result.exports
    if result.recommendation is None or sent is None:
        return None
    exports = build_exports(
        result.recommendation,
        token_model=sent.token_model,
        transformers_version=sent.transformers_version,
        training=result.spec.training,
        device_allocator_conf=result.device.allocator_conf,
    )
    return exports.model_dump(mode="json")


def _store_result(session: Session, row: RunRow, result: TuneResult, now: datetime) -> None:
    """Finish `row` (held under its current lease) with `result`."""
    assert row.lease_id is not None
    lease_id = row.lease_id
    for table in (AttemptRow, TrialRow, ModeRow):
        session.execute(
            delete(table).where(table.run_id == row.id, table.lease_id == lease_id),
            execution_options={"synchronize_session": False},
        )
    sequence = 0
    for mode in result.probe.modes:
        session.add(mode_row(row.id, lease_id=lease_id, mode=mode))
        for attempt in mode.attempts:
            session.add(
                attempt_row(
                    row,
                    sequence=sequence,
                    checkpointing=mode.checkpointing,
                    attempt=attempt,
                    now=now,
                )
            )
            sequence += 1
    for trial in result.trials:
        session.add(trial_row(row, trial=trial, now=now))
    if result.recommendation is not None:
        session.add(RecommendationRow(run_id=row.id, **result.recommendation.model_dump()))
    row.infeasible = result.infeasible.model_dump(mode="json") if result.infeasible else None
    advice = result.probe.fit_advice
    row.fit_advice = advice.model_dump(mode="json") if advice is not None else None
    row.exports = _exports(result)
    row.layouts = [layout.model_dump(mode="json") for layout in result.layouts] or None
    row.worker_device = result.device.model_dump(mode="json")
    row.torch_version = _torch_major_minor(result.device.torch_version)
    row.study_name = result.study_name or row.study_name
    row.status = RunStatus.SUCCEEDED.value
    row.finished_at = now
    row.updated_at = now
    row.lease_expires_at = None


def complete_run(
    session: Session, *, run_id: int, submission: ResultSubmission, now: datetime
) -> None:
    """Finish a run with its result. The result's attempts and trials replace the ones streamed
    under the same lease (the result is authoritative); earlier claims' records stay.

    Raises:
        RunNotFound, StaleLease, RunCancelled, ResultRejected.
    """
    row = held_run(session, run_id=run_id, lease_id=submission.lease_id, now=now)
    _check_result(row, submission.result)
    _store_result(session, row, submission.result, now)


def record_local_run(
    session: Session, *, request: RunCreate, result: TuneResult, version: str, now: datetime
) -> int:
    """Store a tuning run that happened in this process (`autotune tune`) as a finished run
    with one claim, like any worker's; returns its id.

    The run is inserted already finished: it never waits in the queue, so it must not count as
    the unfinished twin of a submission (`ix_autotune_runs_unfinished_fingerprint`).
    """
    row = create_run(
        session, request=request, version=version, now=now, status=RunStatus.SUCCEEDED
    )
    row.lease_id = secrets.token_hex(16)
    row.claim_count = 1
    row.started_at = now
    _check_result(row, result)
    _store_result(session, row, result, now)
    session.flush()
    return row.id
