"""The `autotune worker` command: a probe worker that takes runs from a server.

    autotune worker [--server URL] [--token T] [--device cuda|cuda:N|cpu|estimate]
                    [--memory SIZE | --gpu NAME]
                    [--once] [--db URL] [--data-dir DIR] [--trial-timeout S]
                    [--poll-interval S] [--seconds-per-trial S] [--shutdown-grace S]
                    [--worker-id ID] [--start-method spawn|forkserver]
                    [--allow-factory PREFIX ...] [--no-trace] [--no-expandable-segments]

The token (a worker token of the server) comes from `--token` or AUTOTUNE_TOKEN, the server URL
from `--server` or AUTOTUNE_SERVER. `autotune` finds `register` through the `autotune.commands`
entry points, so the command exists exactly where this package imports. `--device estimate`
answers estimate runs for every catalogue GPU (no GPU used; `autotune serve` starts one).
SIGTERM or Ctrl-C stops the worker with exit code 0 (see `probes.worker`).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
from pathlib import Path
from types import FrameType

from autotune.cli.options import (
    NO_TRACE_HELP,
    Subcommands,
    add_device_args,
    add_expandable_segments_arg,
    add_server_args,
    allocator_config_from_environment,
    memory_size,
    non_negative_seconds,
    positive_seconds,
)
from autotune.core.bytesize import format_bytes
from autotune.core.defaults import (
    DEFAULT_DATA_DIR,
    ESTIMATE_MEMORY_LIMIT_BYTES,
    ESTIMATE_TIME_LIMIT_S,
    EXIT_FAILURE,
    EXIT_OK,
    worker_study_url,
)
from autotune.core.errors import SpecError


def default_worker_id() -> str:
    """host-pid, in the characters the server accepts."""
    return re.sub(r"[^\w.:@-]", "-", f"{socket.gethostname()}-{os.getpid()}")[:100]


def _cmd_worker(args: argparse.Namespace) -> int:
    # A signal during start-up (reading the inventory takes seconds) must not kill the
    # worker half-way: remember it and stop as soon as the worker exists.
    early_signals: list[int] = []

    def remember(signum: int, frame: FrameType | None) -> None:
        early_signals.append(signum)

    previous = {sig: signal.signal(sig, remember) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _serve(args, early_signals)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(args: argparse.Namespace, early_signals: list[int]) -> int:
    from autotune.remote.client import ServerClient
    from probes.inventory import default_device_name, read_inventory
    from probes.worker import RunOutcome, Worker, WorkerConfig

    logging.getLogger("probes").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    if not args.token:
        raise SpecError("--token: required (or set AUTOTUNE_TOKEN): a worker token of the server")
    # Read once, here: the inventory, the estimates and every trial child get them from here.
    allocator_config = allocator_config_from_environment()
    devices = read_inventory(
        args.device or default_device_name(args.gpu),
        args.memory,
        args.gpu,
        allocator_config=allocator_config,
    )
    config = WorkerConfig(
        worker_id=args.worker_id or default_worker_id(),
        storage_url=args.db or worker_study_url(args.data_dir),
        trial_timeout_s=args.trial_timeout,
        poll_interval_s=args.poll_interval,
        seconds_per_trial=args.seconds_per_trial,
        shutdown_grace_s=args.shutdown_grace,
        start_method=args.start_method,
        allowed_factories=tuple(args.allow_factory),
        trace_fit=not args.no_trace,
        expandable_segments=not args.no_expandable_segments,
        estimate_time_limit_s=args.estimate_time_limit,
        estimate_memory_limit_bytes=args.estimate_memory_limit,
        allocator_config=allocator_config,
    )
    with (
        ServerClient(args.server, token=args.token) as client,
        ServerClient(args.server, token=args.token) as heartbeat_client,
    ):
        worker = Worker(client, devices, config, heartbeat_client=heartbeat_client)
        worker.install_signal_handlers()
        if early_signals:
            worker.request_stop()
        outcomes = worker.run_forever(max_runs=1 if args.once else None)
    if args.once and outcomes and outcomes[-1] is not RunOutcome.SUCCEEDED:
        return EXIT_FAILURE
    return EXIT_OK


def _module_prefix(text: str) -> str:
    from autotune.core.factoryaccess import parse_prefix

    try:
        return parse_prefix(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def register(commands: Subcommands) -> None:
    """`autotune worker`."""
    from probes.isolation import DEFAULT_TIMEOUT_S, START_METHODS

    worker = commands.add_parser(
        "worker", help="take runs from a server and tune them on this machine's device"
    )
    add_server_args(worker, token_help="a worker token of the server")
    add_device_args(
        worker,
        device_help="cuda, cuda:N, cpu (an emulated GPU; needs --memory or --gpu), or estimate "
        "(estimates for every catalogue GPU, traced on fake tensors; no GPU used). Default: cpu "
        "with --gpu, else cuda when present, else cpu.",
    )
    worker.add_argument("--once", action="store_true", help="exit after one run")
    worker.add_argument(
        "--db",
        default=None,
        metavar="URL",
        help="Optuna storage URL (default: a SQLite file in --data-dir)",
    )
    worker.add_argument(
        "--data-dir",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help=f"where the default --db lives (default: ./{DEFAULT_DATA_DIR})",
    )
    worker.add_argument(
        "--trial-timeout",
        type=positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=(
            "time limit of one trial's child process, counted once it has imported torch "
            f"(default {DEFAULT_TIMEOUT_S:g})"
        ),
    )
    worker.add_argument(
        "--poll-interval",
        type=positive_seconds,
        default=5.0,
        metavar="S",
        help="seconds between claims while idle (default 5)",
    )
    worker.add_argument(
        "--seconds-per-trial",
        type=positive_seconds,
        default=1.0,
        metavar="S",
        help="how long each throughput measurement's timed steps take (default 1.0)",
    )
    worker.add_argument(
        "--shutdown-grace",
        type=non_negative_seconds,
        default=10.0,
        metavar="S",
        help="on SIGTERM/Ctrl-C, how long a run in progress may take to finish before it is "
        "released (default 10)",
    )
    worker.add_argument("--worker-id", default=None, help="default: HOST-PID")
    worker.add_argument(
        "--start-method",
        choices=START_METHODS,
        default="spawn",
        help="how each trial's fresh child process starts: spawn (a new interpreter, default) "
        "or forkserver (forked from a clean server that pre-imported torch; much faster)",
    )
    worker.add_argument(
        "--allow-factory",
        action="append",
        default=[],
        type=_module_prefix,
        metavar="PREFIX",
        help="run factory specs whose module is PREFIX or under it (e.g. mypkg allows "
        "mypkg.models, never mypkgx); repeatable. Without it the worker refuses every factory "
        "spec: a factory is code that whoever submitted the spec asks this machine to run",
    )
    worker.add_argument("--no-trace", action="store_true", help=NO_TRACE_HELP)
    add_expandable_segments_arg(worker)
    worker.add_argument(
        "--estimate-time-limit",
        type=positive_seconds,
        default=ESTIMATE_TIME_LIMIT_S,
        metavar="S",
        help="--device estimate: a run that builds and traces longer fails, saying so "
        f"(default {ESTIMATE_TIME_LIMIT_S:g}); "
        "cancel and shutdown stop a trace within seconds either way",
    )
    worker.add_argument(
        "--estimate-memory-limit",
        type=memory_size,
        default=ESTIMATE_MEMORY_LIMIT_BYTES,
        metavar="SIZE",
        help="--device estimate: a run that grows the worker's memory by more fails, saying "
        f"so (default {format_bytes(ESTIMATE_MEMORY_LIMIT_BYTES)})",
    )
    worker.set_defaults(func=_cmd_worker)
