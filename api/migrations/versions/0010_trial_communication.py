"""Trials: an estimate's compute, communication and exposed communication with several ranks.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | None = None
depends_on: str | None = None

_COLUMNS = ("compute_time_s", "communication_time_s", "exposed_communication_s")


def upgrade() -> None:
    # Nullable: measured trials and single-rank estimates have no such split.
    for column in _COLUMNS:
        op.add_column("autotune_trials", sa.Column(column, sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_trials") as batch:
        for column in reversed(_COLUMNS):
            batch.drop_column(column)
