"""A PostgreSQL that refuses connections or accepts them and never answers: the server's
/health says 503 with a JSON body within seconds, the client retries 503 until the database is
back, statements time out, and `autotune serve` says in one line that it cannot reach the
database. Real uvicorn and `autotune serve` processes; the outage is a loopback TCP proxy in
front of the real PostgreSQL (tests/api_tests/tcp_proxy.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from sqlalchemy import make_url, text
from sqlalchemy.exc import OperationalError

from api.store.db import Database
from autotune.remote.client import ServerClient
from tests.api_tests.tcp_proxy import Mode, TcpProxy
from tests.conftest import LiveServer, free_port, start_server, stop_server

pytestmark = pytest.mark.slow
# Generous: the server answers within its health timeout (3 s); this only bounds a hang.
HTTP_TIMEOUT_S = 30.0


@pytest.fixture
def proxy(postgres_url: str) -> Iterator[TcpProxy]:
    url = make_url(postgres_url)
    with TcpProxy((url.host or "127.0.0.1", url.port or 5432)) as tcp_proxy:
        yield tcp_proxy


@pytest.fixture
def proxied_server(postgres_url: str, proxy: TcpProxy, tmp_path: Path) -> Iterator[LiveServer]:
    url = make_url(postgres_url).set(port=proxy.port).render_as_string(hide_password=False)
    server = start_server(url, tmp_path / "server.log")
    yield server
    proxy.set_mode(Mode.FORWARD)  # let any held request finish so the server stops promptly
    stop_server(server)


def _health(server: LiveServer) -> httpx2.Response:
    return httpx2.get(f"{server.url}/health", timeout=HTTP_TIMEOUT_S)


def test_health_is_503_json_when_the_database_refuses_or_hangs(
    proxied_server: LiveServer, proxy: TcpProxy
) -> None:
    assert _health(proxied_server).status_code == 200
    for mode in (Mode.HANG, Mode.REFUSE):
        proxy.set_mode(mode)
        response = _health(proxied_server)
        assert response.status_code == 503, (mode, response.text)
        assert response.json()["code"] == "database_unavailable"
        proxy.set_mode(Mode.FORWARD)
        assert _health(proxied_server).status_code == 200  # and it recovers


def test_client_retries_503_until_the_database_is_back(
    proxied_server: LiveServer, proxy: TcpProxy
) -> None:
    proxy.set_mode(Mode.REFUSE)
    statuses: list[int] = []

    def on_response(response: httpx2.Response) -> None:
        # The database comes back once the client has been told it is unavailable.
        statuses.append(response.status_code)
        proxy.set_mode(Mode.FORWARD)

    http = httpx2.Client(
        base_url=proxied_server.url,
        timeout=HTTP_TIMEOUT_S,
        event_hooks={"response": [on_response]},
    )
    with http, ServerClient(http=http, retries=3, backoff_s=0.05) as client:
        assert client.health().status == "ok"
    assert statuses == [503, 200]


def test_statements_time_out_and_url_options_are_kept(postgres_url: str) -> None:
    database = Database(postgres_url, statement_timeout_s=0.2)
    try:
        with database.engine.connect() as connection:
            # The fixture's URL sets search_path through `options`; the timeout is added to it.
            assert (
                connection.execute(text("SHOW search_path"))
                .scalar_one()
                .startswith("autotune_test_")
            )
            with pytest.raises(OperationalError, match="statement timeout"):
                connection.execute(text("SELECT pg_sleep(10)"))
    finally:
        database.dispose()


def _serve(database_url: str, tmp_path: Path) -> tuple[int, str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")}
    started = time.monotonic()
    process = subprocess.run(
        [sys.executable, "-m", "autotune.cli.main", "serve", "--port", str(free_port())]
        + ["--db", database_url, "--no-estimates"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return process.returncode, process.stderr, time.monotonic() - started


@pytest.mark.e2e
def test_serve_says_in_one_line_that_a_silent_database_cannot_be_reached(
    tmp_path: Path,
) -> None:
    with TcpProxy(None) as silent:  # accepts connections, never answers
        url = f"postgresql+psycopg://postgres:secret@127.0.0.1:{silent.port}/test"
        returncode, stderr, elapsed_s = _serve(url, tmp_path)
    assert returncode == 1
    assert stderr.count("\n") == 1, stderr
    assert stderr.startswith(
        f"autotune: error: cannot reach the database at "
        f"postgresql+psycopg://postgres:***@127.0.0.1:{silent.port}/test: "
    )
    assert "secret" not in stderr
    print(f"serve gave up on a silent database after {elapsed_s:.1f} s")


@pytest.mark.e2e
def test_serve_says_in_one_line_that_a_refused_database_cannot_be_reached(
    tmp_path: Path,
) -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test"
    returncode, stderr, _ = _serve(url, tmp_path)
    assert returncode == 1
    assert stderr.count("\n") == 1, stderr
    assert "cannot reach the database" in stderr and "refused" in stderr
