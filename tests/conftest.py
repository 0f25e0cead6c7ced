"""Shared fixtures: a fresh database per test (a SQLite file, or a fresh PostgreSQL schema),
the app built on it with a controllable clock, clients, and a real uvicorn server process.

PostgreSQL comes from AUTOTUNE_TEST_POSTGRES_URL (default: postgres@127.0.0.1:5432/test). An
unreachable server fails its tests; they skip only with AUTOTUNE_TEST_SKIP_POSTGRES=1.

The suite runs in parallel (pytest-xdist, `make test`), so nothing here is shared between tests:
servers listen on ports nobody else is handed (`start_servers`, `free_port`), and every database,
directory and study store is the test's own.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx2
import pytest
from fastapi import FastAPI
from sqlalchemy import create_engine, event, make_url, text
from sqlalchemy.exc import OperationalError
from starlette.testclient import TestClient

from api.main import create_app
from api.settings import Settings
from api.store.db import Database, migrate
from autotune.remote.client import ServerClient

if "PYTEST_XDIST_WORKER" in os.environ:
    # One intra-op thread per xdist worker, inherited by every child (CLI, workers, trials); set
    # before this process imports torch. Two workers of two threads each on two cores made
    # gpt2-tiny steps ten times slower (threads wait at each op's barrier for a descheduled peer).
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests (real processes and servers) first, each group still in pytest-randomly's
    order: xdist hands tests out in this order, and a long test handed out last keeps one worker
    busy while the others wait (a clean `make test` took from 5m43 to 6m26 by the luck of the
    shuffle). Longest first packs the three workers' time. A module stays in one piece (a
    module with a slow test goes first whole), or its module-scoped fixtures, such as two real
    DDP or FSDP ranks, would be set up again each time its tests come back."""
    first_index: dict[str, int] = {}
    slow_modules: set[str] = set()
    for index, item in enumerate(items):
        first_index.setdefault(item.nodeid.split("::")[0], index)
        if item.get_closest_marker("slow") is not None:
            slow_modules.add(item.nodeid.split("::")[0])

    def key(item: pytest.Item) -> tuple[bool, int]:
        module = item.nodeid.split("::")[0]
        return module not in slow_modules, first_index[module]

    items.sort(key=key)


@pytest.fixture(autouse=True)
def _no_fake_process_group_left() -> Iterator[None]:
    """A sharded trial makes a fake default process group in its process
    (`autotune.engine.training.sharding`), which a process runs one spec with; tests share
    processes, and the next one (a generated loop checking its world size) must not find it."""
    yield
    dist = sys.modules.get("torch.distributed")  # never imports torch for tests that do not
    if dist is not None and dist.is_initialized() and dist.get_backend() == "fake":
        dist.destroy_process_group()


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
    with postgres_schema() as url:
        yield url


@contextmanager
def postgres_schema(prefix: str = "autotune_test") -> Iterator[str]:
    """A URL whose connections see only a fresh, empty schema of PostgreSQL, dropped after."""
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        separator = "&" if "?" in POSTGRES_URL else "?"
        yield f"{POSTGRES_URL}{separator}options={quote(f'-csearch_path={schema}')}"
    finally:
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


@pytest.fixture(scope="session")
def _sqlite_at_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file the migrations brought to the newest revision, once per test process."""
    path = tmp_path_factory.mktemp("schema") / "at_head.db"
    database = Database(f"sqlite:///{path}")
    migrate(database)
    database.dispose()  # checkpoints the WAL into the file: the file alone is the database
    return path


@dataclass(frozen=True)
class _Statement:
    sql: str
    parameters: Any
    many: bool


@pytest.fixture(scope="session")
def _postgres_migration(postgres_available: bool) -> list[_Statement]:
    """Every statement the migrations sent to an empty PostgreSQL schema, in order, recorded
    once per test process from a real `migrate` (a schema of our own, dropped after)."""
    if not postgres_available:
        return []
    statements: list[_Statement] = []

    def record(
        _connection: object,
        _cursor: object,
        sql: str,
        parameters: Any,
        _context: object,
        many: bool,
    ) -> None:
        if "pg_advisory" not in sql:  # the lock between servers; one schema per test needs none
            statements.append(_Statement(sql, parameters, many))

    with postgres_schema("autotune_template") as url:
        database = Database(url)
        event.listen(database.engine, "before_cursor_execute", record)
        try:
            migrate(database)
        finally:
            database.dispose()
    return statements


@pytest.fixture
def migrated_db_url(
    db_url: str,
    _sqlite_at_head: Path,
    _postgres_migration: list[_Statement],
) -> str:
    """`db_url`, its schema at the newest revision: what `migrate` makes of an empty database,
    made faster (0.1-0.4 s a test under load, 450 tests): a copy of a file the migrations made
    on SQLite; on PostgreSQL the statements they sent, sent again. `create_app` still runs
    `migrate`, which finds the schema at head (tests/api_tests/test_migrations.py proves the
    copies equal). The tests of migrating itself take `db_url`, empty."""
    if db_url.startswith("sqlite"):
        shutil.copyfile(_sqlite_at_head, make_url(db_url).database or "")
        return db_url
    engine = create_engine(db_url)
    with engine.begin() as connection, connection.connection.cursor() as cursor:
        for statement in _postgres_migration:
            # As SQLAlchemy passed them: its escaping of % depends on whether parameters came.
            if statement.many:
                cursor.executemany(statement.sql, statement.parameters)
            else:
                cursor.execute(statement.sql, statement.parameters)
    engine.dispose()
    return db_url


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
def settings_factory(migrated_db_url: str, tmp_path: Path) -> Callable[..., Settings]:
    def make(**overrides: object) -> Settings:
        values: dict[str, object] = {
            "database_url": migrated_db_url,
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


# Ports a test must know before its server starts (a server restarted on the same port, a
# worker started before its server, a port where nothing listens) come from below the kernel's
# ephemeral range (32768 and up on Linux), where no `bind(port 0)` or outgoing connection of a
# parallel test can take them in the meantime, and each xdist worker draws from its own block.
RESERVED_PORTS = range(20000, 32000)


def free_port() -> int:
    """A port nothing listens on, that no other test of this run is handed."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    block = len(RESERVED_PORTS) // workers
    first = RESERVED_PORTS.start + worker * block
    while True:
        port = random.randrange(first, first + block)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # someone else's: draw again
                continue
            return port


@dataclass
class LiveServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path


# Not `uvicorn --fd`: see the launcher's docstring (40 ms a request).
UVICORN_ON_FD = Path(__file__).with_name("uvicorn_on_fd.py")


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
        # The server inherits a socket bound here to a port the kernel chose, so no other
        # process can take that port between choosing it and serving on it; only the server
        # keeps it, so once the server is gone, connections to it are refused.
        with socket.socket() as sock, log_path.open("wb") as log:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            process = subprocess.Popen(
                [sys.executable, str(UVICORN_ON_FD), str(sock.fileno())],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(sock.fileno(),),
            )
        servers.append(LiveServer(f"http://127.0.0.1:{port}", process, log_path))
    for server in servers:
        wait_for_health(server.url, server.process, server.log_path)
    return servers


def wait_for_health(url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    # Generous: a healthy server answers in a second or two, but on a loaded machine importing
    # the app (and `serve` starting its estimate workers) once took longer than 30 s.
    deadline = time.monotonic() + 90
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
def live_server(migrated_db_url: str, tmp_path: Path) -> Iterator[LiveServer]:
    server = start_server(migrated_db_url, tmp_path / "server.log")
    yield server
    stop_server(server)
