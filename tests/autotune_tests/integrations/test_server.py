"""Both integrations with `server=`: a real autotune server on loopback answers from what a
worker stored, at once, and says which run is waiting when nothing is stored
(autotune/python_api.py `stored_recommendation`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from autotune.core.errors import AutotuneError
from autotune.core.schemas import TuneResult
from autotune.integrations.lightning import AutotuneBatchSize
from autotune.integrations.transformers import tuned_arguments
from autotune.remote.client import ServerClient
from tests.autotune_tests.integrations.test_lightning import (
    MEMORY_BYTES,
    TARGET_GLOBAL_BATCH,
    Rows,
    Wide,
    trainer,
)
from tests.autotune_tests.integrations.test_transformers import rows
from tests.conftest import CLIENT_TOKEN, WORKER_TOKEN, LiveServer, start_server, stop_server


def store(server: LiveServer, result: TuneResult) -> None:
    """What a worker of the fleet does: claim the queued run and post its result."""
    with ServerClient(server.url, token=WORKER_TOKEN, retries=0) as worker:
        claim = worker.claim("w1", [result.device])
        assert claim is not None
        worker.submit_result(claim.run_id, claim.lease_id, result)


@pytest.fixture
def factory_server(db_url: str, tmp_path: Path) -> Iterator[LiveServer]:
    """A server that takes factory specs: a LightningModule is named by its class."""
    server = start_server(
        db_url, tmp_path / "server.log", extra_env={"AUTOTUNE_ALLOW_FACTORY_SPECS": "true"}
    )
    yield server
    stop_server(server)


def test_the_callback_applies_the_servers_stored_recommendation(
    factory_server: LiveServer,
) -> None:
    live_server = factory_server

    def asking() -> AutotuneBatchSize:
        return AutotuneBatchSize(
            target_global_batch=TARGET_GLOBAL_BATCH,
            memory=MEMORY_BYTES,
            server=live_server.url,
            token=CLIENT_TOKEN,
        )

    with pytest.raises(AutotuneError, match=r"no stored recommendation .*run 1 is queued"):
        trainer(asking()).fit(Wide(), datamodule=Rows())
    measured = AutotuneBatchSize(
        target_global_batch=TARGET_GLOBAL_BATCH,
        memory=MEMORY_BYTES,
        trials=2,
        seconds_per_trial=0.05,
    )
    trainer(measured, max_steps=1).fit(Wide(), datamodule=Rows())
    assert measured.result is not None and measured.recommendation is not None
    store(live_server, measured.result)

    callback, data, module = asking(), Rows(), Wide()
    fit = trainer(callback)
    fit.fit(module, datamodule=data)
    assert callback.result is None  # nothing measured here
    assert callback.recommendation == measured.recommendation
    micro = measured.recommendation.micro_batch
    assert data.batch_size == micro
    assert micro * fit.accumulate_grad_batches == TARGET_GLOBAL_BATCH
    assert fit.global_step == 2 and module.seen == [micro] * 2 * fit.accumulate_grad_batches


@pytest.mark.e2e
def test_tuned_arguments_from_the_servers_stored_recommendation(
    live_server: LiveServer, tmp_path: Path
) -> None:
    from transformers import TrainingArguments

    from autotune.python_api import tune
    from tests.autotune_tests.core.exports.roundtrip import tiny_llama

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        report_to=[],
        optim="adamw_torch",
    )
    model, dataset = tiny_llama(), rows(16)
    memory = 64 * 2**20
    with pytest.raises(AutotuneError, match="no stored recommendation"):
        tuned_arguments(
            model, args, dataset, memory=memory, server=live_server.url, token=CLIENT_TOKEN
        )
    # A worker tunes the run as the server holds it: the model rebuilt from its config.
    with ServerClient(live_server.url, token=CLIENT_TOKEN, retries=0) as user:
        [summary] = user.list_runs().items
        queued = user.get_run(summary.id)
    assert queued.spec.model.hf_config is not None
    result = tune(queued.spec, memory=memory, trials=2, seconds_per_trial=0.05)
    store(live_server, result)
    tuned = tuned_arguments(
        model, args, dataset, memory=memory, server=live_server.url, token=CLIENT_TOKEN
    )
    rec = result.recommendation
    assert rec is not None
    assert (tuned.per_device_train_batch_size, tuned.gradient_accumulation_steps) == (
        rec.micro_batch,
        rec.accumulation_steps,
    )
    assert tuned.per_device_train_batch_size * tuned.gradient_accumulation_steps == 8
