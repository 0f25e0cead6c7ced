"""Runs: the caching allocator's settings the run's device must use.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # Nullable: runs submitted before this revision asked for torch's defaults.
    op.add_column(
        "autotune_runs", sa.Column("target_allocator_conf", sa.String(1000), nullable=True)
    )


def downgrade() -> None:
    with op.batch_alter_table("autotune_runs") as batch:
        batch.drop_column("target_allocator_conf")
