"""The ORM rows of the run store (SQLAlchemy 2, typed). Rows never leave `api/`.

Every table is prefixed `autotune_` because Optuna's RDB storage keeps its own tables (`studies`,
`trials`, ..., `alembic_version`) in the same database. Schema changes go through a new Alembic
revision in `api/migrations/versions/`, never through `create_all`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Dialect,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes on every backend (SQLite would hand back naive ones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# 64-bit everywhere; on SQLite a primary key must be declared INTEGER to autoincrement.
BigInt = BigInteger().with_variant(Integer(), "sqlite")


class TableBase(DeclarativeBase):
    type_annotation_map = {
        int: BigInt,
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
        list[Any]: JSON(),
    }


class WorkerRow(TableBase):
    """A probe worker, as last seen claiming or heartbeating."""

    __tablename__ = "autotune_workers"

    id: Mapped[str] = mapped_column(String(100), primary_key=True)
    devices: Mapped[list[Any]]
    first_seen_at: Mapped[datetime]
    last_seen_at: Mapped[datetime]
    claims: Mapped[int] = mapped_column(default=0)


_UNFINISHED = "status IN ('queued', 'running')"


class RunRow(TableBase):
    """One submission: the spec, the device target, its queue state and its outcome."""

    __tablename__ = "autotune_runs"
    __table_args__ = (
        # The claim query walks queued runs oldest first.
        Index("ix_autotune_runs_status_created", "status", "created_at", "id"),
        Index("ix_autotune_runs_fingerprint_status", "fingerprint", "status"),
        # One unfinished run per fingerprint: identical submissions join it (revision 0003).
        Index(
            "ix_autotune_runs_unfinished_fingerprint",
            "fingerprint",
            unique=True,
            sqlite_where=text(_UNFINISHED),
            postgresql_where=text(_UNFINISHED),
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    spec: Mapped[dict[str, Any]]
    model: Mapped[str] = mapped_column(String(300), index=True)
    target_kind: Mapped[str] = mapped_column(String(16))
    target_name: Mapped[str | None] = mapped_column(String(200))
    target_memory_bytes: Mapped[int]
    # The caching allocator's settings the run's device must use (canonical; None: defaults).
    target_allocator_conf: Mapped[str | None] = mapped_column(String(1000))
    device: Mapped[str] = mapped_column(String(300), index=True)
    autotune_version: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(index=True)
    updated_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    claim_count: Mapped[int] = mapped_column(default=0)
    lease_id: Mapped[str | None] = mapped_column(String(64))
    lease_expires_at: Mapped[datetime | None]
    # When the current claim's lease last lapsed (no heartbeat in time), if it did; the holder
    # may renew a lapsed lease until another claim takes the run.
    lease_lapsed_at: Mapped[datetime | None]
    worker_id: Mapped[str | None] = mapped_column(ForeignKey("autotune_workers.id"))
    device_index: Mapped[int | None]
    worker_device: Mapped[dict[str, Any] | None]
    torch_version: Mapped[str | None] = mapped_column(String(32))
    study_name: Mapped[str | None] = mapped_column(String(100))
    infeasible: Mapped[dict[str, Any] | None]
    # The protocol's FitAdvice, as JSON: what would make a spec that fits nowhere fit.
    fit_advice: Mapped[dict[str, Any] | None]
    exports: Mapped[dict[str, Any] | None]
    # sharding: auto: every layout's LayoutOutcome, as JSON (revision 0014).
    layouts: Mapped[list[Any] | None]
    error: Mapped[str | None] = mapped_column(Text)


class RecommendationRow(TableBase):
    """The chosen configuration of a succeeded run, as columns so runs can be queried by it."""

    __tablename__ = "autotune_recommendations"

    run_id: Mapped[int] = mapped_column(
        ForeignKey("autotune_runs.id", ondelete="CASCADE"), primary_key=True
    )
    micro_batch: Mapped[int]
    accumulation_steps: Mapped[int]
    checkpointing: Mapped[bool]
    checkpointed_blocks: Mapped[int | None]
    num_blocks: Mapped[int | None]
    # Micro-batches below the chosen one that run out in its mode (JSON; null before 0009).
    runs_out_below: Mapped[list[Any] | None]
    # PYTORCH_ALLOC_CONF it holds for when not the device's (null: the device's; before 0012).
    allocator_conf: Mapped[str | None] = mapped_column(String(1000))
    world_size: Mapped[int]
    global_batch: Mapped[int]
    samples_per_s: Mapped[float]
    tokens_per_s: Mapped[float | None]
    peak_bytes: Mapped[int]
    capacity_bytes: Mapped[int]
    # The layout measured (revision 0014; null before: the spec's).
    sharding: Mapped[str | None] = mapped_column(String(16))


class ModeRow(TableBase):
    """The final probe summary of one checkpointing mode; its attempts are AttemptRows."""

    __tablename__ = "autotune_probe_modes"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(
        ForeignKey("autotune_runs.id", ondelete="CASCADE"), index=True
    )
    lease_id: Mapped[str] = mapped_column(String(64))
    checkpointing: Mapped[bool]
    max_micro_batch: Mapped[int]
    recommended_micro_batch: Mapped[int]
    capped: Mapped[bool]
    accumulating_micro_batch: Mapped[int | None]
    # The protocol's TracedFit, as JSON: read whole with the mode, never queried.
    traced: Mapped[dict[str, Any] | None]
    # Micro-batches below the max that run out (a JSON list; null before revision 0009).
    runs_out_below: Mapped[list[Any] | None]
    # The protocol's AllocatorOption, as JSON (null when not evaluated, and before 0012).
    expandable_segments: Mapped[dict[str, Any] | None]


class AttemptRow(TableBase):
    """One probe attempt; (run, lease, sequence) is unique so a retried post stores nothing."""

    __tablename__ = "autotune_probe_attempts"
    __table_args__ = (UniqueConstraint("run_id", "lease_id", "sequence"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(
        ForeignKey("autotune_runs.id", ondelete="CASCADE"), index=True
    )
    lease_id: Mapped[str] = mapped_column(String(64))
    claim_number: Mapped[int]
    sequence: Mapped[int]
    checkpointing: Mapped[bool]
    micro_batch: Mapped[int]
    fits: Mapped[bool]
    peak_bytes: Mapped[int]
    peak_allocated_bytes: Mapped[int | None]
    num_alloc_retries: Mapped[int | None]
    phase_peak_bytes: Mapped[dict[str, Any]]
    oom_phase: Mapped[str | None] = mapped_column(String(16))
    # The protocol's OomDetail, as JSON: read whole with the attempt, never queried.
    oom: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime]


class TrialRow(TableBase):
    """One throughput trial; (run, lease, number) is unique so a retried post stores nothing."""

    __tablename__ = "autotune_trials"
    __table_args__ = (UniqueConstraint("run_id", "lease_id", "number"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(
        ForeignKey("autotune_runs.id", ondelete="CASCADE"), index=True
    )
    lease_id: Mapped[str] = mapped_column(String(64))
    claim_number: Mapped[int]
    number: Mapped[int]
    micro_batch: Mapped[int]
    accumulation_steps: Mapped[int]
    checkpointing: Mapped[bool]
    checkpointed_blocks: Mapped[int | None]
    # PYTORCH_ALLOC_CONF it ran under when not the device's (null: the device's; before 0015).
    allocator_conf: Mapped[str | None] = mapped_column(String(1000))
    state: Mapped[str] = mapped_column(String(16))
    samples_per_s: Mapped[float | None]
    tokens_per_s: Mapped[float | None]
    step_time_s: Mapped[float | None]
    step_time_spread: Mapped[float | None]
    timed_steps: Mapped[int]
    peak_bytes: Mapped[int | None]
    # An estimate's split of its step with several ranks (revision 0010).
    compute_time_s: Mapped[float | None]
    communication_time_s: Mapped[float | None]
    exposed_communication_s: Mapped[float | None]
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]


class FailureRow(TableBase):
    """Why one claim ended without a result: a reported error or an expired lease."""

    __tablename__ = "autotune_run_failures"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(
        ForeignKey("autotune_runs.id", ondelete="CASCADE"), index=True
    )
    lease_id: Mapped[str] = mapped_column(String(64))
    claim_number: Mapped[int]
    worker_id: Mapped[str | None] = mapped_column(String(100))
    error_type: Mapped[str] = mapped_column(String(200))
    message: Mapped[str] = mapped_column(Text)
    traceback_tail: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime]
