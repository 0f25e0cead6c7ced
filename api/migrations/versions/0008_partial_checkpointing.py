"""Trials and recommendations: partial checkpointing, the first k blocks of the model.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | None = None
depends_on: str | None = None


def _count() -> sa.types.TypeEngine[int]:
    # The models' int: 64-bit, INTEGER on SQLite (api/store/tables.py).
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    # Nullable: every row before this revision checkpointed all blocks or none.
    op.add_column("autotune_trials", sa.Column("checkpointed_blocks", _count(), nullable=True))
    for column in ("checkpointed_blocks", "num_blocks"):
        op.add_column("autotune_recommendations", sa.Column(column, _count(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_trials") as batch:
        batch.drop_column("checkpointed_blocks")
    with op.batch_alter_table("autotune_recommendations") as batch:
        batch.drop_column("num_blocks")
        batch.drop_column("checkpointed_blocks")
