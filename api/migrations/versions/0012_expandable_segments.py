"""Probe modes: the same mode under expandable segments; recommendations: the allocator
settings they hold for when not the device's.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # Nullable: modes probed before this revision were not evaluated under other settings,
    # and their recommendations hold for the device's own.
    op.add_column(
        "autotune_probe_modes", sa.Column("expandable_segments", sa.JSON(), nullable=True)
    )
    op.add_column(
        "autotune_recommendations", sa.Column("allocator_conf", sa.String(1000), nullable=True)
    )


def downgrade() -> None:
    with op.batch_alter_table("autotune_recommendations") as batch:
        batch.drop_column("allocator_conf")
    with op.batch_alter_table("autotune_probe_modes") as batch:
        batch.drop_column("expandable_segments")
