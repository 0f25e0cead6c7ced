"""Alembic environment of the autotune run store, run by `api.store.db.migrate` at server start.

Our version table is `autotune_alembic_version`, not Alembic's default, because Optuna's storage
keeps its own `alembic_version` table in the same database.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection

from api.store.db import VERSION_TABLE
from api.store.tables import TableBase


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=TableBase.metadata,
        version_table=VERSION_TABLE,
        # SQLite can only change tables by copying them; batch mode does that.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        # One transaction for the whole upgrade, on SQLite too (which Alembic treats as without
        # transactional DDL, committing after each revision): servers starting together on a
        # new file queue on its BEGIN IMMEDIATE, and none runs a revision another has run
        # (eight servers on one file failed with "duplicate column name").
        transactional_ddl=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("pass -x or set sqlalchemy.url: no connection and no URL given")
    engine = create_engine(url)
    with engine.connect() as own_connection:
        _run(own_connection)
        own_connection.commit()


if context.is_offline_mode():
    raise RuntimeError("offline (SQL script) migrations are not supported")
run_migrations_online()
