"""Users' routes: submit a spec (answered from the cache when it can be), browse, cancel."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Response
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool

from api import comparison, submissions
from api.deps import AppContext, ClientAuth, ContextDep, ReaderAuth
from api.store import runreads, runstore
from api.store.rowmodels import run_url
from api.store.runcache import CachedRun
from autotune.remote.protocol import (
    MAX_INT,
    MAX_PAGE_LIMIT,
    Comparison,
    ErrorBody,
    Run,
    RunCreate,
    RunPage,
    RunStatus,
    Submitted,
    UtcDatetime,
    fingerprint,
)

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "No bearer token."},
    403: {"model": ErrorBody, "description": "The token may not do this."},
}
_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "No such run."}
}

router = APIRouter(prefix="/runs", tags=["runs"], responses=_ERRORS)

RunId = Annotated[int, Path(ge=1, le=MAX_INT, description="The run id.")]
WaitSeconds = Annotated[
    float,
    Query(ge=0, le=3600, description="Long-poll: answer when the run finishes, or after this."),
]
_Label = Annotated[str | None, Query(max_length=300, pattern=r"^[^\x00]*$")]


# Shaped like pydantic's errors, so the 422 is the same as any other invalid field's.
_FACTORY_REFUSED = {
    "type": "factory_not_allowed",
    "loc": ("body", "spec", "model", "factory"),
    "msg": submissions.FACTORY_REFUSED,
}


async def _wait_for(context: AppContext, run_id: int, wait_s: float) -> CachedRun | None:
    """The finished run (its status and body), or None when the wait is over first.

    The run is loaded in full at most twice (now, and once it finished); in between, the
    process's one watcher polls only its status (`api.store.runwatch`).
    """
    status, body = await run_in_threadpool(runreads.load_run, context, run_id)
    if status.is_finished():
        return status, body
    timeout_s = min(wait_s, context.settings.max_wait_s)
    if not await context.run_watch.wait_finished(run_id, timeout_s):
        return None
    status, body = await run_in_threadpool(runreads.load_run, context, run_id)
    return (status, body) if status.is_finished() else None


def _json(body: bytes, status_code: int = 200) -> Response:
    return Response(body, status_code=status_code, media_type="application/json")


def _submitted(
    run_id: int,
    status: RunStatus,
    cached: bool,
    run_body: bytes | None,
    notice: str | None = None,
) -> bytes:
    """A `Submitted` body around an already serialised run (no second serialisation)."""
    head = json.dumps(
        {
            "id": run_id,
            "status": status.value,
            "url": run_url(run_id),
            "cached": cached,
            "notice": notice,
        }
    )
    return head[:-1].encode() + b', "run": ' + (run_body or b"null") + b"}"


@router.post(
    "",
    status_code=202,
    response_model=Submitted,
    dependencies=[ClientAuth],
    responses={
        200: {"model": Submitted, "description": "A finished run: cached, or waited for."},
        202: {"model": Submitted, "description": "Queued (or joined an unfinished twin)."},
    },
)
async def submit_run(request: RunCreate, context: ContextDep, wait: WaitSeconds = 0) -> Response:
    """Submit a spec and a device target. A succeeded run with the same fingerprint answers
    at once (200, `cached: true`); otherwise the run is queued (202). A `factory` spec is a
    422 unless the server allows them (`allow_factory_specs`)."""
    if submissions.refuses_factory(context, request):
        raise RequestValidationError([_FACTORY_REFUSED])
    run_fingerprint = fingerprint(request.spec, request.device, context.version)
    known_id = context.finished_runs.succeeded_run(run_fingerprint)
    hit = context.finished_runs.body(known_id) if known_id is not None else None
    if known_id is not None and hit is not None:
        # The hot path: a repeated submission answered without touching the database.
        return _json(_submitted(known_id, hit[0], True, hit[1]))
    run_id, status, cached = await run_in_threadpool(
        submissions.submit, context, request, run_fingerprint
    )
    finished: CachedRun | None = None
    if cached:
        finished = await run_in_threadpool(runreads.load_run, context, run_id)
    elif wait > 0:
        finished = await _wait_for(context, run_id, wait)
    if finished is None:
        notice = await run_in_threadpool(runreads.device_notice, context, request.device)
        return _json(_submitted(run_id, status, False, None, notice), status_code=202)
    return _json(_submitted(run_id, finished[0], cached, finished[1]))


@router.get("", dependencies=[ReaderAuth])
def list_runs(
    context: ContextDep,
    status: RunStatus | None = None,
    model: _Label = None,
    device: _Label = None,
    created_after: UtcDatetime | None = None,
    created_before: UtcDatetime | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_LIMIT)] = 50,
    offset: Annotated[int, Query(ge=0, le=10**9)] = 0,
) -> RunPage:
    """Runs, newest first, filtered by status, model label, device label and creation time."""
    where = runstore.RunFilter(
        status=status,
        model=model,
        device=device,
        created_after=created_after,
        created_before=created_before,
    )
    return runreads.list_runs(context, where=where, limit=limit, offset=offset)


@router.get("/{run_id}", response_model=Run, dependencies=[ReaderAuth], responses=_NOT_FOUND)
async def read_run(run_id: RunId, context: ContextDep, wait: WaitSeconds = 0) -> Response:
    """One run: spec, status, recommendation, exports, attempts, trials, failures, timings."""
    hit = context.finished_runs.body(run_id)
    if hit is not None:
        return _json(hit[1])
    if wait > 0:
        waited = await _wait_for(context, run_id, wait)
        if waited is not None:
            return _json(waited[1])
    _, body = await run_in_threadpool(runreads.load_run, context, run_id)
    return _json(body)


@router.get(
    "/{run_id}/comparison",
    dependencies=[ReaderAuth],
    responses={
        404: {
            "model": ErrorBody,
            "description": "No such run, or no estimate and measurement of it to compare.",
        }
    },
)
def compare_run(run_id: RunId, context: ContextDep) -> Comparison:
    """The run's estimate and measurement on its GPU side by side: each mode's largest
    micro-batch and the recommendations' samples/s, with the estimate's error."""
    with context.db.read() as session:
        return comparison.compare_run(session, run_id=run_id)


@router.post(
    "/{run_id}/cancel",
    dependencies=[ClientAuth],
    responses={
        **_NOT_FOUND,
        409: {"model": ErrorBody, "description": "The run has already finished."},
    },
)
def cancel_run(run_id: RunId, context: ContextDep) -> Run:
    """Cancel a queued or running run."""
    with context.db.write() as session:
        runstore.cancel_run(session, run_id=run_id, now=context.clock())
    with context.db.read() as session:
        return runstore.get_run(session, run_id=run_id)
