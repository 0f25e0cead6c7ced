"""What the web pages cost the server: latency of the list, a run's page and the progress poll.

Starts a real uvicorn process (`api.main`) on a fresh SQLite file (or `--db URL`), stores a
finished run (the test factories' result) and a running one whose worker streamed many attempts
and trials (`--attempts`, `--trials`: a long probe and a long study), then times sequential GETs
over one keep-alive connection, as one browser tab does:

* `/` (the list, 25 rows), `/runs/{finished}`, `/runs/{running}` (plots and tables of every
  attempt and trial), `/runs/{running}/progress` (what an open page polls every second), and the
  API's `GET /api/v1/runs/{running}` for comparison.

Writes bench/results/pages.{json,md}.

    .venv/bin/python bench/pages.py [--db URL] [--requests 200]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.web.pages import TOKEN_COOKIE  # noqa: E402
from autotune.core.schemas import Phase, StepOutcome, Trial, TrialState  # noqa: E402
from autotune.remote.client import ServerClient  # noqa: E402
from tests.api_tests.factories import (  # noqa: E402
    emulated,
    emulated_device,
    finished_run,  # noqa: E402
    tiny_spec,
)
from tests.conftest import CLIENT_TOKEN, WORKER_TOKEN, start_server, stop_server  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _stream(worker: ServerClient, run_id: int, lease_id: str, attempts: int, trials: int) -> None:
    for sequence in range(attempts):
        micro_batch = 1 + sequence // 2
        fits = sequence % 2 == 0
        worker.post_attempt(
            run_id,
            lease_id,
            sequence=sequence,
            checkpointing=sequence >= attempts // 2,
            attempt=StepOutcome(
                micro_batch=micro_batch,
                fits=fits,
                peak_bytes=micro_batch * 20_000_000,
                peak_allocated_bytes=micro_batch * 16_000_000,
                phase_peak_bytes={Phase.FORWARD: micro_batch * 10_000_000},
                oom_phase=None if fits else Phase.BACKWARD,
            ),
        )
    for number in range(trials):
        micro_batch = 2 ** (number % 6)
        worker.post_trial(
            run_id,
            lease_id,
            Trial(
                number=number,
                micro_batch=micro_batch,
                accumulation_steps=64 // micro_batch,
                checkpointing=number % 2 == 1,
                state=TrialState.COMPLETE,
                samples_per_s=100.0 + number,
                step_time_s=0.5,
                timed_steps=3,
                peak_bytes=micro_batch * 20_000_000,
            ),
        )


def _time(http: httpx2.Client, path: str, requests: int) -> dict[str, Any]:
    durations_ms, size = [], 0
    for _ in range(requests):
        start = time.perf_counter()
        answer = http.get(path)
        durations_ms.append((time.perf_counter() - start) * 1000)
        assert answer.status_code == 200, (path, answer.status_code)
        size = len(answer.content)
    durations_ms.sort()
    return {
        "path": path,
        "requests": requests,
        "bytes": size,
        "p50_ms": round(statistics.median(durations_ms), 2),
        "p95_ms": round(durations_ms[int(0.95 * (requests - 1))], 2),
        "p99_ms": round(durations_ms[int(0.99 * (requests - 1))], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", help="database URL (default: a fresh SQLite file)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--attempts", type=int, default=60)
    parser.add_argument("--trials", type=int, default=80)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="autotune-pages-"))
    url = args.db or f"sqlite:///{directory / 'autotune.db'}"
    server = start_server(url, directory / "server.log")
    try:
        user = ServerClient(server.url, token=CLIENT_TOKEN, retries=0)
        worker = ServerClient(server.url, token=WORKER_TOKEN, retries=0)
        finished = finished_run(user, worker)
        running = user.submit_run(tiny_spec(200), emulated()).id
        claim = worker.claim("bench", [emulated_device()])
        assert claim is not None and claim.run_id == running
        _stream(worker, running, claim.lease_id, args.attempts, args.trials)
        for seq_len in range(70, 93):  # a full first page of the list: 25 runs
            user.submit_run(tiny_spec(seq_len), emulated())
        cookies = {TOKEN_COOKIE: CLIENT_TOKEN}
        headers = {"Authorization": f"Bearer {CLIENT_TOKEN}"}
        rows = []
        with httpx2.Client(base_url=server.url, cookies=cookies, headers=headers) as http:
            for path in (
                "/",
                f"/runs/{finished}",
                f"/runs/{running}",
                f"/runs/{running}/progress",
                f"/api/v1/runs/{running}",
            ):
                _time(http, path, 20)  # warm: templates compiled, connections open
                rows.append(_time(http, path, args.requests))
    finally:
        stop_server(server)
    database = "postgresql" if url.startswith("postgresql") else "sqlite"
    report = {
        "database": database,
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "running_run": {"attempts": args.attempts, "trials": args.trials},
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    suffix = "" if database == "sqlite" else f"_{database}"
    (RESULTS / f"pages{suffix}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# Web pages: sequential GETs on one connection ({database})",
        "",
        f"Running run: {args.attempts} attempts and {args.trials} trials streamed; the finished "
        "run is the test factories' (6 attempts, 2 trials); the list shows 25 rows.",
        "",
        "| path | bytes | p50 ms | p95 ms | p99 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    names = ["/ (list)", "/runs/finished", "/runs/running", "/runs/running/progress", "API run"]
    for name, row in zip(names, rows, strict=True):
        lines.append(
            f"| {name} | {row['bytes']} | {row['p50_ms']} | {row['p95_ms']} | {row['p99_ms']} |"
        )
    (RESULTS / f"pages{suffix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
