"""The worker protocol on a real database (SQLite file and PostgreSQL schema, fresh per test):
claims and device matching, leases, heartbeats, idempotent events, results, failures, expiry."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from api.settings import Settings
from autotune.core.gpus.catalogue import find_gpu
from autotune.core.gpus.cuda_reserve import budget_for
from autotune.core.schemas import DeviceInfo, Spec
from autotune.remote.client import LeaseLost, RequestRejected, ServerClient
from autotune.remote.protocol import CudaTarget, EmulatedTarget, EstimateTarget, RunStatus
from tests.api_tests.factories import (
    GIB,
    a100,
    attempt,
    cuda_device,
    emulated,
    emulated_device,
    estimate_device,
    named,
    named_device,
    tiny_spec,
    trial,
    tune_result,
)
from tests.conftest import WORKER_TOKEN, FakeClock

pytestmark = pytest.mark.usefixtures("db_url")


def test_claim_returns_none_when_queue_empty(worker: ServerClient) -> None:
    assert worker.claim("w1", [emulated_device()]) is None


def test_claim_hands_out_oldest_matching_run_with_lease(
    user: ServerClient, worker: ServerClient, clock: FakeClock
) -> None:
    first = user.submit_run(tiny_spec(64), emulated(4 * GIB)).id
    clock.advance(1)
    user.submit_run(tiny_spec(32), emulated(4 * GIB))
    other_memory = user.submit_run(tiny_spec(64), emulated(2 * GIB)).id

    claim = worker.claim("w1", [emulated_device(8 * GIB), emulated_device(4 * GIB, index=1)])

    assert claim is not None
    assert claim.run_id == first
    assert claim.device_index == 1  # the device whose capacity equals the target memory
    assert claim.spec == tiny_spec(64)
    assert claim.claim_number == 1
    assert (claim.lease_expires_at - clock.now).total_seconds() == 30.0
    assert claim.study_name == f"autotune-run-{first}"
    run = user.get_run(first)
    assert run.status == RunStatus.RUNNING
    assert run.worker_id == "w1"
    assert user.get_run(other_memory).status == RunStatus.QUEUED


def test_claim_never_matches_other_devices(user: ServerClient, worker: ServerClient) -> None:
    user.submit_run(tiny_spec(), emulated(4 * GIB))
    user.submit_run(tiny_spec(), a100())
    # Emulated capacity must be equal; a GPU of another name or memory never matches.
    assert worker.claim("w1", [emulated_device(4 * GIB + 1)]) is None
    assert worker.claim("w1", [cuda_device(name="NVIDIA H100 80GB HBM3")]) is None
    assert worker.claim("w1", [cuda_device(total_memory_bytes=40 * GIB)]) is None


@pytest.mark.parametrize(
    ("total_memory_bytes", "matches"),
    [
        (80 * GIB, True),
        (int(80 * GIB * 1.03), True),
        (int(80 * GIB * 0.97) + 1, True),
        (int(80 * GIB * 1.031), False),
        (int(80 * GIB * 0.969), False),
    ],
)
def test_cuda_claim_accepts_memory_within_three_percent(
    user: ServerClient, worker: ServerClient, total_memory_bytes: int, matches: bool
) -> None:
    run_id = user.submit_run(tiny_spec(), a100()).id
    claim = worker.claim("w1", [cuda_device(total_memory_bytes=total_memory_bytes)])
    assert (claim is not None and claim.run_id == run_id) is matches
    assert a100().matches(cuda_device(total_memory_bytes=total_memory_bytes)) is matches


def test_heartbeat_renews_the_lease(
    user: ServerClient, worker: ServerClient, clock: FakeClock
) -> None:
    user.submit_run(tiny_spec(), emulated())
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None
    clock.advance(20)
    lease = worker.heartbeat(claim.run_id, claim.lease_id)
    assert (lease.lease_expires_at - clock.now).total_seconds() == 30.0
    clock.advance(20)  # 40 s after the claim: alive only because of the heartbeat
    assert worker.claim("w2", [emulated_device()]) is None
    assert user.get_run(claim.run_id).status == RunStatus.RUNNING


def test_events_are_stored_once_per_key(user: ServerClient, worker: ServerClient) -> None:
    user.submit_run(tiny_spec(), emulated())
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None
    run_id, lease = claim.run_id, claim.lease_id

    first = worker.post_attempt(
        run_id, lease, sequence=0, checkpointing=False, attempt=attempt(8, True)
    )
    again = worker.post_attempt(
        run_id, lease, sequence=0, checkpointing=False, attempt=attempt(8, True)
    )
    worker.post_attempt(run_id, lease, sequence=1, checkpointing=False, attempt=attempt(16, False))
    assert (first.stored, again.stored) == (True, False)
    assert worker.post_trial(run_id, lease, trial(0)).stored is True
    assert worker.post_trial(run_id, lease, trial(0)).stored is False

    run = user.get_run(run_id)
    assert [(a.sequence, a.attempt.micro_batch, a.attempt.fits) for a in run.attempts] == [
        (0, 8, True),
        (1, 16, False),
    ]
    assert run.attempts[1].attempt.oom_phase == "backward"
    # Reserved and allocated peaks and the allocator's retries are stored as posted.
    assert [a.attempt for a in run.attempts] == [attempt(8, True), attempt(16, False)]
    assert [t.trial.number for t in run.trials] == [0]
    assert run.trials[0].trial == trial(0)


def test_result_finishes_the_run_and_replaces_streamed_records(
    user: ServerClient, worker: ServerClient
) -> None:
    spec = tiny_spec()
    user.submit_run(spec, emulated())
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None
    worker.post_attempt(
        claim.run_id, claim.lease_id, sequence=0, checkpointing=False, attempt=attempt(1, True)
    )
    worker.post_trial(claim.run_id, claim.lease_id, trial(0))
    result = tune_result(spec, emulated_device(), study_name=claim.study_name)

    run = worker.submit_result(claim.run_id, claim.lease_id, result)

    assert run.status == RunStatus.SUCCEEDED
    assert run.recommendation == result.recommendation
    assert run.exports == result.exports
    assert run.modes == result.probe.modes  # each mode with exactly its attempts, in order
    assert [t.trial for t in run.trials] == result.trials
    assert len(run.attempts) == 6
    assert run.worker_device == emulated_device()
    assert run.torch_version == "2.13"
    assert run.finished_at is not None and run.run_s is not None
    # A finished run refuses further events under its old lease.
    with pytest.raises(LeaseLost) as refused:
        worker.heartbeat(claim.run_id, claim.lease_id)
    assert refused.value.code == "stale_lease"


def test_result_for_another_spec_or_device_is_rejected(
    user: ServerClient, worker: ServerClient, http: TestClient
) -> None:
    user.submit_run(tiny_spec(64), emulated())
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None
    headers = {"Authorization": f"Bearer {WORKER_TOKEN}"}
    url = f"/api/v1/worker/runs/{claim.run_id}/result"
    for result in (
        tune_result(tiny_spec(128), emulated_device()),
        tune_result(tiny_spec(64), emulated_device(2 * GIB)),
    ):
        body = {"lease_id": claim.lease_id, "result": result.model_dump(mode="json")}
        response = http.post(url, json=body, headers=headers)
        assert response.status_code == 422
        assert response.json()["code"] == "result_rejected"
    assert user.get_run(claim.run_id).status == RunStatus.RUNNING


def test_a_named_gpu_run_goes_to_a_worker_offering_that_gpu_and_takes_its_result(
    user: ServerClient, worker: ServerClient, http: TestClient
) -> None:
    plain_id = user.submit_run(tiny_spec(64), emulated(named_device().capacity_bytes)).id
    named_id = user.submit_run(tiny_spec(64), named("h100-80gb")).id
    # Neither another GPU nor a plain device of the same capacity takes the named run; the
    # named device does not take the plain run. The name matches whatever the capacity (it
    # depends on the run's world size), here a device described for 4 ranks.
    assert worker.claim("w0", [named_device("A100 80GB")]) is None
    claim = worker.claim("w1", [emulated_device(GIB), named_device("H100 80GB", world_size=4)])
    assert claim is not None
    assert (claim.run_id, claim.device_index) == (named_id, 1)
    assert claim.target == named("H100 80GB")
    assert worker.claim("w2", [named_device("H100 80GB")]) is None
    assert user.get_run(plain_id).status == RunStatus.QUEUED
    headers = {"Authorization": f"Bearer {WORKER_TOKEN}"}
    url = f"/api/v1/worker/runs/{claim.run_id}/result"
    other = tune_result(tiny_spec(64), named_device("H200 141GB"))
    body = {"lease_id": claim.lease_id, "result": other.model_dump(mode="json")}
    response = http.post(url, json=body, headers=headers)
    assert response.status_code == 422
    assert response.json()["code"] == "result_rejected"
    worker.submit_result(
        claim.run_id, claim.lease_id, tune_result(tiny_spec(64), named_device("H100 80GB"))
    )
    run = user.get_run(named_id)
    assert run.status == RunStatus.SUCCEEDED
    assert run.device == named("H100 80GB")
    assert run.worker_device is not None and run.worker_device.gpu == "H100 80GB"


def test_expired_lease_requeues_and_stale_events_change_nothing(
    user: ServerClient, worker: ServerClient, clock: FakeClock
) -> None:
    spec = tiny_spec()
    run_id = user.submit_run(spec, emulated()).id
    old = worker.claim("w1", [emulated_device()])
    assert old is not None
    worker.post_attempt(
        run_id, old.lease_id, sequence=0, checkpointing=False, attempt=attempt(1, True)
    )

    clock.advance(31)
    # Expiry is seen on read: the run is back in the queue, the lapse recorded.
    run = user.get_run(run_id)
    assert run.status == RunStatus.QUEUED
    assert run.lease_lapsed_at == old.lease_expires_at
    assert run.failures == []  # the claim has not ended: its holder may still renew it
    clock.advance(1)
    new = worker.claim("w2", [emulated_device()])
    assert new is not None and new.run_id == run_id and new.claim_number == 2
    assert new.lease_id != old.lease_id
    reclaimed = user.get_run(run_id)
    assert (reclaimed.lease_lapsed_at, reclaimed.updated_at) == (None, clock.now)
    failures = user.get_run(run_id).failures
    assert [(f.claim_number, f.error_type, f.worker_id) for f in failures] == [
        (1, "LeaseExpired", "w1")
    ]
    assert "stopped renewing" not in failures[0].message
    assert "claimed again" in failures[0].message

    before = user.get_run(run_id)
    for stale_call in (
        lambda: worker.heartbeat(run_id, old.lease_id),
        lambda: worker.post_attempt(
            run_id, old.lease_id, sequence=1, checkpointing=True, attempt=attempt(2, True)
        ),
        lambda: worker.post_trial(run_id, old.lease_id, trial(5)),
        lambda: worker.submit_result(run_id, old.lease_id, tune_result(spec, emulated_device())),
        lambda: worker.report_failure(run_id, old.lease_id, error_type="X", message="late"),
    ):
        with pytest.raises(LeaseLost) as refused:
            stale_call()
        assert refused.value.status_code == 409
        assert refused.value.code == "stale_lease"
    after = user.get_run(run_id)
    assert after == before
    assert after.worker_id == "w2"


def test_listing_runs_expires_the_lapsed_leases_and_only_those(
    user: ServerClient, worker: ServerClient, clock: FakeClock
) -> None:
    ids = [user.submit_run(tiny_spec(size), emulated()).id for size in (64, 32, 16)]
    first = worker.claim("w1", [emulated_device()])
    second = worker.claim("w2", [emulated_device()])
    clock.advance(20)
    third = worker.claim("w3", [emulated_device()])
    assert first is not None and second is not None and third is not None
    assert [first.run_id, second.run_id, third.run_id] == ids

    def statuses() -> list[RunStatus]:
        by_id = {run.id: run.status for run in user.list_runs().items}
        return [by_id[run_id] for run_id in ids]

    # A lease is good until the instant it expires, not after it, whichever read sees it.
    clock.advance(10)
    assert clock.now == first.lease_expires_at
    assert user.get_run(ids[0]).status == RunStatus.RUNNING
    assert statuses() == [RunStatus.RUNNING] * 3
    assert worker.claim("w4", [emulated_device()]) is None  # a claim sweeps expiry too
    # One read requeues every lapsed run at once.
    clock.advance(1)
    assert statuses() == [RunStatus.QUEUED, RunStatus.QUEUED, RunStatus.RUNNING]
    assert user.get_run(ids[0]).lease_lapsed_at == first.lease_expires_at
    assert user.get_run(ids[2]).lease_lapsed_at is None


def test_posts_after_the_lease_expired_are_refused_before_anyone_claims(
    user: ServerClient, worker: ServerClient, clock: FakeClock
) -> None:
    # Nobody reads or claims in between, so only the lease's own expiry can refuse these.
    spec = tiny_spec()
    run_id = user.submit_run(spec, emulated()).id
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None
    lease = claim.lease_id
    worker.post_attempt(run_id, lease, sequence=0, checkpointing=False, attempt=attempt(1, True))
    clock.advance(30)  # the lease ends at exactly this instant
    for late_post in (
        lambda: worker.post_attempt(
            run_id, lease, sequence=1, checkpointing=False, attempt=attempt(2, True)
        ),
        lambda: worker.post_trial(run_id, lease, trial(0)),
        lambda: worker.submit_result(run_id, lease, tune_result(spec, emulated_device())),
        lambda: worker.report_failure(run_id, lease, error_type="Late", message="late"),
    ):
        with pytest.raises(LeaseLost) as refused:
            late_post()
        assert refused.value.status_code == 409
        assert refused.value.code == "lease_expired"
    run = user.get_run(run_id)
    assert [a.sequence for a in run.attempts] == [0]
    assert run.trials == [] and run.recommendation is None and run.modes == []
    assert run.status != RunStatus.SUCCEEDED
    assert "Late" not in {f.error_type for f in run.failures}


@pytest.mark.parametrize("read_in_between", [False, True])
def test_a_lapsed_lease_nobody_claimed_is_renewed_by_its_heartbeat(
    user: ServerClient, worker: ServerClient, clock: FakeClock, read_in_between: bool
) -> None:
    # A server outage longer than the lease: the worker worked on, and comes back.
    spec = tiny_spec()
    run_id = user.submit_run(spec, emulated()).id
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None
    clock.advance(90)
    if read_in_between:  # the sweep on read requeues the run, keeping the lease renewable
        assert user.get_run(run_id).status == RunStatus.QUEUED
    with pytest.raises(LeaseLost) as refused:
        worker.post_trial(run_id, claim.lease_id, trial(0))
    assert refused.value.code == "lease_expired"
    lease = worker.heartbeat(run_id, claim.lease_id)
    assert (lease.lease_expires_at - clock.now).total_seconds() == 30.0
    assert worker.post_trial(run_id, claim.lease_id, trial(0)).stored
    run = worker.submit_result(run_id, claim.lease_id, tune_result(spec, emulated_device()))
    assert run.status == RunStatus.SUCCEEDED
    assert run.claim_count == 1 and run.failures == []  # no claim spent
    assert run.lease_lapsed_at == claim.lease_expires_at  # what happened stays on the record


def test_a_lapsed_lease_on_the_last_claim_fails_the_run_saying_so(
    user: ServerClient, worker: ServerClient, clock: FakeClock
) -> None:
    run_id = user.submit_run(tiny_spec(), emulated()).id
    for number in (1, 2, 3):
        claim = worker.claim(f"w{number}", [emulated_device()])
        assert claim is not None and claim.claim_number == number
        clock.advance(31)
    run = user.get_run(run_id)
    assert run.status == RunStatus.FAILED
    assert [(f.claim_number, f.error_type) for f in run.failures] == [
        (1, "LeaseExpired"),
        (2, "LeaseExpired"),
        (3, "LeaseExpired"),
    ]
    assert "no claims left" in run.failures[2].message
    assert not any("stopped renewing" in f.message for f in run.failures)
    with pytest.raises(LeaseLost) as refused:
        worker.heartbeat(run_id, claim.lease_id)
    assert refused.value.code == "stale_lease"


def test_lease_expiry_is_found_by_the_next_claim(
    user: ServerClient, worker: ServerClient, clock: FakeClock
) -> None:
    run_id = user.submit_run(tiny_spec(), emulated()).id
    assert worker.claim("w1", [emulated_device()]) is not None
    assert worker.claim("w2", [emulated_device()]) is None
    clock.advance(30.5)
    reclaimed = worker.claim("w2", [emulated_device()])
    assert reclaimed is not None and reclaimed.run_id == run_id


def test_run_fails_with_reasons_after_max_claims(
    user: ServerClient, worker: ServerClient, clock: FakeClock
) -> None:
    run_id = user.submit_run(tiny_spec(), emulated()).id
    first = worker.claim("w1", [emulated_device()])
    assert first is not None
    run = worker.report_failure(
        run_id, first.lease_id, error_type="RuntimeError", message="CUDA error", retryable=True
    )
    assert run.status == RunStatus.QUEUED
    assert worker.claim("w2", [emulated_device()]) is not None
    clock.advance(31)  # the second claim's lease runs out
    third = worker.claim("w3", [emulated_device()])
    assert third is not None and third.claim_number == 3
    run = worker.report_failure(
        run_id, third.lease_id, error_type="ValueError", message="bad", traceback_tail="tb"
    )

    assert run.status == RunStatus.FAILED
    assert [(f.claim_number, f.error_type) for f in run.failures] == [
        (1, "RuntimeError"),
        (2, "LeaseExpired"),
        (3, "ValueError"),
    ]
    assert run.error is not None
    assert "claim 1: RuntimeError: CUDA error" in run.error
    assert "claim 3: ValueError: bad" in run.error
    assert worker.claim("w4", [emulated_device()]) is None


def test_non_retryable_failure_fails_at_once(user: ServerClient, worker: ServerClient) -> None:
    run_id = user.submit_run(tiny_spec(), emulated()).id
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None
    run = worker.report_failure(
        run_id,
        claim.lease_id,
        error_type="SpecError",
        message="model.preset: unknown preset",
        retryable=False,
    )
    assert run.status == RunStatus.FAILED
    assert run.claim_count == 1
    assert run.error == "failed after 1 claim(s): claim 1: SpecError: model.preset: unknown preset"


def test_a_failed_claim_points_the_run_at_the_study_it_created(
    user: ServerClient, worker: ServerClient
) -> None:
    run_id = user.submit_run(tiny_spec(), emulated()).id
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None
    study_name = f"{claim.study_name}-claim-1-{claim.lease_id[:8]}"
    run = worker.report_failure(
        run_id,
        claim.lease_id,
        error_type="TrialCrashed",
        message="killed by SIGABRT",
        retryable=False,
        study_name=study_name,
    )
    assert run.status == RunStatus.FAILED
    assert run.study_name == study_name


def test_cancel_while_running_tells_the_worker(user: ServerClient, worker: ServerClient) -> None:
    run_id = user.submit_run(tiny_spec(), emulated()).id
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None
    assert user.cancel_run(run_id).status == RunStatus.CANCELLED
    with pytest.raises(LeaseLost) as refused:
        worker.heartbeat(run_id, claim.lease_id)
    assert refused.value.cancelled
    with pytest.raises(LeaseLost):
        worker.submit_result(run_id, claim.lease_id, tune_result(tiny_spec(), emulated_device()))
    assert user.get_run(run_id).recommendation is None


def test_cuda_target_in_inventory_order(user: ServerClient, worker: ServerClient) -> None:
    target = CudaTarget(name="NVIDIA H100 80GB HBM3", memory_bytes="80GiB")
    run_id = user.submit_run(tiny_spec(), target).id
    devices = [cuda_device(index=0), cuda_device(name="NVIDIA H100 80GB HBM3", index=1)]
    claim = worker.claim("gpu-box", devices)
    assert claim is not None
    assert (claim.run_id, claim.device_index, claim.target) == (run_id, 1, target)


def test_worker_record_is_kept(
    user: ServerClient, worker: ServerClient, settings: Settings
) -> None:
    from sqlalchemy import select

    from api.store.db import Database
    from api.store.tables import WorkerRow

    user.submit_run(tiny_spec(), emulated())
    worker.claim("w1", [emulated_device()])
    worker.claim("w1", [emulated_device(), emulated_device(index=1)])
    database = Database(settings.resolved_database_url())
    with database.read() as session:
        row = session.scalars(select(WorkerRow)).one()
    database.dispose()
    assert (row.id, row.claims, len(row.devices)) == ("w1", 1, 2)


def test_a_run_asking_for_allocator_settings_goes_to_a_device_that_uses_them(
    user: ServerClient, worker: ServerClient
) -> None:
    # Written two ways, one canonical setting: one fingerprint, one run.
    asked = EmulatedTarget(memory_bytes=4 * GIB, allocator_conf="expandable_segments:True")
    first = user.submit_run(tiny_spec(), asked)
    spelled_otherwise = "roundup_power2_divisions:1,expandable_segments:True"
    again = user.submit_run(
        tiny_spec(), EmulatedTarget(memory_bytes=4 * GIB, allocator_conf=spelled_otherwise)
    )
    assert again.id == first.id
    plain = emulated_device(4 * GIB)
    expandable = plain.model_copy(update={"allocator_conf": "expandable_segments:True"})
    # A device on torch's defaults does not take it, nor a device with other settings.
    other = plain.model_copy(update={"allocator_conf": "max_split_size_mb:128"})
    assert worker.claim("w1", [plain, other]) is None
    claim = worker.claim("w1", [plain, expandable])
    assert claim is not None and claim.run_id == first.id and claim.device_index == 1
    # A run on the defaults is not the expandable device's either.
    user.submit_run(tiny_spec(), emulated(4 * GIB))
    assert worker.claim("w2", [expandable]) is None
    assert worker.claim("w2", [plain]) is not None


def test_a_failed_run_records_who_failed_when_and_why(
    user: ServerClient, worker: ServerClient, clock: FakeClock
) -> None:
    run_id = user.submit_run(tiny_spec(), emulated()).id
    first = worker.claim("w1", [emulated_device()])
    assert first is not None
    assert len(first.lease_id) == 32 and int(first.lease_id, 16) >= 0  # 16 random bytes
    assert first.heartbeat_interval_s == 10.0  # a third of the 30 s lease
    worker.report_failure(
        run_id, first.lease_id, error_type="ValueError", message="boom", traceback_tail="tb"
    )
    retried = user.get_run(run_id)
    assert (retried.status, retried.worker_id, retried.lease_expires_at) == (
        RunStatus.QUEUED,
        None,
        None,
    )
    clock.advance(5)
    second = worker.claim("w2", [emulated_device()])
    assert second is not None and second.claim_number == 2
    clock.advance(5)
    worker.report_failure(
        run_id, second.lease_id, error_type="KeyError", message="gone", retryable=False
    )
    run = user.get_run(run_id)
    assert run.status == RunStatus.FAILED
    assert run.finished_at == clock.now
    assert [
        (f.claim_number, f.worker_id, f.error_type, f.traceback_tail) for f in run.failures
    ] == [
        (1, "w1", "ValueError", "tb"),
        (2, "w2", "KeyError", None),
    ]
    assert (
        run.error == "failed after 2 claim(s): claim 1: ValueError: boom; claim 2: KeyError: gone"
    )


def test_each_kind_of_target_is_claimed_only_by_its_kind_of_device(
    user: ServerClient, worker: ServerClient
) -> None:
    h100 = budget_for(find_gpu("H100 80GB"))
    plain_id = user.submit_run(tiny_spec(), emulated(h100.capacity_bytes)).id
    named_id = user.submit_run(tiny_spec(), named("H100 80GB")).id
    cuda_id = user.submit_run(tiny_spec(), a100()).id
    # A CUDA card of the plain run's size, a named GPU of the same capacity, an emulated device
    # the size of the A100: none of them is the other's target.
    assert worker.claim("c", [cuda_device("NVIDIA H100", h100.capacity_bytes)]) is None
    claim = worker.claim("n", [named_device("H100 80GB")])
    assert claim is not None and claim.run_id == named_id
    assert worker.claim("e", [emulated_device(80 * GIB)]) is None
    claim = worker.claim("e", [emulated_device(h100.capacity_bytes)])
    assert claim is not None and claim.run_id == plain_id
    claim = worker.claim("a", [emulated_device(GIB), cuda_device()])
    assert claim is not None and claim.run_id == cuda_id and claim.device_index == 1

    # A named GPU's run is not a plain size's, nor a card's that shares its name and memory;
    # a card's run is not a named GPU's of that name.
    total = find_gpu("H100 80GB").total_memory_bytes
    named_id = user.submit_run(tiny_spec(16), named("H100 80GB")).id
    assert worker.claim("e", [emulated_device(total)]) is None
    assert worker.claim("c", [cuda_device("H100 80GB", total)]) is None
    card_id = user.submit_run(tiny_spec(16), CudaTarget(name="H100 80GB", memory_bytes=total)).id
    claim = worker.claim("n", [named_device("H100 80GB")])
    assert claim is not None and claim.run_id == named_id
    assert worker.claim("n", [named_device("H100 80GB")]) is None
    claim = worker.claim("c", [cuda_device("H100 80GB", total)])
    assert claim is not None and claim.run_id == card_id


def test_an_estimate_is_claimed_only_by_an_estimate_device_and_answers_only_estimates(
    user: ServerClient, worker: ServerClient
) -> None:
    estimate_id = user.submit_run(tiny_spec(), EstimateTarget(gpu="H100 80GB")).id
    named_id = user.submit_run(tiny_spec(), named("H100 80GB")).id
    # An emulated H100 does not take the estimate, nor an estimate for another GPU; the
    # estimate device takes the estimate only.
    assert worker.claim("e", [estimate_device("A100 80GB")]) is None
    claim = worker.claim("e", [estimate_device("A100 80GB"), estimate_device("H100 80GB", 1)])
    assert claim is not None
    assert (claim.run_id, claim.device_index) == (estimate_id, 1)
    assert claim.target == EstimateTarget(gpu="H100 80GB")
    assert worker.claim("e", [estimate_device("H100 80GB")]) is None
    # A measurement does not answer the estimate's result, and vice versa.
    with pytest.raises(RequestRejected):
        worker.submit_result(
            claim.run_id, claim.lease_id, tune_result(tiny_spec(), named_device("H100 80GB"))
        )
    worker.submit_result(
        claim.run_id, claim.lease_id, tune_result(tiny_spec(), estimate_device("H100 80GB"))
    )
    run = user.get_run(estimate_id)
    assert run.status == RunStatus.SUCCEEDED and run.device.label == "estimate:H100 80GB"
    # Cached for the estimate; the named GPU's run stays queued for a measurement.
    again = user.submit_run(tiny_spec(), EstimateTarget(gpu="H100 80GB"))
    assert again.cached and again.id == estimate_id
    assert user.get_run(named_id).status == RunStatus.QUEUED
    claim = worker.claim("n", [named_device("H100 80GB")])
    assert claim is not None and claim.run_id == named_id


def _finish(worker: ServerClient, run_id: int, device: DeviceInfo, spec: Spec) -> None:
    claim = worker.claim("w", [device])
    assert claim is not None and claim.run_id == run_id
    worker.submit_result(run_id, claim.lease_id, tune_result(spec, device))


def test_an_estimate_and_a_measurement_of_one_spec_on_one_gpu_are_compared(
    user: ServerClient, worker: ServerClient
) -> None:
    spec = tiny_spec(64)
    estimate_id = user.submit_run(spec, EstimateTarget(gpu="H100 80GB")).id
    with pytest.raises(RequestRejected) as unfinished:
        user.get_comparison(estimate_id)
    assert unfinished.value.code == "no_comparison"
    _finish(worker, estimate_id, estimate_device("H100 80GB"), spec)
    with pytest.raises(RequestRejected) as alone:
        user.get_comparison(estimate_id)  # nothing measured yet
    assert alone.value.code == "no_comparison"
    # A measurement of another spec, or on another GPU, is not its counterpart.
    other_spec_id = user.submit_run(tiny_spec(32), named("H100 80GB")).id
    _finish(worker, other_spec_id, named_device("H100 80GB"), tiny_spec(32))
    other_gpu_id = user.submit_run(spec, named("A100 80GB")).id
    _finish(worker, other_gpu_id, named_device("A100 80GB"), spec)
    with pytest.raises(RequestRejected):
        user.get_comparison(estimate_id)
    measured_id = user.submit_run(spec, named("H100 80GB")).id
    _finish(worker, measured_id, named_device("H100 80GB"), spec)
    # Found from either side; the factories' results are the same, so the error is zero.
    comparison = user.get_comparison(estimate_id)
    assert comparison == user.get_comparison(measured_id)
    assert (comparison.estimate_run_id, comparison.measured_run_id) == (estimate_id, measured_id)
    assert comparison.gpu == "H100 80GB" and comparison.measured_device == named("H100 80GB")
    measured = user.get_run(measured_id)
    assert [m.checkpointing for m in comparison.modes] == [m.checkpointing for m in measured.modes]
    for mode, probed in zip(comparison.modes, measured.modes, strict=True):
        assert mode.measured_max_micro_batch == probed.max_micro_batch
        assert mode.error_micro_batches == 0
    assert comparison.speed_error == 0.0
    # A real card of that GPU is the truth, preferred over the emulated one.
    total = find_gpu("H100 80GB").total_memory_bytes
    card = CudaTarget(name="NVIDIA H100 80GB HBM3", memory_bytes=total)
    card_id = user.submit_run(spec, card).id
    _finish(worker, card_id, cuda_device("NVIDIA H100 80GB HBM3", total), spec)
    assert user.get_comparison(estimate_id).measured_run_id == card_id
