"""Reading runs as every route sees them: a lease that lapsed is expired on read (so a run a
dead worker held is requeued or failed when anyone looks), and finished runs come from the
process's cache."""

from __future__ import annotations

from datetime import datetime

from api.deps import AppContext
from api.store import leases, offers, runstore
from api.store.runcache import CachedRun
from autotune.remote.protocol import DeviceTarget, Run, RunPage, RunStatus


def _expire_if_lapsed(
    context: AppContext, run_id: int, status: RunStatus, lease_expires_at: datetime | None
) -> bool:
    """Expire the run's lease if it has lapsed; True when it had (the caller reads again)."""
    now = context.clock()
    if status != RunStatus.RUNNING or lease_expires_at is None or lease_expires_at >= now:
        return False
    with context.db.write() as session:
        leases.expire_leases(
            session, now=now, max_claims=context.settings.max_claims, run_id=run_id
        )
    return True


def fresh_run(context: AppContext, run_id: int) -> Run:
    """Read a run, first requeueing it if its lease has expired (expiry is checked on read);
    a queued one says when no worker has offered its device lately."""
    with context.db.read() as session:
        run = runstore.get_run(session, run_id=run_id)
    if _expire_if_lapsed(context, run_id, run.status, run.lease_expires_at):
        with context.db.read() as session:
            run = runstore.get_run(session, run_id=run_id)
    if run.status is RunStatus.QUEUED:
        run = run.model_copy(update={"notice": device_notice(context, run.device)})
    return run


def device_notice(context: AppContext, target: DeviceTarget) -> str | None:
    """`offers.offer_notice` for `target` now."""
    with context.db.read() as session:
        return offers.offer_notice(
            session, target, now=context.clock(), window_s=context.settings.offer_window_s
        )


def progress(context: AppContext, run_id: int) -> runstore.Progress:
    """A run's status and counts of stored attempts and trials (one count query), with the
    same expiry on read as `fresh_run`."""
    with context.db.read() as session:
        found = runstore.run_progress(session, run_id=run_id)
    if _expire_if_lapsed(context, run_id, found.status, found.lease_expires_at):
        with context.db.read() as session:
            found = runstore.run_progress(session, run_id=run_id)
    return found


def load_run(context: AppContext, run_id: int) -> CachedRun:
    """(status, JSON body) of a run; finished runs come from the in-process cache."""
    hit = context.finished_runs.body(run_id)
    if hit is not None:
        return hit
    run = fresh_run(context, run_id)
    body = run.model_dump_json().encode()
    if run.status.is_finished():
        context.finished_runs.put_body(run_id, run.status, body)
    return run.status, body


def list_runs(
    context: AppContext, *, where: runstore.RunFilter, limit: int, offset: int
) -> RunPage:
    """A page of runs, newest first, after expiring any lapsed lease."""
    now = context.clock()
    with context.db.read() as session:
        expired = leases.has_expired_leases(session, now=now)
    if expired:
        with context.db.write() as session:
            leases.expire_leases(session, now=now, max_claims=context.settings.max_claims)
    with context.db.read() as session:
        return runstore.list_runs(session, where=where, limit=limit, offset=offset)
