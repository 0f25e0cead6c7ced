"""Both integrations with `server=`: a real autotune server on loopback answers from what a
worker stored, at once, and says which run is waiting when nothing is stored
(autotune/python_api.py `stored_recommendation`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from autotune.core.errors import AutotuneError, SpecError
from autotune.core.schemas import Spec, TuneResult
from autotune.engine.devices.cuda_device import CudaDevice
from autotune.engine.devices.simulated_cuda import SimulatedCuda
from autotune.engine.runner import InProcessRunner
from autotune.engine.tuner import tune_session
from autotune.integrations.lightning import AutotuneBatchSize
from autotune.integrations.transformers import tuned_arguments
from autotune.python_api import stored_recommendation
from autotune.remote.client import ServerClient
from tests.autotune_tests.engine.simulated_gpus import small_gpu
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


@pytest.mark.e2e
def test_a_cuda_card_is_answered_from_what_the_fleet_measured_on_that_card(
    live_server: LiveServer,
) -> None:
    # With neither memory= nor gpu=, the question is about this machine's card (here the
    # simulated CUDA backend's): the stored results are those of workers on the same card.
    spec = Spec.model_validate(
        {"model": {"preset": "mlp"}, "training": {"target_global_batch": 16}}
    )
    with SimulatedCuda(small_gpu()) as cuda:
        with pytest.raises(AutotuneError, match=r"no stored recommendation .* on NVIDIA A100"):
            stored_recommendation(
                spec, server=live_server.url, token=CLIENT_TOKEN, device="cuda", cuda=cuda
            )
        # A worker on the same card measures the run the server queued.
        measured = tune_session(
            InProcessRunner(spec, CudaDevice(0, runtime=cuda)),
            storage_url="sqlite://",
            n_trials=2,
            target_seconds=0.05,
        )
    store(live_server, measured)
    with SimulatedCuda(small_gpu()) as cuda:
        answered = stored_recommendation(
            spec, server=live_server.url, token=CLIENT_TOKEN, device="cuda:0", cuda=cuda
        )
    assert measured.recommendation is not None
    assert answered == measured.recommendation
    # Another card of a different size has nothing stored.
    with SimulatedCuda(small_gpu(total_mib=1024)) as cuda:
        with pytest.raises(AutotuneError, match="no stored recommendation"):
            stored_recommendation(
                spec, server=live_server.url, token=CLIENT_TOKEN, device="cuda", cuda=cuda
            )


def test_an_emulated_gpu_is_not_asked_for_on_a_cuda_device() -> None:
    spec = Spec.model_validate({"model": {"preset": "mlp"}})
    with pytest.raises(SpecError, match="memory= and gpu= name an emulated GPU"):
        stored_recommendation(spec, server="http://127.0.0.1:9", memory=2**30, device="cuda")
    with pytest.raises(SpecError, match="not both"):
        stored_recommendation(spec, server="http://127.0.0.1:9", memory=2**30, gpu="A100 80GB")
