"""Recording a tuning run that ran locally (`autotune tune`) in the project's database, so that
the server shows it next to the runs its workers did. Torch-free like the rest of `api/`.

`DatabaseRecorder` is the server package's `autotune.recorder.RunRecorder`, registered under the
`autotune.recorders` entry points: `autotune tune` finds it there without importing `api`.
"""

from __future__ import annotations

from datetime import UTC, datetime

from api import crud
from api.db import Database, migrate
from autotune import __version__
from autotune.protocol import CudaTarget, DeviceTarget, EmulatedTarget, ResultSubmission, RunCreate
from autotune.schemas import DeviceInfo, DeviceKind, TuneResult

# The whole recording is one transaction; the lease only has to outlive it.
_LOCAL_LEASE_S = 3600.0


def target_for(device: DeviceInfo) -> DeviceTarget:
    """The device target a run on `device` answers (what a user would POST to get it)."""
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
            run_id = crud.create_run(session, request=request, version=__version__, now=now)
            lease_id = crud.start_local_claim(
                session, run_id=run_id, now=now, lease_s=_LOCAL_LEASE_S
            )
            crud.complete_run(
                session,
                run_id=run_id,
                submission=ResultSubmission(lease_id=lease_id, result=result),
                now=now,
            )
        return run_id
    finally:
        database.dispose()


class DatabaseRecorder:
    """`autotune.recorder.RunRecorder` that stores runs in the server's database."""

    def record_run(self, database_url: str, result: TuneResult) -> int:
        return record_local_run(database_url, result)
