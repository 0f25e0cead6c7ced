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
from typing import Any

from fastapi.testclient import TestClient

from api.estimate_worker import Pool, Supervisor, pool
from api.main import create_app
from api.settings import Settings
from autotune.remote.protocol import EstimateWorkerState


def _wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, "timed out"
        time.sleep(0.02)


def _health(http: TestClient) -> dict[str, Any]:
    """The one estimate worker's entry in /health."""
    (worker,) = http.get("/health").json()["estimate_workers"]
    assert worker["worker_id"] == "serve-estimates"
    return worker  # type: ignore[no-any-return]


def _supervisor(
    tmp_path: Path,
    program: str,
    lines: list[str],
    worker_id: str = "serve-estimates",
    **backoff: float,
) -> Supervisor:
    return Supervisor(
        [sys.executable, "-c", program],
        "worker-token",
        tmp_path / f"{worker_id}.log",
        worker_id=worker_id,
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
    log_path = tmp_path / "serve-estimates.log"
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path, client_tokens=["c"])
    app = create_app(settings, estimate_workers=lambda: [supervisor.health()])
    supervisor.start()
    try:
        with TestClient(app) as http:
            _wait_for(lambda: log_path.is_file() and log_path.read_text() != "")
            first = _health(http)
            assert first["state"] == "running" and first["restarts"] == 0
            os.kill(first["pid"], signal.SIGKILL)
            _wait_for(lambda: _health(http)["restarts"] == 1)
            _wait_for(lambda: _health(http)["state"] == "running")
            _wait_for(lambda: len(log_path.read_text().splitlines()) == 2)
            second = _health(http)
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
            assert http.get("/health").json()["estimate_workers"] == []
    finally:
        app.state.context.db.dispose()


def test_a_pool_gives_each_worker_its_id_log_store_and_the_per_run_limits(
    tmp_path: Path,
) -> None:
    """What `serve --estimate-workers 3 --estimate-time-limit 7.5 --estimate-memory-limit 3GiB`
    starts, read back by the worker command's own parser."""
    from autotune.cli.main import build_parser
    from autotune.core.defaults import worker_study_url

    estimates = pool(
        "http://127.0.0.1:8000",
        tmp_path,
        "worker-token",
        workers=3,
        time_limit_s=7.5,
        memory_limit_bytes=3 * 2**30,
    )
    commands = [build_parser().parse_args(s.argv[3:]) for s in estimates.supervisors]
    assert [args.command for args in commands] == ["worker"] * 3
    assert [args.device for args in commands] == ["estimate"] * 3
    assert [args.estimate_time_limit for args in commands] == [7.5] * 3
    assert [args.estimate_memory_limit for args in commands] == [3 * 2**30] * 3
    ids = [args.worker_id for args in commands]
    assert ids == [f"serve-estimates-{n}" for n in (1, 2, 3)]
    assert [s.worker_id for s in estimates.supervisors] == ids
    # Each its own Optuna store and log: one SQLite file would be two writers' lock.
    assert len({worker_study_url(args.data_dir) for args in commands}) == 3
    assert len({s.log_path for s in estimates.supervisors}) == 3
    assert all(s.log_path.parent == tmp_path for s in estimates.supervisors)


def test_a_pool_reports_and_stops_every_worker(tmp_path: Path) -> None:
    lines: list[str] = []
    program = "import time; time.sleep(60)"
    workers = Pool([_supervisor(tmp_path, program, lines, f"serve-estimates-{n}") for n in (1, 2)])
    workers.start()
    _wait_for(lambda: all(h.state is EstimateWorkerState.RUNNING for h in workers.health()))
    pids = [h.pid for h in workers.health()]
    assert [h.worker_id for h in workers.health()] == ["serve-estimates-1", "serve-estimates-2"]
    assert len(set(pids)) == 2
    workers.stop()
    assert [h.state for h in workers.health()] == [EstimateWorkerState.STOPPED] * 2
    assert lines == []
