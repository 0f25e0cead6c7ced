"""Against a real uvicorn process on loopback (both databases): the claim race, long polls, and
the client's retries. A Starlette TestClient is not a server, so these start one."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import pytest
from sqlalchemy import create_engine, text

from autotune.remote.client import ServerClient, ServerUnavailable
from autotune.remote.protocol import RunStatus
from tests.api_tests.factories import GIB, emulated, emulated_device, tiny_spec, tune_result
from tests.conftest import (
    CLIENT_TOKEN,
    WORKER_TOKEN,
    LiveServer,
    free_port,
    start_servers,
    stop_server,
)

pytestmark = pytest.mark.slow
RUNS = 200
CLAIMERS = 8


@pytest.fixture
def two_servers(db_url: str, tmp_path: Path) -> Iterator[list[LiveServer]]:
    """Two server processes on one database, started together (so their migrations race too)."""
    servers = start_servers(db_url, [tmp_path / "a.log", tmp_path / "b.log"])
    yield servers
    for server in servers:
        stop_server(server)


@pytest.mark.e2e
def test_eight_claimers_take_every_run_exactly_once(
    two_servers: list[LiveServer], db_url: str
) -> None:
    with ServerClient(two_servers[0].url, token=CLIENT_TOKEN) as user:
        # 200 distinct specs (seq_len) so none joins another as a twin.
        queued = {
            user.submit_run(tiny_spec(seq_len), emulated()).id for seq_len in range(1, RUNS + 1)
        }
    assert len(queued) == RUNS
    start = threading.Barrier(CLAIMERS)

    def claim_all(worker_number: int) -> list[int]:
        claimed = []
        # Half the claimers talk to each server process: the guard must hold across processes.
        url = two_servers[worker_number % 2].url
        with ServerClient(url, token=WORKER_TOKEN, retries=0) as worker:
            start.wait()
            while (claim := worker.claim(f"w{worker_number}", [emulated_device()])) is not None:
                claimed.append(claim.run_id)
        return claimed

    with ThreadPoolExecutor(CLAIMERS) as pool:
        per_worker = list(pool.map(claim_all, range(CLAIMERS)))

    counts = Counter(run_id for claimed in per_worker for run_id in claimed)
    assert set(counts) == queued
    assert set(counts.values()) == {1}
    assert sum(1 for claimed in per_worker if claimed) > 1  # they really raced
    engine = create_engine(db_url)
    with engine.connect() as connection:
        rows = connection.execute(
            text(
                "SELECT status, claim_count, COUNT(*) FROM autotune_runs"
                " GROUP BY status, claim_count"
            )
        ).all()
    engine.dispose()
    assert [tuple(row) for row in rows] == [("running", 1, RUNS)]


@pytest.mark.e2e
def test_long_poll_answers_when_the_run_finishes(live_server: LiveServer) -> None:
    spec = tiny_spec()
    with (
        ServerClient(live_server.url, token=CLIENT_TOKEN) as user,
        ServerClient(live_server.url, token=WORKER_TOKEN) as worker,
    ):
        run_id = user.submit_run(spec, emulated()).id
        claim = worker.claim("w1", [emulated_device()])
        assert claim is not None

        def finish_soon() -> None:
            time.sleep(0.5)
            worker.submit_result(run_id, claim.lease_id, tune_result(spec, emulated_device()))

        finisher = threading.Thread(target=finish_soon)
        started = time.monotonic()
        finisher.start()
        response = httpx2.post(
            f"{live_server.url}/api/v1/runs",
            params={"wait": 20},
            json={
                "spec": spec.model_dump(mode="json"),
                "device": emulated().model_dump(mode="json"),
            },
            headers={"Authorization": f"Bearer {CLIENT_TOKEN}"},
            timeout=30,
        )
        waited_s = time.monotonic() - started
        finisher.join()
    assert response.status_code == 200
    assert response.json()["run"]["status"] == "succeeded"
    assert response.json()["cached"] is False
    # Answered when the result arrived, not at the end of the 20 s wait (the margin absorbs a
    # loaded machine).
    assert 0.4 < waited_s < 15


@pytest.mark.e2e
def test_client_retries_until_the_server_is_up(live_server: LiveServer) -> None:
    attempts: list[str] = []
    real = httpx2.HTTPTransport()

    class FlakyTransport(httpx2.BaseTransport):
        """Refuses the first two connections, then forwards to the live server."""

        def handle_request(self, request: httpx2.Request) -> httpx2.Response:
            attempts.append(request.url.path)
            if len(attempts) <= 2:
                raise httpx2.ConnectError("connection refused", request=request)
            return real.handle_request(request)

    http = httpx2.Client(base_url=live_server.url, transport=FlakyTransport())
    client = ServerClient(http=http, token=CLIENT_TOKEN, retries=3, backoff_s=0.01)
    submitted = client.submit_run(tiny_spec(), emulated(2 * GIB))
    assert submitted.status == RunStatus.QUEUED
    assert attempts == ["/api/v1/runs"] * 3
    http.close()


def test_client_gives_up_with_server_unavailable() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with ServerClient(dead, retries=2, backoff_s=0.01) as client:
        started = time.monotonic()
        with pytest.raises(ServerUnavailable):
            client.health()
    assert time.monotonic() - started >= 0.03  # 0.01 + 0.02 of backoff


@pytest.mark.e2e
def test_identical_submissions_at_once_queue_one_run(
    two_servers: list[LiveServer], db_url: str
) -> None:
    # Under READ COMMITTED each of these found no twin and queued its own run; the unique index
    # on unfinished fingerprints leaves one, which every submission joins.
    submitters = 20
    for round_number in range(3):
        body = {
            "spec": tiny_spec(seq_len=16 + round_number).model_dump(mode="json"),
            "device": emulated().model_dump(mode="json"),
        }
        start = threading.Barrier(submitters)

        def submit(
            index: int, body: dict[str, object] = body, start: threading.Barrier = start
        ) -> tuple[int, int]:
            url = two_servers[index % 2].url
            start.wait()
            response = httpx2.post(
                f"{url}/api/v1/runs",
                json=body,
                headers={"Authorization": f"Bearer {CLIENT_TOKEN}"},
                timeout=30,
            )
            return response.status_code, response.json()["id"]

        with ThreadPoolExecutor(submitters) as pool:
            answers = list(pool.map(submit, range(submitters)))
        assert {status for status, _ in answers} == {202}
        assert len({run_id for _, run_id in answers}) == 1, answers
    engine = create_engine(db_url)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT COUNT(*) FROM autotune_runs")).scalar() == 3
    engine.dispose()
