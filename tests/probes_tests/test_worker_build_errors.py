"""A run whose model cannot be built fails with its reason, and the worker goes on: the worker
runs in this process against the in-process app (real SQLite store), on estimate devices,
where the model is built in the worker itself (issue 25, item 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.schemas import Spec
from autotune.engine.estimate import estimate_device
from autotune.remote.client import ServerClient
from autotune.remote.protocol import EstimateTarget, RunStatus
from probes.inventory import ESTIMATE_DEVICE, WorkerDevice
from probes.worker import RunOutcome, Worker, WorkerConfig

_LLAMA = {"model_type": "llama", "num_hidden_layers": 1, "intermediate_size": 64}
UNBUILDABLE: dict[str, tuple[dict[str, Any], str]] = {
    "fp16": (
        {"model": {"preset": "mlp"}, "training": {"precision": "fp16"}},
        "training.precision: fp16's gradient scaler",
    ),
    "adafactor": (
        {"model": {"preset": "mlp"}, "training": {"optimizer": "adafactor"}},
        "training.optimizer: adafactor",
    ),
    "unknown model_type": (
        {"model": {"hf_config": {"model_type": "nosuch"}}, "training": {"seq_len": 8}},
        "Unrecognized model identifier: nosuch",
    ),
    "heads do not divide hidden": (
        {
            "model": {"hf_config": {**_LLAMA, "hidden_size": 65, "num_attention_heads": 4}},
            "training": {"seq_len": 8},
        },
        "is not a multiple of the number of attention heads",
    ),
}


def _worker(client: ServerClient, tmp_path: Path) -> Worker:
    gpu = find_gpu("T4").name
    device = WorkerDevice(estimate_device(gpu), ESTIMATE_DEVICE, None, gpu)
    config = WorkerConfig(worker_id="estimates", storage_url=f"sqlite:///{tmp_path / 'optuna.db'}")
    return Worker(client, [device], config)


@pytest.mark.e2e
def test_models_that_cannot_be_built_fail_their_runs_and_the_worker_goes_on(
    user: ServerClient, worker: ServerClient, tmp_path: Path
) -> None:
    target = EstimateTarget(gpu="T4")
    poisons = {
        case: user.submit_run(Spec.model_validate(data), target).id
        for case, (data, _) in UNBUILDABLE.items()
    }
    healthy = user.submit_run(Spec.model_validate({"model": {"preset": "mlp"}}), target)
    estimates = _worker(worker, tmp_path)

    assert [estimates.run_once() for _ in poisons] == [RunOutcome.FAILED] * len(poisons)
    for case, run_id in poisons.items():
        failed = user.get_run(run_id)
        assert failed.status is RunStatus.FAILED, case
        assert failed.claim_count == 1, case  # not retried: any worker would fail the same way
        assert UNBUILDABLE[case][1] in (failed.error or ""), failed.error
    # The next run is taken by the same worker, and answered.
    assert estimates.run_once() is RunOutcome.SUCCEEDED
    assert user.get_run(healthy.id).status is RunStatus.SUCCEEDED
