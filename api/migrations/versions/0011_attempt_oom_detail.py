"""Probe attempts: which allocation ran out of memory and what the memory held then.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # Nullable: attempts that fit, and those recorded before this revision, have none.
    op.add_column("autotune_probe_attempts", sa.Column("oom", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_probe_attempts") as batch:
        batch.drop_column("oom")
