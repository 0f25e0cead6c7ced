"""`autotune tune` records its run in the project's database, where the server shows it and
answers the same submission from it."""

from __future__ import annotations

import optuna

from api.local import record_local_run, target_for
from autotune.core.schemas import Spec
from autotune.engine.device import EmulatedDevice
from autotune.engine.tuner import tune
from autotune.remote.client import ServerClient
from autotune.remote.protocol import RunStatus

CAPACITY_BYTES = 120 * 2**20


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
