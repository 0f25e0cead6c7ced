"""Trials: the allocator settings a trial ran under when not the device's (expandable segments,
for a micro-batch only they fit).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # Nullable: trials measured before this revision ran under the device's settings.
    op.add_column("autotune_trials", sa.Column("allocator_conf", sa.String(1000), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_trials") as batch:
        batch.drop_column("allocator_conf")
