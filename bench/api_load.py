"""Latency and throughput of the API server under 50 concurrent clients on loopback.

Starts a real uvicorn process (`api.main`, one process, like `autotune serve`) on a fresh
database, finishes one run through the worker protocol so that its POST is a cache hit, then
drives two scenarios with N concurrent keep-alive connections (closed loop: each client sends
its next request when the previous answer arrives):

* `POST /api/v1/runs` of the finished run's spec (answered 200 from the cache, full run body)
* `GET /api/v1/runs/{id}` of the same run
* `GET /api/v1/runs/{id}` of a queued run: not finished, so read from the database every time
  (the two above are served from the server's in-process cache of finished runs)

Each scenario runs twice: closed loop (throughput, and the latency of a saturated server, which
is queueing: 50 clients / throughput) and paced at a fixed aggregate rate below saturation (the
latency a client sees while 50 others are connected and active).

The load generator is a minimal asyncio HTTP/1.1 client in its own process, so that its cost
stays small next to the server's; both share the machine's cores, which is stated in the results.
Writes bench/results/api_load.{json,md}.

    .venv/bin/python bench/api_load.py [--db URL] [--clients 50] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.remote.client import ServerClient  # noqa: E402
from tests.api_tests.factories import emulated, emulated_device, tiny_spec, tune_result  # noqa: E402
from tests.conftest import CLIENT_TOKEN, WORKER_TOKEN, start_server, stop_server  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GOAL_P99_MS = 20.0


def _request_bytes(method: str, path: str, body: bytes | None) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: 127.0.0.1",
        f"Authorization: Bearer {CLIENT_TOKEN}",
        "Connection: keep-alive",
    ]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


async def _client(
    port: int,
    request: bytes,
    schedule: _Schedule,
    out: list[float],
    errors: list[int],
) -> None:
    """One keep-alive connection. Closed loop when `schedule.interval_s` is 0; otherwise the
    n-th request is due at start + phase + n * interval, and its latency counts from when it
    was due, so a slow answer that delays the next send is not hidden (coordinated omission)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    due = schedule.start + schedule.phase_s
    while True:
        if schedule.interval_s:
            if due >= schedule.stop_at:
                break
            delay_s = due - time.perf_counter()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            sent = due
            due += schedule.interval_s
        else:
            sent = time.perf_counter()
            if sent >= schedule.stop_at:
                break
        writer.write(request)
        await writer.drain()
        status = await _read_response(reader)
        if sent >= schedule.warm_until:
            out.append(time.perf_counter() - sent)
            if status >= 300:
                errors.append(status)
    writer.close()


@dataclass(frozen=True)
class _Schedule:
    start: float
    warm_until: float
    stop_at: float
    interval_s: float = 0.0
    phase_s: float = 0.0


async def _drive(
    port: int, request: bytes, clients: int, seconds: float, warmup_s: float, rate: float
) -> dict[str, Any]:
    latencies: list[float] = []
    errors: list[int] = []
    start = time.perf_counter()
    interval_s = clients / rate if rate else 0.0
    schedules = [
        _Schedule(
            start=start,
            warm_until=start + warmup_s,
            stop_at=start + warmup_s + seconds,
            interval_s=interval_s,
            phase_s=interval_s * i / clients,
        )
        for i in range(clients)
    ]
    await asyncio.gather(
        *(_client(port, request, schedule, latencies, errors) for schedule in schedules)
    )
    measured_s = time.perf_counter() - (start + warmup_s)
    latencies.sort()
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "mode": f"paced at {rate:g} req/s" if rate else "closed loop (as fast as answered)",
        "requests": len(latencies),
        "errors": len(errors),
        "requests_per_s": round(len(latencies) / measured_s, 1),
        "p50_ms": round(q[49] * 1000, 2),
        "p90_ms": round(q[89] * 1000, 2),
        "p99_ms": round(q[98] * 1000, 2),
        "max_ms": round(latencies[-1] * 1000, 2),
    }


def _drive_in_process(args: tuple[int, bytes, int, float, float, float]) -> dict[str, Any]:
    return asyncio.run(_drive(*args))


def _seed(url: str) -> tuple[int, bytes, int]:
    """Finish one run through the worker protocol and queue another; return the finished run's
    id, the POST body that repeats it, and the queued run's id."""
    spec, target = tiny_spec(), emulated()
    with (
        ServerClient(url, token=CLIENT_TOKEN) as user,
        ServerClient(url, token=WORKER_TOKEN) as worker,
    ):
        run_id = user.submit_run(spec, target).id
        claim = worker.claim("bench-worker", [emulated_device()])
        assert claim is not None and claim.run_id == run_id
        worker.submit_result(run_id, claim.lease_id, tune_result(spec, emulated_device()))
        assert user.submit_run(spec, target).cached
        queued_id = user.submit_run(tiny_spec(seq_len=128), target).id
    body = json.dumps(
        {"spec": spec.model_dump(mode="json"), "device": target.model_dump(mode="json")}
    )
    return run_id, body.encode(), queued_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", default=None, help="database URL (default: a fresh SQLite file)")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--name", default="api_load", help="results file stem")
    parser.add_argument(
        "--rate",
        type=float,
        default=400.0,
        help="aggregate requests/s of the paced runs of cached answers (0: closed loop only)",
    )
    parser.add_argument(
        "--db-rate",
        type=float,
        default=200.0,
        help="aggregate requests/s of the paced database read (its capacity is lower)",
    )
    args = parser.parse_args()

    # Other work on the machine inflates every number here: record how busy it was.
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        db_url = args.db or f"sqlite:///{Path(tmp) / 'autotune.db'}"
        server = start_server(db_url, Path(tmp) / "server.log")
        try:
            run_id, body, queued_id = _seed(server.url)
            port = int(server.url.rsplit(":", 1)[1])
            # name -> (request, paced rate)
            scenarios = {
                "cached POST /api/v1/runs": (
                    _request_bytes("POST", "/api/v1/runs", body),
                    args.rate,
                ),
                "GET /api/v1/runs/{id}": (
                    _request_bytes("GET", f"/api/v1/runs/{run_id}", None),
                    args.rate,
                ),
                "GET /api/v1/runs/{id} of a queued run (database)": (
                    _request_bytes("GET", f"/api/v1/runs/{queued_id}", None),
                    args.db_rate,
                ),
            }
            results = {}
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                for name, (request, paced_rate) in scenarios.items():
                    for rate in (0.0, paced_rate) if paced_rate else (0.0,):
                        job = (port, request, args.clients, args.seconds, args.warmup, rate)
                        result = pool.apply(_drive_in_process, (job,))
                        results[f"{name}, {result['mode']}"] = result
                        print(name, result)
            response_bytes = len(
                httpx2.get(
                    f"{server.url}/api/v1/runs/{run_id}",
                    headers={"Authorization": f"Bearer {CLIENT_TOKEN}"},
                ).content
            )
        finally:
            stop_server(server)

    report = {
        "database": "postgresql" if db_url.startswith("postgresql") else "sqlite (WAL)",
        "clients": args.clients,
        "seconds_per_scenario": args.seconds,
        "server": "one uvicorn process (asyncio + h11), loopback",
        "load_generator": "asyncio HTTP/1.1 keep-alive clients in a separate process",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with the load generator",
        "load_average_before": round(load_before, 2),
        "python": platform.python_version(),
        "run_body_bytes": response_bytes,
        "goal_p99_ms": GOAL_P99_MS,
        "scenarios": results,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# API load: {args.clients} concurrent clients, {report['database']}",
        "",
        f"{report['server']}; {report['load_generator']}; {report['machine']}; "
        f"Python {report['python']}; the run body is {response_bytes} bytes; "
        f"1-minute load average before the run: {report['load_average_before']}.",
        "",
        f"| scenario | requests/s | p50 ms | p90 ms | p99 ms | max ms | errors "
        f"| p99 <= {GOAL_P99_MS:g} ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['requests_per_s']} | {r['p50_ms']} | {r['p90_ms']} | "
            f"{r['p99_ms']} | {r['max_ms']} | {r['errors']} | "
            f"{'yes' if r['p99_ms'] <= GOAL_P99_MS else 'no'} |"
        )
    lines += [
        "",
        "Closed loop, every client sends again as soon as it is answered, so the server is "
        "saturated and latency is mostly queueing (mean = clients / throughput). Paced, the "
        f"{args.clients} clients together send {args.rate:g} requests/s and latency is counted "
        "from when each request was due; the database read is paced lower "
        f"({args.db_rate:g} requests/s) because its capacity is lower.",
    ]
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
