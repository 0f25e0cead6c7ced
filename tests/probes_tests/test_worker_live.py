"""`autotune worker` end to end: a real uvicorn server on loopback, real worker processes on
emulated GPUs, real trial children; faults injected by killing processes and by models that
crash or hang.

Workers use the forkserver start method here (each trial is still a fresh process) so that
the suite fits its time budget; the default spawn method is covered by test_isolation.py and
by the shutdown tests below.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
import pytest

from autotune.core.schemas import Phase, Spec, StepOutcome, Trial, TrialState
from autotune.remote.client import LeaseLost, ServerClient
from autotune.remote.protocol import EmulatedTarget, Run, RunStatus
from tests.conftest import (
    CLIENT_TOKEN,
    WORKER_TOKEN,
    LiveServer,
    free_port,
    start_server,
    stop_server,
    wait_for_health,
)
from tests.probes_tests.factories import wide_spec
from tests.probes_tests.live import (
    WorkerProcess,
    kill_marked,
    start_worker,
    stop_worker,
    wait_for_no_marked,
)

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MIB = 2**20


class Fleet:
    """The server and workers of one test; torn down (and checked for leftovers) after it."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.server: LiveServer | None = None
        self.workers: list[WorkerProcess] = []

    def serve(self, **env: str) -> LiveServer:
        self.server = start_server(
            f"sqlite:///{self.tmp_path / 'server.db'}",
            self.tmp_path / "server.log",
            # The tests' specs are factories (tests.probes_tests.factories): allowed explicitly.
            extra_env={
                "AUTOTUNE_WAIT_POLL_S": "0.05",
                "AUTOTUNE_ALLOW_FACTORY_SPECS": "true",
                **env,
            },
        )
        return self.server

    def worker(self, name: str, memory: str, *extra_args: str, **options: str) -> WorkerProcess:
        assert self.server is not None
        worker = start_worker(
            self.server.url, self.tmp_path, name, memory=memory, extra_args=extra_args, **options
        )
        self.workers.append(worker)
        return worker

    def user(self) -> ServerClient:
        assert self.server is not None
        return ServerClient(self.server.url, token=CLIENT_TOKEN)

    def close(self) -> list[str]:
        """Stop everything; returns complaints about processes that outlived their worker."""
        leftovers = []
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.process.kill()
                worker.process.wait()
            # Polled: a loaded machine may take long to reap a killed tree, never forever.
            stray = wait_for_no_marked(worker.mark, timeout_s=60)
            if stray:
                leftovers.append(f"{worker.name} left processes {stray}")
                kill_marked(worker.mark)
        if self.server is not None:
            stop_server(self.server)
        return leftovers


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path)
    try:
        yield fleet
    finally:
        leftovers = fleet.close()
    assert leftovers == []


# Deadlines, not durations: a healthy run takes seconds, but a machine shared by several test
# suites was seen to take minutes, and a deadline costs nothing while the test passes.
def _wait(user: ServerClient, run_id: int, timeout_s: float = 300) -> Run:
    run = user.wait_for_run(run_id, timeout_s=timeout_s, poll_s=5)
    assert run.status.is_finished(), f"run {run_id} still {run.status.value}"
    return run


def _wait_until(
    user: ServerClient, run_id: int, done: Callable[[Run], bool], timeout_s: float = 180
) -> Run:
    deadline_s = time.monotonic() + timeout_s
    while True:
        run = user.get_run(run_id)
        if done(run):
            return run
        assert time.monotonic() < deadline_s, f"run {run_id}: still not there: {run}"
        time.sleep(0.05)


def _streamed(count: int) -> Callable[[Run], bool]:
    return lambda run: len(run.attempts) >= count


def _assert_recommendation_fits_target(run: Run) -> None:
    rec = run.recommendation
    assert rec is not None, run
    target = run.spec.training.target_global_batch
    assert rec.global_batch == target
    assert rec.micro_batch * rec.accumulation_steps * rec.world_size == target
    assert rec.capacity_bytes == run.device.memory_bytes
    assert 0 < rec.peak_bytes <= rec.capacity_bytes
    assert run.exports is not None and run.exports.deepspeed["train_batch_size"] == target
    # The recommended configuration was measured, and fitted.
    measured = [t.trial for t in run.trials if t.claim_number == run.claim_count]
    chosen = [
        t
        for t in measured
        if (t.micro_batch, t.accumulation_steps, t.checkpointing)
        == (rec.micro_batch, rec.accumulation_steps, rec.checkpointing)
    ]
    assert [t.state for t in chosen] == [TrialState.COMPLETE]


def test_two_workers_finish_every_run_each_on_a_matching_device(fleet: Fleet) -> None:
    fleet.serve()
    small = fleet.worker("small", "5MiB")
    large = fleet.worker("large", "7MiB")
    by_memory = {5 * MIB: small.name, 7 * MIB: large.name}
    submissions: list[tuple[Spec, int]] = [
        (wide_spec(features=16, target_global_batch=32), 5 * MIB),
        (wide_spec(features=16, target_global_batch=32), 7 * MIB),
        (wide_spec(features=24, target_global_batch=48), 5 * MIB),
        (wide_spec(features=24, target_global_batch=48), 7 * MIB),
    ]
    with fleet.user() as user:
        run_ids = [
            user.submit_run(spec, EmulatedTarget(memory_bytes=memory)).id
            for spec, memory in submissions
        ]
        runs = [_wait(user, run_id) for run_id in run_ids]

    for run, (spec, memory) in zip(runs, submissions, strict=True):
        assert run.status is RunStatus.SUCCEEDED, run.error
        assert run.worker_id == by_memory[memory]
        assert run.worker_device is not None
        assert run.worker_device.capacity_bytes == memory
        assert run.claim_count == 1 and run.failures == []
        [mode] = run.modes
        assert 0 < mode.max_micro_batch < spec.training.max_micro_batch
        # The worker traced the fit points in its first child; two real trials certified them.
        assert mode.traced is not None
        assert mode.traced.predicted_max_micro_batch == mode.max_micro_batch
        assert [a.attempt.micro_batch for a in run.attempts] == [
            mode.max_micro_batch,
            mode.max_micro_batch + 1,
        ]
        assert mode.recommended_micro_batch >= 1
        _assert_recommendation_fits_target(run)
    # More memory fits a larger micro-batch of the same model.
    assert runs[1].modes[0].max_micro_batch > runs[0].modes[0].max_micro_batch
    assert stop_worker(small) == 0
    assert stop_worker(large) == 0


def test_a_killed_workers_run_is_released_and_finished_by_the_other(fleet: Fleet) -> None:
    fleet.serve(AUTOTUNE_LEASE_S="3")
    first = fleet.worker("first", "5MiB", "--seconds-per-trial", "0.5")
    second = fleet.worker("second", "5MiB", "--seconds-per-trial", "0.5")
    workers = {first.name: first, second.name: second}
    with fleet.user() as user:
        run_id = user.submit_run(wide_spec(features=16), EmulatedTarget(memory_bytes=5 * MIB)).id
        running = _wait_until(user, run_id, _streamed(2))
        assert running.status is RunStatus.RUNNING
        assert running.worker_id is not None
        victim = workers.pop(running.worker_id)
        [survivor] = workers.values()
        victim_lease = victim.lease_of(run_id)
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait()
        before_kill = user.get_run(run_id)  # what the victim had stored (but for one post)
        assert before_kill.claim_count == 1
        run = _wait(user, run_id)

    assert run.status is RunStatus.SUCCEEDED, run.error
    assert run.worker_id == survivor.name and run.claim_count == 2
    [failure] = run.failures
    assert (failure.claim_number, failure.error_type) == (1, "LeaseExpired")
    assert failure.worker_id == victim.name
    # Nothing the victim stored was lost; nothing was stored twice. The victim posts one thing
    # at a time, so at most one post it sent before it died was answered after the snapshot.
    victim_attempts = [a for a in before_kill.attempts if a.claim_number == 1]
    stored_attempts = [a for a in run.attempts if a.claim_number == 1]
    assert stored_attempts[: len(victim_attempts)] == victim_attempts
    assert len(stored_attempts) <= len(victim_attempts) + 1
    attempt_keys = Counter((a.claim_number, a.sequence) for a in run.attempts)
    trial_keys = Counter((t.claim_number, t.trial.number) for t in run.trials)
    assert max(attempt_keys.values()) == 1 and max(trial_keys.values()) == 1
    final_attempts = [a.attempt for a in run.attempts if a.claim_number == 2]
    assert final_attempts == [a for mode in run.modes for a in mode.attempts]
    assert len({t.trial.number for t in run.trials if t.claim_number == 2}) >= 1
    _assert_recommendation_fits_target(run)

    # A late post under the killed lease is refused and changes nothing.
    assert fleet.server is not None
    with ServerClient(fleet.server.url, token=WORKER_TOKEN) as late:
        attempt = StepOutcome(
            micro_batch=7, fits=True, peak_bytes=1, phase_peak_bytes={Phase.FORWARD: 1}
        )
        with pytest.raises(LeaseLost) as refused:
            late.post_attempt(
                run_id, victim_lease, sequence=99, checkpointing=False, attempt=attempt
            )
        assert refused.value.code == "stale_lease"
        trial = Trial(
            number=99,
            micro_batch=7,
            accumulation_steps=1,
            checkpointing=False,
            state=TrialState.COMPLETE,
            samples_per_s=1.0,
        )
        with pytest.raises(LeaseLost):
            late.post_trial(run_id, victim_lease, trial)
        with pytest.raises(LeaseLost):
            late.heartbeat(run_id, victim_lease)
    with fleet.user() as user:
        assert user.get_run(run_id) == run
    # The victim's trial children died with it (checked for every worker by the fixture too).
    assert wait_for_no_marked(victim.mark) == []
    assert stop_worker(survivor) == 0


def test_a_worker_refuses_factories_outside_its_allow_list_and_imports_nothing(
    fleet: Fleet,
) -> None:
    """`builtins:print` once ran in a trial child for anyone with a client token."""
    fleet.serve()
    worker = fleet.worker("strict", "5MiB")  # --allow-factory tests
    spec = wide_spec(features=16)
    spec = spec.model_copy(
        update={"model": spec.model.model_copy(update={"factory": "builtins:print"})}
    )
    with fleet.user() as user:
        run_id = user.submit_run(spec, EmulatedTarget(memory_bytes=5 * MIB)).id
        deadline_s = time.monotonic() + 120
        while not (run := user.get_run(run_id)).failures:
            assert time.monotonic() < deadline_s, run
            time.sleep(0.2)
        # Refused by this worker, not by the spec: the run waits for another worker (one that
        # allows the factory) and is never handed back to this one, which keeps polling.
        time.sleep(3)
        run = user.get_run(run_id)
    assert run.status is RunStatus.QUEUED
    assert run.claim_count == 1 and len(run.failures) == 1
    for failure in run.failures:
        assert failure.error_type == "FactoryRefused"
        assert failure.message == (
            "factory 'builtins:print' refused: this worker allows factories only under tests; "
            "to run it, start a worker with --allow-factory builtins (or a narrower prefix of "
            "'builtins')"
        )
    assert run.attempts == [] and run.trials == []
    assert "input_shape=(16,)" not in worker.log()  # what print(training) would have written
    assert stop_worker(worker) == 0


def test_crashing_and_hanging_trials_fail_their_runs_and_the_worker_goes_on(
    fleet: Fleet,
) -> None:
    fleet.serve()
    # The limit starts once a child has imported torch (a start took over 20 s on a machine
    # loaded 2x over); a healthy child of this model then needs about a second.
    worker = fleet.worker("crashy", "5MiB", "--trial-timeout", "10")
    target = EmulatedTarget(memory_bytes=5 * MIB)
    with fleet.user() as user:
        aborting = user.submit_run(wide_spec("abort_above_4", features=16), target).id
        hanging = user.submit_run(wide_spec("hang_above_4", features=16), target).id
        measuring = user.submit_run(wide_spec("abort_in_measurement", features=16), target).id
        raising = user.submit_run(wide_spec("raise_boom", features=16), target).id
        healthy = user.submit_run(wide_spec(features=16), target).id
        runs = {
            run_id: _wait(user, run_id)
            for run_id in (aborting, hanging, measuring, raising, healthy)
        }

    for run_id, reason in [
        (aborting, "killed by SIGABRT"),
        (hanging, "timed out after 10 s"),
        (measuring, "killed by SIGABRT"),
    ]:
        run = runs[run_id]
        assert run.status is RunStatus.FAILED
        # A crash reproduces on any worker: failed at once, not retried.
        assert run.claim_count == 1
        [failure] = run.failures
        assert failure.error_type == "TrialCrashed"
        assert reason in failure.message and run.error is not None and reason in run.error
    # The traced fit (on fake tensors: nothing ran above 4) sent the first real trial above 4.
    assert "micro-batch" in runs[aborting].failures[0].message
    assert runs[aborting].attempts == []
    # A crash inside a throughput measurement is a FAILED trial on the run.
    failed = [t.trial for t in runs[measuring].trials if t.trial.state is TrialState.FAILED]
    [failed_trial] = failed
    assert failed_trial.error is not None and "killed by SIGABRT" in failed_trial.error
    assert failed_trial.micro_batch * failed_trial.accumulation_steps == 32
    # The failed run points at the study its claim created in the worker's store.
    study_name = runs[measuring].study_name
    assert study_name is not None and study_name.startswith(f"autotune-run-{measuring}-claim-1-")
    store = f"sqlite:///{fleet.tmp_path / 'crashy-optuna.db'}"
    assert optuna.load_study(study_name=study_name, storage=store).trials
    # A user exception: its type once, beside the message, never "ValueError: ValueError".
    [boom] = runs[raising].failures
    assert (boom.error_type, boom.message) == ("ValueError", "boom")
    assert runs[raising].error is not None and "ValueError: boom" in runs[raising].error
    assert "ValueError: ValueError" not in runs[raising].error
    assert runs[healthy].status is RunStatus.SUCCEEDED
    _assert_recommendation_fits_target(runs[healthy])
    assert worker.process.poll() is None
    assert stop_worker(worker) == 0


def test_a_cancelled_run_stops_at_once_and_the_worker_goes_on(fleet: Fleet) -> None:
    fleet.serve(AUTOTUNE_LEASE_S="3")
    worker = fleet.worker("patient", "5MiB", "--trial-timeout", "600")
    target = EmulatedTarget(memory_bytes=5 * MIB)
    with fleet.user() as user:
        hanging = user.submit_run(wide_spec("hang_above_4", features=16), target).id
        # The trial child says so on stderr, which is the worker's log.
        worker.wait_for_log("hang_above_4: hanging", timeout_s=180)
        assert user.cancel_run(hanging).status is RunStatus.CANCELLED
        # "At once": well within the lease (3 s) and the trial timeout (600 s), but a loaded
        # machine may take seconds to kill and reap a child.
        worker.wait_for_log(rf"run {hanging}: cancelled", timeout_s=60)
        probe_only = wide_spec(features=16, target_global_batch=None)
        next_run = user.submit_run(probe_only, target).id
        assert _wait(user, next_run).status is RunStatus.SUCCEEDED
        assert user.get_run(hanging).status is RunStatus.CANCELLED
    assert stop_worker(worker) == 0


def test_sigterm_stops_an_idle_worker_with_exit_code_0(fleet: Fleet) -> None:
    fleet.serve()
    worker = fleet.worker("idle", "5MiB", start_method="spawn")
    worker.wait_for_log("waiting for runs")
    started_s = time.monotonic()
    assert stop_worker(worker) == 0
    # Promptly, not after a poll or a long-poll (a loaded machine adds seconds of start-up).
    assert time.monotonic() - started_s < 30
    assert "stopped after 0 run(s)" in worker.log()


def test_sigterm_releases_a_run_in_progress_and_exits_0(fleet: Fleet) -> None:
    fleet.serve()
    # --no-trace: the fit points 2 and 3 run (and stream) before the hang above 4; a traced fit
    # would send the first real trial above 4.
    worker = fleet.worker(
        "leaving",
        "5MiB",
        "--trial-timeout",
        "600",
        "--shutdown-grace",
        "1",
        "--no-trace",
        start_method="spawn",
    )
    with fleet.user() as user:
        run_id = user.submit_run(
            wide_spec("hang_above_4", features=16), EmulatedTarget(memory_bytes=5 * MIB)
        ).id
        _wait_until(user, run_id, _streamed(1), timeout_s=120)
        assert stop_worker(worker, timeout_s=20) == 0
        run = user.get_run(run_id)
    assert run.status is RunStatus.QUEUED  # handed back for another worker
    [failure] = run.failures
    assert failure.error_type == "WorkerShutdown"
    assert failure.message == "worker shutting down"
    assert "released" in worker.log()


def test_sigterm_lets_a_run_that_can_finish_in_the_grace_period_finish(fleet: Fleet) -> None:
    fleet.serve()
    worker = fleet.worker("finishing", "5MiB", "--shutdown-grace", "120")
    probe_only = wide_spec(features=16, target_global_batch=None)
    with fleet.user() as user:
        run_id = user.submit_run(probe_only, EmulatedTarget(memory_bytes=5 * MIB)).id
        _wait_until(user, run_id, _streamed(1))
        worker.process.send_signal(signal.SIGTERM)
        assert worker.process.wait(timeout=120) == 0
        run = user.get_run(run_id)
    assert run.status is RunStatus.SUCCEEDED and run.failures == []
    assert run.modes[0].max_micro_batch > 0
    assert "stopped after 1 run(s)" in worker.log()


def _start_server_on(port: int, tmp_path: Path, **extra_env: str) -> LiveServer:
    """A server on a given port (conftest's helper picks its own), on `late.db` in `tmp_path`
    (so a server started again on the same port finds its database as it left it)."""
    log_path = tmp_path / "late-server.log"
    env = {
        **os.environ,
        "AUTOTUNE_DATABASE_URL": f"sqlite:///{tmp_path / 'late.db'}",
        "AUTOTUNE_CLIENT_TOKENS": CLIENT_TOKEN,
        "AUTOTUNE_WORKER_TOKENS": WORKER_TOKEN,
        "AUTOTUNE_ALLOW_FACTORY_SPECS": "true",
        **extra_env,
    }
    command = [sys.executable, "-m", "uvicorn", "--factory", "api.main:create_app_from_env"]
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [*command, "--port", str(port), "--log-level", "warning"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    wait_for_health(url, process, log_path)
    return LiveServer(url, process, log_path)


def test_the_worker_waits_for_a_server_that_is_down(fleet: Fleet, tmp_path: Path) -> None:
    port = free_port()
    worker = start_worker(f"http://127.0.0.1:{port}", tmp_path, "waiting", memory="5MiB")
    fleet.workers.append(worker)
    worker.wait_for_log("server unreachable")
    fleet.server = _start_server_on(port, tmp_path)
    with fleet.user() as user:
        run_id = user.submit_run(
            wide_spec(features=16, target_global_batch=None), EmulatedTarget(memory_bytes=5 * MIB)
        ).id
        assert _wait(user, run_id).status is RunStatus.SUCCEEDED
    # Logged at the first answer; waited for, as the log is written by another process.
    worker.wait_for_log("server reachable again", timeout_s=30)
    log = worker.log()
    assert log.count("server unreachable") == 1  # once per change, not per retry
    # At the first answer (the claim), not after the run that answer brought.
    assert log.index("server reachable again") < log.index(f"run {run_id}: claimed")
    assert stop_worker(worker) == 0


def test_a_server_outage_longer_than_the_lease_keeps_the_claims_work(
    fleet: Fleet, tmp_path: Path
) -> None:
    port = free_port()
    lease = {"AUTOTUNE_LEASE_S": "2", "AUTOTUNE_WAIT_POLL_S": "0.05"}
    fleet.server = _start_server_on(port, tmp_path, **lease)
    worker = fleet.worker("steady", "5MiB", "--seconds-per-trial", "0.5")
    with fleet.user() as user:
        run_id = user.submit_run(wide_spec(features=16), EmulatedTarget(memory_bytes=5 * MIB)).id
        _wait_until(user, run_id, _streamed(2))
    stop_server(fleet.server)
    worker.wait_for_log(rf"run {run_id}: heartbeat failed")
    # The outage itself: three leases long, so the lease lapses while the worker works on.
    time.sleep(6)
    fleet.server = _start_server_on(port, tmp_path, **lease)  # the same database
    with fleet.user() as user:
        run = _wait(user, run_id)
    assert run.status is RunStatus.SUCCEEDED, run.error
    assert run.worker_id == worker.name
    assert run.claim_count == 1  # renewed, not reclaimed: no claim spent
    assert "stopped renewing" not in str(run.failures)
    assert stop_worker(worker) == 0


def test_a_study_store_kept_from_an_earlier_server_does_not_fail_claims(
    fleet: Fleet, tmp_path: Path
) -> None:
    # The same worker (same name, so the same --db) serves a server, then a fresh server with
    # a fresh database, whose run numbers start again at 1.
    spec = wide_spec(features=16)
    target = EmulatedTarget(memory_bytes=5 * MIB)
    fleet.serve()
    first = fleet.worker("keeper", "5MiB")
    with fleet.user() as user:
        earlier = _wait(user, user.submit_run(spec, target).id)
    assert earlier.status is RunStatus.SUCCEEDED, earlier.error
    assert stop_worker(first) == 0
    assert fleet.server is not None
    stop_server(fleet.server)
    fleet.server = _start_server_on(free_port(), tmp_path)
    fleet.worker("keeper", "5MiB")
    with fleet.user() as user:
        later = _wait(user, user.submit_run(spec, target).id)
    assert later.id == earlier.id  # the same run number, on another server
    assert later.status is RunStatus.SUCCEEDED, later.error
    assert later.claim_count == 1 and later.failures == []
    assert later.study_name != earlier.study_name


def test_a_wrong_token_stops_the_worker_with_an_error(fleet: Fleet) -> None:
    fleet.serve()
    worker = fleet.worker("intruder", "5MiB", token="not-a-worker-token")
    assert worker.process.wait(timeout=60) == 1
    assert "autotune: error: 401 invalid_token" in worker.log()
