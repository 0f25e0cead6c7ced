"""At most one unfinished (queued or running) run per fingerprint, enforced by the database.

Identical submissions at the same moment each looked for a twin and found none under READ
COMMITTED on PostgreSQL, so each queued its own run. A partial unique index makes the second
insert fail; the submitting route then joins the twin that won (`api.store.runstore.submit_run`).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None

_UNFINISHED = sa.text("status IN ('queued', 'running')")


def upgrade() -> None:
    op.create_index(
        "ix_autotune_runs_unfinished_fingerprint",
        "autotune_runs",
        ["fingerprint"],
        unique=True,
        sqlite_where=_UNFINISHED,
        postgresql_where=_UNFINISHED,
    )


def downgrade() -> None:
    op.drop_index("ix_autotune_runs_unfinished_fingerprint", table_name="autotune_runs")
