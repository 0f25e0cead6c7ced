"""The estimate worker that `autotune serve` runs beside itself, so that estimate runs (target
kind "estimate": the step traced on fake tensors for a named GPU) need no worker of the user's.

It is the ordinary `autotune worker --device estimate`, started as a child process through the
command line: `api` imports neither torch nor `probes`. It exists only where both are installed
(the `probe` extra); otherwise `serve` says that estimates need a worker. The child gets SIGTERM
when `serve` stops, and from the kernel when `serve` dies without stopping it (Linux).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

from autotune.core.plugins import COMMAND_GROUP, plugins

WORKER_ID = "serve-estimates"
LOG_FILE = "estimate-worker.log"  # in the data directory, beside its Optuna store
# Idle claims this often: an estimate POSTed with ?wait= starts within this (a claim is one
# indexed query).
POLL_INTERVAL_S = 0.5
STOP_GRACE_S = 15.0
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


def start(server_url: str, worker_token: str, log_path: Path) -> subprocess.Popen[bytes]:
    """Start `autotune worker --device estimate` against `server_url`; its log goes to
    `log_path`. It waits for the server to listen (a worker waits for a server that is down)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "autotune.cli.main",
                "worker",
                "--device",
                "estimate",
                "--server",
                server_url,
                "--worker-id",
                WORKER_ID,
                "--poll-interval",
                str(POLL_INTERVAL_S),
                "--data-dir",
                str(log_path.parent),
            ],
            env={**os.environ, "AUTOTUNE_TOKEN": worker_token},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 (serve has no other thread yet)
        )


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (a run in progress is released), then SIGKILL after `STOP_GRACE_S`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
