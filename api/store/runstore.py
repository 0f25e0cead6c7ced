"""Runs as users see them: submitting, reading, listing and cancelling.

Keyword-only functions over a Session, returning protocol models; they raise `api.errors`
domain errors, never HTTP exceptions. Callers own the transaction (writes run inside
`Database.write()`). Leases are `api.store.leases`; what workers store is `api.store.results`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.errors import RunNotCancellable, RunNotFound
from api.store.rowmodels import run_of, summary_of, target_memory_bytes
from api.store.tables import AttemptRow, FailureRow, ModeRow, RecommendationRow, RunRow, TrialRow
from autotune.remote.protocol import CudaTarget, Run, RunCreate, RunPage, RunStatus, fingerprint


def is_postgres(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def lock_run(session: Session, run_id: int) -> RunRow:
    """The run's row, locked for this transaction on PostgreSQL (SQLite writers are serial)."""
    query = select(RunRow).where(RunRow.id == run_id)
    if is_postgres(session):
        query = query.with_for_update()
    row = session.scalars(query).first()
    if row is None:
        raise RunNotFound(run_id)
    return row


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


def create_run(
    session: Session,
    *,
    request: RunCreate,
    version: str,
    now: datetime,
    status: RunStatus = RunStatus.QUEUED,
) -> RunRow:
    """Insert a new run (queued unless told otherwise) and return its row."""
    target = request.device
    row = RunRow(
        fingerprint=fingerprint(request.spec, target, version),
        status=status.value,
        spec=request.spec.model_dump(mode="json"),
        model=request.spec.model.label,
        target_kind=target.kind,
        target_name=target.name if isinstance(target, CudaTarget) else target.gpu,
        target_memory_bytes=target_memory_bytes(target),
        target_allocator_conf=target.allocator_conf,
        device=target.label,
        autotune_version=version,
        created_at=now,
        updated_at=now,
        claim_count=0,
    )
    session.add(row)
    session.flush()
    return row


def submit_run(
    session: Session, *, request: RunCreate, version: str, now: datetime
) -> tuple[int, RunStatus, bool]:
    """(run id, status, created) for a submission: a reusable twin, else a new queued run.

    Two identical submissions at once may both find no twin; the unique index on unfinished
    fingerprints then refuses the second insert, which joins the first one's run instead.
    """
    run_fingerprint = fingerprint(request.spec, request.device, version)
    found = find_reusable_run(session, run_fingerprint=run_fingerprint)
    if found is not None:
        return found[0], found[1], False
    try:
        with session.begin_nested():
            row = create_run(session, request=request, version=version, now=now)
    except IntegrityError:
        found = find_reusable_run(session, run_fingerprint=run_fingerprint)
        if found is None:  # the twin finished and failed in between; nothing to join
            raise
        return found[0], found[1], False
    return row.id, RunStatus.QUEUED, True


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

    return run_of(
        row,
        recommendation=next(iter(children(RecommendationRow, succeeded)), None),
        modes=children(ModeRow, succeeded),
        attempts=children(AttemptRow, claimed),
        trials=children(TrialRow, claimed),
        failures=children(FailureRow, claimed),
    )


@dataclass(frozen=True)
class Progress:
    status: RunStatus
    lease_expires_at: datetime | None
    attempts: int
    trials: int


def run_progress(session: Session, *, run_id: int) -> Progress:
    """A run's status, lease and counts of stored attempts and trials, in one cheap query: what
    a page showing the run polls to know when to reload it."""
    attempts = select(func.count()).where(AttemptRow.run_id == run_id).scalar_subquery()
    trials = select(func.count()).where(TrialRow.run_id == run_id).scalar_subquery()
    found = session.execute(
        select(RunRow.status, RunRow.lease_expires_at, attempts, trials).where(RunRow.id == run_id)
    ).first()
    if found is None:
        raise RunNotFound(run_id)
    return Progress(RunStatus(found[0]), found[1], found[2], found[3])


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
    items = [summary_of(run, rec) for run, rec in rows]
    return RunPage(items=items, total=total, limit=limit, offset=offset)


def cancel_run(session: Session, *, run_id: int, now: datetime) -> None:
    """Cancel a queued or running run; a worker holding it learns on its next call (409).

    Raises:
        RunNotFound, RunNotCancellable: the run has already finished.
    """
    row = lock_run(session, run_id)
    if RunStatus(row.status).is_finished():
        raise RunNotCancellable(f"run {run_id} has already finished ({row.status})")
    row.status = RunStatus.CANCELLED.value
    row.finished_at = now
    row.updated_at = now
    # The lease id stays so that the worker's next call is answered "run_cancelled".
    row.lease_expires_at = None
