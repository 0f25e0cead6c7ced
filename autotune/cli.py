"""The `autotune` command line: an entry point, so the only place (with the server's and the
worker's) that reads arguments and settings.

    autotune probe SPEC [--device cpu|cuda|cuda:N] [--memory SIZE] [--json]
    autotune step SPEC --micro-batch B [--checkpointing] [--device ...] [--memory SIZE] [--json]

Bad input exits with code 2 and one line naming the problem.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

from rich.console import Console
from rich.table import Table

from autotune.bytesize import format_bytes, parse_bytes
from autotune.errors import AutotuneError, DeviceError, ModelBuildError, SpecError
from autotune.schemas import ProbeAttempt, ProbeResult, StepResult

if TYPE_CHECKING:
    from autotune.device import Device

EXIT_USAGE = 2
EXIT_FAILURE = 1

Handler = Callable[[argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and still exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _memory_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_device_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default=None,
        help="cuda, cuda:N, or cpu (an emulated GPU; needs --memory). "
        "Default: cuda when present, else cpu.",
    )
    parser.add_argument(
        "--memory",
        type=_memory_size,
        default=None,
        metavar="SIZE",
        help="capacity of the emulated GPU (e.g. 2GiB, 1500MiB); caps a real GPU's capacity",
    )


def _open_device(args: argparse.Namespace) -> Device:
    from autotune.device import open_device

    name = args.device
    if name is None:
        import torch

        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu" and args.memory is None:
        raise SpecError("--memory: required with the emulated cpu device (e.g. --memory 2GiB)")
    return open_device(name, args.memory)


def _progress_printer(console: Console) -> Callable[[bool, ProbeAttempt], None]:
    def show(checkpointing: bool, attempt: ProbeAttempt) -> None:
        verdict = "[green]fits[/green]" if attempt.fits else "[red]OOM[/red] "
        where = f" in {attempt.oom_phase.value}" if attempt.oom_phase else ""
        mode = "on " if checkpointing else "off"
        console.print(
            f"  checkpointing {mode}  micro-batch {attempt.micro_batch:>5}"
            f"  {verdict}  peak {format_bytes(attempt.peak_bytes)}{where}"
        )

    return show


def _cmd_probe(args: argparse.Namespace) -> int:
    from autotune.probe import probe
    from autotune.specfile import load_spec

    spec = load_spec(args.spec)
    device = _open_device(args)
    err = Console(stderr=True)
    err.print(
        f"probing [bold]{spec.model.label}[/bold] on {device.info.name} "
        f"(capacity {format_bytes(device.info.capacity_bytes)})"
    )
    result = probe(spec, device, on_attempt=_progress_printer(err))
    if args.json:
        sys.stdout.write(result.model_dump_json() + "\n")
    else:
        _print_probe_table(Console(), result, headroom=spec.training.headroom)
    return 0


def _print_probe_table(console: Console, result: ProbeResult, *, headroom: float) -> None:
    table = Table(
        title=f"{result.device.name}: capacity {format_bytes(result.device.capacity_bytes)}"
    )
    table.add_column("checkpointing")
    table.add_column("max micro-batch", justify="right")
    table.add_column(f"recommended ({headroom:.0%} headroom)", justify="right")
    table.add_column("peak at max", justify="right")
    table.add_column("trials", justify="right")
    for mode in result.modes:
        at_max = [a for a in mode.attempts if a.micro_batch == mode.max_micro_batch and a.fits]
        peak = format_bytes(at_max[0].peak_bytes) if at_max else "-"
        table.add_row(
            "on" if mode.checkpointing else "off",
            f"{mode.max_micro_batch}{' (cap)' if mode.capped else ''}",
            str(mode.recommended_micro_batch),
            peak,
            str(len(mode.attempts)),
        )
    console.print(table)


def _cmd_step(args: argparse.Namespace) -> int:
    from autotune.probe import run_step
    from autotune.specfile import load_spec

    spec = load_spec(args.spec)
    device = _open_device(args)
    result: StepResult = run_step(
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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autotune", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    probe = commands.add_parser(
        "probe", help="exact max micro-batch, without and with checkpointing"
    )
    probe.add_argument("spec", help="spec file (YAML or JSON)")
    _add_device_args(probe)
    probe.add_argument("--json", action="store_true", help="print one JSON object")
    probe.set_defaults(func=_cmd_probe)

    step = commands.add_parser("step", help="run one training step at one micro-batch")
    step.add_argument("spec", help="spec file (YAML or JSON)")
    step.add_argument("--micro-batch", type=_positive_int, required=True)
    step.add_argument("--checkpointing", action="store_true")
    _add_device_args(step)
    step.add_argument("--json", action="store_true", help="print one JSON object")
    step.set_defaults(func=_cmd_step)

    _register_optional_commands(commands)
    return parser


# Commands of the optional parts, each only where its extra is installed: the server image has
# no torch, so the tuner and worker commands must fail to register quietly, not break `serve`.
_OPTIONAL_COMMANDS = (
    ("autotune.cli_tune", "register"),
    ("autotune.cli_server", "add_server_commands"),
    ("probes.cli_worker", "register"),
)


def _register_optional_commands(commands: argparse._SubParsersAction[_Parser]) -> None:
    for module_name, function_name in _OPTIONAL_COMMANDS:
        try:
            module = importlib.import_module(module_name)
            getattr(module, function_name)(commands)
        except ImportError as error:
            logging.getLogger(__name__).debug("%s unavailable: %s", module_name, error)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    handler: Handler = args.func
    try:
        return handler(args)
    except (SpecError, ModelBuildError, DeviceError) as error:
        sys.stderr.write(f"autotune: error: {error}\n")
        return EXIT_USAGE
    except AutotuneError as error:
        sys.stderr.write(f"autotune: error: {error}\n")
        return EXIT_FAILURE
    except KeyboardInterrupt:
        sys.stderr.write("autotune: interrupted\n")
        return 130


def run() -> NoReturn:
    sys.exit(main())


if __name__ == "__main__":
    run()
