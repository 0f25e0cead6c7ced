"""Probe attempts: peak allocated memory and allocator retries next to the peak reserved.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None

_COLUMNS = ("peak_allocated_bytes", "num_alloc_retries")


def upgrade() -> None:
    # Nullable: attempts recorded before this revision measured the peak only.
    for name in _COLUMNS:
        op.add_column(
            "autotune_probe_attempts",
            sa.Column(name, sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        )


def downgrade() -> None:
    with op.batch_alter_table("autotune_probe_attempts") as batch:
        for name in _COLUMNS:
            batch.drop_column(name)
