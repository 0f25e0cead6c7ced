"""The `autotune tune` command: probe, search and print the recommendation with export snippets.

    autotune tune SPEC [--device cpu|cuda|cuda:N] [--memory SIZE] [--json] [--db URL]
                       [--trials N] [--seed S] [--processes N|auto]

The Optuna study lives in the database at `--db` (default: AUTOTUNE_DATABASE_URL, else the
embedded SQLite file data/autotune.db), so `optuna-dashboard <url>` can open it, and the run is
recorded there for the server to show, by each installed `autotune.core.recorder.RunRecorder` (the
server package's, where the `api` extra is installed). Registered through the
`autotune.commands` entry points.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from autotune.cli.fit_advice_text import print_fit_advice
from autotune.cli.options import (
    AUTO_PROCESSES,
    Subcommands,
    add_device_args,
    add_expandable_segments_arg,
    add_trace_arg,
    capacity_text,
    expandable_segments,
    fit_tracer,
    open_runner,
    positive_int,
    positive_seconds,
    processes_count,
    side_by_side_processes,
)
from autotune.cli.progress import Progress, format_seconds
from autotune.core.bytesize import format_bytes
from autotune.core.defaults import (
    DEFAULT_DATA_DIR,
    ENV_DATABASE_URL,
    EXIT_FAILURE,
    EXIT_OK,
    server_database_url,
)
from autotune.core.errors import SpecError
from autotune.core.parallel.layout_choice import LAYOUT_NAMES, layout_candidates
from autotune.core.recorder import installed_recorders
from autotune.core.schemas import Infeasible, Sharding, Spec, TuneResult
from autotune.core.tuning.candidates import indivisible_target
from autotune.core.tuning.throughput import speed_label

if TYPE_CHECKING:
    from autotune.engine.probe import FitTracer
    from autotune.engine.runner import TrialRunner


def default_database_url() -> str:
    """AUTOTUNE_DATABASE_URL, else the embedded SQLite file the server uses by default."""
    return os.environ.get(ENV_DATABASE_URL) or server_database_url()


def _cmd_tune(args: argparse.Namespace) -> int:
    from autotune.engine.remedy_trials import fits_nowhere, with_fit_advice
    from autotune.engine.tuner import tune_session

    err = Console(stderr=True)
    converted = read_training_file(args, err)
    spec = converted.spec
    target_global_batch = spec.training.required_target_global_batch()
    indivisible = indivisible_target(target_global_batch, spec.training.world_size)
    if indivisible is not None:
        # Known before the model is built: no need to probe for it.
        if args.json:
            sys.stdout.write(
                json.dumps(
                    {"recommendation": None, "infeasible": indivisible.model_dump(mode="json")}
                )
                + "\n"
            )
        else:
            print_infeasible(Console(), indivisible)
        return EXIT_FAILURE
    from autotune.engine.emulation.gpu_speed import timed_on_its_gpu

    def open_layout(layout: Spec) -> TrialRunner:
        # On an emulated named GPU, samples/s are that GPU's (roofline), not this CPU's.
        return timed_on_its_gpu(open_runner(args, layout))

    auto = spec.training.sharding is Sharding.AUTO
    layouts = layout_candidates(spec.training) if auto else []
    processes = args.processes
    if processes > 1 and (args.estimate is None or not auto):
        # A device runs one trial at a time, and a timed step would time its neighbours too.
        raise SpecError(
            "--processes: layouts are tuned side by side only in an estimate of sharding: auto "
            "(--estimate NAME)"
        )
    if processes == AUTO_PROCESSES:
        processes = (
            side_by_side_processes(len(layouts)) if args.estimate is not None and auto else 1
        )
    side_by_side = processes > 1
    if auto:
        from autotune.engine.layout_tuning import layout_spec

        # The first layout's runner says what the device is; every layout runs on its own.
        first = layout_spec(spec, layouts[0])
        runner = open_layout(first)
    else:
        runner = open_layout(spec)
    info = runner.device_info
    # The default database and the plain loop of the human output go to ./data: say so.
    if args.db is None or (args.export is None and not args.json):
        err.print(
            f"data directory: {DEFAULT_DATA_DIR.resolve()} (the Optuna study, the run's record"
            " and the plain loop; --db URL or $" + ENV_DATABASE_URL + " for another database)",
            soft_wrap=True,
        )
    storage_url = args.db or default_database_url()
    err.print(
        f"tuning [bold]{spec.model.label}[/bold] for global batch "
        f"{target_global_batch} on {info.name} "
        f"({capacity_text(info)})",
        soft_wrap=True,
    )
    progress = Progress(err, speed=speed_label(info))
    common: dict[str, Any] = {
        "storage_url": storage_url,
        "n_trials": args.trials,
        "seed": args.seed,
        "target_seconds": args.seconds_per_trial,
        "on_attempt": progress.attempt,
        "on_trial": progress.trial,
        "on_phase": progress.phase,
    }
    try:
        if auto:
            from autotune.engine.layout_tuning import tune_layouts

            opened = {first.training.sharding: runner}

            def layout_runner(layout: Spec) -> tuple[TrialRunner, FitTracer | None]:
                opened_runner = opened.pop(layout.training.sharding, None)
                layout_runner = opened_runner or open_layout(layout)
                tracer = fit_tracer(args, layout_runner)
                if side_by_side:
                    # In a child process: its steps are not announced (each would start a
                    # spinner of its own); its phases, attempts and trials come here.
                    return layout_runner, tracer
                return progress.runner(layout_runner), tracer

            if side_by_side:
                err.print(
                    f"{len(layouts)} layouts, {processes} at a time, "
                    "each in a process of its own (--processes 1: one at a time)",
                    soft_wrap=True,
                )
            result = tune_layouts(spec, layout_runner, processes=processes, **common)
        else:
            result = tune_session(
                progress.runner(runner),
                tracer=fit_tracer(args, runner),
                expandable=expandable_segments(args, spec, info),
                **common,
            )
    finally:
        progress.close()
    if not args.no_advice and fits_nowhere(result.probe):
        err.print("micro-batch 1 fits in no mode: tracing the changes that would make it fit")
        probe = with_fit_advice(
            spec, result.probe, on_change=lambda label: err.print(f"  tracing: {label}")
        )
        result = result.model_copy(update={"probe": probe})
    _record_locally(result, storage_url, err)
    if args.json:
        sys.stdout.write(tune_json(result) + "\n")
    elif args.export is not None:
        if result.exports is None:
            print_tune_result(err, result)
        else:
            print_one_export(Console(), err, result.exports, args.export)
    else:
        print_tune_result(Console(), result, loop_path=loop_path(result))
        if result.study_name is not None:
            err.print(
                f"Optuna study [bold]{result.study_name}[/bold]: optuna-dashboard {storage_url}"
                " (pip install optuna-dashboard)",
                soft_wrap=True,
            )
    # The file's diff goes where it does not mix with a machine-read output.
    out = err if args.json or args.export else Console()
    write_back(args, converted, result.recommendation, result.exports, out)
    return EXIT_OK if result.recommendation is not None else EXIT_FAILURE


def tune_json(result: TuneResult) -> str:
    """The `--json` document: recommendation, exports, trials and probe (plus why not, if no
    configuration hits the target)."""
    document = {
        "recommendation": result.recommendation,
        "exports": result.exports,
        "trials": result.trials,
        "probe": result.probe,
        "infeasible": result.infeasible,
        "study_name": result.study_name,
    }
    from pydantic import TypeAdapter

    return TypeAdapter(dict[str, Any]).dump_json(document).decode()


def _record_locally(result: TuneResult, storage_url: str, console: Console) -> None:
    """Store the run in the local database, by every installed recorder (none without the
    server package). An estimate is stored under its own target, so it answers estimate
    requests only, never a request for a measurement."""
    for recorder in installed_recorders():
        run_id = recorder.record_run(storage_url, result)
        console.print(f"recorded as run {run_id} in {storage_url}")


def loop_path(result: TuneResult, data_dir: Path = DEFAULT_DATA_DIR) -> Path:
    """Where `tune` writes the plain PyTorch loop of its recommendation: in the data
    directory, named after the model and the configuration (a rerun overwrites its own)."""
    rec = result.recommendation
    shape = "" if rec is None else f"-{rec.micro_batch}x{rec.accumulation_steps}"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", result.spec.model.label)[:80]
    return (data_dir / f"train_loop-{name}{shape}.py").resolve()


def print_tune_result(
    console: Console, result: TuneResult, *, loop_path: Path | None = None
) -> None:
    """The probe, the measured configurations (when any), the recommendation and every export
    (verbatim; the plain loop written to `loop_path` when given)."""
    probe = Table(title="Probe: largest micro-batch that fits")
    for column in ("checkpointing", "max", "within headroom", "when accumulating", "trials"):
        probe.add_column(column, justify="right")
    for mode in result.probe.modes:
        probe.add_row(
            "on" if mode.checkpointing else "off",
            str(mode.max_micro_batch),
            str(mode.recommended_micro_batch),
            "-" if mode.accumulating_micro_batch is None else str(mode.accumulating_micro_batch),
            str(len(mode.attempts)),
        )
    console.print(probe)
    console.print(
        "  within headroom: the largest micro-batch that leaves "
        f"{result.spec.training.headroom:.0%} of the capacity free; when accumulating: the "
        "same while the gradients of earlier micro-batches are kept (G >= 2), about one more "
        "copy of the trainable parameters",
        soft_wrap=True,
    )
    if result.trials:
        print_trials(console, result)
    if result.layouts:
        print_layouts(console, result)
    rec = result.recommendation
    if rec is None:
        assert result.infeasible is not None
        print_infeasible(console, result.infeasible)
        if result.probe.fit_advice is not None:
            print_fit_advice(console, result.probe.fit_advice)
        return
    layout = f", layout {LAYOUT_NAMES[rec.sharding]}" if result.layouts and rec.sharding else ""
    console.print(
        f"[bold green]Recommendation:[/bold green] micro-batch {rec.micro_batch} x "
        f"{rec.accumulation_steps} accumulation steps x {rec.world_size} rank(s) = global batch "
        f"{rec.global_batch}, checkpointing {rec.checkpointing_label}{layout}: "
        f"{speed_text(rec.samples_per_s, rec.tokens_per_s, rec.world_size)} "
        f"({speed_label(result.device)}), peak {format_bytes(rec.peak_bytes)} of "
        f"{format_bytes(rec.capacity_bytes)} per GPU"
        + (f", with PYTORCH_ALLOC_CONF={rec.allocator_conf}" if rec.allocator_conf else ""),
        soft_wrap=True,
    )
    if result.exports is not None:
        print_exports(console, result.exports, loop_path=loop_path)


def speed_text(samples_per_s: float, tokens_per_s: float | None, world_size: int) -> str:
    """A rank's speed, per GPU and for the whole job: every samples/s and tokens/s says which."""
    text = f"{samples_per_s:,.2f} samples/s per GPU"
    if tokens_per_s is not None:
        text += f" ({tokens_per_s:,.0f} tokens/s)"
    if world_size > 1:
        text += f", {samples_per_s * world_size:,.1f} samples/s for the job of {world_size} GPUs"
        if tokens_per_s is not None:
            text += f" ({tokens_per_s * world_size:,.0f} tokens/s)"
    return text


def print_layouts(console: Console, result: TuneResult) -> None:
    """sharding: auto: each layout's reach, speed and memory per rank, and why it lost."""
    world = result.spec.training.world_size
    table = Table(title=f"Layouts on {world} GPU(s): the chosen one first")
    columns = [
        "layout",
        "max micro-batch (plain / ckpt)",
        "best",
        "samples/s per GPU",
        f"samples/s job ({world} GPUs)",
        "compute",
        "exposed comm.",
        "memory per GPU",
        "verdict",
    ]
    for column in columns:
        table.add_column(column, justify="left" if column in ("layout", "verdict") else "right")
    for layout in result.layouts:
        rec = layout.recommendation
        checkpointed = layout.max_micro_batch_checkpointed
        cells = [
            LAYOUT_NAMES[layout.sharding],
            f"{layout.max_micro_batch} / {'-' if checkpointed is None else checkpointed}",
            "-"
            if rec is None
            else f"{rec.micro_batch} x {rec.accumulation_steps}, ckpt {rec.checkpointing_label}",
            "-" if rec is None else f"{rec.samples_per_s:,.2f}",
            "-" if rec is None else f"{rec.job_samples_per_s:,.1f}",
            "-" if layout.compute_time_s is None else format_seconds(layout.compute_time_s),
            "-"
            if layout.exposed_communication_s is None
            else format_seconds(layout.exposed_communication_s),
            "-" if rec is None else format_bytes(rec.peak_bytes),
            layout.verdict.value.replace("_", " "),
        ]
        table.add_row(*cells)
    console.print(table)
    for layout in result.layouts:
        console.print(f"  {LAYOUT_NAMES[layout.sharding]}: {layout.reason}", soft_wrap=True)


def print_trials(console: Console, result: TuneResult) -> None:
    trials = Table(
        title="Measured configurations" + (" (the chosen layout)" if result.layouts else "")
    )
    samples_per_s = f"samples/s per GPU ({speed_label(result.device)})"
    split = any(trial.compute_time_s is not None for trial in result.trials)
    # Where some ran under expandable segments (sizes only they fit): which did.
    allocator = any(trial.allocator_conf is not None for trial in result.trials)
    columns = ["micro-batch", "accumulation", "checkpointing", samples_per_s, "peak"]
    columns += ["PYTORCH_ALLOC_CONF"] if allocator else []
    # With several ranks (estimated): the step is compute + exposed communication.
    for column in columns + (["compute", "comm.", "exposed"] if split else []):
        trials.add_column(column, justify="right")
    for trial in sorted(result.trials, key=lambda t: -(t.samples_per_s or 0.0)):
        cells = [
            str(trial.micro_batch),
            str(trial.accumulation_steps),
            trial.checkpointing_label,
            f"{trial.samples_per_s:,.1f}" if trial.samples_per_s else trial.state.value,
            format_bytes(trial.peak_bytes) if trial.peak_bytes else "-",
        ]
        cells += [trial.allocator_conf or "device's"] if allocator else []
        parts = (trial.compute_time_s, trial.communication_time_s, trial.exposed_communication_s)
        times = ["-" if part is None else format_seconds(part) for part in parts]
        trials.add_row(*cells, *(times if split else []))
    console.print(trials)


def print_infeasible(console: Console, infeasible: Infeasible) -> None:
    console.print(f"[red]No configuration hits the target:[/red] {infeasible.reason}")
    nearest = [
        f"{label} {value}"
        for label, value in (
            ("nearest below", infeasible.nearest_below),
            ("nearest above", infeasible.nearest_above),
        )
        if value is not None
    ]
    if nearest:
        console.print("Achievable global batches: " + ", ".join(nearest))


def register(commands: Subcommands) -> None:
    """`autotune tune`."""
    tune = commands.add_parser(
        "tune", help="the micro-batch x accumulation x checkpointing with the best samples/s"
    )
    tune.add_argument(
        "spec", metavar="FILE", help=FILE_HELP + "; a spec needs training.target_global_batch"
    )
    add_config_args(tune)
    add_write_arg(tune)
    add_device_args(tune, estimate=True)
    add_trace_arg(tune)
    add_expandable_segments_arg(tune)
    output = tune.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print one JSON object")
    add_export_arg(output)
    tune.add_argument("--db", default=None, metavar="URL", help="database URL (Optuna + runs)")
    tune.add_argument("--trials", type=positive_int, default=None, help="measurement budget")
    tune.add_argument("--seed", type=int, default=0, help="sampler seed")
    tune.add_argument(
        "--seconds-per-trial",
        type=positive_seconds,
        default=1.0,
        help="how long each measurement's timed steps take (default 1.0)",
    )
    tune.add_argument(
        "--no-advice",
        action="store_true",
        help="when micro-batch 1 fits in no mode, do not trace what would make it fit",
    )
    tune.add_argument(
        "--processes",
        type=processes_count,
        default=AUTO_PROCESSES,
        metavar="N|auto",
        help="with --estimate and sharding: auto, tune N layouts at a time, each in a process "
        "of its own (default auto: one per core, up to the layouts, on Linux; 1 elsewhere)",
    )
    tune.set_defaults(func=_cmd_tune)
