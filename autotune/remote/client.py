"""`ServerClient`: the typed HTTP client of the autotune server, for the CLI and probe workers.

Transport errors and 502/503/504 are retried with exponential backoff; every other error status
becomes a typed exception carrying the server's code and message:

* ServerError(AutotuneError)
  + ServerUnavailable      the server could not be reached (after retries) or answered 5xx
  + RequestRejected        a 4xx answer; `.status_code`, `.code`, `.detail`
    - AuthError            401 / 403
    - NotFound             404
    - Conflict             409
      . LeaseLost          409 from a worker call: the lease is stale or the run was cancelled;
                           stop working on the run (`.cancelled` tells which)
        LeaseExpired       409 `lease_expired`: the lease lapsed but a heartbeat may renew it
    - InvalidRequest       413 / 422 (and any other 4xx)
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar

import httpx2
from pydantic import BaseModel

from autotune.core.defaults import DEFAULT_SERVER_URL
from autotune.core.errors import AutotuneError
from autotune.core.schemas import DeviceInfo, Spec, StepOutcome, Trial, TuneResult
from autotune.remote.protocol import (
    API_PREFIX,
    AnyTarget,
    AttemptEvent,
    Claim,
    ClaimRequest,
    Comparison,
    EventAck,
    FailureReport,
    Health,
    Heartbeat,
    Lease,
    ResultSubmission,
    Run,
    RunCreate,
    RunPage,
    RunStatus,
    Submitted,
    TrialEvent,
)

logger = logging.getLogger(__name__)

_RETRY_STATUSES = frozenset({502, 503, 504})
ModelT = TypeVar("ModelT", bound=BaseModel)


class ServerError(AutotuneError):
    """Root of the errors talking to the server."""


class ServerUnavailable(ServerError):
    """No usable answer: connection failures or 5xx, after every retry."""


class RequestRejected(ServerError):
    """The server refused the request (4xx)."""

    def __init__(self, status_code: int, code: str, detail: str) -> None:
        super().__init__(f"{status_code} {code}: {detail}")
        self.status_code = status_code
        self.code = code
        self.detail = detail


class AuthError(RequestRejected):
    """401 (no token) or 403 (a token without the needed role)."""


class NotFound(RequestRejected):
    """404: no such run."""


class Conflict(RequestRejected):
    """409: the run is not in a state that allows this."""


class LeaseLost(Conflict):
    """409 on a worker call: stop working on this run; nothing was stored."""

    @property
    def cancelled(self) -> bool:
        return self.code == "run_cancelled"


class LeaseExpired(LeaseLost):
    """409 `lease_expired` on a worker post: the lease lapsed (no heartbeat in time), nothing
    was stored; a heartbeat renews it unless another worker claimed the run since."""


class InvalidRequest(RequestRejected):
    """413 or 422: the body was refused; `detail` names the field."""


def _rejection(response: httpx2.Response, *, worker_call: bool) -> RequestRejected:
    status = response.status_code
    code, detail = f"http_{status}", response.reason_phrase
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        code = str(body.get("code", code))
        raw = body.get("detail", detail)
        if isinstance(raw, list) and raw and isinstance(raw[0], dict):
            # FastAPI's 422: name the field of the first problem.
            location = ".".join(str(p) for p in raw[0].get("loc", []) if p != "body")
            detail = f"{location}: {raw[0].get('msg', '')}" if location else str(raw[0])
            code = "invalid"
        else:
            detail = str(raw)
    kind: type[RequestRejected]
    if status in (401, 403):
        kind = AuthError
    elif status == 404:
        kind = NotFound
    elif status == 409:
        if not worker_call:
            kind = Conflict
        else:
            kind = LeaseExpired if code == "lease_expired" else LeaseLost
    else:
        kind = InvalidRequest
    return kind(status, code, detail)


def _storable_text(text: str) -> str:
    """An error's text as the server accepts it: a path decoded with surrogateescape or a NUL
    from a child's output would otherwise make the report itself invalid."""
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode()


class ServerClient:
    """A client of one autotune server.

    Args:
        base_url: e.g. "http://127.0.0.1:8000".
        token: the bearer token (a client token, or a worker token for the worker calls).
        http: an `httpx2.Client` to use instead of a new one (e.g. a Starlette TestClient).
        retries: extra tries after a transport error or a 502/503/504.
        backoff_s: first wait between tries; doubles each time.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_SERVER_URL,
        *,
        token: str | None = None,
        http: httpx2.Client | None = None,
        timeout_s: float = 30.0,
        retries: int = 4,
        backoff_s: float = 0.25,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._owns_http = http is None
        self._http = http or httpx2.Client(base_url=base_url, timeout=timeout_s)
        self._headers = headers
        self._retries = retries
        self._backoff_s = backoff_s

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> ServerClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _request(
        self,
        method: str,
        path: str,
        *,
        body: BaseModel | None = None,
        params: dict[str, Any] | None = None,
        worker_call: bool = False,
        timeout_s: float | None = None,
    ) -> httpx2.Response:
        content = body.model_dump_json().encode() if body is not None else None
        headers = dict(self._headers)
        if content is not None:
            headers["Content-Type"] = "application/json"
        # An injected client (e.g. a TestClient) keeps its own timeouts.
        own_timeout = timeout_s is not None and self._owns_http
        extra: dict[str, Any] = {"timeout": timeout_s} if own_timeout else {}
        delay_s = self._backoff_s
        for attempt in range(self._retries + 1):
            last_try = attempt == self._retries
            try:
                response = self._http.request(
                    method, path, content=content, params=params, headers=headers, **extra
                )
            except httpx2.TransportError as error:
                if last_try:
                    raise ServerUnavailable(f"{method} {path}: {error}") from error
                logger.warning(
                    "%s %s failed (%s); retrying in %.2fs", method, path, error, delay_s
                )
            else:
                if response.status_code < 400:
                    return response
                if response.status_code < 500:
                    raise _rejection(response, worker_call=worker_call)
                if last_try or response.status_code not in _RETRY_STATUSES:
                    raise ServerUnavailable(
                        f"{method} {path}: {response.status_code} {response.text[:200]}"
                    )
                logger.warning("%s %s: %d; retrying", method, path, response.status_code)
            time.sleep(delay_s)
            delay_s *= 2
        raise AssertionError("unreachable")

    @staticmethod
    def _parse(response: httpx2.Response, model: type[ModelT]) -> ModelT:
        return model.model_validate_json(response.content)

    # -- users ----------------------------------------------------------------------------

    def health(self) -> Health:
        return self._parse(self._request("GET", "/health"), Health)

    def submit_run(self, spec: Spec, device: AnyTarget, *, wait_s: float = 0) -> Submitted:
        """Submit a spec; `.cached` and `.run` are set when a finished run answers it."""
        params = {"wait": wait_s} if wait_s > 0 else None
        response = self._request(
            "POST",
            f"{API_PREFIX}/runs",
            body=RunCreate(spec=spec, device=device),
            params=params,
            timeout_s=wait_s + 30 if wait_s > 0 else None,
        )
        return self._parse(response, Submitted)

    def get_run(self, run_id: int, *, wait_s: float = 0) -> Run:
        """A run; with `wait_s`, the server answers as soon as it finishes (or after wait_s)."""
        params = {"wait": wait_s} if wait_s > 0 else None
        response = self._request(
            "GET",
            f"{API_PREFIX}/runs/{run_id}",
            params=params,
            timeout_s=wait_s + 30 if wait_s > 0 else None,
        )
        return self._parse(response, Run)

    def get_comparison(self, run_id: int) -> Comparison:
        """The run's estimate and measurement side by side (RequestRejected 404 `no_comparison`
        when it has no counterpart yet)."""
        response = self._request("GET", f"{API_PREFIX}/runs/{run_id}/comparison")
        return self._parse(response, Comparison)

    def wait_for_run(self, run_id: int, *, timeout_s: float, poll_s: float = 30.0) -> Run:
        """Long-poll until the run finishes or `timeout_s` passes (then its current state)."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_s = deadline - time.monotonic()
            run = self.get_run(run_id, wait_s=max(0.0, min(poll_s, remaining_s)))
            if run.status.is_finished() or time.monotonic() >= deadline:
                return run

    def list_runs(
        self,
        *,
        status: RunStatus | None = None,
        model: str | None = None,
        device: str | None = None,
        created_after: datetime | None = None,
        created_before: datetime | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> RunPage:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        for name, value in (
            ("status", status.value if status else None),
            ("model", model),
            ("device", device),
            ("created_after", created_after.isoformat() if created_after else None),
            ("created_before", created_before.isoformat() if created_before else None),
        ):
            if value is not None:
                params[name] = value
        return self._parse(self._request("GET", f"{API_PREFIX}/runs", params=params), RunPage)

    def cancel_run(self, run_id: int) -> Run:
        return self._parse(self._request("POST", f"{API_PREFIX}/runs/{run_id}/cancel"), Run)

    # -- workers --------------------------------------------------------------------------

    def claim(self, worker_id: str, devices: list[DeviceInfo]) -> Claim | None:
        """The oldest queued run one of `devices` can take, under a new lease; None if none."""
        response = self._request(
            "POST",
            f"{API_PREFIX}/worker/claim",
            body=ClaimRequest(worker_id=worker_id, devices=devices),
            worker_call=True,
        )
        if response.status_code == 204:
            return None
        return self._parse(response, Claim)

    def heartbeat(self, run_id: int, lease_id: str) -> Lease:
        response = self._request(
            "POST",
            f"{API_PREFIX}/worker/runs/{run_id}/heartbeat",
            body=Heartbeat(lease_id=lease_id),
            worker_call=True,
        )
        return self._parse(response, Lease)

    def post_attempt(
        self,
        run_id: int,
        lease_id: str,
        *,
        sequence: int,
        checkpointing: bool,
        attempt: StepOutcome,
    ) -> EventAck:
        """Stream one probe attempt; a retry with the same sequence number is stored once."""
        event = AttemptEvent(
            lease_id=lease_id, sequence=sequence, checkpointing=checkpointing, attempt=attempt
        )
        response = self._request(
            "POST", f"{API_PREFIX}/worker/runs/{run_id}/attempts", body=event, worker_call=True
        )
        return self._parse(response, EventAck)

    def post_trial(self, run_id: int, lease_id: str, trial: Trial) -> EventAck:
        """Stream one trial; a retry with the same trial number is stored once."""
        response = self._request(
            "POST",
            f"{API_PREFIX}/worker/runs/{run_id}/trials",
            body=TrialEvent(lease_id=lease_id, trial=trial),
            worker_call=True,
        )
        return self._parse(response, EventAck)

    def submit_result(self, run_id: int, lease_id: str, result: TuneResult) -> Run:
        response = self._request(
            "POST",
            f"{API_PREFIX}/worker/runs/{run_id}/result",
            body=ResultSubmission(lease_id=lease_id, result=result),
            worker_call=True,
        )
        return self._parse(response, Run)

    def report_failure(
        self,
        run_id: int,
        lease_id: str,
        *,
        error_type: str,
        message: str,
        traceback_tail: str | None = None,
        retryable: bool = True,
        study_name: str | None = None,
    ) -> Run:
        report = FailureReport(
            lease_id=lease_id,
            error_type=_storable_text(error_type)[:200],
            message=_storable_text(message)[:10_000],
            traceback_tail=_storable_text(traceback_tail)[-10_000:] if traceback_tail else None,
            retryable=retryable,
            study_name=study_name,
        )
        response = self._request(
            "POST", f"{API_PREFIX}/worker/runs/{run_id}/failure", body=report, worker_call=True
        )
        return self._parse(response, Run)
