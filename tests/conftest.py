"""Shared fixtures: a fresh database per test (a SQLite file, or a fresh PostgreSQL schema),
the app built on it with a controllable clock, clients, and a real uvicorn server process.

PostgreSQL comes from AUTOTUNE_TEST_POSTGRES_URL (default: postgres@127.0.0.1:5432/test). An
unreachable server fails its tests; they skip only with AUTOTUNE_TEST_SKIP_POSTGRES=1.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import quote

import httpx2
import pytest
from fastapi import FastAPI
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError
from starlette.testclient import TestClient

from api.main import create_app
from api.settings import Settings
from autotune.remote.client import ServerClient

CLIENT_TOKEN = "client-token-for-tests"
WORKER_TOKEN = "worker-token-for-tests"
POSTGRES_URL = os.environ.get(
    "AUTOTUNE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
BACKENDS = ["sqlite", "postgres"]


def _postgres_reachable() -> bool:
    engine = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
    try:
        with engine.connect():
            return True
    except OperationalError:
        return False
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def postgres_available() -> bool:
    return _postgres_reachable()


@pytest.fixture
def postgres_url(postgres_available: bool) -> Iterator[str]:
    """A URL whose connections see only a fresh, empty schema (dropped afterwards)."""
    if not postgres_available:
        # PostgreSQL is part of the test set-up on every machine and in CI: a silent skip would
        # let the PostgreSQL mode go untested. Skipping is an explicit choice.
        if os.environ.get("AUTOTUNE_TEST_SKIP_POSTGRES") == "1":
            pytest.skip(f"PostgreSQL is not reachable at {POSTGRES_URL}")
        pytest.fail(
            f"PostgreSQL is not reachable at {POSTGRES_URL} (set AUTOTUNE_TEST_POSTGRES_URL, or "
            "AUTOTUNE_TEST_SKIP_POSTGRES=1 to skip the PostgreSQL tests)"
        )
    schema = f"autotune_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    separator = "&" if "?" in POSTGRES_URL else "?"
    yield f"{POSTGRES_URL}{separator}options={quote(f'-csearch_path={schema}')}"
    with admin.connect() as connection:
        connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'autotune.db'}"


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest) -> str:
    """Each test using this runs twice: on a fresh SQLite file and on a fresh Postgres schema."""
    fixture = "sqlite_url" if request.param == "sqlite" else "postgres_url"
    url: str = request.getfixturevalue(fixture)
    return url


@dataclass
class FakeClock:
    """The server's clock, moved by hand so lease expiry needs no sleeping."""

    now: datetime = field(default_factory=lambda: datetime(2026, 1, 1, tzinfo=UTC))

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def settings_factory(db_url: str, tmp_path: Path) -> Callable[..., Settings]:
    def make(**overrides: object) -> Settings:
        values: dict[str, object] = {
            "database_url": db_url,
            "data_dir": tmp_path,
            "client_tokens": [CLIENT_TOKEN],
            "worker_tokens": [WORKER_TOKEN],
            "lease_s": 30.0,
            "max_claims": 3,
            "wait_poll_s": 0.02,
        }
        values.update(overrides)
        return Settings(**values)  # type: ignore[arg-type]

    return make


@pytest.fixture
def settings(settings_factory: Callable[..., Settings]) -> Settings:
    return settings_factory()


@pytest.fixture
def app(settings: Settings, clock: FakeClock) -> Iterator[FastAPI]:
    application = create_app(settings, clock=clock)
    yield application
    application.state.context.db.dispose()


@pytest.fixture
def http(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture
def user(http: TestClient) -> ServerClient:
    """A user's client (client token) talking to the in-process app."""
    return ServerClient(http=http, token=CLIENT_TOKEN, retries=0)


@pytest.fixture
def worker(http: TestClient) -> ServerClient:
    """A probe worker's client (worker token) talking to the in-process app."""
    return ServerClient(http=http, token=WORKER_TOKEN, retries=0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class LiveServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path


def start_server(
    database_url: str, log_path: Path, *, extra_env: dict[str, str] | None = None
) -> LiveServer:
    """A real uvicorn process on loopback serving `api.main` (a TestClient is not a server)."""
    return start_servers(database_url, [log_path], extra_env=extra_env)[0]


def start_servers(
    database_url: str, log_paths: list[Path], *, extra_env: dict[str, str] | None = None
) -> list[LiveServer]:
    """One server process per log path, all launched before any is waited for."""
    env = {
        **os.environ,
        "AUTOTUNE_DATABASE_URL": database_url,
        "AUTOTUNE_CLIENT_TOKENS": CLIENT_TOKEN,
        "AUTOTUNE_WORKER_TOKENS": WORKER_TOKEN,
        **(extra_env or {}),
    }
    servers = []
    for log_path in log_paths:
        port = free_port()
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "--factory",
                    "api.main:create_app_from_env",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--log-level",
                    "warning",
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        servers.append(LiveServer(f"http://127.0.0.1:{port}", process, log_path))
    for server in servers:
        wait_for_health(server.url, server.process, server.log_path)
    return servers


def wait_for_health(url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited early:\n{log_path.read_text()}")
        try:
            if httpx2.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx2.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"server did not become healthy:\n{log_path.read_text()}")


def stop_server(server: LiveServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture
def live_server(db_url: str, tmp_path: Path) -> Iterator[LiveServer]:
    server = start_server(db_url, tmp_path / "server.log")
    yield server
    stop_server(server)
