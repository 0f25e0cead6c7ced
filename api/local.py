"""Recording a tuning run that ran locally (`autotune tune`) in the project's database, so that
the server shows it next to the runs its workers did. Torch-free like the rest of `api/`.

`DatabaseRecorder` is the server package's `autotune.core.recorder.RunRecorder`, registered under
the `autotune.recorders` entry points: `autotune tune` finds it there without importing `api`.
"""

from __future__ import annotations

from datetime import UTC, datetime

from api.store import results
from api.store.db import Database, migrate
from autotune import __version__
from autotune.core.schemas import DeviceInfo, DeviceKind, TuneResult
from autotune.remote.protocol import (
    CudaTarget,
    DeviceTarget,
    EmulatedTarget,
    EstimateTarget,
    RunCreate,
)


def target_for(device: DeviceInfo) -> DeviceTarget:
    """The device target a run on `device` answers (what a user would POST to get it)."""
    if device.kind is DeviceKind.ESTIMATE:
        if device.gpu is None:  # a bare capacity: nobody can ask for it by name
            raise ValueError("an estimate without a named GPU answers no device target")
        return EstimateTarget(gpu=device.gpu, allocator_conf=device.allocator_conf)
    if device.kind is DeviceKind.EMULATED and device.gpu is not None:
        return EmulatedTarget(gpu=device.gpu)
    if device.kind is DeviceKind.EMULATED:
        return EmulatedTarget(memory_bytes=device.capacity_bytes)
    return CudaTarget(name=device.name, memory_bytes=device.total_memory_bytes)


def record_local_run(database_url: str, result: TuneResult) -> int:
    """Store `result` as a finished run (migrating the database first); returns the run id."""
    database = Database(database_url)
    try:
        migrate(database)
        now = datetime.now(UTC)
        with database.write() as session:
            request = RunCreate(spec=result.spec, device=target_for(result.device))
            run_id = results.record_local_run(
                session, request=request, result=result, version=__version__, now=now
            )
        return run_id
    finally:
        database.dispose()


class DatabaseRecorder:
    """`autotune.core.recorder.RunRecorder` that stores runs in the server's database."""

    def record_run(self, database_url: str, result: TuneResult) -> int:
        return record_local_run(database_url, result)
