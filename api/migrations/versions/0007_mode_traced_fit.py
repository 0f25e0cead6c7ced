"""Probe modes: the traced step that gave the search its first fit, next to the real attempts.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # Nullable: modes probed before this revision, or without a trace, have none.
    op.add_column("autotune_probe_modes", sa.Column("traced", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_probe_modes") as batch:
        batch.drop_column("traced")
