"""Submitting a spec: the run it joins (a stored success, or an unfinished twin) or queues.

Shared by the API's POST and the web page's submit form, so that both answer the same spec
with the same run.
"""

from __future__ import annotations

from api.deps import AppContext
from api.store import runstore
from autotune.remote.protocol import RunCreate, RunStatus

FACTORY_REFUSED = (
    "this server does not accept factory specs (a factory is code that workers run); use a "
    "preset, hf_config or hf_id, or ask the operator to start the server with "
    "--allow-factory-specs"
)


def refuses_factory(context: AppContext, request: RunCreate) -> bool:
    """Whether this server refuses the spec for its factory (`allow_factory_specs`)."""
    return request.spec.model.factory is not None and not context.settings.allow_factory_specs


def submit(
    context: AppContext, request: RunCreate, run_fingerprint: str
) -> tuple[int, RunStatus, bool]:
    """(run id, status, cached) for a submission: an existing run or a new queued one."""
    with context.db.read() as session:
        found = runstore.find_reusable_run(session, run_fingerprint=run_fingerprint)
    if found is None:
        with context.db.write() as session:
            # Looked up again inside the write transaction: a twin may have just been queued.
            run_id, status, created = runstore.submit_run(
                session, request=request, version=context.version, now=context.clock()
            )
        if created:
            return run_id, status, False
        found = run_id, status
    run_id, status = found
    if status == RunStatus.SUCCEEDED:
        context.finished_runs.put_succeeded(run_fingerprint, run_id)
    return run_id, status, status == RunStatus.SUCCEEDED
