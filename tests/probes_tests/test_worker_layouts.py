"""A sharding: auto run through the worker and the API: the worker tunes every layout on an
estimate device, streams each layout's trials under distinct numbers, and the server stores the
result with the chosen layout, every layout's outcome and exports for that layout. The worker
runs in this process against the in-process app (real SQLite or PostgreSQL store)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.schemas import LayoutVerdict, Sharding, Spec
from autotune.engine.estimate import estimate_device
from autotune.remote.client import ServerClient
from autotune.remote.protocol import EstimateTarget, RunStatus
from probes.inventory import ESTIMATE_DEVICE, WorkerDevice
from probes.worker import LAYOUT_TRIAL_STRIDE, RunOutcome, Worker, WorkerConfig


@pytest.mark.e2e
def test_an_auto_run_through_the_worker_stores_every_layout(
    user: ServerClient, worker: ServerClient, tmp_path: Path
) -> None:
    spec = Spec.model_validate(
        {
            "model": {"preset": "mlp"},
            "training": {
                "world_size": 2,
                "sharding": "auto",
                "target_global_batch": 8,
                "max_micro_batch": 4,
            },
        }
    )
    run_id = user.submit_run(spec, EstimateTarget(gpu="H100 80GB")).id
    gpu = find_gpu("H100 80GB").name
    device = WorkerDevice(estimate_device(gpu), ESTIMATE_DEVICE, None, gpu)
    config = WorkerConfig(worker_id="estimates", storage_url=f"sqlite:///{tmp_path / 'optuna.db'}")
    assert Worker(worker, [device], config).run_once() is RunOutcome.SUCCEEDED

    run = user.get_run(run_id)
    assert run.status is RunStatus.SUCCEEDED
    rec = run.recommendation
    assert rec is not None and rec.sharding is not None
    assert [layout.sharding for layout in run.layouts][0] is rec.sharding
    assert {layout.sharding for layout in run.layouts} == {
        Sharding.NONE,
        Sharding.ZERO1,
        Sharding.ZERO2,
        Sharding.ZERO3,
    }
    assert run.layouts[0].verdict is LayoutVerdict.CHOSEN
    assert run.exports is not None and run.exports.training.sharding is rec.sharding
    # The result's trials are the chosen layout's, numbered by its own study.
    assert run.trials and all(t.trial.number < LAYOUT_TRIAL_STRIDE for t in run.trials)
