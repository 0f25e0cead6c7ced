"""What long polls cost everyone else: p50 of other GETs with and without 200 `?wait=` pollers.

Starts a real uvicorn process (`api.main`, one process, like `autotune serve`) on a fresh
database, queues 200 runs nobody works on, and measures sequential `GET /api/v1/runs/{id}` of
another queued run (read from the database every time) twice: alone, then while 200 clients
each hold a `?wait=` long poll open on their own run (re-polling when it times out). Before the
shared watcher (`api/store/runwatch.py`) each poller reloaded its whole run every 0.1 s and the p50
went from 5 ms to 135 ms; the goal is within 2x. Runs on SQLite and, when reachable, on
PostgreSQL (a fresh schema, dropped afterwards). Writes bench/results/long_poll.{json,md}.

    .venv/bin/python bench/long_poll.py [--pollers 200] [--requests 400]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx2
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.remote.client import ServerClient  # noqa: E402
from tests.api_tests.factories import emulated, tiny_spec  # noqa: E402
from tests.conftest import CLIENT_TOKEN, POSTGRES_URL, start_server, stop_server  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GOAL_RATIO = 2.0
HEADERS = {"Authorization": f"Bearer {CLIENT_TOKEN}"}


def _p50_ms(url: str, run_id: int, requests: int) -> float:
    """Median latency of sequential GETs of one unfinished run, on one keep-alive connection."""
    latencies_ms = []
    with httpx2.Client(base_url=url, headers=HEADERS, timeout=30) as client:
        for _ in range(20):  # warm-up
            client.get(f"/api/v1/runs/{run_id}").raise_for_status()
        for _ in range(requests):
            started = time.perf_counter()
            client.get(f"/api/v1/runs/{run_id}").raise_for_status()
            latencies_ms.append((time.perf_counter() - started) * 1000)
    return statistics.median(latencies_ms)


class Pollers:
    """`count` clients, each re-issuing `GET /runs/{id}?wait=` for its own run, in a thread."""

    def __init__(self, url: str, run_ids: list[int], wait_s: float) -> None:
        self.url = url
        self.run_ids = run_ids
        self.wait_s = wait_s
        self.started = 0
        self.answers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> Pollers:
        self._thread.start()
        deadline = time.monotonic() + 60
        while self.started < len(self.run_ids) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # let every first request reach the server and start waiting
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.wait_s + 30)

    async def _main(self) -> None:
        limits = httpx2.Limits(max_connections=len(self.run_ids) + 10)
        async with httpx2.AsyncClient(
            base_url=self.url, headers=HEADERS, timeout=self.wait_s + 30, limits=limits
        ) as client:
            await asyncio.gather(*(self._poll(client, run_id) for run_id in self.run_ids))

    async def _poll(self, client: httpx2.AsyncClient, run_id: int) -> None:
        self.started += 1
        while not self._stop.is_set():
            await client.get(f"/api/v1/runs/{run_id}", params={"wait": self.wait_s})
            self.answers += 1


def _measure(db_url: str, database: str, pollers: int, requests: int) -> dict[str, Any]:
    log = Path(tempfile.mkdtemp()) / "server.log"
    server = start_server(db_url, log)
    try:
        with ServerClient(server.url, token=CLIENT_TOKEN) as user:
            ids = [
                user.submit_run(tiny_spec(seq_len=8 + i), emulated()).id
                for i in range(pollers + 1)
            ]
        other, waited = ids[0], ids[1:]
        alone_ms = _p50_ms(server.url, other, requests)
        with Pollers(server.url, waited, wait_s=30) as running:
            with_pollers_ms = _p50_ms(server.url, other, requests)
            answered_early = running.answers
        return {
            "database": database,
            "pollers": pollers,
            "requests": requests,
            "p50_alone_ms": round(alone_ms, 2),
            "p50_with_pollers_ms": round(with_pollers_ms, 2),
            "ratio": round(with_pollers_ms / alone_ms, 2),
            "poll_answers_during_measurement": answered_early,
        }
    finally:
        stop_server(server)


def _postgres_schema_url() -> tuple[str, str] | None:
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    schema = f"autotune_bench_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    except OperationalError:
        return None
    finally:
        admin.dispose()
    separator = "&" if "?" in POSTGRES_URL else "?"
    return f"{POSTGRES_URL}{separator}options={quote(f'-csearch_path={schema}')}", schema


def _drop_schema(schema: str) -> None:
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pollers", type=int, default=200)
    parser.add_argument("--requests", type=int, default=400)
    args = parser.parse_args()
    rows = []
    sqlite_url = f"sqlite:///{Path(tempfile.mkdtemp()) / 'bench.db'}"
    rows.append(_measure(sqlite_url, "sqlite (WAL)", args.pollers, args.requests))
    postgres = _postgres_schema_url()
    if postgres is not None:
        url, schema = postgres
        try:
            rows.append(_measure(url, "postgresql", args.pollers, args.requests))
        finally:
            _drop_schema(schema)
    report = {
        "goal": f"p50 of other GETs with {args.pollers} pollers within {GOAL_RATIO}x of alone",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "results": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "long_poll.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Long polls: what 200 waiting clients cost other requests",
        "",
        "`bench/long_poll.py`: one real uvicorn process; sequential GETs of an unfinished run "
        f"({args.requests} per measurement, one keep-alive connection), alone and while "
        f"{args.pollers} clients hold `?wait=30` long polls on their own queued runs. "
        f"Goal: within {GOAL_RATIO}x. Before the shared watcher: 5 ms -> 135 ms (27x).",
        f"Machine: {os.cpu_count()} CPUs shared by the server and the load, Python "
        f"{platform.python_version()}.",
        "",
        "| database | p50 alone (ms) | p50 with pollers (ms) | ratio | within goal |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        within = "yes" if row["ratio"] <= GOAL_RATIO else "no"
        lines.append(
            f"| {row['database']} | {row['p50_alone_ms']} | {row['p50_with_pollers_ms']} "
            f"| {row['ratio']} | {within} |"
        )
    (RESULTS / "long_poll.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))  # noqa: T201


if __name__ == "__main__":
    main()
