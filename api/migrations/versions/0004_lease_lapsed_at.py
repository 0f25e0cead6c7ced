"""Runs: when the current claim's lease lapsed, so that a renewed lapse stays on the record.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.add_column(
        "autotune_runs",
        sa.Column("lease_lapsed_at", sa.DateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    with op.batch_alter_table("autotune_runs") as batch:
        batch.drop_column("lease_lapsed_at")
