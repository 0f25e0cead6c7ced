"""Input an attacker would send, on both databases: every refusal is a 422 naming the field
(never a 500), and nothing is stored. Bodies are sent as raw JSON text so that lone surrogates,
NaN, Infinity and 1e400 reach the server exactly as written."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient

from autotune.remote.client import ServerClient
from tests.api_tests.factories import emulated, emulated_device, tiny_spec, trial, tune_result
from tests.conftest import CLIENT_TOKEN, WORKER_TOKEN

pytestmark = pytest.mark.usefixtures("db_url")
USER = {"Authorization": f"Bearer {CLIENT_TOKEN}", "Content-Type": "application/json"}
WORKER = {"Authorization": f"Bearer {WORKER_TOKEN}", "Content-Type": "application/json"}
SURROGATE = "\udfff"


def _run_body(**training: Any) -> dict[str, Any]:
    return {
        "spec": {"model": {"preset": "gpt2-tiny"}, "training": {"seq_len": 64, **training}},
        "device": {"kind": "emulated", "memory_bytes": 1024},
    }


def _post(http: TestClient, path: str, text: str, headers: dict[str, str]) -> Any:
    return http.post(path, content=text.encode(), headers=headers)


def _assert_422_naming(response: Any, field: str) -> None:
    assert response.status_code == 422, response.text
    problems = response.json()["detail"]
    named = " ".join(".".join(map(str, p["loc"])) + " " + p["msg"] for p in problems)
    assert field in named, named


def _claimed(user: ServerClient, worker: ServerClient) -> tuple[int, str]:
    run_id = user.submit_run(tiny_spec(), emulated()).id
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None
    return run_id, claim.lease_id


# -- defect 4: lone surrogates ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            {
                "spec": {
                    "model": {"hf_config": {"model_type": "llama", "k": SURROGATE}},
                    "training": {"seq_len": 8},
                },
                "device": {"kind": "emulated", "memory_bytes": 1024},
            },
            "hf_config",
        ),
        (
            {
                "spec": {
                    "model": {"hf_config": {"model_type": "llama", "n": {SURROGATE: [1]}}},
                    "training": {"seq_len": 8},
                },
                "device": {"kind": "emulated", "memory_bytes": 1024},
            },
            "hf_config",
        ),
        (
            {
                "spec": {"model": {"preset": "gpt2-tiny"}},
                "device": {"kind": "cuda", "name": "A100" + SURROGATE, "memory_bytes": 1024},
            },
            "name",
        ),
    ],
)
def test_submit_refuses_lone_surrogates(
    http: TestClient, user: ServerClient, body: dict[str, Any], field: str
) -> None:
    _assert_422_naming(_post(http, "/api/v1/runs", json.dumps(body), USER), field)
    assert user.list_runs().total == 0


def test_claim_refuses_lone_surrogates(http: TestClient, user: ServerClient) -> None:
    run_id = user.submit_run(tiny_spec(), emulated()).id
    device = emulated_device().model_dump(mode="json")
    for body, field in (
        ({"worker_id": "w" + SURROGATE, "devices": [device]}, "worker_id"),
        ({"worker_id": "w", "devices": [{**device, "name": SURROGATE}]}, "name"),
        ({"worker_id": "w", "devices": [{**device, "uuid": SURROGATE}]}, "uuid"),
    ):
        _assert_422_naming(_post(http, "/api/v1/worker/claim", json.dumps(body), WORKER), field)
    assert user.get_run(run_id).claim_count == 0


def test_worker_events_refuse_lone_surrogates(
    http: TestClient, user: ServerClient, worker: ServerClient
) -> None:
    run_id, lease_id = _claimed(user, worker)
    base = f"/api/v1/worker/runs/{run_id}"
    bad_trial = trial(0).model_dump(mode="json") | {"error": SURROGATE}
    result = tune_result(tiny_spec(), emulated_device()).model_dump(mode="json")
    for path, body, field in (
        ("/trials", {"lease_id": lease_id, "trial": bad_trial}, "error"),
        (
            "/result",
            {"lease_id": lease_id, "result": result | {"study_name": SURROGATE}},
            "study_name",
        ),
        ("/failure", {"lease_id": lease_id, "error_type": "E", "message": SURROGATE}, "message"),
    ):
        _assert_422_naming(_post(http, base + path, json.dumps(body), WORKER), field)
    run = user.get_run(run_id)
    assert (run.status.value, run.trials, run.failures) == ("running", [], [])


def test_a_worker_reports_an_error_whose_text_is_not_storable(
    user: ServerClient, worker: ServerClient
) -> None:
    # A path decoded with surrogateescape, or a NUL from a child's output, in an error message.
    run_id, lease_id = _claimed(user, worker)
    worker.report_failure(run_id, lease_id, error_type="OSError", message="/data/\udcff\x00")
    assert user.get_run(run_id).failures[0].message == "/data/\\udcff\\x00"


def test_query_parameters_with_undecodable_text_are_not_a_500(http: TestClient) -> None:
    for query in ("model=%ED%BF%BF", "device=%ED%A0%80x", "model=%FF"):
        response = http.get(f"/api/v1/runs?{query}", headers=USER)
        assert response.status_code in (200, 422), response.text


# -- defect 5: naive or extreme datetimes ----------------------------------------------------


@pytest.mark.parametrize(
    "moment",
    [
        "2026-01-01T00:00:00",  # naive
        "0001-01-01T00:00:00+14:00",  # before year 1 in UTC
        "9999-12-31T23:59:59-14:00",  # after year 9999 in UTC
    ],
)
@pytest.mark.parametrize("name", ["created_after", "created_before"])
def test_naive_or_extreme_datetimes_are_422(http: TestClient, name: str, moment: str) -> None:
    response = http.get("/api/v1/runs", params={name: moment}, headers=USER)
    _assert_422_naming(response, name)


def test_aware_datetimes_at_the_edges_are_fine(http: TestClient) -> None:
    for moment in ("0001-01-01T00:00:00Z", "9999-12-31T23:59:59+00:00", "2026-01-01T05:00+05:00"):
        response = http.get("/api/v1/runs", params={"created_after": moment}, headers=USER)
        assert response.status_code == 200, response.text


# -- defect 6: NaN, Infinity, 1e400 ----------------------------------------------------------


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_numbers_in_a_submission_are_422(
    http: TestClient, user: ServerClient, number: str
) -> None:
    for field, text in (
        ("headroom", json.dumps(_run_body(headroom=0.5)).replace("0.5", number)),
        ("memory_bytes", json.dumps(_run_body()).replace("1024", number)),
        ("seq_len", json.dumps(_run_body()).replace("64", number)),
        (
            "hf_config",
            json.dumps(
                {
                    "spec": {
                        "model": {"hf_config": {"model_type": "llama", "x": 0.5}},
                        "training": {"seq_len": 8},
                    },
                    "device": {"kind": "emulated", "memory_bytes": 1024},
                }
            ).replace("0.5", number),
        ),
    ):
        response = _post(http, "/api/v1/runs", text, USER)
        _assert_422_naming(response, field)
        assert number not in response.text  # never echoed
    assert user.list_runs().total == 0


@pytest.mark.parametrize("number", ["NaN", "Infinity", "1e400"])
def test_non_finite_numbers_in_worker_calls_are_422(
    http: TestClient, user: ServerClient, worker: ServerClient, number: str
) -> None:
    run_id, lease_id = _claimed(user, worker)
    base = f"/api/v1/worker/runs/{run_id}"
    device = emulated_device().model_dump(mode="json")
    claim = json.dumps({"worker_id": "w2", "devices": [device | {"capacity_bytes": 12345}]})
    good_trial = trial(0).model_dump(mode="json") | {"samples_per_s": 0.5}
    result = tune_result(tiny_spec(), emulated_device()).model_dump(mode="json")
    result["recommendation"]["samples_per_s"] = 0.5
    for path, text, field in (
        ("/api/v1/worker/claim", claim.replace("12345", number), "capacity_bytes"),
        (
            base + "/trials",
            json.dumps({"lease_id": lease_id, "trial": good_trial}).replace("0.5", number),
            "samples_per_s",
        ),
        (
            base + "/result",
            json.dumps({"lease_id": lease_id, "result": result}).replace("0.5", number),
            "samples_per_s",
        ),
    ):
        _assert_422_naming(_post(http, path, text, WORKER), field)
    assert user.get_run(run_id).trials == []


@pytest.mark.parametrize("wait", ["nan", "inf", "1e400"])
def test_non_finite_query_numbers_are_422(http: TestClient, wait: str) -> None:
    _assert_422_naming(http.get(f"/api/v1/runs/1?wait={wait}", headers=USER), "wait")


# -- defect 11: lengths the database refuses, 404/405 bodies ---------------------------------


def test_lengths_beyond_the_columns_are_422_on_both_databases(
    http: TestClient, user: ServerClient, worker: ServerClient
) -> None:
    long_model = {"hf_config": {"model_type": "m" * 400}}
    for model, field in ((long_model, "model_type"), ({"hf_id": "o/" + "m" * 400}, "hf_id")):
        body = {
            "spec": {"model": model, "training": {"seq_len": 8}},
            "device": {"kind": "emulated", "memory_bytes": 1024},
        }
        _assert_422_naming(_post(http, "/api/v1/runs", json.dumps(body), USER), field)
    assert user.list_runs().total == 0

    run_id, lease_id = _claimed(user, worker)
    result = tune_result(tiny_spec(), emulated_device()).model_dump(mode="json")
    for patch, field in (
        ({"study_name": "s" * 101}, "study_name"),
        ({"device": result["device"] | {"torch_version": "9" * 40}}, "torch_version"),
    ):
        body = json.dumps({"lease_id": lease_id, "result": result | patch})
        path = f"/api/v1/worker/runs/{run_id}/result"
        _assert_422_naming(_post(http, path, body, WORKER), field)
    assert user.get_run(run_id).status.value == "running"


def test_unknown_paths_and_methods_answer_with_a_code(http: TestClient) -> None:
    missing = http.get("/api/v1/nothing-here", headers=USER)
    assert missing.status_code == 404
    assert missing.json() == {"code": "not_found", "detail": "Not Found"}
    wrong_method = http.delete("/api/v1/runs/1/cancel", headers=USER)
    assert wrong_method.status_code == 405
    assert wrong_method.json() == {"code": "method_not_allowed", "detail": "Method Not Allowed"}
    assert wrong_method.headers["allow"] == "POST"
