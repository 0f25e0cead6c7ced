"""The one converter between ORM rows (`api.store.tables`) and protocol models
(`autotune.remote.protocol`).

Fields are copied by name by pydantic, never one by one by hand: rows become models through
`model_validate(..., from_attributes=True)`, models become rows through `model_dump()`. A
column added to a row and its model therefore flows through without touching this module, and
a field the other side lacks is an error, not a silent drop.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from api.store.tables import AttemptRow, ModeRow, RunRow, TrialRow
from autotune.core.gpus.catalogue import find_gpu
from autotune.core.schemas import ModeProbe, StepOutcome, Trial
from autotune.remote.protocol import (
    API_PREFIX,
    AnyTarget,
    AttemptRecord,
    CudaTarget,
    EmulatedTarget,
    EstimateTarget,
    Run,
    RunSummary,
)

Target = AnyTarget


class _With:
    """An object's attributes, with some replaced or added: the source `from_attributes`
    reads when a model has fields the row lacks (a nested model, a derived value)."""

    def __init__(self, source: Any, **fields: Any) -> None:
        self._source = source
        self._fields = fields

    def __getattr__(self, name: str) -> Any:
        if name in self._fields:
            return self._fields[name]
        return getattr(self._source, name)


def run_url(run_id: int) -> str:
    return f"{API_PREFIX}/runs/{run_id}"


def target_of(row: RunRow) -> Target:
    """The device target a run was submitted for."""
    allocator_conf = row.target_allocator_conf
    if row.target_kind == "cuda":
        return CudaTarget.model_validate(
            _With(
                row,
                name=row.target_name,
                memory_bytes=row.target_memory_bytes,
                allocator_conf=allocator_conf,
            ),
            from_attributes=True,
        )
    if row.target_kind == "estimate":
        return EstimateTarget(gpu=row.target_name, allocator_conf=allocator_conf)
    if row.target_name is not None:  # a named GPU (its memory column is informative)
        return EmulatedTarget(gpu=row.target_name, allocator_conf=allocator_conf)
    return EmulatedTarget(memory_bytes=row.target_memory_bytes, allocator_conf=allocator_conf)


def target_memory_bytes(target: Target) -> int:
    """The memory column of a run's target: the target's memory, or a named GPU's total."""
    if target.memory_bytes is not None:
        return target.memory_bytes
    assert isinstance(target, EmulatedTarget | EstimateTarget) and target.gpu is not None
    return find_gpu(target.gpu).total_memory_bytes


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return (end - start).total_seconds() if start is not None and end is not None else None


def run_of(
    row: RunRow,
    *,
    recommendation: Any,
    modes: Sequence[Any],
    attempts: Sequence[Any],
    trials: Sequence[Any],
    failures: Sequence[Any],
) -> Run:
    """The protocol view of a run; child arguments are rows of the matching tables."""
    attempt_records = [
        AttemptRecord.model_validate(_With(a, attempt=a), from_attributes=True) for a in attempts
    ]
    # A mode's attempts are those of the lease that produced the mode, in order.
    final_attempts: dict[tuple[str, bool], list[StepOutcome]] = {}
    for a, record in zip(attempts, attempt_records, strict=True):
        final_attempts.setdefault((a.lease_id, a.checkpointing), []).append(record.attempt)
    view = _With(
        row,
        url=run_url(row.id),
        device=target_of(row),
        queued_s=_seconds(row.created_at, row.started_at),
        run_s=_seconds(row.started_at, row.finished_at),
        recommendation=recommendation,
        modes=[
            _With(m, attempts=final_attempts.get((m.lease_id, m.checkpointing), [])) for m in modes
        ],
        attempts=attempt_records,
        trials=[_With(t, trial=t) for t in trials],
        failures=failures,
    )
    return Run.model_validate(view, from_attributes=True)


def summary_of(run: RunRow, recommendation: Any) -> RunSummary:
    """One row of the listing; the recommendation's columns are None when there is none."""
    chosen = {
        name: getattr(recommendation, name, None)
        for name in ("micro_batch", "accumulation_steps", "checkpointing", "samples_per_s")
    }
    return RunSummary.model_validate(
        _With(run, url=run_url(run.id), **chosen), from_attributes=True
    )


def attempt_row(
    row: RunRow, *, sequence: int, checkpointing: bool, attempt: StepOutcome, now: datetime
) -> AttemptRow:
    """A probe attempt under the run's current lease."""
    assert row.lease_id is not None
    return AttemptRow(
        run_id=row.id,
        lease_id=row.lease_id,
        claim_number=row.claim_count,
        sequence=sequence,
        checkpointing=checkpointing,
        created_at=now,
        **attempt.model_dump(mode="json"),
    )


def trial_row(row: RunRow, *, trial: Trial, now: datetime) -> TrialRow:
    """A trial under the run's current lease."""
    assert row.lease_id is not None
    return TrialRow(
        run_id=row.id,
        lease_id=row.lease_id,
        claim_number=row.claim_count,
        created_at=now,
        **trial.model_dump(mode="json"),
    )


def mode_row(run_id: int, *, lease_id: str, mode: ModeProbe) -> ModeRow:
    """A mode's summary; its attempts are stored as attempt rows."""
    return ModeRow(
        run_id=run_id, lease_id=lease_id, **mode.model_dump(mode="json", exclude={"attempts"})
    )
