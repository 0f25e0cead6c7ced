"""User-facing routes on a real database (SQLite file and PostgreSQL schema, fresh per test):
submit and the fingerprint cache, long polls, listing with filters and pages, cancel, bad input."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
from starlette.testclient import TestClient

from api.main import create_app
from api.settings import Settings
from autotune.remote.client import Conflict, InvalidRequest, NotFound, ServerClient
from autotune.remote.protocol import RunStatus
from tests.api_tests.factories import (
    EXPANDABLE,
    GIB,
    a100,
    emulated,
    emulated_device,
    expandable_tune_result,
    finished_run,
    tiny_spec,
)
from tests.conftest import CLIENT_TOKEN, FakeClock

pytestmark = pytest.mark.usefixtures("db_url")
AUTH = {"Authorization": f"Bearer {CLIENT_TOKEN}"}


def test_health_needs_no_token(http: TestClient) -> None:
    response = http.get("/health")
    assert response.status_code == 200
    assert response.json() == {
        "status": "ok",
        "database": "ok",
        "version": "0.1.0",
        "estimate_workers": [],  # this app supervises none
    }


def test_submit_queues_a_run_with_202(http: TestClient) -> None:
    body = {
        "spec": {"model": {"preset": "gpt2-tiny"}},
        "device": {"kind": "emulated", "memory_bytes": "4GiB"},
    }
    response = http.post("/api/v1/runs", json=body, headers=AUTH)
    assert response.status_code == 202
    assert response.json() == {
        "id": 1,
        "status": "queued",
        "url": "/api/v1/runs/1",
        "cached": False,
        "run": None,
        # No worker offers 4 GiB here (none at all): the run would wait silently.
        "notice": "no worker has offered this device (emulated:4294967296) in the last 10 "
        "minutes: the run waits until one does (start one with `autotune worker` and a "
        "matching --device/--memory/--gpu)",
    }
    run = http.get("/api/v1/runs/1", headers=AUTH).json()
    assert run["device"] == {"kind": "emulated", "memory_bytes": 4 * GIB}
    assert run["spec"]["training"]["headroom"] == 0.05  # stored with defaults filled in


def test_a_named_gpu_is_stored_by_its_catalogue_name_and_aliases_join_its_run(
    http: TestClient,
) -> None:
    body = {"spec": {"model": {"preset": "gpt2-tiny"}}, "device": {"kind": "emulated"}}
    first = http.post(
        "/api/v1/runs",
        json={**body, "device": {"kind": "emulated", "gpu": "h100-80gb"}},
        headers=AUTH,
    )
    assert first.status_code == 202
    again = http.post(
        "/api/v1/runs",
        json={**body, "device": {"kind": "emulated", "gpu": "NVIDIA H100 80GB HBM3"}},
        headers=AUTH,
    )
    assert again.json()["id"] == first.json()["id"]  # one fingerprint
    run = http.get(first.json()["url"], headers=AUTH).json()
    assert run["device"] == {"kind": "emulated", "gpu": "H100 80GB"}
    listed = http.get("/api/v1/runs", params={"device": "emulated:H100 80GB"}, headers=AUTH)
    assert [item["id"] for item in listed.json()["items"]] == [first.json()["id"]]


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ({"kind": "emulated", "gpu": "H100 PCIe"}, "unknown GPU; known: T4"),
        ({"kind": "emulated", "gpu": "T4", "memory_bytes": 1024}, "exactly one"),
        (
            {"kind": "emulated", "gpu": "T4", "allocator_conf": "expandable_segments:yes"},
            "expandable_segments",
        ),
        (
            {"kind": "emulated", "gpu": "T4", "allocator_conf": "max_split_size_mb:5"},
            "max_split_size_mb",
        ),
    ],
)
def test_a_bad_gpu_is_422_naming_the_field(
    http: TestClient, device: dict[str, object], message: str
) -> None:
    body = {"spec": {"model": {"preset": "gpt2-tiny"}}, "device": device}
    response = http.post("/api/v1/runs", json=body, headers=AUTH)
    assert response.status_code == 422
    (problem,) = response.json()["detail"]
    assert problem["loc"][:3] == ["body", "device", "emulated"]
    assert message in problem["msg"]


def test_finished_run_answers_the_same_fingerprint_from_cache(
    user: ServerClient, worker: ServerClient, http: TestClient
) -> None:
    run_id = finished_run(user, worker)
    # The same spec written differently (defaults spelled out) is the same fingerprint.
    body = {
        "spec": {
            "model": {"preset": "gpt2-tiny"},
            "training": {
                "seq_len": 64,
                "precision": "fp32",
                "world_size": 1,
                "target_global_batch": 32,
            },
        },
        "device": {"kind": "emulated", "memory_bytes": 4 * GIB},
    }
    response = http.post("/api/v1/runs", json=body, headers=AUTH)
    assert response.status_code == 200
    payload = response.json()
    assert (payload["id"], payload["cached"], payload["status"]) == (run_id, True, "succeeded")
    assert payload["run"]["recommendation"]["micro_batch"] == 8
    # Another device or another spec is not a hit.
    assert user.submit_run(tiny_spec(64), emulated(2 * GIB)).cached is False
    assert user.submit_run(tiny_spec(65), emulated()).cached is False
    assert user.list_runs().total == 3


def test_unfinished_twin_is_joined_not_duplicated(user: ServerClient) -> None:
    first = user.submit_run(tiny_spec(), emulated())
    second = user.submit_run(tiny_spec(), emulated())
    assert second.id == first.id and second.status == RunStatus.QUEUED and not second.cached
    assert user.list_runs().total == 1


def test_failed_run_is_not_a_cache_hit(user: ServerClient, worker: ServerClient) -> None:
    run_id = user.submit_run(tiny_spec(), emulated()).id
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None
    worker.report_failure(run_id, claim.lease_id, error_type="E", message="m", retryable=False)
    again = user.submit_run(tiny_spec(), emulated())
    assert again.id != run_id and again.status == RunStatus.QUEUED and not again.cached


def test_wait_on_a_queued_run_times_out_with_202(http: TestClient) -> None:
    body = {
        "spec": {"model": {"preset": "mlp"}},
        "device": {"kind": "emulated", "memory_bytes": 1024},
    }
    response = http.post("/api/v1/runs", params={"wait": 0.1}, json=body, headers=AUTH)
    assert response.status_code == 202
    assert response.json()["status"] == "queued"
    assert (
        http.get("/api/v1/runs/1", params={"wait": 0.1}, headers=AUTH).json()["status"] == "queued"
    )


def test_wait_on_a_finished_run_answers_200(user: ServerClient, worker: ServerClient) -> None:
    run_id = finished_run(user, worker)
    assert user.get_run(run_id, wait_s=5).status == RunStatus.SUCCEEDED


def test_read_shows_everything(user: ServerClient, worker: ServerClient) -> None:
    run = user.get_run(finished_run(user, worker))
    assert run.status == RunStatus.SUCCEEDED
    assert run.model == "gpt2-tiny"
    assert run.recommendation is not None and run.recommendation.global_batch == 32
    assert run.exports is not None and run.exports.hf["gradient_accumulation_steps"] == 4
    assert [m.max_micro_batch for m in run.modes] == [8, 16]
    assert len(run.trials) == 2 and len(run.attempts) == 6
    assert run.worker_id == "w1" and run.worker_device is not None
    assert run.queued_s is not None and run.run_s is not None
    assert run.error is None and run.failures == []


def test_unknown_id_is_404(user: ServerClient, http: TestClient) -> None:
    with pytest.raises(NotFound):
        user.get_run(12345)
    with pytest.raises(NotFound):
        user.cancel_run(12345)
    response = http.get("/api/v1/runs/9223372036854775807", headers=AUTH)
    assert response.status_code == 404
    assert response.json()["code"] == "run_not_found"
    assert http.get("/api/v1/runs/9223372036854775808", headers=AUTH).status_code == 422


def test_list_filters_and_pages(
    user: ServerClient, worker: ServerClient, clock: FakeClock
) -> None:
    start = clock.now
    done = finished_run(user, worker, seq_len=10)
    clock.advance(60)
    queued_gpu = user.submit_run(tiny_spec(20), a100()).id
    clock.advance(60)
    mlp = user.submit_run(tiny_spec(30), emulated(2 * GIB)).id

    assert [r.id for r in user.list_runs().items] == [mlp, queued_gpu, done]  # newest first
    assert [r.id for r in user.list_runs(status=RunStatus.SUCCEEDED).items] == [done]
    assert user.list_runs(status=RunStatus.SUCCEEDED).items[0].micro_batch == 8
    assert [r.id for r in user.list_runs(device="NVIDIA A100-SXM4-80GB").items] == [queued_gpu]
    assert [r.id for r in user.list_runs(device=f"emulated:{2 * GIB}").items] == [mlp]
    assert user.list_runs(model="gpt2-tiny").total == 3
    assert user.list_runs(model="llama-tiny").total == 0
    window = user.list_runs(
        created_after=start + timedelta(seconds=30), created_before=start + timedelta(seconds=90)
    )
    assert [r.id for r in window.items] == [queued_gpu]
    page = user.list_runs(limit=2, offset=1)
    assert ([r.id for r in page.items], page.total, page.limit, page.offset) == (
        [queued_gpu, done],
        3,
        2,
        1,
    )


def test_page_limit_is_capped(http: TestClient) -> None:
    assert http.get("/api/v1/runs", params={"limit": 200}, headers=AUTH).status_code == 200
    response = http.get("/api/v1/runs", params={"limit": 201}, headers=AUTH)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["query", "limit"]


def test_cancel_queued_run_and_refuse_finished(user: ServerClient, worker: ServerClient) -> None:
    queued = user.submit_run(tiny_spec(99), emulated()).id
    cancelled = user.cancel_run(queued)
    assert cancelled.status == RunStatus.CANCELLED and cancelled.finished_at is not None
    assert worker.claim("w1", [emulated_device()]) is None
    with pytest.raises(Conflict) as refused:
        user.cancel_run(queued)
    assert refused.value.code == "run_finished"
    with pytest.raises(Conflict):
        user.cancel_run(finished_run(user, worker))


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            {
                "spec": {"model": {"preset": "gpt9"}},
                "device": {"kind": "emulated", "memory_bytes": 1},
            },
            "preset",
        ),
        (
            {
                "spec": {"model": {"preset": "mlp"}},
                "device": {"kind": "emulated", "memory_bytes": "4 lots"},
            },
            "memory_bytes",
        ),
        (
            {"spec": {"model": {"preset": "mlp"}}, "device": {"kind": "tpu", "memory_bytes": 1}},
            "device",
        ),
        (
            {
                "spec": {"model": {"preset": "mlp"}, "training": {"headroom": 2}},
                "device": {"kind": "emulated", "memory_bytes": 1},
            },
            "headroom",
        ),
        (
            {
                "spec": {"model": {"preset": "mlp"}, "trainig": {}},
                "device": {"kind": "emulated", "memory_bytes": 1},
            },
            "trainig",
        ),
        (
            {
                "spec": {"model": {"factory": "os:system; rm -rf /"}},
                "device": {"kind": "emulated", "memory_bytes": 1},
            },
            "factory",
        ),
        (
            {
                "spec": {
                    "model": {"hf_config": {"model_type": "llama", "x": 2**70}},
                    "training": {"seq_len": 8},
                },
                "device": {"kind": "emulated", "memory_bytes": 1},
            },
            "hf_config.x",
        ),
        (
            {
                "spec": {
                    "model": {"hf_config": {"model_type": "a\u0000b"}},
                    "training": {"seq_len": 8},
                },
                "device": {"kind": "emulated", "memory_bytes": 1},
            },
            "model_type",
        ),
    ],
)
def test_invalid_spec_is_422_naming_the_field(
    user: ServerClient, http: TestClient, body: dict[str, object], field: str
) -> None:
    response = http.post("/api/v1/runs", json=body, headers=AUTH)
    assert response.status_code == 422
    problem = response.json()["detail"][0]
    assert field in ".".join(map(str, problem["loc"])) + " " + problem["msg"]
    assert user.list_runs().total == 0


FACTORY_BODY = {
    "spec": {"model": {"factory": "os:system"}, "training": {"input_shape": [4]}},
    "device": {"kind": "emulated", "memory_bytes": 1024},
}


def test_factory_specs_are_refused_by_default_with_422_naming_the_field(
    user: ServerClient, http: TestClient
) -> None:
    response = http.post("/api/v1/runs", json=FACTORY_BODY, headers=AUTH)
    assert response.status_code == 422
    assert response.json()["code"] == "invalid"
    (problem,) = response.json()["detail"]
    assert problem["loc"] == ["body", "spec", "model", "factory"]
    assert problem["type"] == "factory_not_allowed"
    assert "--allow-factory-specs" in problem["msg"]
    assert user.list_runs().total == 0


def test_a_server_that_allows_factory_specs_stores_them_and_runs_nothing(
    settings_factory: Callable[..., Settings], clock: FakeClock
) -> None:
    app = create_app(settings_factory(allow_factory_specs=True), clock=clock)
    try:
        with TestClient(app) as http:
            response = http.post("/api/v1/runs", json=FACTORY_BODY, headers=AUTH)
            assert response.status_code == 202
            run = ServerClient(http=http, token=CLIENT_TOKEN).get_run(response.json()["id"])
            assert run.spec.model.factory == "os:system"
    finally:
        app.state.context.db.dispose()


def test_oversized_body_is_413(http: TestClient) -> None:
    padding = "x" * (1024 * 1024)
    body = {"spec": {"model": {"hf_config": {"model_type": "llama", "pad": padding}}}}
    response = http.post("/api/v1/runs", json=body, headers=AUTH)
    assert response.status_code == 413


def test_non_json_body_is_422(http: TestClient) -> None:
    response = http.post(
        "/api/v1/runs", content=b"{not json", headers={**AUTH, "Content-Type": "application/json"}
    )
    assert response.status_code == 422


def test_client_maps_422_to_invalid_request_naming_the_field(user: ServerClient) -> None:
    with pytest.raises(InvalidRequest) as refused:
        user.list_runs(limit=500)
    assert refused.value.status_code == 422
    assert refused.value.detail.startswith("query.limit:")


def test_repeated_reads_of_a_finished_run_are_identical(
    user: ServerClient, worker: ServerClient, http: TestClient
) -> None:
    # The second answers come from the in-process cache of finished runs: same bytes as the
    # first, which came from the database.
    run_id = finished_run(user, worker)
    reads = [http.get(f"/api/v1/runs/{run_id}", headers=AUTH).content for _ in range(3)]
    assert reads[0] == reads[1] == reads[2]
    body = {
        "spec": tiny_spec().model_dump(mode="json"),
        "device": {"kind": "emulated", "memory_bytes": 4 * GIB},
    }
    posts = [http.post("/api/v1/runs", json=body, headers=AUTH) for _ in range(3)]
    assert [p.status_code for p in posts] == [200, 200, 200]
    assert posts[0].content == posts[1].content == posts[2].content
    assert posts[0].json()["run"] == http.get(f"/api/v1/runs/{run_id}", headers=AUTH).json()


def test_cancelled_run_reads_stay_cancelled(user: ServerClient, http: TestClient) -> None:
    run_id = user.submit_run(tiny_spec(), emulated()).id
    assert http.get(f"/api/v1/runs/{run_id}", headers=AUTH).json()["status"] == "queued"
    user.cancel_run(run_id)
    for _ in range(2):
        assert http.get(f"/api/v1/runs/{run_id}", headers=AUTH).json()["status"] == "cancelled"


def test_openapi_documents_every_route(http: TestClient) -> None:
    assert http.get("/docs").status_code == 200
    paths = http.get("/openapi.json").json()["paths"]
    assert set(paths) == {
        "/health",
        "/api/v1/runs",
        "/api/v1/runs/{run_id}",
        "/api/v1/runs/{run_id}/cancel",
        "/api/v1/runs/{run_id}/comparison",
        "/api/v1/worker/claim",
        "/api/v1/worker/runs/{run_id}/heartbeat",
        "/api/v1/worker/runs/{run_id}/attempts",
        "/api/v1/worker/runs/{run_id}/trials",
        "/api/v1/worker/runs/{run_id}/result",
        "/api/v1/worker/runs/{run_id}/failure",
    }
    submit = paths["/api/v1/runs"]["post"]["responses"]
    assert {"200", "202", "401", "403", "422"} <= set(submit)


@pytest.mark.parametrize(
    ("training", "device", "field"),
    [
        ({"world_size": 16}, {"kind": "estimate", "gpu": "H100 80GB"}, "training.world_size"),
        (
            {"nodes": 2, "gpus_per_node": 12},
            {"kind": "emulated", "gpu": "RTX 4090"},
            "training.gpus_per_node",
        ),
        (
            {"nodes": 1, "gpus_per_node": 8, "sharding": "hybrid", "shard_group_size": 4},
            {"kind": "estimate", "gpu": "H100 80GB"},
            "training.sharding",
        ),
        (
            {"nodes": 2, "gpus_per_node": 8, "sharding": "hybrid", "shard_group_size": 3},
            {"kind": "estimate", "gpu": "H100 80GB"},
            "training.shard_group_size",
        ),
    ],
)
def test_a_topology_no_box_holds_is_422_naming_the_field(
    http: TestClient, training: dict[str, object], device: dict[str, object], field: str
) -> None:
    body = {"spec": {"model": {"preset": "gpt2-tiny"}, "training": training}, "device": device}
    response = http.post("/api/v1/runs", json=body, headers=AUTH)
    assert response.status_code == 422
    (problem,) = response.json()["detail"]
    assert field in problem["msg"]


def test_a_trial_under_expandable_segments_is_stored_with_its_settings(
    user: ServerClient, worker: ServerClient
) -> None:
    """The allocator settings a trial ran under (revision 0015), the recommendation's and the
    accumulating limit under expandable segments come back as they were posted."""
    spec = tiny_spec()
    run_id = user.submit_run(spec, emulated()).id
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None and claim.run_id == run_id
    posted = expandable_tune_result(spec, emulated_device())
    for posted_trial in posted.trials:
        worker.post_trial(run_id, claim.lease_id, posted_trial)
    worker.submit_result(run_id, claim.lease_id, posted)

    run = user.get_run(run_id)
    assert [t.trial.allocator_conf for t in run.trials] == [None, None, EXPANDABLE]
    assert run.recommendation is not None and run.recommendation.allocator_conf == EXPANDABLE
    option = run.modes[0].expandable_segments
    assert option is not None and option.accumulating_micro_batch == 16
