"""The FastAPI application: `create_app(settings)` builds it (migrating the database first).

Run it with `autotune serve`, or `uvicorn --factory api.main:create_app_from_env`. This package
never imports torch: the server installs and starts without it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

import autotune
from api.deps import AppContext
from api.errors import register_error_handlers
from api.routes import health, runs, worker
from api.security_headers import SecurityHeaders
from api.settings import Settings
from api.store.db import Database, migrate
from api.store.runcache import FinishedRunCache
from api.store.runwatch import RunWatch
from api.web import pages
from autotune.remote.protocol import API_PREFIX, EstimateWorkerHealth

logger = logging.getLogger(__name__)


def _utc_now() -> datetime:
    return datetime.now(UTC)


def create_app(
    settings: Settings,
    *,
    clock: Callable[[], datetime] = _utc_now,
    estimate_workers: Callable[[], list[EstimateWorkerHealth]] | None = None,
) -> FastAPI:
    """The API for `settings`; the schema is migrated to the newest revision before returning.

    Args:
        settings: everything configurable; nothing else is read from the environment.
        clock: the server's notion of now (aware UTC); tests pass a controllable one.
        estimate_workers: the state of the estimate workers beside this server, for /health.
    """
    database = Database(
        settings.resolved_database_url(),
        connect_timeout_s=settings.database_connect_timeout_s,
        statement_timeout_s=settings.database_statement_timeout_s,
    )
    migrate(database)
    if not settings.client_tokens and not settings.worker_tokens and not settings.open_reads:
        logger.warning("no tokens configured: every protected endpoint will answer 401/403")

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        database.dispose()

    app = FastAPI(
        title="autotune",
        version=autotune.__version__,
        summary="The largest micro-batch that fits, and the fastest accumulation for a batch.",
        lifespan=lifespan,
        max_body_size=settings.max_body_bytes,
    )
    app.state.context = AppContext(
        settings=settings,
        db=database,
        clock=clock,
        version=autotune.__version__,
        finished_runs=FinishedRunCache(),
        run_watch=RunWatch(
            database,
            clock=clock,
            max_claims=settings.max_claims,
            poll_s=settings.wait_poll_s,
        ),
        estimate_workers=estimate_workers,
    )
    register_error_handlers(app)
    app.add_middleware(SecurityHeaders)
    app.include_router(health.router)
    app.include_router(runs.router, prefix=API_PREFIX)
    app.include_router(worker.router, prefix=API_PREFIX)
    app.include_router(pages.router)
    app.mount("/static", StaticFiles(directory=Path(pages.__file__).parent / "static"), "static")
    return app


def create_app_from_env() -> FastAPI:
    """Entry point for `uvicorn --factory`: settings from `AUTOTUNE_*` variables."""
    return create_app(Settings())
