"""Leases: a worker's claim on a run, its renewal, its end (a failure or expiry).

Concurrency rules:
* A claim is one guarded UPDATE (`status = 'queued'` re-checked, the row picked with
  `FOR UPDATE SKIP LOCKED` on PostgreSQL; SQLite serialises writers with BEGIN IMMEDIATE), so
  two workers can never own the same run.
* Every lease-bound operation first locks the run row and checks the lease (`held_run`); an
  event under a stale lease raises `StaleLease` before anything is written.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from api.errors import RunCancelled, StaleLease
from api.rowmodels import target_of
from api.runstore import is_postgres, lock_run
from api.tables import FailureRow, RunRow, WorkerRow
from autotune.protocol import (
    Claim,
    ClaimRequest,
    FailureReport,
    Lease,
    RunStatus,
    cuda_memory_bounds,
)
from autotune.schemas import DeviceInfo, DeviceKind, Spec

_ERROR_TEXT_CHARS = 2000


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
    if is_postgres(session):
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
    dialect = postgresql if is_postgres(session) else sqlite
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
    if is_postgres(session):
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
    target = target_of(row)
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


def held_run(session: Session, *, run_id: int, lease_id: str, now: datetime) -> RunRow:
    """The run, locked, if `lease_id` is its current unexpired lease.

    Raises:
        RunNotFound, RunCancelled, StaleLease: nothing may be written under this lease.
    """
    row = lock_run(session, run_id)
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


def renew(session: Session, row: RunRow, now: datetime, lease_s: float) -> datetime:
    """Extend the lease of a held run by `lease_s` from now; returns the new expiry."""
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
    row = held_run(session, run_id=run_id, lease_id=lease_id, now=now)
    expires_at = renew(session, row, now, lease_s)
    return Lease(run_id=run_id, lease_id=lease_id, lease_expires_at=expires_at)


def fail_claim(
    session: Session, *, run_id: int, report: FailureReport, now: datetime, max_claims: int
) -> None:
    """A worker gave up: requeue the run, or fail it when the error is not retryable or the run
    has used up `max_claims` claims. The reasons of every claim are kept."""
    row = held_run(session, run_id=run_id, lease_id=report.lease_id, now=now)
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
