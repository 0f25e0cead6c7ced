"""`make run`: the whole system on this machine: a server on embedded SQLite, one probe worker,
the example spec submitted, its progress, recommendation, export snippets and URL.

    python -m autotune.cli.demo [--stop] [--spec FILE] [--memory SIZE] [--port N] [--data-dir DIR]
                            [--seconds-per-trial S] [--start-method spawn|forkserver]
                            [--timeout S]

The worker uses the first CUDA GPU when there is one, otherwise an emulated GPU of `--memory`
(default 1 GiB) on the CPU. The server keeps running (with its URL and tokens printed) until
Ctrl-C; `--stop` (or DEMO_STOP=1) stops it as soon as the result is printed. Either way the
worker and the server are stopped (SIGTERM, then SIGKILL after a grace period), and no process
is left behind. Logs go to DIR/server.log and DIR/worker.log. A spec whose model is a factory
is your own code: the demo starts its server with `--allow-factory-specs` and its worker with
`--allow-factory` for that factory's module only.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

from rich.console import Console

from autotune.cli.options import memory_size
from autotune.cli.progress import Progress, follow_run
from autotune.core.bytesize import format_bytes, parse_bytes
from autotune.core.defaults import DEFAULT_DATA_DIR
from autotune.core.schemas import ProbeResult, TuneResult
from autotune.remote.client import ServerClient, ServerError
from autotune.remote.protocol import CudaTarget, EmulatedTarget, Run, RunStatus

EXAMPLE_SPEC = Path(__file__).resolve().parents[2] / "examples" / "gpt2-tiny.yaml"
DEMO_MEMORY = "1GiB"
STARTUP_TIMEOUT_S = 60.0
STOP_GRACE_S = 30.0  # the worker's own shutdown grace is 10 s, plus reporting the release


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]

    def tail(self, lines: int = 20) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _start(name: str, argv: list[str], env: dict[str, str], log_path: Path) -> _Child:
    log = log_path.open("ab")
    # A session of its own: Ctrl-C reaches only the demo, which then stops the children in
    # order (the worker first, so that it can still hand its run back to the server).
    process = subprocess.Popen(
        [sys.executable, "-m", "autotune.cli.main", *argv],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return _Child(name, process, log_path, log)


def _stop(child: _Child, console: Console) -> None:
    if child.process.poll() is None:
        child.process.terminate()
        try:
            child.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            console.print(f"{child.name} did not stop within {STOP_GRACE_S:g} s; killing it")
            child.process.kill()
            child.process.wait()
    child.log.close()


def _wait_for_server(client: ServerClient, server: _Child) -> None:
    deadline_s = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited at start:\n{server.tail()}")
        try:
            client.health()
            return
        except ServerError:
            if time.monotonic() > deadline_s:
                raise RuntimeError(
                    f"the server did not answer in time:\n{server.tail()}"
                ) from None
            time.sleep(0.2)


def _device(memory: str) -> tuple[list[str], EmulatedTarget | CudaTarget, str]:
    """Worker arguments, the run's target and a sentence saying which device it is."""
    import torch

    if torch.cuda.is_available():
        from autotune.engine.devices.nvml import read_gpus

        gpus = read_gpus()
        if gpus:
            gpu = gpus[0]
            target = CudaTarget(name=gpu.name, memory_bytes=gpu.total_memory_bytes)
            return (
                ["--device", "cuda"],
                target,
                f"CUDA GPU {gpu.name} ({format_bytes(gpu.total_memory_bytes)})",
            )
    memory_bytes = parse_bytes(memory)
    return (
        ["--device", "cpu", "--memory", memory],
        EmulatedTarget(memory_bytes=memory_bytes),
        f"no CUDA GPU here: the worker emulates a GPU of {format_bytes(memory_bytes)} on the "
        "CPU (real training steps, memory counted and capped at that capacity)",
    )


def _follow(client: ServerClient, run_id: int, worker: _Child, timeout_s: float) -> Run:
    """Print the run's attempts and trials as they arrive, until it finishes."""
    progress = Progress(Console(stderr=True))

    def worker_alive() -> None:
        if worker.process.poll() is not None:
            raise RuntimeError(f"the worker exited:\n{worker.tail()}")

    run = follow_run(client, run_id, progress, timeout_s=timeout_s, still_working=worker_alive)
    if not run.status.is_finished():
        raise RuntimeError(f"run {run_id} did not finish within {timeout_s:g} s")
    return run


def _as_result(run: Run) -> TuneResult | None:
    """The run's final claim as a TuneResult, to print it as `autotune tune` does."""
    if run.worker_device is None:
        return None
    return TuneResult(
        spec=run.spec,
        device=run.worker_device,
        probe=ProbeResult(device=run.worker_device, modes=run.modes),
        trials=[t.trial for t in run.trials if t.claim_number == run.claim_count],
        recommendation=run.recommendation,
        infeasible=run.infeasible,
        exports=run.exports,
        study_name=run.study_name,
    )


def _print_run(console: Console, run: Run, url: str, data_dir: Path) -> None:
    from autotune.cli.tune import loop_path, print_tune_result

    result = _as_result(run)
    if run.status is RunStatus.SUCCEEDED and result is not None:
        if result.recommendation is None and result.infeasible is None:
            from autotune.cli.main import print_probe_table

            # A spec without a target global batch is probed, not tuned.
            print_probe_table(console, result.probe, headroom=run.spec.training.headroom)
        else:
            print_tune_result(console, result, loop_path=loop_path(result, data_dir))
    else:
        console.print(f"[red]run {run.id} {run.status.value}[/red]: {run.error or ''}")
    console.print(f"[bold]Run URL:[/bold] {url}{run.url}")
    console.print(
        f"[bold]Web page:[/bold] {url}/runs/{run.id} (plots and exports; the browser asks for "
        "the client token once)"
    )


def _wait_until_interrupted(server: _Child, console: Console) -> None:
    console.print("The server keeps running; press Ctrl-C to stop it.")
    while server.process.poll() is None:
        time.sleep(0.5)
    console.print(f"[red]the server exited[/red]:\n{server.tail()}")


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_demo(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    stop = args.stop or os.environ.get("DEMO_STOP", "") not in ("", "0")
    console = Console()
    # SIGTERM ends the demo as Ctrl-C does: through the `finally` that stops the children.
    # SIGINT is set explicitly too: a process started with SIGINT ignored (as a child of one
    # that ignores it) would otherwise never see Ctrl-C.
    previous_handlers = {
        signum: signal.signal(signum, _raise_interrupt)
        for signum in (signal.SIGTERM, signal.SIGINT)
    }
    data_dir = Path(args.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    client_token, worker_token = secrets.token_urlsafe(18), secrets.token_urlsafe(18)
    url = f"http://127.0.0.1:{args.port or _free_port()}"
    worker_args, target, device_text = _device(args.memory)
    from autotune.core.specfile import load_spec

    spec = load_spec(args.spec)
    # Your own spec on your own machine: a factory in it is your code, so this server accepts
    # it and this worker runs it (and nothing else: only the factory's own module).
    server_args, factory_args = [], []
    if spec.model.factory is not None:
        server_args = ["--allow-factory-specs"]
        factory_args = ["--allow-factory", spec.model.factory.partition(":")[0]]
    children: list[_Child] = []
    try:
        server_env = {
            **os.environ,
            "AUTOTUNE_DATA_DIR": str(data_dir),
            "AUTOTUNE_CLIENT_TOKENS": client_token,
            "AUTOTUNE_WORKER_TOKENS": worker_token,
        }
        server_env.pop("AUTOTUNE_DATABASE_URL", None)  # the demo's server is the embedded one
        port = url.rsplit(":", 1)[1]
        server = _start(
            "server",
            # The demo's worker is the one it starts; estimates are not part of the tour.
            ["serve", "--port", port, "--no-estimates", *server_args],
            server_env,
            data_dir / "server.log",
        )
        children.append(server)
        with ServerClient(url, retries=0) as probe_client:
            _wait_for_server(probe_client, server)
        client = ServerClient(url, token=client_token)
        console.print(f"[bold]Server[/bold] {url} (SQLite in {data_dir}, log {server.log_path})")
        console.print(f"  client token: {client_token}")
        console.print(f"  worker token: {worker_token}")
        worker_env = {**os.environ, "AUTOTUNE_TOKEN": worker_token}
        worker = _start(
            "worker",
            [
                "worker",
                "--server",
                url,
                *worker_args,
                "--data-dir",
                str(data_dir),
                "--poll-interval",
                "1",
                "--seconds-per-trial",
                str(args.seconds_per_trial),
                "--start-method",
                args.start_method,
                *factory_args,
            ],
            worker_env,
            data_dir / "worker.log",
        )
        children.append(worker)
        console.print(f"[bold]Worker[/bold]: {device_text} (log {worker.log_path})")
        submitted = client.submit_run(spec, target)
        console.print(f"Submitted {args.spec} as run {submitted.id}: {url}{submitted.url}")
        if submitted.cached:
            console.print("(an identical run finished before: its result answers at once)")
        run = submitted.run or _follow(client, submitted.id, worker, args.timeout)
        _print_run(console, run, url, data_dir)
        if not stop:
            _wait_until_interrupted(server, console)
        return 0 if run.status is RunStatus.SUCCEEDED else 1
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, ServerError) as error:
        console.print(f"[red]demo failed:[/red] {error}")
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut cleanup
        console.print("Stopping " + " and ".join(c.name for c in reversed(children)) + " ...")
        for child in reversed(children):
            _stop(child, console)
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)


def _memory(text: str) -> str:
    memory_size(text)  # validated here, passed on as text to the worker's --memory
    return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m autotune.cli.demo", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--stop", action="store_true", help="stop the server after the result (or DEMO_STOP=1)"
    )
    parser.add_argument("--spec", default=str(EXAMPLE_SPEC), help="spec file to submit")
    parser.add_argument(
        "--memory",
        type=_memory,
        default=DEMO_MEMORY,
        help=f"emulated GPU size without CUDA ({DEMO_MEMORY})",
    )
    parser.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    parser.add_argument(
        "--data-dir",
        default=str(DEFAULT_DATA_DIR),
        help=f"database and logs (./{DEFAULT_DATA_DIR})",
    )
    parser.add_argument("--seconds-per-trial", type=float, default=1.0)
    parser.add_argument("--start-method", choices=("spawn", "forkserver"), default="spawn")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait")
    return parser


if __name__ == "__main__":
    sys.exit(run_demo())
