"""The estimate workers that `autotune serve` runs beside itself, so that estimate runs (target
kind "estimate": the step traced on fake tensors for a named GPU) need no worker of the user's.

Each is the ordinary `autotune worker --device estimate`, started as a child process through the
command line: `api` imports neither torch nor `probes`. They exist only where both are installed
(the `probe` extra); otherwise `serve` says that estimates need a worker. A child gets SIGTERM
when `serve` stops, and from the kernel when `serve` dies without stopping it (Linux).

A worker takes one run at a time, so `serve` runs a `Pool` of them (`DEFAULT_WORKERS`,
`serve --estimate-workers`): an estimate that traces for minutes (a model of thousands of
layers, up to the per-run time limit) holds one, and the others answer the estimates submitted
after it. Each has its own id, log and Optuna store (two processes writing one SQLite file
would wait on each other's locks), and the per-run limits `serve` was given.

`Supervisor` keeps one running: a worker that exits (a crash, the kernel's OOM killer, a
signal) is restarted after a back-off that doubles from `RESTART_BACKOFF_S` to
`MAX_RESTART_BACKOFF_S` (reset once a worker has lived `STABLE_S`), each exit and restart logged;
`GET /health` reports each one's state (`autotune.remote.protocol.EstimateWorkerHealth`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from autotune.core.defaults import ESTIMATE_MEMORY_LIMIT_BYTES, ESTIMATE_TIME_LIMIT_S
from autotune.core.plugins import COMMAND_GROUP, plugins
from autotune.remote.protocol import EstimateWorkerHealth, EstimateWorkerState

WORKER_ID = "serve-estimates"  # worker n of the pool is serve-estimates-n
# In the data directory: worker n logs to estimate-worker-n.log and keeps its Optuna store in
# estimate-worker-n/.
WORKER_FILES = "estimate-worker"
DEFAULT_WORKERS = 2
# Idle claims this often: an estimate POSTed with ?wait= starts within this (a claim is one
# indexed query).
POLL_INTERVAL_S = 0.5
STOP_GRACE_S = 15.0
RESTART_BACKOFF_S = 1.0
MAX_RESTART_BACKOFF_S = 60.0
# A worker that lived this long was healthy: the next restart waits RESTART_BACKOFF_S again.
STABLE_S = 60.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def missing_reason() -> str | None:
    """Why no estimate worker can run here, or None when one can."""
    try:
        has_torch = importlib.util.find_spec("torch") is not None
    except ImportError:  # a finder that refuses it outright
        has_torch = False
    if not has_torch:
        return "torch is not installed here (pip install 'autotune[probe]')"
    if not any(plugin.name == "worker" for plugin in plugins(COMMAND_GROUP)):
        return "the worker command is not installed (pip install 'autotune[probe]')"
    return None


def local_url(host: str, port: int) -> str:
    """Where a process on this machine reaches a server listening on `host`."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: SIGTERM when the server's process dies.
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def command(
    server_url: str,
    data_dir: Path,
    *,
    worker_id: str = WORKER_ID,
    time_limit_s: float = ESTIMATE_TIME_LIMIT_S,
    memory_limit_bytes: int = ESTIMATE_MEMORY_LIMIT_BYTES,
) -> list[str]:
    """`autotune worker --device estimate` against `server_url`, its store in `data_dir`, with
    the per-run time and memory limits."""
    return [
        sys.executable,
        "-m",
        "autotune.cli.main",
        "worker",
        "--device",
        "estimate",
        "--server",
        server_url,
        "--worker-id",
        worker_id,
        "--poll-interval",
        str(POLL_INTERVAL_S),
        "--data-dir",
        str(data_dir),
        "--estimate-time-limit",
        repr(time_limit_s),
        "--estimate-memory-limit",
        str(memory_limit_bytes),
    ]


def start(argv: Sequence[str], worker_token: str, log_path: Path) -> subprocess.Popen[bytes]:
    """Start `argv` (`command`) with the worker token; its log goes to `log_path`. It waits for
    the server to listen (a worker waits for a server that is down)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(
            list(argv),
            env={**os.environ, "AUTOTUNE_TOKEN": worker_token},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Async-signal-safe enough: one prctl call through an already loaded libc, in the
            # supervisor's thread (which lives as long as the child: PDEATHSIG follows the
            # thread that forked).
            preexec_fn=_die_with_parent,  # noqa: PLW1509
        )


def stop(process: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM (a run in progress is released), then SIGKILL after `grace_s`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _exit_reason(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _stderr_line(message: str) -> None:
    sys.stderr.write(f"autotune serve: {message}\n")
    sys.stderr.flush()


class Supervisor:
    """Runs `argv` as the estimate worker and restarts it whenever it exits, until `stop`.

    Args:
        argv: the worker's command line (`command`).
        worker_id: its id (in its command line), which health and the log lines name.
        worker_token: its bearer token (passed in its environment, never on the command line).
        log_path: where its output goes.
        log: one line per exit and restart (default: serve's standard error).
        restart_backoff_s, max_restart_backoff_s, stable_s: the back-off (see the module).
    """

    def __init__(
        self,
        argv: Sequence[str],
        worker_token: str,
        log_path: Path,
        *,
        worker_id: str = WORKER_ID,
        log: Callable[[str], None] = _stderr_line,
        restart_backoff_s: float = RESTART_BACKOFF_S,
        max_restart_backoff_s: float = MAX_RESTART_BACKOFF_S,
        stable_s: float = STABLE_S,
        stop_grace_s: float = STOP_GRACE_S,
    ) -> None:
        self.argv = list(argv)
        self.worker_id = worker_id
        self.worker_token = worker_token
        self.log_path = log_path
        self.log = log
        self.restart_backoff_s = restart_backoff_s
        self.max_restart_backoff_s = max_restart_backoff_s
        self.stable_s = stable_s
        self.stop_grace_s = stop_grace_s
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._process: subprocess.Popen[bytes] | None = None
        self._state = EstimateWorkerState.STARTING
        self._restarts = 0
        self._last_exit: str | None = None
        self._thread = threading.Thread(
            target=self._supervise, name="estimate-worker", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def health(self) -> EstimateWorkerHealth:
        """The worker's state now, for `GET /health`."""
        with self._lock:
            process = self._process
            return EstimateWorkerHealth(
                worker_id=self.worker_id,
                state=self._state,
                pid=process.pid
                if process is not None and self._state is EstimateWorkerState.RUNNING
                else None,
                restarts=self._restarts,
                last_exit=self._last_exit,
            )

    def stop(self) -> None:
        """Stop supervising and stop the worker (SIGTERM, then SIGKILL after the grace)."""
        self._stopping.set()
        with self._lock:
            process = self._process
        if process is not None:
            stop(process, self.stop_grace_s)
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            self._state = EstimateWorkerState.STOPPED

    def _supervise(self) -> None:
        backoff_s = self.restart_backoff_s
        while not self._stopping.is_set():
            started_s = time.monotonic()
            with self._lock:
                if self._stopping.is_set():
                    return
                self._process = start(self.argv, self.worker_token, self.log_path)
                self._state = EstimateWorkerState.RUNNING
                process = self._process
            code = process.wait()
            if self._stopping.is_set():
                return
            if time.monotonic() - started_s >= self.stable_s:
                backoff_s = self.restart_backoff_s
            reason = _exit_reason(code)
            with self._lock:
                self._state = EstimateWorkerState.RESTARTING
                self._restarts += 1
                self._last_exit = reason
            self.log(
                f"the estimate worker {self.worker_id} stopped ({reason}; log: {self.log_path}); "
                f"restarting it in {backoff_s:g} s"
            )
            if self._stopping.wait(backoff_s):
                return
            backoff_s = min(backoff_s * 2, self.max_restart_backoff_s)


class Pool:
    """Several supervised estimate workers (see the module), started and stopped together."""

    def __init__(self, supervisors: Sequence[Supervisor]) -> None:
        self.supervisors = list(supervisors)

    def start(self) -> None:
        for supervisor in self.supervisors:
            supervisor.start()

    def health(self) -> list[EstimateWorkerHealth]:
        """Each worker's state now, for `GET /health`."""
        return [supervisor.health() for supervisor in self.supervisors]

    def stop(self) -> None:
        """Stop them all at once: each may take its grace to release the run it holds."""
        stopping = [
            threading.Thread(target=supervisor.stop, name=f"stop-{supervisor.worker_id}")
            for supervisor in self.supervisors
        ]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()


def pool(
    server_url: str,
    data_dir: Path,
    worker_token: str,
    *,
    workers: int = DEFAULT_WORKERS,
    time_limit_s: float = ESTIMATE_TIME_LIMIT_S,
    memory_limit_bytes: int = ESTIMATE_MEMORY_LIMIT_BYTES,
) -> Pool:
    """`workers` estimate workers against `server_url` (not started yet), each with its own
    id, log and store under `data_dir`, and the per-run limits."""
    supervisors = []
    for number in range(1, workers + 1):
        worker_id = f"{WORKER_ID}-{number}"
        argv = command(
            server_url,
            data_dir / f"{WORKER_FILES}-{number}",
            worker_id=worker_id,
            time_limit_s=time_limit_s,
            memory_limit_bytes=memory_limit_bytes,
        )
        log_path = data_dir / f"{WORKER_FILES}-{number}.log"
        supervisors.append(Supervisor(argv, worker_token, log_path, worker_id=worker_id))
    return Pool(supervisors)
