"""Database plumbing: the engine for a URL, sessions, and migrations applied at start.

SQLite (the embedded default) runs in WAL mode with foreign keys on and a busy timeout; write
transactions there start with BEGIN IMMEDIATE so that two writers queue on the busy timeout
instead of failing when a read lock cannot be upgraded. PostgreSQL needs none of that, but it
can be unreachable: every connection attempt gives up after a connect timeout, every statement
after a statement timeout (set per connection), pooled connections are pinged before use, and
TCP keepalives eventually free a connection whose server vanished mid-query. A request that hits
any of these ends in 503 `database_unavailable` (`api.errors`), which clients retry.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.resources import files
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, make_url, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker

logger = logging.getLogger(__name__)

VERSION_TABLE = "autotune_alembic_version"
SQLITE_BUSY_TIMEOUT_MS = 30_000
# A request thread waits this long for a pooled connection before the request is a 503.
POOL_TIMEOUT_S = 10.0
# What a refused, timed-out or hung database raises through SQLAlchemy.
UNREACHABLE_ERRORS = (OperationalError, PoolTimeout)
# Any constant works: it only has to be the same in every server process.
_MIGRATION_LOCK_KEY = 0x4155544F54554E45
_WRITE_OPTION = "autotune_write"


def make_engine(
    url: str, *, connect_timeout_s: int = 3, statement_timeout_s: float = 30.0
) -> Engine:
    """An engine for `url`, configured for many concurrent request threads.

    Args:
        connect_timeout_s: PostgreSQL: give up connecting (TCP, TLS and start-up) after this;
            libpq counts whole seconds and treats less than 2 as 2.
        statement_timeout_s: PostgreSQL: the server cancels any statement running longer.
    """
    pool = {"pool_size": 20, "max_overflow": 20, "pool_timeout": POOL_TIMEOUT_S}
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            pool_pre_ping=True,
            **pool,
        )
        event.listen(engine, "connect", _configure_sqlite)
        event.listen(engine, "begin", _begin_sqlite)
        return engine
    return create_engine(
        url,
        connect_args=_postgres_connect_args(url, connect_timeout_s, statement_timeout_s),
        pool_pre_ping=True,
        **pool,
    )


def _postgres_connect_args(
    url: str, connect_timeout_s: int, statement_timeout_s: float
) -> dict[str, Any]:
    # connect_args replace the URL's own `options`, so keep those (e.g. a search_path) and add.
    given = make_url(url).query.get("options", ())
    options = [given] if isinstance(given, str) else list(given)
    options.append(f"-c statement_timeout={max(1, round(statement_timeout_s * 1000))}")
    return {
        "connect_timeout": max(2, connect_timeout_s),
        "options": " ".join(options),
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
    }


def _configure_sqlite(dbapi_connection: Any, _record: Any) -> None:
    # Take transaction control away from the sqlite3 module so that `_begin_sqlite` decides
    # how each transaction starts (SQLAlchemy's documented recipe for pysqlite).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    _set_wal(cursor)
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _set_wal(cursor: Any) -> None:
    """WAL mode, which the database file keeps once set. Switching to it takes the file's
    exclusive lock, and SQLite answers "database is locked" at once, without its busy handler,
    when another process holds a lock: two servers starting on one new file (a test starts
    eight) raced there. So it is set only when not already, and retried within the busy
    timeout."""
    deadline_s = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            if cursor.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline_s:
                raise
            time.sleep(0.05)


def _begin_sqlite(connection: Connection) -> None:
    if connection.get_execution_options().get(_WRITE_OPTION):
        connection.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        connection.exec_driver_sql("BEGIN")


class Database:
    """An engine with two session factories: reads, and writes (serialised early on SQLite)."""

    def __init__(
        self, url: str, *, connect_timeout_s: int = 3, statement_timeout_s: float = 30.0
    ) -> None:
        self.engine = make_engine(
            url, connect_timeout_s=connect_timeout_s, statement_timeout_s=statement_timeout_s
        )
        self.is_postgres = self.engine.dialect.name == "postgresql"
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write = sessionmaker(
            self.engine.execution_options(**{_WRITE_OPTION: True}), expire_on_commit=False
        )

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self._read() as session:
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A session whose transaction commits on success and rolls back on any error."""
        with self._write() as session, session.begin():
            yield session

    def ping(self) -> None:
        with self.engine.connect() as connection:
            connection.execute(text("SELECT 1"))

    def dispose(self) -> None:
        self.engine.dispose()


def alembic_config(connection: Connection | None = None) -> Config:
    """The packaged Alembic environment, optionally bound to an open connection."""
    config = Config(str(files("api") / "alembic.ini"))
    config.set_main_option("script_location", str(files("api") / "migrations"))
    config.attributes["connection"] = connection
    return config


def migrate(database: Database) -> None:
    """Bring the schema to the newest revision (idempotent; safe with many server processes)."""
    # On SQLite the write option makes the first statement BEGIN IMMEDIATE: a second process
    # starting at the same time waits, then finds the schema already at head.
    engine = database.engine.execution_options(**{_WRITE_OPTION: True})
    with engine.connect() as connection:
        if database.is_postgres:
            # Two servers starting together must not both create the tables.
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _MIGRATION_LOCK_KEY})
            connection.commit()
        try:
            command.upgrade(alembic_config(connection), "head")
            connection.commit()
        finally:
            if database.is_postgres:
                connection.execute(
                    text("SELECT pg_advisory_unlock(:key)"), {"key": _MIGRATION_LOCK_KEY}
                )
                connection.commit()
    logger.info("database schema is at the newest revision")
