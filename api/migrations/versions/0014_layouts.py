"""sharding: auto: the layout a recommendation was measured with, and every layout's outcome.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # Nullable: recommendations recorded before this revision were measured with the spec's
    # layout, and only sharding: auto runs compare layouts.
    op.add_column("autotune_recommendations", sa.Column("sharding", sa.String(16), nullable=True))
    op.add_column("autotune_runs", sa.Column("layouts", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_runs") as batch:
        batch.drop_column("layouts")
    with op.batch_alter_table("autotune_recommendations") as batch:
        batch.drop_column("sharding")
