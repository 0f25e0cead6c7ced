"""Estimate runs are bounded and stoppable (issue 25, item 2): a long accumulation is traced
as a few micro-steps, a run past the worker's time or memory limit fails saying so, and a
cancel or a shutdown stops a trace, or the build of a model of thousands of layers, within
seconds. The worker runs in this process against the in-process app (real SQLite or PostgreSQL
store)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from autotune.core.gpus.catalogue import find_gpu
from autotune.core.schemas import Spec
from autotune.engine.estimate import estimate_device
from autotune.engine.runner import TrialRunner
from autotune.remote.client import ServerClient
from autotune.remote.protocol import Claim, EstimateTarget, RunStatus
from probes.inventory import ESTIMATE_DEVICE, WorkerDevice
from probes.worker import RunOutcome, Worker, WorkerConfig
from tests.probes_tests.factories import llama_spec

# Traces for tens of seconds: long enough to stop in the middle.
SLOW_SPEC = llama_spec(60)
# Its build alone takes seconds to minutes, so a stop that only traces check is not honoured
# for that long (2,000 layers took 9 min on the only estimate worker, in the issue). With the
# layer replay the build is mostly the depth's read, the model built whole on the meta device:
# 1.7 s at 2,000 layers on session 42's machine, inside the test's 2 s limit; 8,000 layers
# take 6-8 s there (some 640 MiB at the peak), and more on a slower machine.
HUGE_SPEC = llama_spec(8000)


class _Observed(Worker):
    """The worker, noting when each run's model is built (nothing else changes)."""

    built: list[int]

    def _estimate_runner(self, claim: Claim, *args: Any) -> TrialRunner:
        runner = super()._estimate_runner(claim, *args)
        self.built.append(claim.run_id)
        return runner


def _worker(client: ServerClient, tmp_path: Path, **config: Any) -> _Observed:
    gpu = find_gpu("T4").name
    device = WorkerDevice(estimate_device(gpu), ESTIMATE_DEVICE, None, gpu)
    settings = WorkerConfig(
        worker_id="estimates",
        storage_url=f"sqlite:///{tmp_path / 'optuna.db'}",
        shutdown_grace_s=0.0,
        **config,
    )
    worker = _Observed(client, [device], settings)
    worker.built = []
    return worker


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(call()), daemon=True)
    thread.start()
    return thread, results


@contextmanager
def _short_lease(
    settings_factory: Callable[..., Any], clock: Any
) -> Iterator[tuple[ServerClient, ServerClient]]:
    """A user's and a worker's client of an app whose lease is short: the heartbeat that
    learns of a cancel comes every second."""
    from fastapi.testclient import TestClient

    from api.main import create_app
    from tests.conftest import CLIENT_TOKEN, WORKER_TOKEN

    app = create_app(settings_factory(lease_s=3.0), clock=clock)
    try:
        with TestClient(app) as http:
            yield (
                ServerClient(http=http, token=CLIENT_TOKEN, retries=0),
                ServerClient(http=http, token=WORKER_TOKEN, retries=0),
            )
    finally:
        app.state.context.db.dispose()


def _wait_until_claimed(user: ServerClient, run_id: int) -> None:
    deadline_s = time.monotonic() + 120
    while user.get_run(run_id).status is not RunStatus.RUNNING:
        assert time.monotonic() < deadline_s
        time.sleep(0.05)


def _wait_until_tracing(user: ServerClient, run_id: int, built: list[int]) -> None:
    """Until the run's model is built and its first step is being traced."""
    deadline_s = time.monotonic() + 120
    while run_id not in built:
        assert time.monotonic() < deadline_s
        time.sleep(0.05)
    time.sleep(0.5)


@pytest.mark.e2e  # tens of seconds of child processes: CI's end-to-end run
def test_a_huge_accumulation_is_traced_as_a_few_micro_steps(
    user: ServerClient, worker: ServerClient, tmp_path: Path
) -> None:
    """target_global_batch 2^40 on an mlp grew the worker by gigabytes for minutes."""
    spec = Spec.model_validate(
        {"model": {"preset": "mlp"}, "training": {"target_global_batch": 2**40}}
    )
    run_id = user.submit_run(spec, EstimateTarget(gpu="T4")).id
    estimates = _worker(worker, tmp_path, estimate_time_limit_s=120.0)
    assert estimates.run_once() is RunOutcome.SUCCEEDED
    run = user.get_run(run_id)
    assert run.recommendation is not None
    assert run.recommendation.global_batch == 2**40


def test_an_estimate_past_its_time_limit_fails_saying_so(
    user: ServerClient, worker: ServerClient, tmp_path: Path
) -> None:
    run_id = user.submit_run(SLOW_SPEC, EstimateTarget(gpu="T4")).id
    estimates = _worker(worker, tmp_path, estimate_time_limit_s=1.0)
    started_s = time.monotonic()
    assert estimates.run_once() is RunOutcome.FAILED
    assert time.monotonic() - started_s < 30  # the build and trace take minutes
    run = user.get_run(run_id)
    assert run.status is RunStatus.FAILED and run.claim_count == 1
    assert "ran past its time limit of 1 s per run" in (run.error or ""), run.error


def test_an_estimate_past_its_memory_limit_fails_saying_so(
    user: ServerClient, worker: ServerClient, tmp_path: Path
) -> None:
    run_id = user.submit_run(SLOW_SPEC, EstimateTarget(gpu="T4")).id
    estimates = _worker(worker, tmp_path, estimate_memory_limit_bytes=1)
    assert estimates.run_once() is RunOutcome.FAILED
    run = user.get_run(run_id)
    assert "grew the worker's memory by more than its limit of 1 B" in (run.error or ""), run.error


def test_a_cancel_stops_an_estimate_within_seconds(
    settings_factory: Callable[..., Any], clock: Any, tmp_path: Path
) -> None:
    with _short_lease(settings_factory, clock) as (user, worker):
        run_id = user.submit_run(SLOW_SPEC, EstimateTarget(gpu="T4")).id
        estimates = _worker(worker, tmp_path)
        thread, outcome = _in_thread(estimates.run_once)
        _wait_until_tracing(user, run_id, estimates.built)
        user.cancel_run(run_id)
        thread.join(60)
        assert outcome == [RunOutcome.LOST]


def test_a_shutdown_releases_an_estimate_within_seconds(
    user: ServerClient, worker: ServerClient, tmp_path: Path
) -> None:
    run_id = user.submit_run(SLOW_SPEC, EstimateTarget(gpu="T4")).id
    estimates = _worker(worker, tmp_path)
    thread, outcome = _in_thread(estimates.run_once)
    _wait_until_tracing(user, run_id, estimates.built)
    estimates.request_stop()  # what SIGTERM does; the grace here is 0 s
    thread.join(60)
    assert outcome == [RunOutcome.RELEASED]
    assert user.get_run(run_id).status is RunStatus.QUEUED


@pytest.mark.parametrize("stop", ["cancel", "shutdown", "time limit"])
@pytest.mark.e2e
def test_a_stop_ends_the_build_of_a_model_of_thousands_of_layers(
    stop: str, settings_factory: Callable[..., Any], clock: Any, tmp_path: Path
) -> None:
    """The stop is honoured while transformers builds the model: the build never finishes
    (6-8 s here, at 8,000 layers), and the run ends as the stop says."""
    with _short_lease(settings_factory, clock) as (user, worker):
        run_id = user.submit_run(HUGE_SPEC, EstimateTarget(gpu="T4")).id
        limit_s = 2.0 if stop == "time limit" else 600.0
        estimates = _worker(worker, tmp_path, estimate_time_limit_s=limit_s)
        thread, outcome = _in_thread(estimates.run_once)
        _wait_until_claimed(user, run_id)
        if stop == "cancel":
            user.cancel_run(run_id)
        elif stop == "shutdown":
            estimates.request_stop()  # what SIGTERM does; the grace here is 0 s
        thread.join(600)
        assert not thread.is_alive()
        assert estimates.built == []  # stopped inside the build, not after it
        run = user.get_run(run_id)
        if stop == "cancel":
            assert outcome == [RunOutcome.LOST] and run.status is RunStatus.CANCELLED
        elif stop == "shutdown":
            assert outcome == [RunOutcome.RELEASED] and run.status is RunStatus.QUEUED
        else:
            assert outcome == [RunOutcome.FAILED] and run.status is RunStatus.FAILED
            assert "ran past its time limit of 2 s per run" in (run.error or ""), run.error
