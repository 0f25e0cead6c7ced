"""The probe-worker protocol: claim a run, renew the lease, stream attempts and trials, finish.

Every call after the claim names the lease; under a stale lease it is refused with 409 and
changes nothing (code `stale_lease`, or `run_cancelled` when a user cancelled the run).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from api.deps import ContextDep, WorkerAuth
from api.errors import InvalidResult
from api.routes.runs import RunId
from api.store import leases, results, runstore
from autotune.core.tuning.result_check import check_result
from autotune.remote.protocol import (
    AttemptEvent,
    Claim,
    ClaimRequest,
    ErrorBody,
    EventAck,
    FailureReport,
    Heartbeat,
    Lease,
    ResultSubmission,
    Run,
    TrialEvent,
)

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "No bearer token."},
    403: {"model": ErrorBody, "description": "Not a worker token."},
}
_LEASED: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "No such run."},
    409: {"model": ErrorBody, "description": "Stale lease, or the run was cancelled."},
}

router = APIRouter(prefix="/worker", tags=["worker"], dependencies=[WorkerAuth], responses=_ERRORS)


@router.post(
    "/claim",
    response_model=Claim,
    responses={
        200: {"model": Claim, "description": "A run, under a new lease."},
        204: {"description": "Nothing queued matches the devices."},
    },
)
def claim_run(request: ClaimRequest, context: ContextDep) -> Claim | Response:
    """Hand over the oldest queued run that one of the worker's devices matches."""
    with context.db.write() as session:
        claim = leases.claim_run(
            session,
            request=request,
            now=context.clock(),
            lease_s=context.settings.lease_s,
            max_claims=context.settings.max_claims,
        )
    if claim is None:
        return Response(status_code=204)
    return claim


@router.post("/runs/{run_id}/heartbeat", responses=_LEASED)
def heartbeat(run_id: RunId, request: Heartbeat, context: ContextDep) -> Lease:
    """Renew the lease."""
    with context.db.write() as session:
        return leases.heartbeat(
            session,
            run_id=run_id,
            lease_id=request.lease_id,
            now=context.clock(),
            lease_s=context.settings.lease_s,
        )


@router.post("/runs/{run_id}/attempts", responses=_LEASED)
def post_attempt(run_id: RunId, event: AttemptEvent, context: ContextDep) -> EventAck:
    """Store one probe attempt (once per lease and sequence number); renews the lease."""
    with context.db.write() as session:
        return results.record_attempt(
            session,
            run_id=run_id,
            event=event,
            now=context.clock(),
            lease_s=context.settings.lease_s,
        )


@router.post("/runs/{run_id}/trials", responses=_LEASED)
def post_trial(run_id: RunId, event: TrialEvent, context: ContextDep) -> EventAck:
    """Store one trial (once per lease and trial number); renews the lease."""
    with context.db.write() as session:
        return results.record_trial(
            session,
            run_id=run_id,
            event=event,
            now=context.clock(),
            lease_s=context.settings.lease_s,
        )


@router.post(
    "/runs/{run_id}/result",
    responses={
        **_LEASED,
        422: {
            "description": "Invalid body, a result for another spec or device, or one that "
            "breaks an invariant of the tuner (`invalid_result`)."
        },
    },
)
def submit_result(run_id: RunId, submission: ResultSubmission, context: ContextDep) -> Run:
    """Finish the run with its result, if the tuner could have produced it; a result that
    breaks an invariant is refused (422 `invalid_result`) and the lease stays valid."""
    violations = check_result(submission.result.spec, submission.result)
    if violations:
        raise InvalidResult(violations)
    with context.db.write() as session:
        results.complete_run(session, run_id=run_id, submission=submission, now=context.clock())
    with context.db.read() as session:
        return runstore.get_run(session, run_id=run_id)


@router.post("/runs/{run_id}/failure", responses=_LEASED)
def report_failure(run_id: RunId, report: FailureReport, context: ContextDep) -> Run:
    """Give up the run: it is requeued, or failed when out of claims or not retryable."""
    with context.db.write() as session:
        leases.fail_claim(
            session,
            run_id=run_id,
            report=report,
            now=context.clock(),
            max_claims=context.settings.max_claims,
        )
    with context.db.read() as session:
        return runstore.get_run(session, run_id=run_id)
