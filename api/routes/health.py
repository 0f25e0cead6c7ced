"""GET /health: the process is up and the database answers (503 when it does not, promptly);
with the state of the estimate worker `serve` runs beside itself, where it runs one (a worker
that is restarting is reported, not a 503: the API itself still answers)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from api.deps import ContextDep
from api.errors import DatabaseUnavailable
from autotune.remote.protocol import ErrorBody, Health

_UNAVAILABLE: dict[int | str, dict[str, Any]] = {
    503: {"model": ErrorBody, "description": "The database refused, failed or did not answer."}
}

router = APIRouter(tags=["health"])


@router.get("/health", responses=_UNAVAILABLE)
async def read_health(context: ContextDep) -> Health:
    # A database that accepts connections and never answers would hold the ping until TCP
    # keepalives give up (tens of seconds); a load balancer needs its answer sooner.
    try:
        await asyncio.wait_for(
            run_in_threadpool(context.db.ping), timeout=context.settings.health_timeout_s
        )
    except TimeoutError:
        raise DatabaseUnavailable(
            f"the database did not answer within {context.settings.health_timeout_s:g} s"
        ) from None
    estimates = context.estimate_workers
    return Health(
        status="ok",
        database="ok",
        version=context.version,
        estimate_workers=estimates() if estimates is not None else [],
    )
