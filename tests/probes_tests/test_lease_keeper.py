"""The worker side of the lease protocol, against a scripted HTTP server on loopback.

The server side of `lease_expired` (a lapsed lease, renewable by a heartbeat while nobody else
claimed the run) is built in api/ separately; these tests pin what the worker does with each
answer: the client's typed error, one heartbeat, one resend, or giving the run up.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from autotune.core.schemas import Trial, TrialState
from autotune.remote.client import LeaseExpired, LeaseLost, ServerClient
from autotune.remote.protocol import Claim, EmulatedTarget
from probes.worker import _LeaseKeeper
from tests.probes_tests.factories import wide_spec

LEASE = "ab" * 16
NOW = datetime(2026, 1, 1, tzinfo=UTC).isoformat()


class Script:
    """Answers per path suffix, in order; records every request's path."""

    def __init__(self, answers: dict[str, list[tuple[int, dict[str, object]]]]) -> None:
        self.answers = answers
        self.paths: list[str] = []


def _handler(script: Script) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            suffix = self.path.rsplit("/", 1)[1]
            script.paths.append(suffix)
            status, body = script.answers[suffix].pop(0)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@pytest.fixture
def serve() -> Iterator[list[ThreadingHTTPServer]]:
    servers: list[ThreadingHTTPServer] = []
    yield servers
    for server in servers:
        server.shutdown()
        server.server_close()


def _keeper(servers: list[ThreadingHTTPServer], script: Script) -> _LeaseKeeper:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(script))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    servers.append(server)
    client = ServerClient(f"http://127.0.0.1:{server.server_address[1]}", token="t")
    claim = Claim(
        run_id=1,
        spec=wide_spec(),
        target=EmulatedTarget(memory_bytes=2**20),
        device_index=0,
        lease_id=LEASE,
        lease_expires_at=datetime.fromisoformat(NOW),
        heartbeat_interval_s=60,
        claim_number=1,
        study_name="autotune-run-1",
    )
    return _LeaseKeeper(client, claim)


def _post_trial(keeper: _LeaseKeeper) -> object:
    trial = Trial(
        number=0, micro_batch=1, accumulation_steps=1, checkpointing=False,
        state=TrialState.COMPLETE, samples_per_s=1.0,
    )  # fmt: skip
    return keeper.call(lambda: keeper.client.post_trial(1, LEASE, trial))


EXPIRED = (409, {"code": "lease_expired", "detail": "lease lapsed"})
STALE = (409, {"code": "stale_lease", "detail": "claimed by another worker"})
RENEWED = (200, {"run_id": 1, "lease_id": LEASE, "lease_expires_at": NOW})
STORED = (200, {"stored": True, "lease_expires_at": NOW})


def test_a_lapsed_lease_is_renewed_and_the_post_sent_again(
    serve: list[ThreadingHTTPServer],
) -> None:
    script = Script({"trials": [EXPIRED, STORED], "heartbeat": [RENEWED]})
    keeper = _keeper(serve, script)
    _post_trial(keeper)
    assert script.paths == ["trials", "heartbeat", "trials"]
    keeper.check()  # the lease is still ours


def test_a_lease_another_worker_took_gives_the_run_up(serve: list[ThreadingHTTPServer]) -> None:
    script = Script({"trials": [EXPIRED], "heartbeat": [STALE]})
    keeper = _keeper(serve, script)
    with pytest.raises(LeaseLost) as lost:
        _post_trial(keeper)
    assert not isinstance(lost.value, LeaseExpired) and lost.value.code == "stale_lease"
    assert script.paths == ["trials", "heartbeat"]  # no resend
    with pytest.raises(LeaseLost):
        keeper.check()  # the run stops


def test_a_post_refused_again_after_renewal_is_resent_only_once(
    serve: list[ThreadingHTTPServer],
) -> None:
    script = Script({"trials": [EXPIRED, EXPIRED], "heartbeat": [RENEWED]})
    keeper = _keeper(serve, script)
    with pytest.raises(LeaseExpired):
        _post_trial(keeper)
    assert script.paths == ["trials", "heartbeat", "trials"]


def test_the_client_maps_each_409_code_to_its_error(serve: list[ThreadingHTTPServer]) -> None:
    script = Script({"trials": [EXPIRED, STALE]})
    keeper = _keeper(serve, script)
    trial = Trial(
        number=0, micro_batch=1, accumulation_steps=1, checkpointing=False,
        state=TrialState.COMPLETE, samples_per_s=1.0,
    )  # fmt: skip
    with pytest.raises(LeaseExpired):
        keeper.client.post_trial(1, LEASE, trial)
    with pytest.raises(LeaseLost) as stale:
        keeper.client.post_trial(1, LEASE, trial)
    assert type(stale.value) is LeaseLost
