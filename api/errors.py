"""Domain errors raised by the run store (`api.store.runstore`, `api.store.leases`,
`api.store.results`) and the auth dependencies, and the handlers that turn them into HTTP.

* ApiError                 (code, status)
  + Unauthenticated        401  no bearer token
  + InvalidToken           401  a token the server does not know (RFC 6750 `invalid_token`)
  + Forbidden              403  a known token without the role this needs
  + RunNotFound            404
  + RunNotCancellable      409  the run has already finished
  + StaleLease             409  the lease is not the run's current lease (expired, requeued,
  |                             finished elsewhere): the event changes nothing
  |  + RunCancelled        409  ... because the run was cancelled while the worker held it
  |  + LeaseExpired        409  the lease lapsed (no heartbeat in time) but nobody else claimed
  |                             the run: a heartbeat renews it, then the event may be sent again
  + ResultRejected         422  a result that does not belong to the run it is posted to
  + InvalidResult          422  a result the tuner could not have produced (its body also
  |                             lists `violations`: [{field, message}])
  + DatabaseUnavailable    503  the database refused, timed out or hung (retry later)

Every such response has the body `{"code": ..., "detail": ...}`
(`autotune.remote.protocol.ErrorBody`), and so do Starlette's own 404/405/413 (unknown path, wrong
method, body over `max_body_size`). A request that fails validation is a 422 `{"code": "invalid",
"detail": [{loc, msg, type}]}`: FastAPI's shape without the offending input, which may not even be
encodable as JSON (NaN) or UTF-8 (a lone surrogate), and need not be reflected back anyway.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError
from starlette.exceptions import HTTPException

from api.store.db import UNREACHABLE_ERRORS
from autotune.core.tuning.result_check import Violation

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """Root of the errors a request can end in on purpose."""

    status_code = 400
    code = "bad_request"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    def body(self) -> dict[str, Any]:
        return {"code": self.code, "detail": self.detail}


class Unauthenticated(ApiError):
    status_code = 401
    code = "unauthenticated"


class InvalidToken(ApiError):
    status_code = 401
    code = "invalid_token"


class Forbidden(ApiError):
    status_code = 403
    code = "forbidden"


class RunNotFound(ApiError):
    status_code = 404
    code = "run_not_found"

    def __init__(self, run_id: int) -> None:
        super().__init__(f"no run with id {run_id}")


class NoComparison(ApiError):
    status_code = 404
    code = "no_comparison"


class RunNotCancellable(ApiError):
    status_code = 409
    code = "run_finished"


class StaleLease(ApiError):
    status_code = 409
    code = "stale_lease"


class RunCancelled(StaleLease):
    code = "run_cancelled"


class LeaseExpired(StaleLease):
    code = "lease_expired"


class ResultRejected(ApiError):
    status_code = 422
    code = "result_rejected"


class InvalidResult(ApiError):
    status_code = 422
    code = "invalid_result"

    def __init__(self, violations: list[Violation]) -> None:
        super().__init__("; ".join(str(v) for v in violations))
        self.violations = violations

    def body(self) -> dict[str, Any]:
        listed = [{"field": v.field, "message": v.message} for v in self.violations]
        return {**super().body(), "violations": listed}


class DatabaseUnavailable(ApiError):
    status_code = 503
    code = "database_unavailable"


# RFC 6750 section 3: a 401 names the scheme, and says why when a token was given.
_CHALLENGES = {
    Unauthenticated.code: "Bearer",
    InvalidToken.code: 'Bearer error="invalid_token"',
}
_HTTP_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
}


def error_response(error: ApiError) -> JSONResponse:
    challenge = _CHALLENGES.get(error.code)
    return JSONResponse(
        error.body(),
        status_code=error.status_code,
        headers={"WWW-Authenticate": challenge} if challenge else None,
    )


async def _handle_api_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ApiError)
    return error_response(error)


async def _handle_data_error(_request: Request, error: Exception) -> JSONResponse:
    # Validation should stop out-of-range values first; if one still reaches the database it
    # is the client's bad value, not a server fault.
    logger.warning("database refused a value: %s", error)
    return JSONResponse(
        {"code": "value_out_of_range", "detail": "a value is out of range for the database"},
        status_code=422,
    )


async def _handle_unreachable_database(_request: Request, error: Exception) -> JSONResponse:
    # Refused, timed out (connect or statement timeout), or the pool is exhausted by hung
    # connections: the request may succeed later, so 503, which clients retry.
    logger.warning("database unavailable: %s", str(error).splitlines()[0] if str(error) else error)
    return error_response(DatabaseUnavailable("the database is unavailable; retry later"))


def _printable(text: str) -> str:
    # A message or a dict key inside a location may carry the lone surrogate it complains of.
    return text.encode("utf-8", "backslashreplace").decode()


def _problem(error: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": error["type"],
        "loc": [part if isinstance(part, int) else _printable(str(part)) for part in error["loc"]],
        "msg": _printable(str(error["msg"])),
    }


async def _handle_validation_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    problems = [_problem(problem) for problem in error.errors()]
    return JSONResponse({"code": "invalid", "detail": problems}, status_code=422)


async def _handle_http_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, HTTPException)
    code = _HTTP_CODES.get(error.status_code, f"http_{error.status_code}")
    return JSONResponse(
        {"code": code, "detail": str(error.detail)},
        status_code=error.status_code,
        headers=error.headers,
    )


def register_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _handle_api_error)
    app.add_exception_handler(DataError, _handle_data_error)
    for unreachable in UNREACHABLE_ERRORS:
        app.add_exception_handler(unreachable, _handle_unreachable_database)
    app.add_exception_handler(RequestValidationError, _handle_validation_error)
    app.add_exception_handler(HTTPException, _handle_http_error)
