"""Reading runs as every route sees them: a lease that lapsed is expired on read (so a run a
dead worker held is requeued or failed when anyone looks), and finished runs come from the
process's cache."""

from __future__ import annotations

from api import leases, runstore
from api.deps import AppContext
from api.runcache import CachedRun
from autotune.remote.protocol import Run, RunPage, RunStatus


def fresh_run(context: AppContext, run_id: int) -> Run:
    """Read a run, first requeueing it if its lease has expired (expiry is checked on read)."""
    with context.db.read() as session:
        run = runstore.get_run(session, run_id=run_id)
    now = context.clock()
    if run.status == RunStatus.RUNNING and run.lease_expires_at and run.lease_expires_at < now:
        with context.db.write() as session:
            leases.expire_leases(
                session, now=now, max_claims=context.settings.max_claims, run_id=run_id
            )
        with context.db.read() as session:
            run = runstore.get_run(session, run_id=run_id)
    return run


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
