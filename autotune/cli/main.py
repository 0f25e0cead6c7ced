"""The `autotune` command line: the entry point of every command, so the only place (with the
commands' own modules) that reads arguments and settings.

    autotune probe SPEC [--device cpu|cuda|cuda:N] [--memory SIZE] [--json]
    autotune step SPEC --micro-batch B [--checkpointing] [--device ...] [--memory SIZE] [--json]

The other commands belong to the part that implements them and are found through the
`autotune.commands` entry points (see `autotune.core.plugins` and pyproject.toml): `tune`, `submit`
and `runs` here, `serve` in `api.cli`, `worker` in `probes.cli`. A command whose extra is not
installed still parses; running it says which extra to install and exits with code 2.

Bad input exits with code 2 and one line naming the problem.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import NoReturn

from rich.console import Console
from rich.table import Table

from autotune.cli.config_files import FILE_HELP, add_config_args, read_training_file
from autotune.cli.fit_advice_text import print_fit_advice
from autotune.cli.options import (
    CommandParser,
    Subcommands,
    add_device_args,
    add_expandable_segments_arg,
    add_trace_arg,
    capacity_text,
    expandable_segments,
    fit_tracer,
    open_device,
    open_runner,
    positive_int,
)
from autotune.cli.progress import Progress
from autotune.core.bytesize import format_bytes
from autotune.core.defaults import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE
from autotune.core.errors import AutotuneError, DeviceError, ModelBuildError, SpecError
from autotune.core.plugins import (
    COMMAND_GROUP,
    Plugin,
    install_hint,
    is_missing_dependency,
    plugins,
)
from autotune.core.schemas import (
    AllocatorOption,
    ProbeResult,
    SequenceProbeResult,
    Spec,
    StepOutcome,
)
from autotune.core.search.sequence import DEFAULT_STEP_TOKENS

Handler = Callable[[argparse.Namespace], int]

DESCRIPTION = (
    "autotune: the largest micro-batch that fits your GPU (with and without gradient "
    "checkpointing) and the accumulation steps that hit your global batch at the best "
    "samples/s, with settings to paste. Start with `autotune probe SPEC` or `autotune tune "
    "SPEC`; `autotune COMMAND --help` for each command."
)


def _cmd_probe(args: argparse.Namespace) -> int:
    from autotune.engine.probe import probe_session
    from autotune.engine.remedy_trials import fits_nowhere, with_fit_advice

    err = Console(stderr=True)
    spec = read_training_file(args, err).spec
    if args.max_seq_len:
        return _probe_max_seq_len(args, spec)
    runner = open_runner(args, spec)
    info = runner.device_info
    err.print(f"probing [bold]{spec.model.label}[/bold] on {info.name} ({capacity_text(info)})")
    progress = Progress(err)
    try:
        result = probe_session(
            progress.runner(runner),
            on_attempt=progress.attempt,
            tracer=fit_tracer(args, runner),
            on_phase=progress.phase,
            expandable=expandable_segments(args, spec, info),
        )
    finally:
        progress.close()
    if not args.no_advice and fits_nowhere(result):
        err.print("micro-batch 1 fits in no mode: tracing the changes that would make it fit")
        result = with_fit_advice(
            spec, result, on_change=lambda label: err.print(f"  tracing: {label}")
        )
    if args.json:
        sys.stdout.write(result.model_dump_json() + "\n")
    else:
        print_probe_table(Console(), result, headroom=spec.training.headroom)
        if result.fit_advice is not None:
            print_fit_advice(Console(), result.fit_advice)
    return 0


def _probe_max_seq_len(args: argparse.Namespace, spec: Spec) -> int:
    from autotune.engine.sequence_probe import probe_max_seq_len, sequence_cap

    cap = sequence_cap(spec, step_tokens=args.seq_step, cap_tokens=args.seq_cap)
    err = Console(stderr=True)
    err.print(
        f"probing [bold]{spec.model.label}[/bold] for the longest sequence at micro-batch "
        f"{args.micro_batch} (multiples of {args.seq_step} tokens, up to {cap})"
    )

    def attempted(checkpointing: bool, seq_len: int, outcome: StepOutcome) -> None:
        verdict = "fits" if outcome.fits else "out of memory"
        err.print(
            f"  checkpointing {'on' if checkpointing else 'off'}: {seq_len} tokens {verdict}, "
            f"peak {format_bytes(outcome.peak_bytes)}"
        )

    result = probe_max_seq_len(
        spec,
        lambda changed: open_runner(args, changed),
        micro_batch=args.micro_batch,
        step_tokens=args.seq_step,
        cap_tokens=cap,
        on_attempt=attempted,
    )
    if args.json:
        sys.stdout.write(result.model_dump_json() + "\n")
    else:
        print_sequence_table(Console(), result)
    return 0


def print_sequence_table(console: Console, result: SequenceProbeResult) -> None:
    table = Table(
        title=f"{result.device.name}: capacity {format_bytes(result.device.capacity_bytes)}, "
        f"micro-batch {result.micro_batch}"
    )
    table.add_column("checkpointing")
    table.add_column(f"longest sequence (x{result.step_tokens})", justify="right")
    table.add_column("peak at it", justify="right")
    table.add_column("trials", justify="right")
    for mode in result.modes:
        at_max = [a for a in mode.attempts if a.seq_len == mode.max_seq_len and a.fits]
        cap = f" (cap {result.cap_tokens})" if mode.capped else ""
        table.add_row(
            "on" if mode.checkpointing else "off",
            f"{mode.max_seq_len}{cap}",
            format_bytes(at_max[0].peak_bytes) if at_max else "-",
            str(len(mode.attempts)),
        )
    console.print(table)


def print_probe_table(console: Console, result: ProbeResult, *, headroom: float) -> None:
    table = Table(
        title=f"{result.device.name}: capacity {format_bytes(result.device.capacity_bytes)}"
    )
    table.add_column("checkpointing")
    table.add_column("max micro-batch", justify="right")
    table.add_column(f"recommended ({headroom:.0%} headroom)", justify="right")
    table.add_column("peak at max", justify="right")
    table.add_column("trials", justify="right")
    evaluated = any(mode.expandable_segments is not None for mode in result.modes)
    if evaluated:
        table.add_column("expandable segments", justify="right")
    for mode in result.modes:
        at_max = [a for a in mode.attempts if a.micro_batch == mode.max_micro_batch and a.fits]
        peak = format_bytes(at_max[0].peak_bytes) if at_max else "-"
        table.add_row(
            "on" if mode.checkpointing else "off",
            f"{mode.max_micro_batch}{' (cap)' if mode.capped else ''}",
            str(mode.recommended_micro_batch),
            peak,
            str(len(mode.attempts)),
            *([expandable_segments_cell(mode.expandable_segments)] if evaluated else []),
        )
    console.print(table)


def expandable_segments_cell(option: AllocatorOption | None) -> str:
    """A mode's answer under expandable segments: verified by trials, or only traced (they
    predicted no gain, so none ran), with the trials it took and whether it is recommended."""
    if option is None or option.traced_max_micro_batch is None:
        return "-"
    if option.max_micro_batch is None:
        return f"{option.traced_max_micro_batch} (traced)"
    dips = f", {len(option.runs_out_below)} below run out" if option.runs_out_below else ""
    verdict = ", recommended" if option.recommended else ""
    return f"{option.max_micro_batch} ({option.trials} trials{dips}){verdict}"


def _cmd_step(args: argparse.Namespace) -> int:
    from autotune.core.specfile import load_spec
    from autotune.engine.probe import run_step

    spec = load_spec(args.spec)
    device = open_device(args, world_size=spec.training.world_size)
    result: StepOutcome = run_step(
        spec, device, micro_batch=args.micro_batch, checkpointing=args.checkpointing
    )
    if args.json:
        sys.stdout.write(json.dumps({"fits": result.fits, "peak_bytes": result.peak_bytes}) + "\n")
    else:
        verdict = "fits" if result.fits else f"out of memory (in {result.oom_phase})"
        Console().print(
            f"micro-batch {args.micro_batch}: {verdict}, peak {format_bytes(result.peak_bytes)}"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="autotune", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)

    probe = commands.add_parser(
        "probe", help="exact max micro-batch, without and with checkpointing"
    )
    probe.add_argument("spec", metavar="FILE", help=FILE_HELP)
    add_config_args(probe)
    add_device_args(probe, estimate=True)
    add_trace_arg(probe)
    add_expandable_segments_arg(probe)
    probe.add_argument("--json", action="store_true", help="print one JSON object")
    probe.add_argument(
        "--no-advice",
        action="store_true",
        help="when micro-batch 1 fits in no mode, do not trace what would make it fit",
    )
    sequence = probe.add_argument_group("longest sequence (--max-seq-len)")
    sequence.add_argument(
        "--max-seq-len",
        action="store_true",
        help="find the longest sequence that fits at --micro-batch instead, in both modes",
    )
    sequence.add_argument(
        "--micro-batch", type=positive_int, default=1, help="samples per step (default 1)"
    )
    sequence.add_argument(
        "--seq-step",
        type=positive_int,
        default=DEFAULT_STEP_TOKENS,
        metavar="TOKENS",
        help=f"the answer is a multiple of it (default {DEFAULT_STEP_TOKENS})",
    )
    sequence.add_argument(
        "--seq-cap",
        type=positive_int,
        default=None,
        metavar="TOKENS",
        help="the longest sequence tried (default: the model's max positions)",
    )
    probe.set_defaults(func=_cmd_probe, extra="probe")

    step = commands.add_parser("step", help="run one training step at one micro-batch")
    step.add_argument("spec", help="spec file (YAML or JSON)")
    step.add_argument(
        "--micro-batch", type=positive_int, required=True, help="samples per forward/backward"
    )
    step.add_argument(
        "--checkpointing", action="store_true", help="with gradient (activation) checkpointing"
    )
    add_device_args(step)
    step.add_argument("--json", action="store_true", help="print one JSON object")
    step.set_defaults(func=_cmd_step, extra="probe")

    for plugin in plugins(COMMAND_GROUP):
        _register_plugin(commands, plugin)
    return parser


def _register_plugin(commands: Subcommands, plugin: Plugin) -> None:
    """Add the commands of one entry point, each marked with the extra it needs. A module that
    cannot be imported still gets its command, which reports the problem when it is run."""
    before = set(commands.choices)
    try:
        register = plugin.load()
        if not callable(register):
            raise TypeError(f"{plugin.entry_point.value}: not a register(commands) function")
        register(commands)
    except Exception as error:  # noqa: BLE001 - reported when the command is run
        if plugin.name in commands.choices:
            raise  # half registered: a bug in the command's module, shown at once
        _add_unavailable_command(commands, plugin, error)
        return
    for name in set(commands.choices) - before:
        commands.choices[name].set_defaults(extra=plugin.extra)


def _add_unavailable_command(commands: Subcommands, plugin: Plugin, error: Exception) -> None:
    hint = install_hint(plugin.extra)
    help_text = f"(not installed: {hint})" if is_missing_dependency(error) else "(broken)"
    # Takes any arguments, so that running the command explains itself instead of parsing.
    placeholder = commands.add_parser(
        plugin.name, help=help_text, add_help=False, prefix_chars="\0"
    )
    placeholder.add_argument("arguments", nargs=argparse.REMAINDER)

    def explain(args: argparse.Namespace) -> int:
        raise error

    placeholder.set_defaults(func=explain, extra=plugin.extra)


# Libraries that speak up on every run about themselves, not about the user's run: torchao
# (which transformers imports where it is installed) on its CUDA kernels missing on a CPU box,
# torch's pytree on deprecated registrations. `-v` shows them.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_third_parties() -> None:
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # transformers' deprecation notices (FutureWarning) on every config it builds.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers(\.|$)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        quiet_third_parties()
    handler: Handler = args.func
    try:
        return handler(args)
    except (SpecError, ModelBuildError, DeviceError) as error:
        sys.stderr.write(f"autotune: error: {error}\n")
        return EXIT_USAGE
    except AutotuneError as error:
        sys.stderr.write(f"autotune: error: {error}\n")
        return EXIT_FAILURE
    except ModuleNotFoundError as error:
        # A command of an extra that is not installed (or only partly: no torch for the worker).
        if not is_missing_dependency(error):
            raise
        extra = getattr(args, "extra", None)
        needs = f"the {extra!r} extra" if extra else "a package that is not installed"
        sys.stderr.write(
            f"autotune {args.command}: needs {needs} ({error}): {install_hint(extra)}\n"
        )
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("autotune: interrupted\n")
        return EXIT_INTERRUPTED


def run() -> NoReturn:
    sys.exit(main())


if __name__ == "__main__":
    run()
