"""Initial run store: runs, workers, probe attempts and modes, trials, recommendations, failures.

Revision ID: 0001
Revises:
Create Date: 2026-11-22

Self-contained on purpose (no import of api.store.tables): a revision is a frozen snapshot.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

# 64-bit integers; on SQLite a primary key must be INTEGER to autoincrement.
BigInt = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Timestamp = sa.DateTime(timezone=True)


def _run_fk() -> sa.Column[int]:
    return sa.Column(
        "run_id", BigInt, sa.ForeignKey("autotune_runs.id", ondelete="CASCADE"), nullable=False
    )


def upgrade() -> None:
    op.create_table(
        "autotune_workers",
        sa.Column("id", sa.String(100), primary_key=True),
        sa.Column("devices", sa.JSON(), nullable=False),
        sa.Column("first_seen_at", Timestamp, nullable=False),
        sa.Column("last_seen_at", Timestamp, nullable=False),
        sa.Column("claims", BigInt, nullable=False),
    )
    op.create_table(
        "autotune_runs",
        sa.Column("id", BigInt, primary_key=True, autoincrement=True),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("model", sa.String(300), nullable=False),
        sa.Column("target_kind", sa.String(16), nullable=False),
        sa.Column("target_name", sa.String(200), nullable=True),
        sa.Column("target_memory_bytes", BigInt, nullable=False),
        sa.Column("device", sa.String(300), nullable=False),
        sa.Column("autotune_version", sa.String(32), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
        sa.Column("started_at", Timestamp, nullable=True),
        sa.Column("finished_at", Timestamp, nullable=True),
        sa.Column("claim_count", BigInt, nullable=False),
        sa.Column("lease_id", sa.String(64), nullable=True),
        sa.Column("lease_expires_at", Timestamp, nullable=True),
        sa.Column(
            "worker_id", sa.String(100), sa.ForeignKey("autotune_workers.id"), nullable=True
        ),
        sa.Column("device_index", BigInt, nullable=True),
        sa.Column("worker_device", sa.JSON(), nullable=True),
        sa.Column("torch_version", sa.String(32), nullable=True),
        sa.Column("study_name", sa.String(100), nullable=True),
        sa.Column("infeasible", sa.JSON(), nullable=True),
        sa.Column("exports", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
    )
    op.create_index("ix_autotune_runs_created_at", "autotune_runs", ["created_at"])
    op.create_index("ix_autotune_runs_device", "autotune_runs", ["device"])
    op.create_index("ix_autotune_runs_model", "autotune_runs", ["model"])
    op.create_index(
        "ix_autotune_runs_fingerprint_status", "autotune_runs", ["fingerprint", "status"]
    )
    op.create_index(
        "ix_autotune_runs_status_created", "autotune_runs", ["status", "created_at", "id"]
    )
    op.create_table(
        "autotune_recommendations",
        sa.Column(
            "run_id",
            BigInt,
            sa.ForeignKey("autotune_runs.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("micro_batch", BigInt, nullable=False),
        sa.Column("accumulation_steps", BigInt, nullable=False),
        sa.Column("checkpointing", sa.Boolean(), nullable=False),
        sa.Column("world_size", BigInt, nullable=False),
        sa.Column("global_batch", BigInt, nullable=False),
        sa.Column("samples_per_s", sa.Double(), nullable=False),
        sa.Column("tokens_per_s", sa.Double(), nullable=True),
        sa.Column("peak_bytes", BigInt, nullable=False),
        sa.Column("capacity_bytes", BigInt, nullable=False),
    )
    op.create_table(
        "autotune_probe_modes",
        sa.Column("id", BigInt, primary_key=True, autoincrement=True),
        _run_fk(),
        sa.Column("lease_id", sa.String(64), nullable=False),
        sa.Column("checkpointing", sa.Boolean(), nullable=False),
        sa.Column("max_micro_batch", BigInt, nullable=False),
        sa.Column("recommended_micro_batch", BigInt, nullable=False),
        sa.Column("capped", sa.Boolean(), nullable=False),
    )
    op.create_index("ix_autotune_probe_modes_run_id", "autotune_probe_modes", ["run_id"])
    op.create_table(
        "autotune_probe_attempts",
        sa.Column("id", BigInt, primary_key=True, autoincrement=True),
        _run_fk(),
        sa.Column("lease_id", sa.String(64), nullable=False),
        sa.Column("claim_number", BigInt, nullable=False),
        sa.Column("sequence", BigInt, nullable=False),
        sa.Column("checkpointing", sa.Boolean(), nullable=False),
        sa.Column("micro_batch", BigInt, nullable=False),
        sa.Column("fits", sa.Boolean(), nullable=False),
        sa.Column("peak_bytes", BigInt, nullable=False),
        sa.Column("phase_peak_bytes", sa.JSON(), nullable=False),
        sa.Column("oom_phase", sa.String(16), nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.UniqueConstraint("run_id", "lease_id", "sequence"),
    )
    op.create_index("ix_autotune_probe_attempts_run_id", "autotune_probe_attempts", ["run_id"])
    op.create_table(
        "autotune_trials",
        sa.Column("id", BigInt, primary_key=True, autoincrement=True),
        _run_fk(),
        sa.Column("lease_id", sa.String(64), nullable=False),
        sa.Column("claim_number", BigInt, nullable=False),
        sa.Column("number", BigInt, nullable=False),
        sa.Column("micro_batch", BigInt, nullable=False),
        sa.Column("accumulation_steps", BigInt, nullable=False),
        sa.Column("checkpointing", sa.Boolean(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("samples_per_s", sa.Double(), nullable=True),
        sa.Column("tokens_per_s", sa.Double(), nullable=True),
        sa.Column("step_time_s", sa.Double(), nullable=True),
        sa.Column("step_time_spread", sa.Double(), nullable=True),
        sa.Column("timed_steps", BigInt, nullable=False),
        sa.Column("peak_bytes", BigInt, nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.UniqueConstraint("run_id", "lease_id", "number"),
    )
    op.create_index("ix_autotune_trials_run_id", "autotune_trials", ["run_id"])
    op.create_table(
        "autotune_run_failures",
        sa.Column("id", BigInt, primary_key=True, autoincrement=True),
        _run_fk(),
        sa.Column("lease_id", sa.String(64), nullable=False),
        sa.Column("claim_number", BigInt, nullable=False),
        sa.Column("worker_id", sa.String(100), nullable=True),
        sa.Column("error_type", sa.String(200), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("traceback_tail", sa.Text(), nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
    )
    op.create_index("ix_autotune_run_failures_run_id", "autotune_run_failures", ["run_id"])


def downgrade() -> None:
    for table in (
        "autotune_run_failures",
        "autotune_trials",
        "autotune_probe_attempts",
        "autotune_probe_modes",
        "autotune_recommendations",
        "autotune_runs",
        "autotune_workers",
    ):
        op.drop_table(table)
