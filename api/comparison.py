"""An estimate and a measurement of the same spec on the same GPU, side by side.

From either run: an estimate (`EstimateTarget`) finds the newest succeeded measurement of its
spec on that catalogue GPU, a real card of it (`CudaTarget`, preferred: it is the truth) or else
the emulated named GPU; a measurement finds the newest succeeded estimate. Same spec, same
allocator settings, same autotune version: what a fingerprint compares, but for the device.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.errors import NoComparison
from api.store.runstore import get_run
from api.store.tables import RunRow
from autotune.core.gpus.catalogue import Gpu, UnknownGpu, find_gpu
from autotune.remote.protocol import (
    Comparison,
    CudaTarget,
    EmulatedTarget,
    EstimateTarget,
    ModeComparison,
    Run,
    RunStatus,
    cuda_memory_bounds,
    fingerprint,
)


def compare_run(session: Session, *, run_id: int) -> Comparison:
    """The comparison `run_id` takes part in.

    Raises:
        RunNotFound: no such run.
        NoComparison: the run has not succeeded, is not on a catalogue GPU, or has no
            succeeded counterpart yet.
    """
    run = get_run(session, run_id=run_id)
    if run.status is not RunStatus.SUCCEEDED:
        raise NoComparison(f"run {run_id} has not succeeded ({run.status.value})")
    target = run.device
    gpu = _catalogue_gpu(target)
    if gpu is None:
        raise NoComparison(f"run {run_id} is not on a catalogue GPU: nothing estimates it")
    estimate: Run | None
    measured: Run | None
    if isinstance(target, EstimateTarget):
        estimate, measured = run, _newest_measurement(session, run, gpu)
    else:
        twin = EstimateTarget(gpu=gpu.name, allocator_conf=target.allocator_conf)
        estimate = _newest(session, fingerprint(run.spec, twin, run.autotune_version))
        measured = run
    if estimate is None or measured is None:
        raise NoComparison(f"run {run_id}: no succeeded counterpart on {gpu.name} yet")
    return _side_by_side(gpu, estimate, measured)


def _catalogue_gpu(target: EstimateTarget | EmulatedTarget | CudaTarget) -> Gpu | None:
    if isinstance(target, EstimateTarget | EmulatedTarget):
        return find_gpu(target.gpu) if target.gpu is not None else None
    try:
        gpu = find_gpu(target.name)
    except UnknownGpu:
        return None
    low, high = cuda_memory_bounds(gpu.total_memory_bytes)
    return gpu if low <= target.memory_bytes <= high else None


def _newest(session: Session, run_fingerprint: str) -> Run | None:
    found = session.scalar(
        select(RunRow.id)
        .where(
            RunRow.fingerprint == run_fingerprint,
            RunRow.status == RunStatus.SUCCEEDED.value,
        )
        .order_by(RunRow.id.desc())
        .limit(1)
    )
    return get_run(session, run_id=found) if found is not None else None


def _newest_measurement(session: Session, estimate: Run, gpu: Gpu) -> Run | None:
    """A real card's run first (its name is the driver's, so matched through the catalogue),
    else the emulated named GPU's."""
    rows = session.execute(
        select(RunRow.id, RunRow.target_name)
        .where(RunRow.target_kind == "cuda", RunRow.status == RunStatus.SUCCEEDED.value)
        .order_by(RunRow.id.desc())
    ).all()
    for row in rows:
        candidate = get_run(session, run_id=row.id)
        if (
            _catalogue_gpu(candidate.device) == gpu
            and candidate.spec == estimate.spec
            and candidate.device.allocator_conf == estimate.device.allocator_conf
            and candidate.autotune_version == estimate.autotune_version
        ):
            return candidate
    emulated = EmulatedTarget(gpu=gpu.name, allocator_conf=estimate.device.allocator_conf)
    return _newest(session, fingerprint(estimate.spec, emulated, estimate.autotune_version))


def _side_by_side(gpu: Gpu, estimate: Run, measured: Run) -> Comparison:
    measured_modes = {mode.checkpointing: mode for mode in measured.modes}
    modes = [
        ModeComparison(
            checkpointing=mode.checkpointing,
            estimated_max_micro_batch=mode.max_micro_batch,
            measured_max_micro_batch=measured_modes[mode.checkpointing].max_micro_batch,
            error_micro_batches=mode.max_micro_batch
            - measured_modes[mode.checkpointing].max_micro_batch,
        )
        for mode in estimate.modes
        if mode.checkpointing in measured_modes
    ]
    estimated_speed = estimate.recommendation.samples_per_s if estimate.recommendation else None
    measured_speed = measured.recommendation.samples_per_s if measured.recommendation else None
    speed_error = (
        estimated_speed / measured_speed - 1
        if estimated_speed is not None and measured_speed
        else None
    )
    return Comparison(
        gpu=gpu.name,
        estimate_run_id=estimate.id,
        measured_run_id=measured.id,
        measured_device=measured.device,
        modes=modes,
        estimated_samples_per_s=estimated_speed,
        measured_samples_per_s=measured_speed,
        speed_error=speed_error,
    )
