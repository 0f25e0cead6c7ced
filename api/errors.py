"""Domain errors raised by `api.crud` and `api.auth`, and the handlers that turn them into HTTP.

* ApiError                 (code, status)
  + Unauthenticated        401  no bearer token
  + Forbidden              403  a token that does not allow this
  + RunNotFound            404
  + RunNotCancellable      409  the run has already finished
  + StaleLease             409  the lease is not the run's current lease (expired, requeued,
  |                             finished elsewhere): the event changes nothing
  |  + RunCancelled        409  ... because the run was cancelled while the worker held it
  + ResultRejected         422  a result that does not belong to the run it is posted to

Every such response has the body `{"code": ..., "detail": ...}` (`autotune.protocol.ErrorBody`).
Bodies over the size limit are refused with 413 by FastAPI's own `max_body_size` before parsing.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """Root of the errors a request can end in on purpose."""

    status_code = 400
    code = "bad_request"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Unauthenticated(ApiError):
    status_code = 401
    code = "unauthenticated"


class Forbidden(ApiError):
    status_code = 403
    code = "forbidden"


class RunNotFound(ApiError):
    status_code = 404
    code = "run_not_found"

    def __init__(self, run_id: int) -> None:
        super().__init__(f"no run with id {run_id}")


class RunNotCancellable(ApiError):
    status_code = 409
    code = "run_finished"


class StaleLease(ApiError):
    status_code = 409
    code = "stale_lease"


class RunCancelled(StaleLease):
    code = "run_cancelled"


class ResultRejected(ApiError):
    status_code = 422
    code = "result_rejected"


def error_response(error: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status_code == 401 else None
    return JSONResponse(
        {"code": error.code, "detail": error.detail},
        status_code=error.status_code,
        headers=headers,
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


def register_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _handle_api_error)
    app.add_exception_handler(DataError, _handle_data_error)
