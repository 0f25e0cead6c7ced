"""`api.estimate_worker.Supervisor`: the estimate worker `serve` runs is restarted whenever it
stops, with a back-off, each exit logged, and `GET /health` says so. The supervised process is
a real child (a short Python program standing in for the worker, which would import torch)."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fastapi.testclient import TestClient

from api.estimate_worker import Supervisor
from api.main import create_app
from api.settings import Settings
from autotune.remote.protocol import EstimateWorkerState


def _wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, "timed out"
        time.sleep(0.02)


def _supervisor(tmp_path: Path, program: str, lines: list[str], **backoff: float) -> Supervisor:
    return Supervisor(
        [sys.executable, "-c", program],
        "worker-token",
        tmp_path / "estimate-worker.log",
        log=lines.append,
        **{"restart_backoff_s": 0.05, "max_restart_backoff_s": 0.2, **backoff},
    )


def test_a_worker_that_exits_is_restarted_with_a_growing_back_off(tmp_path: Path) -> None:
    lines: list[str] = []
    supervisor = _supervisor(tmp_path, "import sys; sys.exit(3)", lines)
    supervisor.start()
    try:
        _wait_for(lambda: supervisor.health().restarts >= 4)
    finally:
        supervisor.stop()
    assert supervisor.health().state is EstimateWorkerState.STOPPED
    assert supervisor.health().last_exit == "exit code 3"
    assert "exit code 3" in lines[0] and "restarting it in 0.05 s" in lines[0]
    assert "restarting it in 0.1 s" in lines[1]
    assert "restarting it in 0.2 s" in lines[2] and "restarting it in 0.2 s" in lines[3]
    # The token reached the child through its environment, never its command line.
    assert "worker-token" not in " ".join(supervisor.argv)


def test_a_killed_worker_is_restarted_and_health_reports_it(
    tmp_path: Path, sqlite_url: str
) -> None:
    lines: list[str] = []
    program = "import os, time; print(os.environ['AUTOTUNE_TOKEN'], flush=True); time.sleep(60)"
    supervisor = _supervisor(tmp_path, program, lines)
    log_path = tmp_path / "estimate-worker.log"
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path, client_tokens=["c"])
    app = create_app(settings, estimate_worker=supervisor.health)
    supervisor.start()
    try:
        with TestClient(app) as http:
            _wait_for(lambda: log_path.is_file() and log_path.read_text() != "")
            first = http.get("/health").json()["estimate_worker"]
            assert first["state"] == "running" and first["restarts"] == 0
            os.kill(first["pid"], signal.SIGKILL)
            _wait_for(lambda: http.get("/health").json()["estimate_worker"]["restarts"] == 1)
            _wait_for(lambda: http.get("/health").json()["estimate_worker"]["state"] == "running")
            _wait_for(lambda: len(log_path.read_text().splitlines()) == 2)
            second = http.get("/health").json()["estimate_worker"]
            assert second["last_exit"] == "killed by SIGKILL"
            assert second["pid"] != first["pid"]
    finally:
        supervisor.stop()
        app.state.context.db.dispose()
    assert "killed by SIGKILL" in lines[0]
    assert log_path.read_text().splitlines() == ["worker-token"] * 2


def test_stop_ends_the_worker_even_when_it_ignores_sigterm(tmp_path: Path) -> None:
    lines: list[str] = []
    program = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    supervisor = _supervisor(tmp_path, program, lines, stop_grace_s=0.5)
    supervisor.start()
    _wait_for(lambda: supervisor.health().state is EstimateWorkerState.RUNNING)
    pid = supervisor.health().pid
    assert pid is not None
    supervisor.stop()
    assert lines == []  # a stop is not an exit to restart from
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        pass
    else:
        raise AssertionError(f"worker {pid} still alive")


def test_health_has_no_estimate_worker_where_none_is_supervised(
    tmp_path: Path, sqlite_url: str
) -> None:
    app = create_app(Settings(database_url=sqlite_url, data_dir=tmp_path))
    try:
        with TestClient(app) as http:
            assert http.get("/health").json()["estimate_worker"] is None
    finally:
        app.state.context.db.dispose()
