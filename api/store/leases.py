"""Leases: a worker's claim on a run, its renewal, its end (a failure or expiry).

Concurrency rules:
* A claim is one guarded UPDATE (`status = 'queued'` re-checked, the row picked with
  `FOR UPDATE SKIP LOCKED` on PostgreSQL; SQLite serialises writers with BEGIN IMMEDIATE), so
  two workers can never own the same run.
* Every lease-bound operation first locks the run row and checks the lease (`held_run`); an
  event under a stale lease raises `StaleLease` before anything is written.

A lease that lapsed (no heartbeat within `lease_s`, e.g. while the server was down) is not lost
at once: the expiry sweep puts the run back in the queue but keeps the lease id, so its holder's
next heartbeat renews it (`lease_lapsed_at` records the lapse) and no claim of `max_claims` is
spent. Until then the holder's other posts are refused as `LeaseExpired`. The lapsed claim ends
for good only when another worker claims the run (its failure is recorded then), or, when the
run has no claims left, at the sweep.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, exists, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from api.errors import LeaseExpired, RunCancelled, StaleLease
from api.store.rowmodels import target_of
from api.store.runstore import is_postgres, lock_run
from api.store.tables import FailureRow, RunRow, WorkerRow
from autotune.core.errors import FactoryRefused
from autotune.core.schemas import DeviceInfo, DeviceKind, Spec
from autotune.remote.protocol import (
    Claim,
    ClaimRequest,
    FailureReport,
    Lease,
    RunStatus,
    cuda_memory_bounds,
)

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
    """Requeue every running run whose lease has lapsed (its holder may still renew it), or
    fail it when it has no claims left.

    Returns how many leases lapsed here. On PostgreSQL the rows are locked and re-checked,
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
        lapsed_at = row.lease_expires_at
        if row.claim_count < max_claims:
            # The lease id and worker stay: the holder may be alive behind an outage.
            row.status = RunStatus.QUEUED.value
            row.lease_lapsed_at = lapsed_at
            row.lease_expires_at = None
            row.updated_at = now
            continue
        _end_claim(
            session,
            row,
            error_type="LeaseExpired",
            message=f"the lease of worker {row.worker_id} lapsed at {lapsed_at} with no "
            "heartbeat, and the run has no claims left",
            traceback_tail=None,
            retryable=False,
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
        # The allocator's settings change what fits: a run asks for them, a device reports them.
        conf = device.allocator_conf
        same_allocator = (
            RunRow.target_allocator_conf.is_(None)
            if conf is None
            else RunRow.target_allocator_conf == conf
        )
        clauses.append(and_(same_allocator, _target_clause(device)))
    return or_(*clauses)


def _target_clause(device: DeviceInfo) -> ColumnElement[bool]:
    if device.kind == DeviceKind.ESTIMATE:
        return and_(RunRow.target_kind == "estimate", RunRow.target_name == device.gpu)
    if device.kind == DeviceKind.EMULATED and device.gpu is not None:
        # A named GPU: its capacity depends on each run's world size, the name matches.
        return and_(RunRow.target_kind == "emulated", RunRow.target_name == device.gpu)
    if device.kind == DeviceKind.EMULATED:
        return and_(
            RunRow.target_kind == "emulated",
            RunRow.target_name.is_(None),
            RunRow.target_memory_bytes == device.capacity_bytes,
        )
    low, high = cuda_memory_bounds(device.total_memory_bytes)
    return and_(
        RunRow.target_kind == "cuda",
        RunRow.target_name == device.name,
        RunRow.target_memory_bytes.between(low, high),
    )


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
    # A worker that refused a run's factory would refuse it again: the run waits for another
    # (it spent every claim on the same worker within seconds).
    refused_here = exists().where(
        FailureRow.run_id == RunRow.id,
        FailureRow.worker_id == request.worker_id,
        FailureRow.error_type == FactoryRefused.__name__,
    )
    oldest = (
        select(RunRow.id)
        .where(
            RunRow.status == RunStatus.QUEUED.value,
            _match_clause(request.devices),
            ~refused_here,
        )
        .order_by(RunRow.created_at, RunRow.id)
        .limit(1)
    )
    if is_postgres(session):
        oldest = oldest.with_for_update(skip_locked=True)
    taken = session.execute(
        oldest.add_columns(RunRow.lease_id, RunRow.worker_id, RunRow.lease_lapsed_at)
    ).first()
    if taken is None:
        return None
    lease_id = secrets.token_hex(16)
    expires_at = now + timedelta(seconds=lease_s)
    claimed = session.execute(
        update(RunRow)
        .where(RunRow.id == taken.id, RunRow.status == RunStatus.QUEUED.value)
        .values(
            status=RunStatus.RUNNING.value,
            lease_id=lease_id,
            lease_expires_at=expires_at,
            lease_lapsed_at=None,
            worker_id=request.worker_id,
            claim_count=RunRow.claim_count + 1,
            started_at=now,
            updated_at=now,
        )
        .returning(RunRow.id, RunRow.claim_count)
        .execution_options(synchronize_session=False)
    ).first()
    if claimed is None:
        return None
    if taken.lease_id is not None:
        # A lapsed lease nobody renewed: this claim ends it, and says so.
        session.add(
            FailureRow(
                run_id=taken.id,
                lease_id=taken.lease_id,
                claim_number=claimed.claim_count - 1,
                worker_id=taken.worker_id,
                error_type="LeaseExpired",
                message=f"the lease of worker {taken.worker_id} lapsed at "
                f"{taken.lease_lapsed_at} with no heartbeat; the run was claimed again",
                created_at=now,
            )
        )
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


def _lease_of(session: Session, *, run_id: int, lease_id: str) -> RunRow:
    """The run, locked, if `lease_id` is its current lease (expired or not).

    Raises:
        RunNotFound, RunCancelled, StaleLease: the lease is not (or no longer) the run's.
    """
    row = lock_run(session, run_id)
    if row.lease_id != lease_id:
        raise StaleLease(f"lease {lease_id} is not the current lease of run {run_id}")
    if row.status == RunStatus.CANCELLED.value:
        raise RunCancelled(f"run {run_id} was cancelled")
    if row.status not in (RunStatus.RUNNING.value, RunStatus.QUEUED.value):
        raise StaleLease(f"run {run_id} is {row.status}, not running")
    return row


def _has_lapsed(row: RunRow, now: datetime) -> bool:
    # Queued under its lease id: the sweep found the lease lapsed and requeued the run.
    return (
        row.status == RunStatus.QUEUED.value
        or row.lease_expires_at is None
        or row.lease_expires_at <= now
    )


def held_run(session: Session, *, run_id: int, lease_id: str, now: datetime) -> RunRow:
    """The run, locked, if `lease_id` is its current unexpired lease.

    Raises:
        RunNotFound, RunCancelled, StaleLease: nothing may be written under this lease.
        LeaseExpired: the lease lapsed but is still the run's; a heartbeat renews it.
    """
    row = _lease_of(session, run_id=run_id, lease_id=lease_id)
    if _has_lapsed(row, now):
        raise LeaseExpired(
            f"lease {lease_id} of run {run_id} lapsed at "
            f"{row.lease_expires_at or row.lease_lapsed_at}; renew it with a heartbeat"
        )
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
    """Renew a lease for another `lease_s` seconds; a lapsed lease nobody else claimed is
    renewed too (the run runs again under it), and the lapse stays on the record."""
    row = _lease_of(session, run_id=run_id, lease_id=lease_id)
    if _has_lapsed(row, now):
        row.lease_lapsed_at = row.lease_lapsed_at or row.lease_expires_at
        row.status = RunStatus.RUNNING.value
    expires_at = renew(session, row, now, lease_s)
    return Lease(run_id=run_id, lease_id=lease_id, lease_expires_at=expires_at)


def fail_claim(
    session: Session, *, run_id: int, report: FailureReport, now: datetime, max_claims: int
) -> None:
    """A worker gave up: requeue the run, or fail it when the error is not retryable or the run
    has used up `max_claims` claims. The reasons of every claim are kept, and the run points
    at the study the claim created (its name is the worker's: `probes.worker`)."""
    row = held_run(session, run_id=run_id, lease_id=report.lease_id, now=now)
    row.study_name = report.study_name or row.study_name
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
