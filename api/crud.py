"""The run store's operations: keyword-only functions over a Session, returning protocol models.

Raises `api.errors` domain errors, never HTTP exceptions. Callers own the transaction (writes
run inside `Database.write()`); every function here leaves the session consistent on error.

Concurrency rules:
* A claim is one guarded UPDATE (`status = 'queued'` re-checked, the row picked with
  `FOR UPDATE SKIP LOCKED` on PostgreSQL; SQLite serialises writers with BEGIN IMMEDIATE), so
  two workers can never own the same run.
* Every lease-bound operation first locks the run row and checks the lease; an event under a
  stale lease raises `StaleLease` before anything is written.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from api.errors import ResultRejected, RunCancelled, RunNotCancellable, RunNotFound, StaleLease
from api.tables import (
    AttemptRow,
    FailureRow,
    ModeRow,
    RecommendationRow,
    RunRow,
    TrialRow,
    WorkerRow,
)
from autotune.protocol import (
    API_PREFIX,
    AttemptEvent,
    AttemptRecord,
    Claim,
    ClaimRequest,
    CudaTarget,
    EmulatedTarget,
    EventAck,
    FailureRecord,
    FailureReport,
    Lease,
    ResultSubmission,
    Run,
    RunCreate,
    RunPage,
    RunStatus,
    RunSummary,
    TrialEvent,
    TrialRecord,
    cuda_memory_bounds,
    fingerprint,
)
from autotune.schemas import (
    DeviceInfo,
    DeviceKind,
    Exports,
    Infeasible,
    ModeProbe,
    ProbeAttempt,
    Recommendation,
    Spec,
    Trial,
    TuneResult,
)

Target = EmulatedTarget | CudaTarget
_ERROR_TEXT_CHARS = 2000


def run_url(run_id: int) -> str:
    return f"{API_PREFIX}/runs/{run_id}"


def _is_postgres(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def _target_of(row: RunRow) -> Target:
    if row.target_kind == "cuda":
        assert row.target_name is not None
        return CudaTarget(name=row.target_name, memory_bytes=row.target_memory_bytes)
    return EmulatedTarget(memory_bytes=row.target_memory_bytes)


# ---------------------------------------------------------------------------------------------
# Submitting, reading, listing, cancelling.


def find_reusable_run(session: Session, *, run_fingerprint: str) -> tuple[int, RunStatus] | None:
    """The newest succeeded run with this fingerprint, else an unfinished one to join.

    Joining a queued or running twin keeps the same spec from being measured twice at once.
    """
    for statuses in ((RunStatus.SUCCEEDED,), (RunStatus.QUEUED, RunStatus.RUNNING)):
        found = session.execute(
            select(RunRow.id, RunRow.status)
            .where(RunRow.fingerprint == run_fingerprint, RunRow.status.in_(statuses))
            .order_by(RunRow.id.desc())
            .limit(1)
        ).first()
        if found is not None:
            return found.id, RunStatus(found.status)
    return None


def create_run(session: Session, *, request: RunCreate, version: str, now: datetime) -> int:
    """Queue a new run and return its id."""
    target = request.device
    row = RunRow(
        fingerprint=fingerprint(request.spec, target, version),
        status=RunStatus.QUEUED.value,
        spec=request.spec.model_dump(mode="json"),
        model=request.spec.model.label,
        target_kind=target.kind,
        target_name=target.name if isinstance(target, CudaTarget) else None,
        target_memory_bytes=target.memory_bytes,
        device=target.label,
        autotune_version=version,
        created_at=now,
        updated_at=now,
        claim_count=0,
    )
    session.add(row)
    session.flush()
    return row.id


def run_status(session: Session, *, run_id: int) -> tuple[RunStatus, datetime | None]:
    """Status and lease expiry of a run, cheaply (for long polls and expiry checks)."""
    found = session.execute(
        select(RunRow.status, RunRow.lease_expires_at).where(RunRow.id == run_id)
    ).first()
    if found is None:
        raise RunNotFound(run_id)
    return RunStatus(found.status), found.lease_expires_at


def get_run(session: Session, *, run_id: int) -> Run:
    """Everything about one run, with its attempts, trials and failures.

    Child rows are read as plain rows, and only where they can exist (nothing is recorded
    before the first claim; a recommendation and modes only on success): reads of queued and
    running runs are the API's uncached hot path.
    """
    row = session.scalars(select(RunRow).where(RunRow.id == run_id)).first()
    if row is None:
        raise RunNotFound(run_id)
    succeeded = row.status == RunStatus.SUCCEEDED.value
    claimed = row.claim_count > 0

    def children(table: Any, wanted: bool) -> Sequence[Any]:
        if not wanted:
            return []
        columns = table.__table__
        return session.execute(
            select(columns).where(columns.c.run_id == run_id).order_by(*columns.primary_key)
        ).all()

    return _run_of(
        row,
        recommendation=next(iter(children(RecommendationRow, succeeded)), None),
        modes=children(ModeRow, succeeded),
        attempts=children(AttemptRow, claimed),
        trials=children(TrialRow, claimed),
        failures=children(FailureRow, claimed),
    )


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return (end - start).total_seconds() if start is not None and end is not None else None


def _run_of(
    row: RunRow,
    *,
    recommendation: Any,
    modes: Sequence[Any],
    attempts: Sequence[Any],
    trials: Sequence[Any],
    failures: Sequence[Any],
) -> Run:
    """The protocol view of a run; child arguments are rows of the matching tables."""
    attempt_records = [
        AttemptRecord(
            claim_number=a.claim_number,
            sequence=a.sequence,
            checkpointing=a.checkpointing,
            attempt=ProbeAttempt(
                micro_batch=a.micro_batch,
                fits=a.fits,
                peak_bytes=a.peak_bytes,
                phase_peak_bytes=a.phase_peak_bytes,
                oom_phase=a.oom_phase,
            ),
            created_at=a.created_at,
        )
        for a in attempts
    ]
    # A mode's attempts are those of the lease that produced the mode, in order.
    final_attempts: dict[tuple[str, bool], list[ProbeAttempt]] = {}
    for a, record in zip(attempts, attempt_records, strict=True):
        final_attempts.setdefault((a.lease_id, a.checkpointing), []).append(record.attempt)
    rec = recommendation
    return Run(
        id=row.id,
        url=run_url(row.id),
        status=RunStatus(row.status),
        fingerprint=row.fingerprint,
        spec=Spec.model_validate(row.spec),
        device=_target_of(row),
        model=row.model,
        autotune_version=row.autotune_version,
        created_at=row.created_at,
        updated_at=row.updated_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
        lease_expires_at=row.lease_expires_at,
        queued_s=_seconds(row.created_at, row.started_at),
        run_s=_seconds(row.started_at, row.finished_at),
        claim_count=row.claim_count,
        worker_id=row.worker_id,
        worker_device=DeviceInfo.model_validate(row.worker_device) if row.worker_device else None,
        torch_version=row.torch_version,
        study_name=row.study_name,
        recommendation=Recommendation(
            micro_batch=rec.micro_batch,
            accumulation_steps=rec.accumulation_steps,
            checkpointing=rec.checkpointing,
            world_size=rec.world_size,
            global_batch=rec.global_batch,
            samples_per_s=rec.samples_per_s,
            tokens_per_s=rec.tokens_per_s,
            peak_bytes=rec.peak_bytes,
            capacity_bytes=rec.capacity_bytes,
        )
        if rec is not None
        else None,
        infeasible=Infeasible.model_validate(row.infeasible) if row.infeasible else None,
        exports=Exports.model_validate(row.exports) if row.exports else None,
        modes=[
            ModeProbe(
                checkpointing=m.checkpointing,
                max_micro_batch=m.max_micro_batch,
                recommended_micro_batch=m.recommended_micro_batch,
                capped=m.capped,
                accumulating_micro_batch=m.accumulating_micro_batch,
                attempts=final_attempts.get((m.lease_id, m.checkpointing), []),
            )
            for m in modes
        ],
        attempts=attempt_records,
        trials=[
            TrialRecord(
                claim_number=t.claim_number,
                trial=Trial(
                    number=t.number,
                    micro_batch=t.micro_batch,
                    accumulation_steps=t.accumulation_steps,
                    checkpointing=t.checkpointing,
                    state=t.state,
                    samples_per_s=t.samples_per_s,
                    tokens_per_s=t.tokens_per_s,
                    step_time_s=t.step_time_s,
                    step_time_spread=t.step_time_spread,
                    timed_steps=t.timed_steps,
                    peak_bytes=t.peak_bytes,
                    error=t.error,
                ),
                created_at=t.created_at,
            )
            for t in trials
        ],
        failures=[
            FailureRecord(
                claim_number=f.claim_number,
                worker_id=f.worker_id,
                error_type=f.error_type,
                message=f.message,
                traceback_tail=f.traceback_tail,
                created_at=f.created_at,
            )
            for f in failures
        ],
        error=row.error,
    )


@dataclass(frozen=True)
class RunFilter:
    """Filters of the run listing; None means any."""

    status: RunStatus | None = None
    model: str | None = None
    device: str | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None

    def where(self) -> list[ColumnElement[bool]]:
        clauses: list[ColumnElement[bool]] = []
        if self.status is not None:
            clauses.append(RunRow.status == self.status.value)
        if self.model is not None:
            clauses.append(RunRow.model == self.model)
        if self.device is not None:
            clauses.append(RunRow.device == self.device)
        if self.created_after is not None:
            clauses.append(RunRow.created_at >= self.created_after)
        if self.created_before is not None:
            clauses.append(RunRow.created_at < self.created_before)
        return clauses


def list_runs(session: Session, *, where: RunFilter, limit: int, offset: int) -> RunPage:
    """One page of runs, newest first, with the total matching the filters."""
    clauses = where.where()
    total = session.scalar(select(func.count()).select_from(RunRow).where(*clauses)) or 0
    rows = session.execute(
        select(RunRow, RecommendationRow)
        .outerjoin(RecommendationRow, RecommendationRow.run_id == RunRow.id)
        .where(*clauses)
        .order_by(RunRow.created_at.desc(), RunRow.id.desc())
        .limit(limit)
        .offset(offset)
    ).all()
    items = [
        RunSummary(
            id=run.id,
            url=run_url(run.id),
            status=RunStatus(run.status),
            model=run.model,
            device=run.device,
            created_at=run.created_at,
            finished_at=run.finished_at,
            micro_batch=rec.micro_batch if rec else None,
            accumulation_steps=rec.accumulation_steps if rec else None,
            checkpointing=rec.checkpointing if rec else None,
            samples_per_s=rec.samples_per_s if rec else None,
        )
        for run, rec in rows
    ]
    return RunPage(items=items, total=total, limit=limit, offset=offset)


def _lock_run(session: Session, run_id: int) -> RunRow:
    query = select(RunRow).where(RunRow.id == run_id)
    if _is_postgres(session):
        query = query.with_for_update()
    row = session.scalars(query).first()
    if row is None:
        raise RunNotFound(run_id)
    return row


def cancel_run(session: Session, *, run_id: int, now: datetime) -> None:
    """Cancel a queued or running run; a worker holding it learns on its next call (409).

    Raises:
        RunNotFound, RunNotCancellable: the run has already finished.
    """
    row = _lock_run(session, run_id)
    if RunStatus(row.status).is_finished():
        raise RunNotCancellable(f"run {run_id} has already finished ({row.status})")
    row.status = RunStatus.CANCELLED.value
    row.finished_at = now
    row.updated_at = now
    # The lease id stays so that the worker's next call is answered "run_cancelled".
    row.lease_expires_at = None


# ---------------------------------------------------------------------------------------------
# Leases: expiry, claims, heartbeats.


def has_expired_leases(session: Session, *, now: datetime) -> bool:
    return (
        session.execute(
            select(RunRow.id)
            .where(RunRow.status == RunStatus.RUNNING.value, RunRow.lease_expires_at < now)
            .limit(1)
        ).first()
        is not None
    )


def expire_leases(
    session: Session, *, now: datetime, max_claims: int, run_id: int | None = None
) -> int:
    """Requeue (or, past `max_claims`, fail) every running run whose lease has expired.

    Returns how many leases were ended here. On PostgreSQL the rows are locked and re-checked,
    so a heartbeat that renewed the lease in the meantime wins and a concurrent expirer skips.
    """
    query = select(RunRow).where(
        RunRow.status == RunStatus.RUNNING.value, RunRow.lease_expires_at < now
    )
    if run_id is not None:
        query = query.where(RunRow.id == run_id)
    if _is_postgres(session):
        query = query.with_for_update(skip_locked=True)
    rows = session.scalars(query.order_by(RunRow.id)).all()
    for row in rows:
        _end_claim(
            session,
            row,
            error_type="LeaseExpired",
            message=f"worker {row.worker_id} stopped renewing its lease",
            traceback_tail=None,
            retryable=True,
            now=now,
            max_claims=max_claims,
        )
    return len(rows)


def _end_claim(
    session: Session,
    row: RunRow,
    *,
    error_type: str,
    message: str,
    traceback_tail: str | None,
    retryable: bool,
    now: datetime,
    max_claims: int,
) -> None:
    assert row.lease_id is not None
    session.add(
        FailureRow(
            run_id=row.id,
            lease_id=row.lease_id,
            claim_number=row.claim_count,
            worker_id=row.worker_id,
            error_type=error_type,
            message=message,
            traceback_tail=traceback_tail,
            created_at=now,
        )
    )
    row.updated_at = now
    row.lease_id = None
    row.lease_expires_at = None
    if retryable and row.claim_count < max_claims:
        row.status = RunStatus.QUEUED.value
        row.worker_id = None
        row.device_index = None
        return
    session.flush()
    reasons = session.execute(
        select(FailureRow.claim_number, FailureRow.error_type, FailureRow.message)
        .where(FailureRow.run_id == row.id)
        .order_by(FailureRow.id)
    ).all()
    summary = "; ".join(f"claim {n}: {kind}: {text}" for n, kind, text in reasons)
    row.status = RunStatus.FAILED.value
    row.finished_at = now
    row.error = f"failed after {row.claim_count} claim(s): {summary}"[:_ERROR_TEXT_CHARS]


def _match_clause(devices: Sequence[DeviceInfo]) -> ColumnElement[bool]:
    """SQL for "the run's target matches one of these devices" (`Target.matches`, as SQL)."""
    clauses: list[ColumnElement[bool]] = []
    for device in devices:
        if device.kind == DeviceKind.EMULATED:
            clauses.append(
                and_(
                    RunRow.target_kind == "emulated",
                    RunRow.target_memory_bytes == device.capacity_bytes,
                )
            )
        else:
            low, high = cuda_memory_bounds(device.total_memory_bytes)
            clauses.append(
                and_(
                    RunRow.target_kind == "cuda",
                    RunRow.target_name == device.name,
                    RunRow.target_memory_bytes.between(low, high),
                )
            )
    return or_(*clauses)


def _record_worker(session: Session, request: ClaimRequest, now: datetime) -> None:
    """Insert or refresh the worker's row in one statement (no race between two claims)."""
    values: dict[str, Any] = {
        "id": request.worker_id,
        "devices": [device.model_dump(mode="json") for device in request.devices],
        "first_seen_at": now,
        "last_seen_at": now,
        "claims": 0,
    }
    dialect = postgresql if _is_postgres(session) else sqlite
    insert = dialect.insert(WorkerRow).values(values)
    session.execute(
        insert.on_conflict_do_update(
            index_elements=[WorkerRow.id],
            set_={"devices": insert.excluded.devices, "last_seen_at": now},
        )
    )


def claim_run(
    session: Session, *, request: ClaimRequest, now: datetime, lease_s: float, max_claims: int
) -> Claim | None:
    """Hand the oldest queued run matching the worker's devices to it, or None.

    Expired leases are requeued first, so a dead worker's run is claimable again right away.
    """
    _record_worker(session, request, now)
    expire_leases(session, now=now, max_claims=max_claims)
    oldest = (
        select(RunRow.id)
        .where(RunRow.status == RunStatus.QUEUED.value, _match_clause(request.devices))
        .order_by(RunRow.created_at, RunRow.id)
        .limit(1)
    )
    if _is_postgres(session):
        oldest = oldest.with_for_update(skip_locked=True)
    lease_id = secrets.token_hex(16)
    expires_at = now + timedelta(seconds=lease_s)
    claimed = session.execute(
        update(RunRow)
        .where(RunRow.id == oldest.scalar_subquery(), RunRow.status == RunStatus.QUEUED.value)
        .values(
            status=RunStatus.RUNNING.value,
            lease_id=lease_id,
            lease_expires_at=expires_at,
            worker_id=request.worker_id,
            claim_count=RunRow.claim_count + 1,
            started_at=now,
            updated_at=now,
        )
        .returning(RunRow.id)
        .execution_options(synchronize_session=False)
    ).first()
    if claimed is None:
        return None
    row = session.get_one(RunRow, claimed.id)
    session.refresh(row)
    target = _target_of(row)
    device_index = next(i for i, d in enumerate(request.devices) if target.matches(d))
    row.device_index = device_index
    row.study_name = row.study_name or f"autotune-run-{row.id}"
    session.execute(
        update(WorkerRow)
        .where(WorkerRow.id == request.worker_id)
        .values(claims=WorkerRow.claims + 1)
        .execution_options(synchronize_session=False)
    )
    return Claim(
        run_id=row.id,
        spec=Spec.model_validate(row.spec),
        target=target,
        device_index=device_index,
        lease_id=lease_id,
        lease_expires_at=expires_at,
        heartbeat_interval_s=lease_s / 3,
        claim_number=row.claim_count,
        study_name=row.study_name,
    )


def _held_run(session: Session, *, run_id: int, lease_id: str, now: datetime) -> RunRow:
    """The run, locked, if `lease_id` is its current unexpired lease.

    Raises:
        RunNotFound, RunCancelled, StaleLease: nothing may be written under this lease.
    """
    row = _lock_run(session, run_id)
    if row.lease_id != lease_id:
        raise StaleLease(f"lease {lease_id} is not the current lease of run {run_id}")
    if row.status == RunStatus.CANCELLED.value:
        raise RunCancelled(f"run {run_id} was cancelled")
    if row.status != RunStatus.RUNNING.value:
        raise StaleLease(f"run {run_id} is {row.status}, not running")
    assert row.lease_expires_at is not None
    if row.lease_expires_at <= now:
        raise StaleLease(f"lease {lease_id} of run {run_id} expired at {row.lease_expires_at}")
    return row


def _renew(session: Session, row: RunRow, now: datetime, lease_s: float) -> datetime:
    row.lease_expires_at = now + timedelta(seconds=lease_s)
    row.updated_at = now
    if row.worker_id is not None:
        session.execute(
            update(WorkerRow)
            .where(WorkerRow.id == row.worker_id)
            .values(last_seen_at=now)
            .execution_options(synchronize_session=False)
        )
    return row.lease_expires_at


def heartbeat(
    session: Session, *, run_id: int, lease_id: str, now: datetime, lease_s: float
) -> Lease:
    """Renew a lease for another `lease_s` seconds."""
    row = _held_run(session, run_id=run_id, lease_id=lease_id, now=now)
    expires_at = _renew(session, row, now, lease_s)
    return Lease(run_id=run_id, lease_id=lease_id, lease_expires_at=expires_at)


def _attempt_row(
    row: RunRow, *, sequence: int, checkpointing: bool, attempt: ProbeAttempt, now: datetime
) -> AttemptRow:
    assert row.lease_id is not None
    return AttemptRow(
        run_id=row.id,
        lease_id=row.lease_id,
        claim_number=row.claim_count,
        sequence=sequence,
        checkpointing=checkpointing,
        micro_batch=attempt.micro_batch,
        fits=attempt.fits,
        peak_bytes=attempt.peak_bytes,
        phase_peak_bytes={phase.value: b for phase, b in attempt.phase_peak_bytes.items()},
        oom_phase=attempt.oom_phase.value if attempt.oom_phase else None,
        created_at=now,
    )


def _trial_row(row: RunRow, *, trial: Trial, now: datetime) -> TrialRow:
    assert row.lease_id is not None
    return TrialRow(
        run_id=row.id,
        lease_id=row.lease_id,
        claim_number=row.claim_count,
        number=trial.number,
        micro_batch=trial.micro_batch,
        accumulation_steps=trial.accumulation_steps,
        checkpointing=trial.checkpointing,
        state=trial.state.value,
        samples_per_s=trial.samples_per_s,
        tokens_per_s=trial.tokens_per_s,
        step_time_s=trial.step_time_s,
        step_time_spread=trial.step_time_spread,
        timed_steps=trial.timed_steps,
        peak_bytes=trial.peak_bytes,
        error=trial.error,
        created_at=now,
    )


def record_attempt(
    session: Session, *, run_id: int, event: AttemptEvent, now: datetime, lease_s: float
) -> EventAck:
    """Store a streamed probe attempt once per (run, lease, sequence); renews the lease."""
    row = _held_run(session, run_id=run_id, lease_id=event.lease_id, now=now)
    seen = session.execute(
        select(AttemptRow.id).where(
            AttemptRow.run_id == run_id,
            AttemptRow.lease_id == event.lease_id,
            AttemptRow.sequence == event.sequence,
        )
    ).first()
    if seen is None:
        session.add(
            _attempt_row(
                row,
                sequence=event.sequence,
                checkpointing=event.checkpointing,
                attempt=event.attempt,
                now=now,
            )
        )
    return EventAck(stored=seen is None, lease_expires_at=_renew(session, row, now, lease_s))


def record_trial(
    session: Session, *, run_id: int, event: TrialEvent, now: datetime, lease_s: float
) -> EventAck:
    """Store a streamed trial once per (run, lease, trial number); renews the lease."""
    row = _held_run(session, run_id=run_id, lease_id=event.lease_id, now=now)
    seen = session.execute(
        select(TrialRow.id).where(
            TrialRow.run_id == run_id,
            TrialRow.lease_id == event.lease_id,
            TrialRow.number == event.trial.number,
        )
    ).first()
    if seen is None:
        session.add(_trial_row(row, trial=event.trial, now=now))
    return EventAck(stored=seen is None, lease_expires_at=_renew(session, row, now, lease_s))


def _torch_major_minor(version: str | None) -> str | None:
    if not version:
        return None
    return ".".join(version.split("+")[0].split(".")[:2])


def _check_result(row: RunRow, result: TuneResult) -> None:
    if result.spec.model_dump(mode="json") != row.spec:
        raise ResultRejected(f"result.spec: differs from the spec of run {row.id}")
    target = _target_of(row)
    if not target.matches(result.device):
        raise ResultRejected(
            f"result.device: {result.device.name} does not match the run's target {target.label}"
        )


def complete_run(
    session: Session, *, run_id: int, submission: ResultSubmission, now: datetime
) -> None:
    """Finish a run with its result. The result's attempts and trials replace the ones streamed
    under the same lease (the result is authoritative); earlier claims' records stay.

    Raises:
        RunNotFound, StaleLease, RunCancelled, ResultRejected.
    """
    row = _held_run(session, run_id=run_id, lease_id=submission.lease_id, now=now)
    result = submission.result
    _check_result(row, result)
    lease_id = submission.lease_id
    for table in (AttemptRow, TrialRow, ModeRow):
        session.execute(
            delete(table).where(table.run_id == run_id, table.lease_id == lease_id),
            execution_options={"synchronize_session": False},
        )
    sequence = 0
    for mode in result.probe.modes:
        session.add(
            ModeRow(
                run_id=run_id,
                lease_id=lease_id,
                checkpointing=mode.checkpointing,
                max_micro_batch=mode.max_micro_batch,
                recommended_micro_batch=mode.recommended_micro_batch,
                capped=mode.capped,
                accumulating_micro_batch=mode.accumulating_micro_batch,
            )
        )
        for attempt in mode.attempts:
            session.add(
                _attempt_row(
                    row,
                    sequence=sequence,
                    checkpointing=mode.checkpointing,
                    attempt=attempt,
                    now=now,
                )
            )
            sequence += 1
    for trial in result.trials:
        session.add(_trial_row(row, trial=trial, now=now))
    if result.recommendation is not None:
        session.add(RecommendationRow(run_id=run_id, **result.recommendation.model_dump()))
    row.infeasible = result.infeasible.model_dump(mode="json") if result.infeasible else None
    row.exports = result.exports.model_dump(mode="json") if result.exports else None
    row.worker_device = result.device.model_dump(mode="json")
    row.torch_version = _torch_major_minor(result.device.torch_version)
    row.study_name = result.study_name or row.study_name
    row.status = RunStatus.SUCCEEDED.value
    row.finished_at = now
    row.updated_at = now
    row.lease_expires_at = None


def fail_claim(
    session: Session, *, run_id: int, report: FailureReport, now: datetime, max_claims: int
) -> None:
    """A worker gave up: requeue the run, or fail it when the error is not retryable or the run
    has used up `max_claims` claims. The reasons of every claim are kept."""
    row = _held_run(session, run_id=run_id, lease_id=report.lease_id, now=now)
    _end_claim(
        session,
        row,
        error_type=report.error_type,
        message=report.message,
        traceback_tail=report.traceback_tail,
        retryable=report.retryable,
        now=now,
        max_claims=max_claims,
    )


def start_local_claim(session: Session, *, run_id: int, now: datetime, lease_s: float) -> str:
    """Mark a just-created run as running under a lease of this process, for a tuning run that
    happened locally (`autotune tune`) and is recorded like any worker's. Returns the lease id.
    """
    row = _lock_run(session, run_id)
    lease_id = secrets.token_hex(16)
    row.status = RunStatus.RUNNING.value
    row.lease_id = lease_id
    row.claim_count += 1
    row.started_at = now
    row.updated_at = now
    row.lease_expires_at = now + timedelta(seconds=lease_s)
    return lease_id
