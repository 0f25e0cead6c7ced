"""Tokens: 401 without one or with an unknown one (RFC 6750 `invalid_token`), 403 with one of
the wrong role, reads opened only by a setting."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from api.main import create_app
from api.settings import Settings
from tests.conftest import CLIENT_TOKEN, WORKER_TOKEN

pytestmark = pytest.mark.usefixtures("db_url")

RUN_BODY = {
    "spec": {"model": {"preset": "mlp"}},
    "device": {"kind": "emulated", "memory_bytes": 1024},
}
LEASE = {"lease_id": "ab"}
# (method, path, body, the role it needs)
ENDPOINTS = [
    ("POST", "/api/v1/runs", RUN_BODY, "client"),
    ("POST", "/api/v1/runs/1/cancel", None, "client"),
    ("GET", "/api/v1/runs", None, "reader"),
    ("GET", "/api/v1/runs/1", None, "reader"),
    ("POST", "/api/v1/worker/claim", {"worker_id": "w", "devices": []}, "worker"),
    ("POST", "/api/v1/worker/runs/1/heartbeat", LEASE, "worker"),
    ("POST", "/api/v1/worker/runs/1/attempts", LEASE, "worker"),
    ("POST", "/api/v1/worker/runs/1/trials", LEASE, "worker"),
    ("POST", "/api/v1/worker/runs/1/result", LEASE, "worker"),
    ("POST", "/api/v1/worker/runs/1/failure", LEASE, "worker"),
]
TOKENS = {"client": CLIENT_TOKEN, "worker": WORKER_TOKEN}


def _call(
    http: TestClient, method: str, path: str, body: object, token: str | None
) -> tuple[int, dict[str, object]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = http.request(method, path, json=body, headers=headers)
    return response.status_code, response.json()


@pytest.mark.parametrize(("method", "path", "body", "role"), ENDPOINTS)
def test_missing_token_is_401(
    http: TestClient, method: str, path: str, body: object, role: str
) -> None:
    status, payload = _call(http, method, path, body, None)
    assert (status, payload["code"]) == (401, "unauthenticated")


@pytest.mark.parametrize(("method", "path", "body", "role"), ENDPOINTS)
def test_unknown_token_is_401_invalid_token(
    http: TestClient, method: str, path: str, body: object, role: str
) -> None:
    headers = {"Authorization": "Bearer not-a-token"}
    response = http.request(method, path, json=body, headers=headers)
    assert (response.status_code, response.json()["code"]) == (401, "invalid_token")
    assert response.headers["www-authenticate"] == 'Bearer error="invalid_token"'


@pytest.mark.parametrize(("method", "path", "body", "role"), ENDPOINTS)
def test_token_of_the_wrong_role_is_403(
    http: TestClient, method: str, path: str, body: object, role: str
) -> None:
    if role in TOKENS:
        other = WORKER_TOKEN if role == "client" else CLIENT_TOKEN
        status, payload = _call(http, method, path, body, other)
        assert (status, payload["code"]) == (403, "forbidden")


@pytest.mark.parametrize(("method", "path", "body", "role"), ENDPOINTS)
def test_right_token_gets_past_auth(
    http: TestClient, method: str, path: str, body: object, role: str
) -> None:
    for token in [TOKENS[role]] if role in TOKENS else [CLIENT_TOKEN, WORKER_TOKEN]:
        status, _ = _call(http, method, path, body, token)
        assert status not in (401, 403)


def test_401_says_how_to_authenticate(http: TestClient) -> None:
    response = http.get("/api/v1/runs")
    assert response.headers["www-authenticate"] == "Bearer"
    response = http.get("/api/v1/runs", headers={"Authorization": "Basic abc"})
    assert response.status_code == 401


def _app(settings_factory: Callable[..., Settings], **overrides: object) -> FastAPI:
    return create_app(settings_factory(**overrides))


def test_open_reads_opens_only_reads(settings_factory: Callable[..., Settings]) -> None:
    with TestClient(_app(settings_factory, open_reads=True)) as http:
        assert http.get("/api/v1/runs").status_code == 200
        assert http.get("/api/v1/runs/7").status_code == 404
        assert http.post("/api/v1/runs", json=RUN_BODY).status_code == 401
        assert http.post("/api/v1/worker/claim", json={}).status_code == 401


def test_without_configured_tokens_nothing_is_open(
    settings_factory: Callable[..., Settings],
) -> None:
    with TestClient(_app(settings_factory, client_tokens=[], worker_tokens=[])) as http:
        assert http.get("/api/v1/runs").status_code == 401
        headers = {"Authorization": "Bearer anything"}
        assert http.get("/api/v1/runs", headers=headers).status_code == 401
        assert http.post("/api/v1/runs", json=RUN_BODY, headers=headers).status_code == 401


def test_several_tokens_per_role_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, settings_factory: Callable[..., Settings]
) -> None:
    monkeypatch.setenv("AUTOTUNE_CLIENT_TOKENS", "one, two")
    monkeypatch.setenv("AUTOTUNE_WORKER_TOKENS", '["three"]')
    from_env = Settings()
    assert (from_env.client_tokens, from_env.worker_tokens) == (["one", "two"], ["three"])
    app = _app(settings_factory, client_tokens=from_env.client_tokens)
    with TestClient(app) as http:
        for token in ("one", "two"):
            headers = {"Authorization": f"Bearer {token}"}
            assert http.post("/api/v1/runs", json=RUN_BODY, headers=headers).status_code in (
                200,
                202,
            )
