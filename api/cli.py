"""The server's command: `autotune serve`, registered through the `autotune.commands` entry
points, so that it exists exactly where the `api` extra is installed.

    autotune serve [--host 127.0.0.1] [--port 8000] [--db URL] [--workers N]
                   [--allow-factory-specs] [--no-estimates] [--estimate-workers N]
                   [--estimate-time-limit S] [--estimate-memory-limit SIZE]

Settings come from the environment (`api.settings.Settings`, `AUTOTUNE_` prefix), read here.
`serve` connects to the database before listening: when it cannot (refused, or no answer within
the connect timeout) it says so in one line and exits 1 (EXIT_FAILURE: the database may come
back, so this is not a usage error, exit 2, that the user must fix in the command). Where torch
is installed, it also runs a pool of estimate workers (`api.estimate_worker`), each given the
per-run limits, unless `--no-estimates`.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

from api import estimate_worker
from autotune.cli.options import (
    Subcommands,
    memory_size,
    port_number,
    positive_int,
    positive_seconds,
)
from autotune.core.bytesize import format_bytes
from autotune.core.defaults import (
    DEFAULT_DATA_DIR,
    ESTIMATE_MEMORY_LIMIT_BYTES,
    ESTIMATE_TIME_LIMIT_S,
    EXIT_OK,
    SERVER_DATABASE_FILE,
)
from autotune.core.errors import AutotuneError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from api.settings import Settings


class DatabaseUnreachable(AutotuneError):
    """`serve` could not connect to (or migrate) its database."""


def _cmd_serve(args: argparse.Namespace) -> int:
    from api.main import create_app
    from api.settings import Settings
    from api.store.db import UNREACHABLE_ERRORS, Database

    settings = Settings()
    if args.db:
        settings = settings.model_copy(update={"database_url": args.db})
    if args.allow_factory_specs:
        settings = settings.model_copy(update={"allow_factory_specs": True})
    generated: dict[str, str] = {}
    # Never run open by default: generate the tokens nobody configured, and show them once.
    if not settings.client_tokens:
        generated["client"] = secrets.token_urlsafe(24)
        settings = settings.model_copy(update={"client_tokens": [generated["client"]]})
    if not settings.worker_tokens:
        generated["worker"] = secrets.token_urlsafe(24)
        settings = settings.model_copy(update={"worker_tokens": [generated["worker"]]})
    url = settings.resolved_database_url()
    estimates, estimates_note = _estimate_pool(args, settings)
    app: FastAPI | None = None
    try:
        if args.workers == 1:
            app = create_app(
                settings, estimate_workers=estimates.health if estimates is not None else None
            )
        else:
            # Each process migrates on start; check once here so one line says what is wrong.
            database = Database(url, connect_timeout_s=settings.database_connect_timeout_s)
            try:
                database.ping()
            finally:
                database.dispose()
    except UNREACHABLE_ERRORS as error:
        from sqlalchemy import make_url

        reason = str(error).strip().splitlines() or [type(error).__name__]
        where = make_url(url).render_as_string(hide_password=True)
        raise DatabaseUnreachable(f"cannot reach the database at {where}: {reason[0]}") from None
    for role, token in generated.items():
        sys.stderr.write(f"autotune serve: generated {role} token: {token}\n")
    if generated:
        sys.stderr.write(
            "autotune serve: set AUTOTUNE_CLIENT_TOKENS / AUTOTUNE_WORKER_TOKENS to choose them\n"
        )
    if estimates_note:
        sys.stderr.write(f"autotune serve: {estimates_note}\n")
    if estimates is not None:
        estimates.start()
    if args.port == 0:
        sys.stderr.write(f"autotune serve: listening on {args.host}, on a port the system picks\n")
    else:
        address = estimate_worker.local_url(args.host, args.port)
        sys.stderr.write(
            f"autotune serve: listening on {address} (web pages at {address}/, "
            f"API docs at {address}/docs)\n"
        )
    sys.stderr.flush()
    # SIGTERM may come at any moment: before uvicorn listens, while it serves (its own handler
    # then stops it and raises the signal again on its way out), or after. The handler only
    # records it and asks the server to stop: an exception raised from a signal handler lands
    # wherever the main thread happens to be, and CI saw one land in a garbage-collection
    # callback, where Python ignores it, and the server listened on, never to stop. The
    # estimate workers are stopped (the `finally`) before the process dies of the signal: when
    # uvicorn's signal killed serve first, they were orphaned.
    shutdown = _Shutdown()
    previous = signal.signal(signal.SIGTERM, shutdown.handle)
    try:
        _run_uvicorn(args, app, settings, url, shutdown)
    finally:
        if estimates is not None:
            estimates.stop()
        signal.signal(signal.SIGTERM, previous)
    if shutdown.requested:
        signal.raise_signal(signal.SIGTERM)
    return EXIT_OK


class _Shutdown:
    """SIGTERM reached `serve`: recorded, and passed on to the server once there is one."""

    def __init__(self) -> None:
        self.requested = False
        self._stop: Callable[[], None] | None = None

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        if self._stop is not None:
            self._stop()

    def stop_with(self, stop: Callable[[], None]) -> None:
        """How to stop the server; called at once when SIGTERM came before it existed."""
        self._stop = stop
        if self.requested:
            stop()


def _estimate_pool(
    args: argparse.Namespace, settings: Settings
) -> tuple[estimate_worker.Pool | None, str | None]:
    """The estimate workers to run beside the server (not started yet), or None; and what to
    tell the operator about them."""
    if not args.estimates:
        return None, None
    missing = estimate_worker.missing_reason()
    if args.port == 0:
        missing = "--port 0 leaves the port to the system, and the worker could not find it"
    if missing is not None:
        return None, f"estimates need a worker: {missing}"
    pool = estimate_worker.pool(
        estimate_worker.local_url(args.host, args.port),
        settings.data_dir,
        settings.worker_tokens[0],
        workers=args.estimate_workers,
        time_limit_s=args.estimate_time_limit,
        memory_limit_bytes=args.estimate_memory_limit,
    )
    logs = settings.data_dir / f"{estimate_worker.WORKER_FILES}-N.log"
    return pool, (
        f"estimates run here on {args.estimate_workers} worker(s), each run at most "
        f"{args.estimate_time_limit:g} s and {format_bytes(args.estimate_memory_limit)} "
        f"(worker logs: {logs}; restarted if they stop)"
    )


def _run_uvicorn(
    args: argparse.Namespace,
    app: FastAPI | None,
    settings: Settings,
    url: str,
    shutdown: _Shutdown,
) -> None:
    # uvicorn.run's two modes, spelt out so that a SIGTERM that came before uvicorn took the
    # signal over still reaches its `should_exit`.
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    if app is not None:
        server = uvicorn.Server(
            uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
        )
        shutdown.stop_with(lambda: setattr(server, "should_exit", True))
        server.run()
        return
    # Several processes build their own app from the environment (uvicorn's factory mode).
    os.environ["AUTOTUNE_DATABASE_URL"] = url
    os.environ["AUTOTUNE_CLIENT_TOKENS"] = json.dumps(settings.client_tokens)
    os.environ["AUTOTUNE_WORKER_TOKENS"] = json.dumps(settings.worker_tokens)
    os.environ["AUTOTUNE_ALLOW_FACTORY_SPECS"] = json.dumps(settings.allow_factory_specs)
    config = uvicorn.Config(
        "api.main:create_app_from_env",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        log_level="warning",
    )
    supervisor = Multiprocess(config, sockets=[config.bind_socket()])
    # The supervisor took SIGTERM over (and never gives it back): take it back, so that serve
    # knows it was stopped by it and dies of it like the single-process server.
    signal.signal(signal.SIGTERM, shutdown.handle)
    shutdown.stop_with(supervisor.should_exit.set)
    supervisor.run()


def register(commands: Subcommands) -> None:
    """`autotune serve`."""
    serve = commands.add_parser("serve", help="run the API server")
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every "
        "interface)",
    )
    serve.add_argument(
        "--port", type=port_number, default=8000, help="port to listen on (default 8000)"
    )
    serve.add_argument(
        "--db",
        default=None,
        help=f"database URL (default: ./{DEFAULT_DATA_DIR / SERVER_DATABASE_FILE})",
    )
    serve.add_argument("--workers", type=positive_int, default=1, help="server processes")
    serve.add_argument(
        "--allow-factory-specs",
        action="store_true",
        help="accept factory specs (default: refused with 422, or AUTOTUNE_ALLOW_FACTORY_SPECS"
        "=true); only workers started with --allow-factory run them",
    )
    serve.add_argument(
        "--no-estimates",
        dest="estimates",
        action="store_false",
        help="do not run the embedded estimate workers (estimate runs then wait for an "
        "`autotune worker --device estimate`)",
    )
    serve.add_argument(
        "--estimate-workers",
        type=positive_int,
        default=estimate_worker.DEFAULT_WORKERS,
        metavar="N",
        help="estimate workers to run (default "
        f"{estimate_worker.DEFAULT_WORKERS}): each takes one run at a time, so a slow "
        "estimate holds one and the others answer the rest",
    )
    serve.add_argument(
        "--estimate-time-limit",
        type=positive_seconds,
        default=ESTIMATE_TIME_LIMIT_S,
        metavar="S",
        help="an estimate run that builds and traces longer fails, saying so (default "
        f"{ESTIMATE_TIME_LIMIT_S:g})",
    )
    serve.add_argument(
        "--estimate-memory-limit",
        type=memory_size,
        default=ESTIMATE_MEMORY_LIMIT_BYTES,
        metavar="SIZE",
        help="an estimate run that grows its worker's memory by more fails, saying so "
        f"(default {format_bytes(ESTIMATE_MEMORY_LIMIT_BYTES)})",
    )
    serve.set_defaults(func=_cmd_serve)
