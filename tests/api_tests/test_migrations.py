"""Migrations: applied at start, idempotent, equal to the ORM model, and living beside Optuna's
own tables and `alembic_version` in one database."""

from __future__ import annotations

import contextlib
from pathlib import Path

import optuna
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.elements import ClauseElement

from api.store.db import VERSION_TABLE, Database, alembic_config, migrate
from api.store.tables import TableBase
from tests.conftest import postgres_schema

OUR_TABLES = {
    "autotune_alembic_version",
    "autotune_probe_attempts",
    "autotune_probe_modes",
    "autotune_recommendations",
    "autotune_run_failures",
    "autotune_runs",
    "autotune_trials",
    "autotune_workers",
}


def test_migrated_schema_equals_the_models(db_url: str) -> None:
    database = Database(db_url)
    migrate(database)
    migrate(database)  # a second start changes nothing
    with database.engine.connect() as connection:
        context = MigrationContext.configure(
            connection, opts={"compare_type": True, "version_table": VERSION_TABLE}
        )
        assert compare_metadata(context, TableBase.metadata) == []
        assert connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).all() == [
            (ScriptDirectory.from_config(alembic_config()).get_current_head(),)
        ]
        assert set(inspect(connection).get_table_names()) == OUR_TABLES
    database.dispose()


def test_upgrades_from_the_first_revision_keep_runs(db_url: str) -> None:
    from alembic import command

    database = Database(db_url)
    with database.engine.connect() as connection:
        command.upgrade(alembic_config(connection), "0001")
        connection.commit()
    migrate(database)
    with database.engine.connect() as connection:
        columns = {c["name"] for c in inspect(connection).get_columns("autotune_probe_modes")}
    assert "accumulating_micro_batch" in columns
    database.dispose()


def test_sqlite_runs_in_wal_mode_with_foreign_keys(sqlite_url: str) -> None:
    database = Database(sqlite_url)
    migrate(database)
    with database.engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    database.dispose()


@pytest.mark.parametrize("optuna_first", [True, False])
def test_optuna_storage_shares_the_database(db_url: str, optuna_first: bool) -> None:
    database = Database(db_url)
    if not optuna_first:
        migrate(database)
    storage = optuna.storages.RDBStorage(db_url)
    study = optuna.create_study(storage=storage, study_name="autotune-run-1")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    migrate(database)
    with database.engine.connect() as connection:
        tables = set(inspect(connection).get_table_names())
        assert OUR_TABLES <= tables
        assert {"studies", "trials", "alembic_version"} <= tables
        assert (
            connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()
            == ScriptDirectory.from_config(alembic_config()).get_current_head()
        )
    assert len(optuna.load_study(study_name="autotune-run-1", storage=db_url).trials) == 2
    storage.remove_session()
    storage.engine.dispose()
    database.dispose()


def test_the_unfinished_twin_index_goes_down_and_up(db_url: str) -> None:
    from alembic import command

    database = Database(db_url)
    migrate(database)

    def index_names() -> set[str]:
        with database.engine.connect() as connection:
            return {i["name"] or "" for i in inspect(connection).get_indexes("autotune_runs")}

    assert "ix_autotune_runs_unfinished_fingerprint" in index_names()
    with database.engine.connect() as connection:
        command.downgrade(alembic_config(connection), "0002")
        connection.commit()
    assert "ix_autotune_runs_unfinished_fingerprint" not in index_names()
    migrate(database)
    assert "ix_autotune_runs_unfinished_fingerprint" in index_names()
    # The index refuses a second unfinished run of one fingerprint, and only that.
    row = (
        "INSERT INTO autotune_runs (fingerprint, status, spec, model, target_kind,"
        " target_memory_bytes, device, autotune_version, created_at, updated_at, claim_count)"
        " VALUES ('f', :status, '{}', 'm', 'emulated', 1, 'd', 'v', :now, :now, 0)"
    )
    now = "2026-01-01 00:00:00"
    with database.engine.connect() as connection:
        for status in ("succeeded", "succeeded", "queued"):
            connection.execute(text(row), {"status": status, "now": now})
        with pytest.raises(IntegrityError):
            connection.execute(text(row), {"status": "running", "now": now})
        connection.rollback()
    database.dispose()


def test_the_attempt_allocator_figures_go_down_and_up(db_url: str) -> None:
    from alembic import command

    database = Database(db_url)
    migrate(database)

    def attempt_columns() -> set[str]:
        with database.engine.connect() as connection:
            return {c["name"] for c in inspect(connection).get_columns("autotune_probe_attempts")}

    assert {"peak_allocated_bytes", "num_alloc_retries"} <= attempt_columns()
    with database.engine.connect() as connection:
        command.downgrade(alembic_config(connection), "0004")
        connection.commit()
    assert not {"peak_allocated_bytes", "num_alloc_retries"} & attempt_columns()
    migrate(database)
    assert {"peak_allocated_bytes", "num_alloc_retries"} <= attempt_columns()
    database.dispose()


def test_the_run_allocator_settings_go_down_and_up(db_url: str) -> None:
    from alembic import command

    database = Database(db_url)
    migrate(database)

    def run_columns() -> set[str]:
        with database.engine.connect() as connection:
            return {c["name"] for c in inspect(connection).get_columns("autotune_runs")}

    assert "target_allocator_conf" in run_columns()
    with database.engine.connect() as connection:
        command.downgrade(alembic_config(connection), "0005")
        connection.commit()
    assert "target_allocator_conf" not in run_columns()
    migrate(database)
    assert "target_allocator_conf" in run_columns()
    database.dispose()


def _columns_go_down_and_up(db_url: str, below: str, added: set[tuple[str, str]]) -> None:
    """The (table, column) pairs `added` after revision `below` are there at head, gone once
    downgraded to `below`, and back after migrating again."""
    from alembic import command

    database = Database(db_url)
    migrate(database)

    def columns() -> set[tuple[str, str]]:
        with database.engine.connect() as connection:
            inspector = inspect(connection)
            return {
                (table, c["name"])
                for table in {table for table, _ in added}
                for c in inspector.get_columns(table)
            }

    assert added <= columns()
    with database.engine.connect() as connection:
        command.downgrade(alembic_config(connection), below)
        connection.commit()
    assert not added & columns()
    migrate(database)
    assert added <= columns()
    database.dispose()


def test_the_expandable_segments_columns_go_down_and_up(db_url: str) -> None:
    _columns_go_down_and_up(
        db_url,
        "0011",
        {
            ("autotune_probe_modes", "expandable_segments"),
            ("autotune_recommendations", "allocator_conf"),
        },
    )


def test_the_trial_allocator_column_goes_down_and_up(db_url: str) -> None:
    _columns_go_down_and_up(db_url, "0014", {("autotune_trials", "allocator_conf")})


def test_the_layout_columns_go_down_and_up(db_url: str) -> None:
    from alembic import command

    database = Database(db_url)
    migrate(database)

    def columns() -> tuple[set[str], set[str]]:
        with database.engine.connect() as connection:
            found = inspect(connection)
            return (
                {c["name"] for c in found.get_columns("autotune_runs")},
                {c["name"] for c in found.get_columns("autotune_recommendations")},
            )

    runs, recommendations = columns()
    assert "layouts" in runs and "sharding" in recommendations
    with database.engine.connect() as connection:
        command.downgrade(alembic_config(connection), "0013")
        connection.commit()
    runs, recommendations = columns()
    assert "layouts" not in runs and "sharding" not in recommendations
    migrate(database)
    runs, recommendations = columns()
    assert "layouts" in runs and "sharding" in recommendations
    database.dispose()


def _plain(value: object) -> object:
    """`value` with SQL expressions (a partial index's WHERE) as their text, to compare."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, ClauseElement):
        return str(value)
    return value


def _described(url: str) -> dict[str, object]:
    """Everything reflection sees of a schema, and the revision it is at."""
    database = Database(url)
    with database.engine.connect() as connection:
        found = inspect(connection)
        tables: dict[str, object] = {
            name: (
                [
                    (c["name"], str(c["type"]), c["nullable"], c["default"])
                    for c in found.get_columns(name)
                ],
                found.get_pk_constraint(name),
                sorted(map(repr, map(_plain, found.get_foreign_keys(name)))),
                sorted(map(repr, map(_plain, found.get_indexes(name)))),
                sorted(map(repr, map(_plain, found.get_unique_constraints(name)))),
                sorted(map(repr, map(_plain, found.get_check_constraints(name)))),
            )
            for name in found.get_table_names()
        }
        tables["revision"] = connection.execute(text(f"SELECT * FROM {VERSION_TABLE}")).all()
    database.dispose()
    return tables


def test_the_tests_schema_at_head_is_the_migrated_one(
    migrated_db_url: str, tmp_path: Path
) -> None:
    """tests/conftest.py's `migrated_db_url` makes the schema the API tests start from without
    running the migrations (a copied file, their statements sent again): it must be what
    `migrate` makes of an empty database, on both backends."""
    with contextlib.ExitStack() as stack:
        if migrated_db_url.startswith("sqlite"):
            fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
        else:
            fresh = stack.enter_context(postgres_schema())
        database = Database(fresh)
        migrate(database)
        database.dispose()
        assert _described(migrated_db_url) == _described(fresh)
