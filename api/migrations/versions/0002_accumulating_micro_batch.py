"""Probe modes: the largest micro-batch when gradients accumulate (set by the tuner).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # Nullable: runs recorded before this revision never measured it.
    op.add_column(
        "autotune_probe_modes",
        sa.Column(
            "accumulating_micro_batch",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            nullable=True,
        ),
    )


def downgrade() -> None:
    with op.batch_alter_table("autotune_probe_modes") as batch:
        batch.drop_column("accumulating_micro_batch")
