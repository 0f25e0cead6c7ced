"""`autotune tune` records its run in the project's database, where the server shows it and
answers the same submission from it."""

from __future__ import annotations

import optuna
import pytest

from api.local import record_local_run, target_for
from autotune.core.gpus.catalogue import find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.schemas import Spec
from autotune.engine.devices.device import EmulatedDevice, open_device
from autotune.engine.tuner import tune
from autotune.remote.client import ServerClient
from autotune.remote.protocol import EmulatedTarget, RunStatus
from tests.api_tests.factories import auto_layout_result

CAPACITY_BYTES = 180 * 2**20


@pytest.mark.e2e
def test_a_local_tuning_run_is_served_and_answers_the_cache(
    db_url: str, user: ServerClient
) -> None:
    spec = Spec.model_validate(
        {"model": {"preset": "gpt2-tiny"}, "training": {"seq_len": 16, "target_global_batch": 8}}
    )
    # The Optuna study goes to the same database as the runs (prefixed tables, no clash).
    result = tune(spec, EmulatedDevice(CAPACITY_BYTES), storage_url=db_url, target_seconds=0.05)
    assert result.recommendation is not None

    run_id = record_local_run(db_url, result)

    run = user.get_run(run_id)
    assert run.status is RunStatus.SUCCEEDED
    assert run.recommendation == result.recommendation
    assert run.exports == result.exports
    assert run.study_name == result.study_name
    assert len(run.attempts) == sum(len(m.attempts) for m in result.probe.modes)
    assert [record.trial for record in run.trials] == result.trials
    assert run.modes == result.probe.modes  # including the accumulation limits
    assert [m.max_micro_batch for m in run.modes] == [
        m.max_micro_batch for m in result.probe.modes
    ]
    assert optuna.load_study(study_name=result.study_name, storage=db_url).trials

    submitted = user.submit_run(spec, target_for(result.device))
    assert submitted.cached
    assert submitted.run is not None and submitted.run.id == run_id


@pytest.mark.e2e
def test_a_local_run_on_a_named_gpu_is_served_with_its_assumptions(
    db_url: str, user: ServerClient
) -> None:
    # A real catalogue GPU and a tiny model: the search cap binds, the device is what counts.
    spec = Spec.model_validate(
        {
            "model": {"preset": "gpt2-tiny"},
            "training": {"seq_len": 16, "target_global_batch": 2, "max_micro_batch": 2},
        }
    )
    device = open_device("cpu", gpu="T4", world_size=spec.training.world_size)
    result = tune(spec, device, storage_url=db_url, target_seconds=0.05)
    assert result.recommendation is not None
    assert result.recommendation.capacity_bytes == budget_for(find_gpu("T4")).capacity_bytes

    run_id = record_local_run(db_url, result)

    run = user.get_run(run_id)
    assert run.status is RunStatus.SUCCEEDED
    assert run.device == EmulatedTarget(gpu="T4")
    assert run.worker_device == result.device
    assert run.worker_device is not None and run.worker_device.gpu == "T4"
    assert run.worker_device.assumptions == list(budget_for(find_gpu("T4")).assumptions)
    # Any alias of the GPU is the same submission.
    submitted = user.submit_run(spec, EmulatedTarget(gpu="tesla t4"))
    assert submitted.cached
    assert submitted.run is not None and submitted.run.id == run_id


@pytest.mark.e2e
def test_a_local_auto_layout_run_is_served_with_its_layouts(
    db_url: str, user: ServerClient
) -> None:
    """sharding: auto estimated on two H100s: the run names the chosen layout, lists every
    layout with why it lost, and its exports set the chosen layout."""
    from autotune.core.schemas import LayoutVerdict, Sharding

    result = auto_layout_result(db_url)
    assert result.recommendation is not None and result.recommendation.sharding is not None
    assert [layout.sharding for layout in result.layouts][0] is result.recommendation.sharding
    assert {layout.sharding for layout in result.layouts} == {
        Sharding.NONE,
        Sharding.ZERO1,
        Sharding.ZERO2,
        Sharding.ZERO3,
    }

    run = user.get_run(record_local_run(db_url, result))
    assert run.status is RunStatus.SUCCEEDED
    assert run.recommendation == result.recommendation
    assert run.layouts == result.layouts
    assert run.layouts[0].verdict is LayoutVerdict.CHOSEN
    assert all(layout.reason for layout in run.layouts)
    assert run.exports == result.exports
    assert run.exports is not None
    assert run.exports.training.sharding is result.recommendation.sharding
