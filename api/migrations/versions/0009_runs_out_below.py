"""Probe modes and recommendations: the micro-batches below the answer that run out (memory is
not monotone in the micro-batch).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | None = None
depends_on: str | None = None

_TABLES = ("autotune_probe_modes", "autotune_recommendations")


def upgrade() -> None:
    # Nullable: rows before this revision were probed as if memory were monotone.
    for table in _TABLES:
        op.add_column(table, sa.Column("runs_out_below", sa.JSON(), nullable=True))


def downgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("runs_out_below")
