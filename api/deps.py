"""Request dependencies: the app context (database, settings, clock) and bearer-token roles.

Tokens come from `Settings`; comparisons are constant-time. A missing token is 401, an unknown
token is 401 `invalid_token` (RFC 6750), a known token without the needed role is 403. With no
tokens configured nothing is authorised: the server never runs open by accident (`autotune
serve` generates tokens instead).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Annotated

from fastapi import Depends, Request

from api.errors import Forbidden, InvalidToken, Unauthenticated
from api.settings import Settings
from api.store.db import Database
from api.store.runcache import FinishedRunCache
from api.store.runwatch import RunWatch
from autotune.remote.protocol import EstimateWorkerHealth


@dataclass(frozen=True)
class AppContext:
    """What every route needs, built once by `create_app` and kept on `app.state`."""

    settings: Settings
    db: Database
    clock: Callable[[], datetime]
    version: str
    finished_runs: FinishedRunCache
    run_watch: RunWatch
    # The embedded estimate workers' states (`api.estimate_worker.Pool.health`), when this
    # process supervises them.
    estimate_workers: Callable[[], list[EstimateWorkerHealth]] | None = None


async def get_context(request: Request) -> AppContext:
    # async (though it awaits nothing) so that FastAPI runs it on the event loop, not in the
    # thread pool: a thread hop per dependency is measurable at a thousand requests a second.
    return context_of(request)


def context_of(request: Request) -> AppContext:
    """The app's context, for handlers that read the request themselves (the web pages)."""
    context: AppContext = request.app.state.context
    return context


ContextDep = Annotated[AppContext, Depends(get_context)]


class Role(StrEnum):
    READER = "reader"  # GET runs: client or worker tokens, or anyone with open_reads
    CLIENT = "client"  # submit and cancel
    WORKER = "worker"  # the worker protocol


def _bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _is_one_of(token: str, allowed: list[str]) -> bool:
    # Check every token so the time taken does not reveal which one nearly matched.
    found = False
    for candidate in allowed:
        found |= hmac.compare_digest(token.encode(), candidate.encode())
    return found


def authorize(role: Role) -> Callable[[Request], Awaitable[None]]:
    """A dependency that lets the request through only with a token for `role`."""

    async def check(request: Request) -> None:
        settings = context_of(request).settings
        token = _bearer_token(request)
        if token is None and not (role == Role.READER and settings.open_reads):
            raise Unauthenticated("missing bearer token (Authorization: Bearer <token>)")
        check_token(settings, role, token)

    return check


def check_token(settings: Settings, role: Role, token: str | None) -> None:
    """Let `token` act as `role`, or raise: 401 for none or an unknown one, 403 for a known
    token without the role. The API reads it from the Authorization header, the web pages
    from their cookie (`api.web.pages`)."""
    if role == Role.READER and settings.open_reads:
        return
    if token is None:
        raise Unauthenticated("missing token")
    allowed = {
        Role.READER: settings.client_tokens + settings.worker_tokens,
        Role.CLIENT: settings.client_tokens,
        Role.WORKER: settings.worker_tokens,
    }[role]
    if _is_one_of(token, allowed):
        return
    if not is_known_token(settings, token):
        raise InvalidToken("unknown bearer token")
    raise Forbidden(f"this token may not act as {role.value}")


ReaderAuth = Depends(authorize(Role.READER))
ClientAuth = Depends(authorize(Role.CLIENT))
WorkerAuth = Depends(authorize(Role.WORKER))


def is_known_token(settings: Settings, token: str) -> bool:
    """Whether `token` is one of the server's client or worker tokens."""
    return _is_one_of(token, settings.client_tokens + settings.worker_tokens)
