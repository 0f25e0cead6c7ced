"""Runs: what would make a spec that fits nowhere fit (the probe's fit advice).

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # Nullable: runs where micro-batch 1 fits, and those recorded before this revision, have none.
    op.add_column("autotune_runs", sa.Column("fit_advice", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_runs") as batch:
        batch.drop_column("fit_advice")
