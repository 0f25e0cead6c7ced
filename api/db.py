"""Database plumbing: the engine for a URL, sessions, and migrations applied at start.

SQLite (the embedded default) runs in WAL mode with foreign keys on and a busy timeout; write
transactions there start with BEGIN IMMEDIATE so that two writers queue on the busy timeout
instead of failing when a read lock cannot be upgraded. PostgreSQL needs none of that.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.resources import files
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session, sessionmaker

logger = logging.getLogger(__name__)

VERSION_TABLE = "autotune_alembic_version"
SQLITE_BUSY_TIMEOUT_MS = 30_000
# Any constant works: it only has to be the same in every server process.
_MIGRATION_LOCK_KEY = 0x4155544F54554E45
_WRITE_OPTION = "autotune_write"


def make_engine(url: str) -> Engine:
    """An engine for `url`, configured for many concurrent request threads."""
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            pool_size=20,
            max_overflow=20,
        )
        event.listen(engine, "connect", _configure_sqlite)
        event.listen(engine, "begin", _begin_sqlite)
        return engine
    return create_engine(url, pool_size=20, max_overflow=20, pool_pre_ping=True)


def _configure_sqlite(dbapi_connection: Any, _record: Any) -> None:
    # Take transaction control away from the sqlite3 module so that `_begin_sqlite` decides
    # how each transaction starts (SQLAlchemy's documented recipe for pysqlite).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _begin_sqlite(connection: Connection) -> None:
    if connection.get_execution_options().get(_WRITE_OPTION):
        connection.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        connection.exec_driver_sql("BEGIN")


class Database:
    """An engine with two session factories: reads, and writes (serialised early on SQLite)."""

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url)
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
