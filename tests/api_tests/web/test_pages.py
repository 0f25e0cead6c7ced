"""The web pages as HTML (the in-process app, both databases): the list and its filters and pages,
a run's recommendation, exports and plots, the token rules, the submit form's errors and the
progress the run page polls. What a browser does with them is tests/api_tests/test_browser.py."""

from __future__ import annotations

import functools
import re
from html import escape, unescape

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from api.web.charts import nice_ticks
from api.web.pages import TOKEN_COOKIE
from autotune.core.exports import render_exports
from autotune.core.schemas import TuneResult
from autotune.remote.client import ServerClient
from autotune.remote.protocol import EstimateTarget, RunStatus
from tests.api_tests.factories import (
    AUTO_LAYOUT_SPEC,
    GIB,
    attempt,
    auto_layout_result,
    emulated,
    emulated_device,
    estimate_device,
    finished_run,
    named,
    named_device,
    tiny_spec,
    trial,
    tune_result,
)
from tests.conftest import CLIENT_TOKEN, WORKER_TOKEN, FakeClock

SPEC_YAML = """\
model:
  preset: gpt2-tiny
training:
  seq_len: 64
  target_global_batch: 32
"""


def _signed_in(http: TestClient, token: str = CLIENT_TOKEN) -> TestClient:
    http.cookies.clear()
    http.cookies.set(TOKEN_COOKIE, token)
    return http


def _run_ids(html: str) -> list[int]:
    return [int(found) for found in re.findall(r'<tr data-run-id="(\d+)">', html)]


def test_the_list_shows_runs_newest_first_and_filters_them(
    http: TestClient, user: ServerClient, worker: ServerClient
) -> None:
    finished = finished_run(user, worker)
    queued = [user.submit_run(tiny_spec(seq_len), emulated()).id for seq_len in (65, 66)]
    user.cancel_run(queued[0])
    page = _signed_in(http).get("/")
    assert page.status_code == 200
    assert _run_ids(page.text) == [queued[1], queued[0], finished]
    assert "micro-batch 8 × 4 steps" in page.text  # the recommendation at a glance
    assert "101.0 samples/s per GPU (CPU timing, not a GPU&#39;s)" in page.text
    assert "<td>emulated 4.00 GiB</td>" in page.text
    assert _run_ids(http.get("/?status=cancelled").text) == [queued[0]]
    assert _run_ids(http.get("/?status=succeeded").text) == [finished]
    assert _run_ids(http.get("/?model=nothing-like-it").text) == []
    assert "No runs match these filters" in http.get("/?model=nothing-like-it").text
    assert _run_ids(http.get("/?since=2000-01-01&until=2000-01-02").text) == []


def test_the_list_pages_by_25(http: TestClient, user: ServerClient) -> None:
    ids = [user.submit_run(tiny_spec(seq_len), emulated()).id for seq_len in range(60, 87)]
    first = _signed_in(http).get("/?status=queued")
    assert _run_ids(first.text) == ids[::-1][:25]
    assert "Runs 1–25 of 27" in first.text
    older = re.search(r'href="([^"]+)" rel="next"', first.text)
    assert older is not None and "status=queued" in unescape(older[1])
    second = http.get(unescape(older[1]))
    assert _run_ids(second.text) == ids[::-1][25:]
    assert 'rel="prev"' in second.text and 'rel="next"' not in second.text
    past = http.get("/?status=queued&page=9")
    assert _run_ids(past.text) == [] and "Page 9 is past the last page" in past.text
    assert 'href="/?status=queued&amp;page=2">Go to page 2</a>' in past.text


def test_a_run_page_shows_the_recommendation_exports_plots_and_tables(
    http: TestClient, user: ServerClient, worker: ServerClient
) -> None:
    run_id = finished_run(user, worker)
    page = _signed_in(http).get(f"/runs/{run_id}")
    assert page.status_code == 200
    html = page.text
    assert re.search(r'<dd id="rec-micro-batch">8</dd>', html)
    assert re.search(r'<dd id="rec-accumulation">4</dd>', html)
    run = user.get_run(run_id)
    assert run.exports is not None
    for key, text in render_exports(run.exports).items():
        block = re.search(
            rf'<pre id="export-{key}" tabindex="0"><code>(.*?)</code></pre>', html, re.S
        )
        assert block is not None and unescape(block[1]) == text
        assert f'data-copy="export-{key}"' in html
    memory = html[html.index('id="memory-plot"') : html.index('id="throughput-plot"')]
    # The factory's result: 4 + 2 attempts, 3 of them out of memory, and the two points the
    # checkpointed mode's trace predicted; two rules; a line through each mode's fits.
    assert len(re.findall(r'class="point dot ', memory)) == 3
    assert len(re.findall(r'class="point cross ', memory)) == 3
    assert len(re.findall(r'class="point square ckpt"[^>]*data-traced="true"', memory)) == 2
    assert 'class="rule capacity"' in memory and 'class="rule headroom"' in memory
    assert ">headroom 5%<" in memory and "peak memory (GiB)" in memory
    assert len(re.findall(r'<polyline class="fit-line', memory)) == 2
    speed = html[html.index('id="throughput-plot"') :]
    assert len(re.findall(r'class="point (?:dot|ring) ', speed)) == 2
    assert re.findall(r'class="point ring[^>]*data-chosen="true"', speed)
    # CPU timings of an emulated GPU say so wherever samples/s appear.
    assert "throughput (samples/s per GPU, CPU timing, not a GPU's)" in unescape(speed)
    assert '<span class="speed-source">(CPU timing, not a GPU&#39;s)</span>' in html
    assert '<th scope="col">samples/s per GPU (CPU timing, not a GPU&#39;s)</th>' in html
    assert re.findall(r'<text class="point-label"[^>]*>(×\d+)</text>', speed) == ["×8", "×4"]
    assert html.count('<tr class="fits">') + html.count('<tr class="oom">') == 6
    # Each out-of-memory says which allocation failed and what the memory held then.
    assert html.count('class="oom-detail"') == 3
    assert (
        "2.00 MiB for aten.mm.default in backward did not fit; memory held: weights 3.81 MiB, "
        "gradients 2.86 MiB, optimizer state 7.63 MiB, activations and temporaries 76.29 MiB, "
        "cache 976.56 KiB"
    ) in unescape(html)
    assert html.count('<tr class="complete">') == 2
    assert "preset: gpt2-tiny" in html


def test_a_run_page_marks_the_sizes_that_run_out_below_the_max_as_dips(
    http: TestClient, user: ServerClient, worker: ServerClient
) -> None:
    spec = tiny_spec(64)
    run_id = user.submit_run(spec, emulated()).id
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None
    result = tune_result(spec, emulated_device())
    plain, checkpointed = result.probe.modes
    dipped = checkpointed.model_copy(update={"runs_out_below": [10, 13]})
    probe = result.probe.model_copy(update={"modes": [plain, dipped]})
    worker.submit_result(run_id, claim.lease_id, result.model_copy(update={"probe": probe}))
    assert user.get_run(run_id).modes[1].runs_out_below == [10, 13]
    html = _signed_in(http).get(f"/runs/{run_id}").text
    memory = html[html.index('id="memory-plot"') : html.index('id="throughput-plot"')]
    dips = re.findall(
        r'class="point cross ckpt"[^>]*data-dip="true" data-micro-batch="(\d+)"', memory
    )
    assert dips == ["10", "13"]
    assert "micro-batch 10: runs out, below 16, which fits" in memory
    assert memory.count(">dip</text>") == 2


def test_a_run_page_sets_the_estimate_beside_the_measurement(
    http: TestClient, user: ServerClient, worker: ServerClient
) -> None:
    spec = tiny_spec()
    ids = []
    for target, device in (
        (EstimateTarget(gpu="H100 80GB"), estimate_device("H100 80GB")),
        (named("H100 80GB"), named_device("H100 80GB")),
    ):
        ids.append(user.submit_run(spec, target).id)
        claim = worker.claim("w", [device])
        assert claim is not None and claim.run_id == ids[-1]
        worker.submit_result(ids[-1], claim.lease_id, tune_result(spec, device))
    _signed_in(http)
    for run_id in ids:  # from either side
        html = http.get(f"/runs/{run_id}").text
        table = html[
            html.index('<table id="comparison">') : html.index(
                "</table>", html.index('<table id="comparison">')
            )
        ]
        assert f'<a href="/runs/{ids[0]}">#{ids[0]}</a> estimated' in table
        assert f'<a href="/runs/{ids[1]}">#{ids[1]}</a> measured on H100 80GB' in table
        # The factories' results are equal: each mode's maxima side by side, error 0.
        assert "<td>8</td><td>8</td><td>+0</td>" in table
        assert "<td>16</td><td>16</td><td>+0</td>" in table
    alone = finished_run(user, worker, seq_len=70)
    assert 'id="comparison"' not in http.get(f"/runs/{alone}").text


def test_pages_follow_the_token_rules_and_never_show_the_token(
    http: TestClient, user: ServerClient, worker: ServerClient
) -> None:
    run_id = finished_run(user, worker)
    anonymous = http.get(f"/runs/{run_id}")
    assert anonymous.status_code == 401
    assert "Enter a client token" in anonymous.text and 'name="token"' in anonymous.text
    http.cookies.set(TOKEN_COOKIE, "not-a-token")
    unknown = http.get("/")
    assert unknown.status_code == 401 and "is not known to this server" in unknown.text
    refused = http.post("/token", data={"token": "still-not-a-token", "next": "/"})
    assert refused.status_code == 401 and "not known to this server" in refused.text
    http.cookies.clear()
    saved = http.post(
        "/token",
        data={"token": WORKER_TOKEN, "next": "https://evil.example/"},
        follow_redirects=False,
    )
    assert saved.status_code == 303 and saved.headers["location"] == "/"
    for elsewhere in ("//evil.example/", "/\\evil.example/"):
        again = http.post(
            "/token", data={"token": WORKER_TOKEN, "next": elsewhere}, follow_redirects=False
        )
        assert again.headers["location"] == "/"
    cookie = saved.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie
    for path in ("/", f"/runs/{run_id}", "/token"):
        shown = http.get(path)
        assert shown.status_code == 200 and WORKER_TOKEN not in shown.text
    # A worker token reads but does not submit.
    forbidden = http.get("/submit")
    assert forbidden.status_code == 403 and "needs a client token" in forbidden.text
    _signed_in(http, CLIENT_TOKEN)
    assert http.get("/submit").status_code == 200
    assert http.post("/token/forget", follow_redirects=False).status_code == 303


def test_open_reads_show_runs_without_a_token(
    settings_factory: object, user: ServerClient, worker: ServerClient
) -> None:
    from api.main import create_app

    run_id = finished_run(user, worker)
    app: FastAPI = create_app(settings_factory(open_reads=True))  # type: ignore[operator]
    with TestClient(app) as anonymous:
        assert anonymous.get(f"/runs/{run_id}").status_code == 200
        assert anonymous.get("/submit").status_code == 401  # submitting still needs a token
    app.state.context.db.dispose()


def test_the_submit_form_names_the_bad_field_and_queues_a_good_spec(
    http: TestClient, user: ServerClient
) -> None:
    _signed_in(http)
    form = {"spec": SPEC_YAML, "kind": "emulated", "memory": "4GiB", "gpu": "", "name": ""}
    not_yaml = http.post("/submit", data={**form, "spec": "model: [unclosed"})
    assert not_yaml.status_code == 422 and "spec: not valid YAML" in not_yaml.text
    bad_field = http.post(
        "/submit", data={**form, "spec": SPEC_YAML.replace("seq_len: 64", "seq_len: -1")}
    )
    assert bad_field.status_code == 422
    assert "spec.training.seq_len: Input should be greater than or equal to 1" in bad_field.text
    assert "seq_len: -1" in bad_field.text  # the pasted spec is kept for correcting
    bad_memory = http.post("/submit", data={**form, "memory": "lots"})
    assert bad_memory.status_code == 422 and "device.emulated.memory_bytes" in bad_memory.text
    factory = http.post("/submit", data={**form, "spec": "model:\n  factory: os:system\n"})
    assert factory.status_code == 422 and "spec.model.factory" in factory.text
    huge = http.post("/submit", data={**form, "spec": SPEC_YAML + "#" * (2 << 20)})
    assert huge.status_code == 413
    queued = http.post("/submit", data=form, follow_redirects=False)
    assert queued.status_code == 303
    run_id = int(queued.headers["location"].rsplit("/", 1)[1])
    run = user.get_run(run_id)
    assert run.status is RunStatus.QUEUED and run.spec == tiny_spec()
    assert run.device == emulated()
    estimate = http.post(
        "/submit", data={**form, "kind": "estimate", "gpu": "H100 80GB"}, follow_redirects=False
    )
    assert user.get_run(int(estimate.headers["location"].rsplit("/", 1)[1])).device.kind == (
        "estimate"
    )


def test_the_progress_a_run_page_polls_counts_what_the_worker_stored(
    http: TestClient, user: ServerClient, worker: ServerClient, clock: FakeClock
) -> None:
    spec = tiny_spec()
    run_id = user.submit_run(spec, emulated()).id
    _signed_in(http)
    assert http.get(f"/runs/{run_id}/progress").json() == {
        "status": "queued",
        "attempts": 0,
        "trials": 0,
    }
    page = http.get(f"/runs/{run_id}").text
    assert f'data-progress-url="/runs/{run_id}/progress"' in page
    claim = worker.claim("w1", [emulated_device()])
    assert claim is not None
    worker.post_attempt(
        run_id, claim.lease_id, sequence=0, checkpointing=False, attempt=attempt(1, True)
    )
    worker.post_trial(run_id, claim.lease_id, trial(0))
    assert http.get(f"/runs/{run_id}/progress").json() == {
        "status": "running",
        "attempts": 1,
        "trials": 1,
    }
    # A worker that went silent: once its lease lapsed, the poll says the run is queued again.
    clock.advance(31)
    assert http.get(f"/runs/{run_id}/progress").json()["status"] == "queued"
    claim = worker.claim("w2", [emulated_device()])
    assert claim is not None and claim.run_id == run_id
    worker.submit_result(run_id, claim.lease_id, tune_result(spec, emulated_device()))
    assert http.get(f"/runs/{run_id}/progress").json()["status"] == "succeeded"
    assert "data-progress-url" not in http.get(f"/runs/{run_id}").text  # finished: no polling
    for missing in ("999999", "0", "abc", "99999999999999999999999"):
        page = http.get(f"/runs/{missing}")
        assert page.status_code == 404 and "This server has no run" in page.text
    escaped = http.get("/runs/%3Cimg%20src=x%20onerror=alert(1)%3E").text  # pages escape input
    assert "<img src=x" not in escaped and "&lt;img src=x onerror=alert(1)&gt;" in escaped
    assert http.get("/runs/999999/progress").status_code == 404


def test_axis_ticks_are_round_and_cover_the_range() -> None:
    assert nice_ticks(0, 4.3) == [0, 1, 2, 3, 4, 5]
    assert nice_ticks(0, 101) == [0, 50, 100, 150]
    ticks = nice_ticks(0, 0.37)
    assert ticks[0] == 0 and ticks[-1] >= 0.37 and len(ticks) <= 6


@pytest.mark.parametrize("path", ["/static/autotune.css", "/static/autotune.js"])
def test_the_pages_assets_are_served_by_the_app(http: TestClient, path: str) -> None:
    assert http.get(path).status_code == 200


def test_a_run_for_a_device_no_worker_offers_says_so_and_the_form_defaults_to_offered_ones(
    http: TestClient, user: ServerClient, worker: ServerClient, clock: FakeClock
) -> None:
    # The README's own mistake: a 4 GiB run, and only a 1 GiB worker.
    queued = user.submit_run(tiny_spec(), emulated(4 * GIB))
    assert queued.notice is not None
    assert queued.notice.startswith(
        "no worker has offered this device (emulated:4294967296) in the last 10 minutes"
    )
    assert worker.claim("w1", [emulated_device(1 * GIB)]) is None
    assert user.get_run(queued.id).notice == queued.notice  # 1 GiB is not this device
    page = _signed_in(http).get(f"/runs/{queued.id}").text
    assert 'id="run-notice"' in page and "Waiting: no worker has offered this device" in page
    # The form's default is what the worker offers, not 24 GiB.
    form = _signed_in(http).get("/submit").text
    assert 'name="memory" value="1073741824"' in form
    assert "Offered by workers in the last 10 minutes: emulated 1.00 GiB." in form

    user.cancel_run(queued.id)
    other = user.submit_run(tiny_spec(seq_len=65), emulated(1 * GIB))
    assert other.notice is None  # offered a moment ago
    assert user.get_run(other.id).notice is None
    clock.advance(11 * 60)
    assert user.get_run(other.id).notice is not None  # nobody for 11 minutes
    assert "No worker has offered a device in the last 10 minutes" in (
        _signed_in(http).get("/submit").text
    )


@functools.cache
def _auto_result(storage_dir: str) -> TuneResult:
    """Tuned once for the module, whichever database serves it."""
    return auto_layout_result(f"sqlite:///{storage_dir}/auto.db")


@pytest.mark.e2e
def test_an_auto_layout_run_shows_its_layouts_table_and_plot(
    http: TestClient,
    user: ServerClient,
    worker: ServerClient,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A worker's sharding: auto result is checked and stored as any (the server rebuilds its
    exports for the chosen layout); the page names the layout, gives samples/s per GPU and for
    the job, tables every layout with why it lost, and plots samples/s per layout."""
    result = _auto_result(str(tmp_path_factory.getbasetemp()))
    run_id = user.submit_run(AUTO_LAYOUT_SPEC, EstimateTarget(gpu="H100 80GB")).id
    claim = worker.claim("w", [estimate_device("H100 80GB")])
    assert claim is not None and claim.run_id == run_id
    worker.submit_result(run_id, claim.lease_id, result)
    run = user.get_run(run_id)
    rec = run.recommendation
    assert rec is not None and rec.sharding is result.layouts[0].sharding
    assert run.layouts == result.layouts
    assert run.exports is not None and run.exports.training.sharding is rec.sharding

    html = _signed_in(http).get(f"/runs/{run_id}").text
    assert f'<dd id="rec-layout">{rec.sharding.value} (chosen by sharding: auto)</dd>' in html
    throughput = re.search(r'<dd id="rec-throughput">(.*?)</dd>', html, re.S)
    assert throughput is not None
    assert f"{rec.samples_per_s:.2f} samples/s per GPU" in throughput.group(1)
    assert f"{rec.job_samples_per_s:.1f} samples/s for the job of 2 GPUs" in throughput.group(1)
    table = html[
        html.index('<table id="layouts">') : html.index(
            "</table>", html.index('<table id="layouts">')
        )
    ]
    rows = re.findall(r'<tr data-layout="(\w+)" data-verdict="(\w+)">', table)
    assert rows == [(layout.sharding.value, layout.verdict.value) for layout in run.layouts]
    assert rows[0][1] == "chosen"
    for layout in run.layouts:
        assert escape(layout.reason) in table
    plot = html[html.index('id="layouts-plot"') :]
    chosen = re.findall(r'data-layout="(\w+)" data-chosen="true"', plot)
    assert chosen == [rec.sharding.value]
