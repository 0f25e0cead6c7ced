"""Results the tuner could not have produced, posted under a valid lease, on both databases: each
is refused with 422 `invalid_result` naming the broken invariants, nothing is stored, the run stays
with its lease holder, and a later valid result under the same lease finishes the run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from starlette.testclient import TestClient

from autotune.remote.client import ServerClient
from autotune.remote.protocol import RunStatus
from tests.api_tests.factories import GIB, emulated, emulated_device, tiny_spec, tune_result
from tests.conftest import WORKER_TOKEN

pytestmark = pytest.mark.usefixtures("db_url")
WORKER = {"Authorization": f"Bearer {WORKER_TOKEN}"}
Data = dict[str, Any]


def _recommend(**values: object) -> Callable[[Data], None]:
    def mutate(data: Data) -> None:
        data["recommendation"].update(values)

    return mutate


def _no_recommendation(data: Data) -> None:
    data["recommendation"] = None
    data["exports"] = None


def _trial_far_above_the_max(data: Data) -> None:
    data["trials"][1].update(micro_batch=10**6, accumulation_steps=1)


def _probe_on_another_device(data: Data) -> None:
    data["probe"]["device"]["name"] = "NVIDIA H100 80GB HBM3"


def _advice_although_it_fits(data: Data) -> None:
    data["probe"]["fit_advice"] = {"remedies": [], "not_modelled": ["offload"]}


# The defects of issue 8 (7): what a worker token could store and have served as cached.
BAD_RESULTS: list[tuple[Callable[[Data], None], str]] = [
    (_recommend(global_batch=999), "recommendation.global_batch"),
    (
        _recommend(micro_batch=3, accumulation_steps=5, global_batch=15),
        "recommendation.global_batch",
    ),
    (_recommend(world_size=7), "recommendation.world_size"),
    (_trial_far_above_the_max, "trials[1].micro_batch"),
    (_recommend(peak_bytes=5 * GIB), "recommendation.peak_bytes"),
    (_no_recommendation, "recommendation"),
    (_probe_on_another_device, "probe.device"),
    (_advice_although_it_fits, "probe.fit_advice"),
]


def test_a_result_that_breaks_an_invariant_is_refused_and_the_lease_kept(
    user: ServerClient, worker: ServerClient, http: TestClient
) -> None:
    spec = tiny_spec()
    run_id = user.submit_run(spec, emulated()).id
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None and claim.run_id == run_id
    good = tune_result(spec, emulated_device(), study_name=claim.study_name)
    before = user.get_run(run_id)
    url = f"/api/v1/worker/runs/{run_id}/result"

    for mutate, field in BAD_RESULTS:
        data = good.model_dump(mode="json")
        mutate(data)
        response = http.post(
            url, json={"lease_id": claim.lease_id, "result": data}, headers=WORKER
        )

        assert response.status_code == 422, (field, response.text)
        body = response.json()
        assert body["code"] == "invalid_result"
        assert field in [v["field"] for v in body["violations"]], body
        assert field in body["detail"]
        # Nothing written, the lease untouched: the run is exactly as before.
        assert user.get_run(run_id) == before

    # The lease is still the holder's: it renews, and a valid result finishes the run.
    worker.heartbeat(run_id, claim.lease_id)
    run = worker.submit_result(run_id, claim.lease_id, good)
    assert run.status == RunStatus.SUCCEEDED
    assert run.recommendation == good.recommendation
    again = user.submit_run(spec, emulated())
    assert again.cached and again.id == run_id
