"""Real worker processes for the tests, and a way to find every process they left behind.

Each test process tree is marked with an environment variable that every descendant inherits
(the worker, its forkserver, every trial's child), so "no stray processes" is checked by
scanning /proc for the mark, whatever re-parenting happened.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import WORKER_TOKEN

REPO = Path(__file__).resolve().parents[2]
MARK_VARIABLE = "AUTOTUNE_TEST_PROCESS_MARK"


def new_mark() -> str:
    return uuid.uuid4().hex


def marked_pids(mark: str) -> list[int]:
    """Every live process whose environment carries `mark` (zombies have no environment)."""
    needle = f"{MARK_VARIABLE}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def wait_for_no_marked(mark: str, timeout_s: float = 15.0) -> list[int]:
    """The marked processes still alive after `timeout_s` (an empty list is the goal)."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        pids = marked_pids(mark)
        if not pids or time.monotonic() > deadline_s:
            return pids
        time.sleep(0.1)


def kill_marked(mark: str) -> None:
    for pid in marked_pids(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class WorkerProcess:
    """An `autotune worker` subprocess with its log file and its process mark."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    mark: str = field(default_factory=new_mark)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, pattern: str, timeout_s: float = 60.0) -> re.Match[str]:
        deadline_s = time.monotonic() + timeout_s
        while True:
            match = re.search(pattern, self.log())
            if match is not None:
                return match
            if self.process.poll() is not None or time.monotonic() > deadline_s:
                raise AssertionError(
                    f"{self.name}: no {pattern!r} in the log "
                    f"(exit code {self.process.poll()}):\n{self.log()}"
                )
            time.sleep(0.1)

    def lease_of(self, run_id: int) -> str:
        return self.wait_for_log(rf"run {run_id}: claimed \(claim \d+, lease ([0-9a-f]+)\)")[1]


def start_worker(
    server_url: str,
    log_dir: Path,
    name: str,
    *,
    memory: str | None,
    start_method: str = "forkserver",
    extra_args: tuple[str, ...] = (),
    token: str = WORKER_TOKEN,
    allow_factories: tuple[str, ...] = ("tests",),
) -> WorkerProcess:
    """`autotune worker` on an emulated GPU of `memory` (None: `--device estimate`), run from
    the repository root so that the test factories are importable in its children, and allowed
    (`--allow-factory`)."""
    mark = new_mark()
    log_path = log_dir / f"{name}.log"
    env = {**os.environ, "AUTOTUNE_TOKEN": token, MARK_VARIABLE: mark}
    env.pop("AUTOTUNE_SERVER", None)
    argv = [
        sys.executable,
        "-m",
        "autotune.cli.main",
        "worker",
        "--server",
        server_url,
        *(("--device", "estimate") if memory is None else ("--device", "cpu", "--memory", memory)),
        "--worker-id",
        name,
        "--db",
        f"sqlite:///{log_dir / f'{name}-optuna.db'}",
        "--poll-interval",
        "0.3",
        "--seconds-per-trial",
        "0.2",
        "--start-method",
        start_method,
        *(arg for prefix in allow_factories for arg in ("--allow-factory", prefix)),
        *extra_args,
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return WorkerProcess(name, process, log_path, mark)


def stop_worker(worker: WorkerProcess, timeout_s: float = 30.0) -> int:
    """SIGTERM, then the exit code (SIGKILL if it does not stop in time)."""
    if worker.process.poll() is None:
        worker.process.send_signal(signal.SIGTERM)
    try:
        return worker.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        worker.process.kill()
        worker.process.wait()
        raise AssertionError(f"{worker.name} ignored SIGTERM:\n{worker.log()}") from None
