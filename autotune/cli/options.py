"""The command-line options every `autotune` command shares, each parsed and validated once,
here, at the boundary: memory sizes, counts and durations, the device pair (`--device`,
`--memory`) and the server pair (`--server`, `--token`). The server's and the worker's commands
(`api.cli`, `probes.cli`) use these too, so a value means the same in every command.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn, TypeAlias

from autotune.core.bytesize import parse_bytes
from autotune.core.defaults import DEFAULT_SERVER_URL, ENV_SERVER_URL, ENV_TOKEN, EXIT_USAGE

if TYPE_CHECKING:
    from autotune.engine.device import Device

# What `add_subparsers()` returns (a private argparse class); every `register` function takes it.
Subcommands: TypeAlias = "argparse._SubParsersAction[CommandParser]"


class CommandParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and still exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def memory_size(text: str) -> int:
    """A memory size such as `2GiB`, `1500MiB` or a byte count (argparse type)."""
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}: {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}: {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
port_number = int_at_least(0, 65535)


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None


def positive_seconds(text: str) -> float:
    value = _seconds(text)
    if not value > 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


def non_negative_seconds(text: str) -> float:
    value = _seconds(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text}")
    return value


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """`--device` and `--memory`; `open_device(args)` opens the pair."""
    parser.add_argument(
        "--device",
        default=None,
        help="cuda, cuda:N, or cpu (an emulated GPU; needs --memory). "
        "Default: cuda when present, else cpu.",
    )
    parser.add_argument(
        "--memory",
        type=memory_size,
        default=None,
        metavar="SIZE",
        help="capacity of the emulated GPU (e.g. 2GiB, 1500MiB); caps a real GPU's capacity",
    )


def open_device(args: argparse.Namespace) -> Device:
    """The device of `--device` / `--memory` ("cuda" when present and no `--device` was given,
    else "cpu").

    Raises:
        SpecError: the emulated cpu device without `--memory`, or an unknown device name.
        DeviceError: CUDA was asked for and is unavailable.
    """
    import torch

    from autotune.engine.device import open_device as open_named_device

    name: str | None = args.device
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return open_named_device(name, args.memory)


def add_server_args(parser: argparse.ArgumentParser, *, token_help: str) -> None:
    """`--server` (default AUTOTUNE_SERVER, else the local server) and `--token`."""
    parser.add_argument(
        "--server",
        default=os.environ.get(ENV_SERVER_URL, DEFAULT_SERVER_URL),
        help=f"server URL (default: {ENV_SERVER_URL} or {DEFAULT_SERVER_URL})",
    )
    parser.add_argument(
        "--token", default=os.environ.get(ENV_TOKEN), help=f"{token_help} (default: {ENV_TOKEN})"
    )
