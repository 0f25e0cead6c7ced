"""The client's commands: `autotune submit` and `autotune runs list|show`, talking to a server
over HTTP with only the core installed (no torch, no server package).

    autotune submit FILE --server URL [--device cpu:4GiB | "cuda:NAME:80GiB" | --gpu NAME] [--wait]
                     [--write]
    autotune runs list [--status S] [--model M] [--device D] --server URL
    autotune runs show ID [--export hf|axolotl|deepspeed|lightning|pytorch] --server URL
    autotune runs cancel ID --server URL

Registered through the `autotune.commands` entry points (`register_submit`, `register_runs`).
Tokens: `--token` or AUTOTUNE_TOKEN; the server URL: `--server` or AUTOTUNE_SERVER.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from autotune.cli.config_files import (
    FILE_HELP,
    add_config_args,
    add_write_arg,
    read_training_file,
    write_back,
)
from autotune.cli.export_text import add_export_arg, print_exports, print_one_export
from autotune.cli.options import (
    Subcommands,
    add_server_args,
    gpu_name,
    non_negative_int,
    positive_int,
    positive_seconds,
)
from autotune.cli.progress import Progress, follow_run
from autotune.core.bytesize import format_bytes, parse_bytes
from autotune.core.configs import ConfigFormat, Converted
from autotune.core.defaults import EXIT_FAILURE, EXIT_OK, EXIT_TIMEOUT, EXIT_USAGE
from autotune.core.errors import SpecError
from autotune.core.presets import PRESETS
from autotune.core.schemas import ModelSpec, Spec
from autotune.remote.client import ServerClient
from autotune.remote.protocol import (
    AnyTarget,
    CudaTarget,
    EmulatedTarget,
    EstimateTarget,
    Run,
    RunPage,
    RunStatus,
)

# ---------------------------------------------------------------------------------------------
# submit


def parse_device(text: str) -> EmulatedTarget | CudaTarget:
    """`cpu:4GiB` / `emulated:4GiB` (the emulated GPU) or `cuda:NAME:80GiB` (a GPU model)."""
    kind, _, rest = text.partition(":")
    try:
        if kind in ("cpu", "emulated") and rest:
            return EmulatedTarget(memory_bytes=parse_bytes(rest))
        name, _, memory = rest.rpartition(":")
        if kind == "cuda" and name and memory:
            return CudaTarget(name=name, memory_bytes=parse_bytes(memory))
    except ValueError as error:
        raise SpecError(f"--device: {error}") from None
    raise SpecError(f"--device: expected cpu:SIZE or cuda:NAME:SIZE, got {text!r}")


def _local_gpu_target() -> CudaTarget:
    from autotune.engine.devices.nvml import read_gpus

    gpus = read_gpus()
    if not gpus:
        raise SpecError("--device: no local GPU to default to; give cpu:SIZE or cuda:NAME:SIZE")
    return CudaTarget(name=gpus[0].name, memory_bytes=gpus[0].total_memory_bytes)


def _load_spec(args: argparse.Namespace) -> Converted | Spec:
    """The file read as a spec (a config file keeps what writing back needs), or a preset's."""
    text = args.spec
    if text in PRESETS and not os.path.exists(text):
        return Spec(model=ModelSpec(preset=text))
    return read_training_file(args, Console(stderr=True))


def _client(args: argparse.Namespace) -> ServerClient:
    return ServerClient(args.server, token=args.token)


def _cmd_submit(args: argparse.Namespace) -> int:
    loaded = _load_spec(args)
    converted = loaded if isinstance(loaded, Converted) else None
    spec = loaded.spec if isinstance(loaded, Converted) else loaded
    if args.write and (converted is None or converted.format is ConfigFormat.SPEC):
        raise SpecError("--write: only a config file (Axolotl, TrainingArguments, DeepSpeed)")
    device: AnyTarget
    if args.estimate is not None:
        device = EstimateTarget(gpu=args.estimate)
    elif args.gpu is not None:
        device = EmulatedTarget(gpu=args.gpu)
    else:
        device = parse_device(args.device) if args.device else _local_gpu_target()
    with _client(args) as client:
        submitted = client.submit_run(spec, device)
        run = submitted.run
        if submitted.notice and not args.json:
            Console(stderr=True).print(
                f"autotune submit: run {submitted.id}: {submitted.notice}",
                soft_wrap=True,
                highlight=False,
            )
        if run is None and args.wait:
            err = Console(stderr=True)
            err.print(f"run {submitted.id}: {args.server}{submitted.url}", soft_wrap=True)
            progress = Progress(err)
            try:
                run = follow_run(client, submitted.id, progress, timeout_s=args.timeout)
            finally:
                progress.close()
    out = Console()
    if args.json:
        payload = run.model_dump(mode="json") if run else submitted.model_dump(mode="json")
        sys.stdout.write(json.dumps(payload) + "\n")
    elif run is None:
        out.print(f"run {submitted.id} {submitted.status.value}: {args.server}{submitted.url}")
    else:
        if submitted.cached:
            out.print(f"run {run.id}: cached result")
        _print_run(out, run)
    if run is not None and run.status in (RunStatus.FAILED, RunStatus.CANCELLED):
        _say_why(Console(stderr=True), run)
        return EXIT_FAILURE
    if converted is not None and run is not None and run.status is RunStatus.SUCCEEDED:
        # The file's diff goes where it does not mix with a machine-read output.
        console = Console(stderr=True) if args.json else out
        write_back(args, converted, run.recommendation, run.exports, console)
    elif args.write and not args.wait:
        Console(stderr=True).print(
            f"autotune submit: --write: run {submitted.id} is {submitted.status.value}, so "
            "there is nothing to write until it finishes; add --wait to write it when it does",
            soft_wrap=True,
            highlight=False,
        )
        return EXIT_USAGE
    if args.wait and (run is None or not run.status.is_finished()):
        status = run.status if run is not None else submitted.status
        Console(stderr=True).print(
            f"autotune submit: run {submitted.id} is still {status.value} after "
            f"{args.timeout:g} s (--timeout): {args.server}{submitted.url}",
            soft_wrap=True,
        )
        return EXIT_TIMEOUT
    return EXIT_OK


def _say_why(console: Console, run: Run) -> None:
    """Why a run ended without a result: its error, and what each failed claim reported."""
    console.print(
        f"autotune submit: run {run.id} {run.status.value}: {run.error or 'no reason recorded'}",
        soft_wrap=True,
        highlight=False,
    )
    for failure in run.failures:
        on = f" on {failure.worker_id}" if failure.worker_id else ""
        console.print(
            f"  claim {failure.claim_number}{on}: {failure.error_type}: {failure.message}",
            soft_wrap=True,
            highlight=False,
        )


# ---------------------------------------------------------------------------------------------
# runs list / show


def _when(moment: datetime | None) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S") if moment else "-"


def _print_page(console: Console, page: RunPage) -> None:
    first = page.offset + 1 if page.items else 0
    table = Table(title=f"runs {first}-{page.offset + len(page.items)} of {page.total}")
    # Short columns never wrap; long labels (model, device) fold on narrow terminals.
    table.add_column("id", justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True)
    # Long labels are shortened with an ellipsis on narrow terminals, never folded over lines
    # (`runs show ID` has them whole).
    table.add_column("model", no_wrap=True, overflow="ellipsis", min_width=10)
    table.add_column("device", no_wrap=True, overflow="ellipsis", min_width=10)
    table.add_column("created", no_wrap=True)
    table.add_column("micro x acc", no_wrap=True)
    table.add_column("samples/s per GPU", justify="right")
    for item in page.items:
        config = "-"
        if item.micro_batch is not None:
            config = f"{item.micro_batch} x {item.accumulation_steps}"
            config += " ckpt" if item.checkpointing else ""
        table.add_row(
            str(item.id),
            item.status.value,
            item.model,
            item.device,
            item.created_at.strftime("%m-%d %H:%M"),
            config,
            "-"
            if item.samples_per_s is None
            else f"{item.samples_per_s:.1f} ({item.speed_label})",
        )
    console.print(table)


def _print_run(console: Console, run: Run) -> None:
    table = Table(title=f"run {run.id}: {run.model} on {run.device.label}", show_header=False)
    table.add_column("field")
    table.add_column("value")
    rows: list[tuple[str, Any]] = [
        ("status", run.status.value),
        ("created", _when(run.created_at)),
        ("finished", _when(run.finished_at)),
        ("claims", run.claim_count),
        ("worker", run.worker_id or "-"),
        ("torch", run.torch_version or "-"),
        ("attempts / trials", f"{len(run.attempts)} / {len(run.trials)}"),
    ]
    rec = run.recommendation
    if rec is not None:
        rows += [
            ("micro-batch", rec.micro_batch),
            ("accumulation steps", rec.accumulation_steps),
            ("checkpointing", rec.checkpointing_label),
            ("global batch", rec.global_batch),
            ("layout", rec.sharding.value if rec.sharding is not None else "-"),
            (
                "samples/s",
                f"{rec.samples_per_s:.2f} per GPU, {rec.job_samples_per_s:.1f} for the job of "
                f"{rec.world_size} GPU(s) ({run.speed_label})",
            ),
            ("peak", f"{format_bytes(rec.peak_bytes)} of {format_bytes(rec.capacity_bytes)}"),
        ]
    if run.infeasible is not None:
        rows.append(("infeasible", run.infeasible.reason))
    if run.error:
        rows.append(("error", run.error))
    for name, value in rows:
        table.add_row(name, str(value))
    console.print(table)
    if run.exports is not None:
        print_exports(console, run.exports)


def _cmd_runs_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        page = client.list_runs(
            status=RunStatus(args.status) if args.status else None,
            model=args.model,
            device=args.device,
            limit=args.limit,
            offset=args.offset,
        )
    if args.json:
        sys.stdout.write(page.model_dump_json() + "\n")
    else:
        _print_page(Console(), page)
    return 0


def _cmd_runs_show(args: argparse.Namespace) -> int:
    with _client(args) as client:
        run = client.get_run(args.id)
    if args.json:
        sys.stdout.write(run.model_dump_json() + "\n")
    elif args.export is not None:
        if run.exports is None:
            sys.stderr.write(
                f"autotune runs show: run {run.id} ({run.status.value}) has no exports\n"
            )
            return EXIT_FAILURE
        print_one_export(Console(), Console(stderr=True), run.exports, args.export)
    else:
        _print_run(Console(), run)
    return 0


def _cmd_runs_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        run = client.cancel_run(args.id)
    if args.json:
        sys.stdout.write(run.model_dump_json() + "\n")
    else:
        Console().print(f"run {run.id}: {run.status.value}")
    return EXIT_OK if run.status is RunStatus.CANCELLED else EXIT_FAILURE


# ---------------------------------------------------------------------------------------------
# registration


def _add_client_args(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser, token_help="a client token of the server")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def register_submit(commands: Subcommands) -> None:
    """`autotune submit`."""
    submit = commands.add_parser("submit", help="submit a spec to a server")
    submit.add_argument("spec", metavar="FILE", help=FILE_HELP + ", or a preset name")
    add_config_args(submit)
    target = submit.add_mutually_exclusive_group()
    target.add_argument(
        "--device",
        default=None,
        help='cpu:SIZE (emulated GPU) or "cuda:NAME:SIZE"; default: this machine\'s first GPU',
    )
    target.add_argument(
        "--gpu",
        type=gpu_name,
        default=None,
        metavar="NAME",
        help='an emulated named GPU, e.g. "H100 80GB" (its memory less what CUDA takes on it)',
    )
    target.add_argument(
        "--estimate",
        type=gpu_name,
        default=None,
        metavar="NAME",
        help="an estimate for a named GPU (traced on fake tensors; `autotune serve` runs them)",
    )
    add_write_arg(submit, when="; needs the result: --wait, unless a stored result answers")
    submit.add_argument("--wait", action="store_true", help="wait for the result")
    submit.add_argument(
        "--timeout", type=positive_seconds, default=3600.0, help="seconds to --wait"
    )
    _add_client_args(submit)
    submit.set_defaults(func=_cmd_submit)


def register_runs(commands: Subcommands) -> None:
    """`autotune runs list`, `autotune runs show` and `autotune runs cancel`."""
    runs = commands.add_parser("runs", help="browse a server's runs")
    runs_commands = runs.add_subparsers(dest="runs_command", required=True)
    listing = runs_commands.add_parser("list", help="runs, newest first")
    listing.add_argument("--status", choices=[s.value for s in RunStatus])
    listing.add_argument("--model", help="model label, e.g. gpt2-tiny")
    listing.add_argument("--device", help="device label, e.g. emulated:4294967296")
    listing.add_argument("--limit", type=positive_int, default=50)
    listing.add_argument("--offset", type=non_negative_int, default=0)
    _add_client_args(listing)
    listing.set_defaults(func=_cmd_runs_list)
    show = runs_commands.add_parser("show", help="one run in full, with its exports")
    show.add_argument("id", type=positive_int)
    add_server_args(show, token_help="a client token of the server")
    output = show.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_export_arg(output)
    show.set_defaults(func=_cmd_runs_show)
    cancel = runs_commands.add_parser("cancel", help="cancel a queued or running run")
    cancel.add_argument("id", type=positive_int)
    _add_client_args(cancel)
    cancel.set_defaults(func=_cmd_runs_cancel)
